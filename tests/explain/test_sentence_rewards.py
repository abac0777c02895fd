import torch

from flowkit.explain.context import encode_context
from flowkit.explain.flow_net import ExplanationFlow
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.sentence_rewards import (
    flow_samples, flow_samples_per_prefix, flow_sentence_rewards, prefix_table, sentence_token_ends,
)

EXPLANATIONS = ["goal is 1 east, 2 north. y gap is larger. dist is 2.2.", "it moved before. x gap is larger.",
                "dist is 1.4.\ngoal is 0 east, 1 south. y gap is larger. it is not at the goal."]


def _rows(tokenizer):
    prompt = explanation_prompt("d=+1,+2 a=?")
    prompt_ids = tokenizer(prompt)["input_ids"]
    rows, ends = [], []
    for text in EXPLANATIONS:
        response = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + response)
        ends.append(sentence_token_ends(tokenizer, response))
    length = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    return ids, mask, torch.full((len(rows),), len(prompt_ids)), ends


def test_sentence_token_ends_follow_the_splitter(tokenizer):
    response = tokenizer("dist is 1.4. it moved.")["input_ids"] + [tokenizer.eos_token_id]
    assert sentence_token_ends(tokenizer, response) == [len("dist is 1.4."), len("dist is 1.4. it moved.")]


def test_one_pass_sentence_prefixes_equal_per_prefix_recomputation(backbone, tokenizer):
    """All K + 1 prefixes of an explanation read one backbone pass (keys [0, end_k)); the naive path
    re-encodes every truncated prefix. Same z0 draws → same z1 to fp32 tolerance."""
    torch.manual_seed(0)
    ids, mask, prompt_lengths, ends = _rows(tokenizer)
    prefixes, prefix_mask = prefix_table(prompt_lengths, ends)
    assert prefixes.shape[1] == 5 and prefix_mask.sum().item() == 4 + 3 + 5
    flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32)
    z0 = torch.randn(*prefixes.shape, 3, 4)
    one_pass = flow_samples(flow, encode_context(backbone, ids, mask), prefixes, z0, num_steps=4)
    naive = flow_samples_per_prefix(flow, backbone, ids, mask, prefixes, z0, num_steps=4)
    torch.testing.assert_close(one_pass, naive, atol=1e-5, rtol=1e-5)
    # The prefixes really differ: a flow that ignored the prefix length would pass trivially.
    assert not torch.allclose(one_pass[0, 0], one_pass[0, -1], atol=1e-3)


def test_sentence_rewards_telescope_and_land_on_sentence_ends(backbone, tokenizer):
    ids, mask, prompt_lengths, ends = _rows(tokenizer)
    prefixes, prefix_mask = prefix_table(prompt_lengths, ends)
    flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32)
    decisions = torch.tensor([0, 2, 1])
    out = flow_sentence_rewards(flow, encode_context(backbone, ids, mask), prefixes, prefix_mask, decisions,
                                num_draws=6, num_steps=3, generator=torch.Generator().manual_seed(0))
    last = prefix_mask.sum(-1) - 1
    rows = torch.arange(3)
    # Eq. 5 telescopes: the sentence rewards sum to p_K − p_0.
    torch.testing.assert_close(out.rewards.sum(-1), out.probs[rows, last] - out.probs[:, 0])
    torch.testing.assert_close(out.true_logit_mean, out.probs[rows, last])
    assert (out.rewards[~out.mask] == 0).all() and (out.true_logit_std > 0).all()


def test_every_prefix_of_an_explanation_reads_the_same_z0_draws(backbone, tokenizer):
    """Common random numbers: a sentence that leaves the prefix's context unchanged gets exactly 0 reward
    (the draw noise cancels in p_k − p_{k−1}); independent draws per prefix would give it noise."""
    ids, mask, prompt_lengths, ends = _rows(tokenizer)
    prefixes, prefix_mask = prefix_table(prompt_lengths, ends)
    same = prefixes[:, -1:].expand_as(prefixes)  # every "prefix" is the whole explanation
    flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32)
    context, decisions = encode_context(backbone, ids, mask), torch.tensor([0, 2, 1])
    shared = flow_sentence_rewards(flow, context, same, prefix_mask, decisions, num_draws=4, num_steps=3,
                                   generator=torch.Generator().manual_seed(0))
    assert (shared.rewards == 0).all()
    independent = flow_sentence_rewards(flow, context, same, prefix_mask, decisions, num_draws=4, num_steps=3,
                                        z0=torch.randn(*same.shape, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert independent.rewards[independent.mask].abs().min() > 0
