"""On the bundled grid-world task the trained flow infers held-out decisions well above chance (1/|A|)."""

import json

import torch

from flowkit.explain.context import encode_context
from flowkit.explain.gridworld import DECISIONS
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.proxy import proxy_probabilities
from flowkit.explain.reward_model import ExplanationFlowModel, explanation_inputs
from flowkit.llm.backbone import ASSETS, load_backbone
from flowkit.llm.packing import encode_pairs


def _records(split, n):
    with open(ASSETS / "gridworld" / f"{split}.jsonl") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def _encode(backbone, tokenizer, proxy, rows):
    batch = encode_pairs(tokenizer, [explanation_prompt(r["context"]) for r in rows], [r["explanation"] for r in rows])
    inputs = explanation_inputs(batch, tokenizer)
    probs = proxy_probabilities([proxy], [r["context"] for r in rows], [r["explanation"] for r in rows],
                                [DECISIONS] * len(rows))[0]
    decisions = torch.tensor([DECISIONS.index(r["decision"]) for r in rows])
    return encode_context(backbone, inputs.input_ids, inputs.attention_mask), probs, decisions


def test_trained_flow_beats_chance_on_heldout_positives():
    torch.manual_seed(0)
    backbone, tokenizer = load_backbone("bundled:explain_tiny/policy")
    proxy = load_backbone("bundled:explain_tiny/proxy0")
    backbone.eval().requires_grad_(False)
    proxy[0].eval()
    train_context, train_probs, train_decisions = _encode(backbone, tokenizer, proxy, _records("train", 384))
    test_context, test_probs, test_decisions = _encode(backbone, tokenizer, proxy, _records("test", 160))
    positives = (train_probs.argmax(-1) == train_decisions).nonzero().flatten()  # rejection sampling
    model = ExplanationFlowModel(len(DECISIONS), backbone.config.hidden_size, num_steps=6, num_draws=16, time_dim=32,
                            projector_dim=128)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(250):
        rows = positives[torch.randint(len(positives), (128,), generator=generator)]
        loss = model.loss(train_context.select(rows), train_probs[rows], generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    heldout_positive = test_probs.argmax(-1) == test_decisions
    predicted = model.predict(test_context, generator).argmax(-1)
    accuracy = (predicted == test_decisions)[heldout_positive].float().mean().item()
    assert heldout_positive.sum() >= 40
    print(f"held-out positives {int(heldout_positive.sum())}, flow accuracy {accuracy:.3f}")
    assert accuracy > 0.6, accuracy  # chance is 1/|A| = 0.25
