import copy

import torch
from peft import LoraConfig, get_peft_model

from flowkit.explain.context import encode_context, last_layer
from flowkit.explain.flow_net import ExplanationFlow, prefix_means, time_encoding
from flowkit.llm.backbone import decoder_layers


def _batch(tokenizer, texts):
    rows = [tokenizer(t)["input_ids"] for t in texts]
    length = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    return ids, mask


def test_flow_token_qkv_are_the_backbones_last_layer_projections(backbone):
    attn = decoder_layers(backbone)[-1].self_attn
    hidden = torch.randn(3, 5, backbone.config.hidden_size)
    layer = last_layer(backbone)
    for name, (weight, bias) in {"q_proj": (layer.q_weight, layer.q_bias), "k_proj": (layer.k_weight, layer.k_bias),
                                 "v_proj": (layer.v_weight, layer.v_bias)}.items():
        torch.testing.assert_close(torch.nn.functional.linear(hidden, weight, bias), getattr(attn, name)(hidden))


def test_lora_policy_exposes_the_frozen_base_projections(backbone):
    policy = get_peft_model(copy.deepcopy(backbone), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    base_layer, lora_layer = last_layer(backbone), last_layer(policy)
    assert torch.equal(base_layer.q_weight, lora_layer.q_weight) and torch.equal(base_layer.v_bias, lora_layer.v_bias)
    attn = decoder_layers(policy)[-1].self_attn
    hidden = torch.randn(2, backbone.config.hidden_size)
    assert not torch.allclose(attn.q_proj(hidden), torch.nn.functional.linear(hidden, lora_layer.q_weight,
                                                                                lora_layer.q_bias))


def test_flow_attention_equals_hf_last_layer_on_concatenated_sequence(backbone, tokenizer):
    """Flow tokens appended after a prefix, run through HF's own last layer with a mask that lets them see
    [0, prefix) and each other, give the same attention output (after o_proj) as the flow's path."""
    torch.manual_seed(1)
    ids, mask = _batch(tokenizer, ["d=+1,+2 a=east; goal is 1 east.", "x gap is larger. y gap"])
    context = encode_context(backbone, ids, mask)
    flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32)
    prefix = torch.tensor([[9, 30], [4, 20]])
    t = torch.rand(2, 2)
    z = torch.randn(2, 2, 4)
    tokens = flow.flow_tokens(t, z)
    got = flow.attend(tokens, context, prefix)  # [B, S, d]

    with torch.no_grad():
        hidden_in = backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    layer = decoder_layers(backbone)[-1]
    rotary = backbone.model.rotary_emb
    for b in range(2):
        for s in range(2):
            n = int(prefix[b, s])
            seq = torch.cat((hidden_in[b, :n], tokens[b, s].detach()))[None]  # [1, n + 2, d]
            allowed = torch.ones(n + 2, n + 2).tril().bool()
            allowed[n:, n:] = True  # the two flow tokens see each other fully
            additive = torch.zeros(n + 2, n + 2).masked_fill(~allowed, float("-inf"))[None, None]
            positions = torch.arange(n + 2)[None]
            out, _ = layer.self_attn(layer.input_layernorm(seq), rotary(seq, positions), additive)
            torch.testing.assert_close(got[b, s], out[0, n + 1], atol=1e-5, rtol=1e-5)


def test_flow_forward_shapes_and_gradients_reach_only_the_flow(backbone, tokenizer):
    ids, mask = _batch(tokenizer, ["abc. de.", "x."])
    context = encode_context(backbone, ids, mask)
    for use_attention in (True, False):
        flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32,
                               use_attention=use_attention)
        v = flow(torch.rand(2, 3), torch.randn(2, 3, 4), context, torch.tensor([[1, 2, 8], [1, 2, 2]]))
        assert v.shape == (2, 3, 4)
        v.square().sum().backward()
        assert all(p.grad is not None for p in flow.parameters())
        assert all(p.grad is None for p in backbone.parameters())


def test_prefix_means_and_time_encoding():
    hidden = torch.arange(12.0).view(1, 6, 2)
    got = prefix_means(hidden, torch.tensor([[1, 3, 6]]))
    torch.testing.assert_close(got[0], torch.stack([hidden[0, :n].mean(0) for n in (1, 3, 6)]))
    pe = time_encoding(torch.tensor([0.0, 0.5]), 8)
    assert pe.shape == (2, 8) and not torch.allclose(pe[0], pe[1])
