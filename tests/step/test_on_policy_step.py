"""On-policy GRPO without a scoring pass trains exactly as with one: π_old taken from the update's own forward
(detached) equals the scoring pass's log-probs to the bit, so the weights after a step are identical — on the bundled
tiny policy, with zero-advantage rows skipped and the sampler's log-probs driving the rollout correction."""

from __future__ import annotations

import pytest
import torch

from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.step import (
    AdvantageOptions, ExperienceMaker, LossOptions, PolicyUpdate, PromptBatch, SamplingControls, TorchOptimizer,
    UpdateOptions,
)
from flowkit.step.actor import Actor
from flowkit.rl.rollout_correction import RolloutCorrection


class ScoringMaker(ExperienceMaker):
    """The same maker with the scoring pass forced on."""

    def scores(self) -> bool:
        return True


def grade(batch) -> dict:
    rewards = torch.tensor([float(i % 4 == 0 and i < 8) for i in range(batch.batch_size)])  # the third group all wrong
    batch.outcome_rewards, batch.correct = rewards, rewards > 0
    return {}


def one_step(maker_class, correction: RolloutCorrection) -> tuple[dict, dict, bool]:
    """Weights after one RL step from the same seed, the step's metrics, whether the experience held π_old."""
    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    update = UpdateOptions(micro_batch_size=5)
    actor = Actor(model, None, None, None, update, LossOptions(rollout_correction=correction))
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=12, rollout_batch_size=16)
    maker = maker_class(actor, engine, grade, None, AdvantageOptions(), update, SamplingControls(), 4)
    torch.manual_seed(0)
    experience = maker.make_experience(PromptBatch(["3+4=", "68+62=", "7+15="], ["7", "130", "22"]), step=0)
    optimizer = TorchOptimizer(torch.optim.AdamW([{"params": list(model.parameters()), "name": "policy"}], lr=1e-3,
                                                   weight_decay=0.0),
                               max_grad_norm=1.0)
    metrics = PolicyUpdate(actor, update).train_on(experience, optimizer)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics, experience.old_logprobs is not None


@pytest.mark.parametrize("correction", [RolloutCorrection(), RolloutCorrection(mode="token_tis")],
                         ids=["plain", "token_tis"])
def test_a_step_without_the_scoring_pass_equals_one_with_it(single_thread, correction):
    weights, metrics, held = one_step(ExperienceMaker, correction)
    scored_weights, scored_metrics, scored_held = one_step(ScoringMaker, correction)
    assert not held and scored_held
    assert weights.keys() == scored_weights.keys()
    moved = [name for name in weights if not torch.equal(weights[name], load_backbone(
        "bundled:tiny_adder", "float32", False)[0].state_dict()[name])]
    assert moved, "the step moved no weight: the comparison would be empty"
    for name, value in weights.items():
        assert torch.equal(value, scored_weights[name]), name
    for key in ("train/policy_loss", "train/clip_fraction", "train/approx_kl"):
        assert float(metrics[key]) == float(scored_metrics[key]), key
    assert "train/entropy" in metrics and float(metrics["train/entropy"]) > 0
