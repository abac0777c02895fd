import torch

from flowkit.explain.context import encode_context
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.reward_model import ExplanationFlowModel, explanation_inputs, place_token_rewards
from flowkit.llm.packing import encode_pairs


def _batch(tokenizer):
    prompts = [explanation_prompt("d=+1,+2 a=?"), explanation_prompt("d=-3,+10 a=east; d=-2,+10 a=?")]
    responses = ["goal is 1 east, 2 north. y gap is larger.", "it moved before"]
    return encode_pairs(tokenizer, prompts, responses)  # left-padded prompts, right-padded responses


def test_explanation_inputs_left_align_rows_and_find_sentences(tokenizer):
    batch = _batch(tokenizer)
    assert batch.attention_mask[0, 0] == 0  # the shorter prompt is left-padded in the source batch
    inputs = explanation_inputs(batch, tokenizer)
    for b in range(2):
        real = batch.input_ids[b][batch.attention_mask[b].bool()]
        assert torch.equal(inputs.input_ids[b, : len(real)], real)
        assert torch.equal(batch.input_ids[b, inputs.positions[b]], real)
    first, both = "goal is 1 east, 2 north.", "goal is 1 east, 2 north. y gap is larger."
    assert inputs.sentence_ends[0] == [len(first), len(both)]
    assert inputs.sentence_ends[1] == [len("it moved before")]  # the unterminated fragment is one sentence


def test_token_rewards_land_on_sentence_ends_in_the_source_layout(tokenizer):
    batch = _batch(tokenizer)
    inputs = explanation_inputs(batch, tokenizer)
    rewards = torch.tensor([[0.25, -0.5], [0.75, 0.0]])
    dense = place_token_rewards(tuple(batch.input_ids.shape), inputs, rewards, torch.tensor([1.0, 0.0]))
    assert tokenizer.decode(batch.input_ids[0, dense[0] == 0.25]) == "."
    last = batch.attention_mask[0].nonzero().max()
    assert dense[0, last] == 1.0 and batch.input_ids[0, last] == tokenizer.eos_token_id
    torch.testing.assert_close(dense.sum(-1), torch.tensor([0.75, 0.75]))
    assert (dense * (1 - batch.response_mask)).abs().sum() == 0  # nothing on prompt or padding


def test_flow_loss_decreases_on_fixed_targets_and_predictions_follow_them(backbone, tokenizer):
    torch.manual_seed(0)
    batch = _batch(tokenizer)
    inputs = explanation_inputs(batch, tokenizer)
    context = encode_context(backbone, inputs.input_ids, inputs.attention_mask)
    model = ExplanationFlowModel(4, backbone.config.hidden_size, num_steps=8, num_draws=32, time_dim=16, projector_dim=64)
    targets = torch.tensor([[0.1, 0.7, 0.1, 0.1], [0.05, 0.05, 0.1, 0.8]])
    rows = torch.arange(2).repeat(64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(150):
        loss = model.loss(context.select(rows), targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-15:]) / 15 < 0.5 * sum(losses[:15]) / 15
    assert model.predict(context).argmax(-1).tolist() == [1, 3]
