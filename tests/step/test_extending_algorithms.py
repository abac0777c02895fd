"""The algorithm extension points, exercised from this file alone: a policy loss with its own hyper-parameter and an
advantage estimator are registered here (and unregistered after), and reach the Actor and PolicyModule by name; the
shipped RLOO estimator runs through a tiny fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import Tensor

from flowkit.step import Actor, AdvantageOptions, LossOptions, SamplingOptions, StepStats, UpdateOptions
from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import OptimOptions
from flowkit.rl.advantages import ESTIMATORS, gae_tokens, raw_outcome, register_advantage
from flowkit.rl.losses import (
    POLICY_LOSSES, LossContext, aggregated, aggregation_denominator, policy_metrics, register_policy_loss, token_ratio,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def advantage_clipped_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                                  ctx: LossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """−ρ·clip(A, −c, c) per token, c = ``advantage_clip``: a policy gradient whose advantages are bounded."""
    bound = ctx.args["advantage_clip"]
    per_token = -token_ratio(logprobs, old_logprobs) * advantages.clamp(-bound, bound)
    return aggregated(per_token, mask, ctx), policy_metrics(logprobs, old_logprobs, mask, advantages.abs() > bound)


@pytest.fixture
def advantage_clipped_loss():
    register_policy_loss("advantage_clipped", advantage_clip=1.0)(advantage_clipped_policy_loss)
    yield "advantage_clipped"
    del POLICY_LOSSES["advantage_clipped"]


@pytest.fixture
def valued_estimator():
    """GAE's stages under another name: an estimator that declares a value head."""
    register_advantage("test_valued", tokens=gae_tokens, value_head=True, whiten=True)(raw_outcome)
    yield "test_valued"
    del ESTIMATORS["test_valued"]


def test_a_registered_loss_reads_its_own_hyper_parameter_and_trains_through_the_actor(advantage_clipped_loss):
    """On-policy (ρ = 1) the loss is −Σ clip(A)/tokens: rows alternate A = 2 and A = −0.5, so with c = 0.5 it is
    −(0.5·n₊ − 0.5·n₋)/n and with the declared default c = 1 it is −(n₊ − 0.5·n₋)/n. Three Adam steps through
    Actor.forward / Actor.loss lower it."""
    torch.manual_seed(0)
    model, tokenizer = load_backbone("bundled:tiny_adder", "float32", False)
    batch = HFRolloutEngine(model, tokenizer, max_new_tokens=8).generate(["3+4=", "12+5="], n=2)
    mask = batch.response_mask
    positive = torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None]
    batch.advantages = (2.0 * positive - 0.5 * (1 - positive)) * mask
    tokens, plus = mask.sum(), (mask * positive).sum()
    minus = tokens - plus
    denominator = aggregation_denominator(mask)
    default = Actor(model, None, None, None, UpdateOptions(), LossOptions(policy_loss=advantage_clipped_loss))
    actor = Actor(model, None, None, None, UpdateOptions(),
                  LossOptions(policy_loss=advantage_clipped_loss, policy_loss_args={"advantage_clip": 0.5}))
    out = actor.forward(batch)
    batch.old_logprobs = out.logprobs.detach()
    torch.testing.assert_close(default.loss(batch, out, denominator, tokens, StepStats()),
                               -(plus - 0.5 * minus) / tokens)
    stats, losses = StepStats(), []
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(4):
        loss = actor.loss(batch, actor.forward(batch), denominator, tokens, stats)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[0] == pytest.approx(float(-(0.5 * plus - 0.5 * minus) / tokens), abs=1e-6)
    assert losses[-1] < losses[0]
    stats.close_minibatch()
    clip_fraction = float(stats.means()["train/clip_fraction"])
    assert clip_fraction == pytest.approx(float(plus / tokens))  # A = 2 exceeds c = 0.5; A = −0.5 sits on it


def test_unknown_loss_arguments_are_a_one_line_error_naming_the_loss_and_what_it_accepts(advantage_clipped_loss):
    LossOptions(policy_loss=advantage_clipped_loss, policy_loss_args={"advantage_clip": 2.0}).check("model")
    with pytest.raises(ConfigError, match=r"^model.policy_loss_args: policy_loss 'advantage_clipped' accepts "
                                          r"advantage_clip, got tau$"):
        LossOptions(policy_loss=advantage_clipped_loss, policy_loss_args={"tau": 1.0}).check("model")
    with pytest.raises(ConfigError, match="policy_loss 'ppo' accepts no arguments, got advantage_clip"):
        LossOptions(policy_loss_args={"advantage_clip": 1.0}).check("model")


def test_the_policy_gets_a_value_head_when_its_estimator_declares_one(valued_estimator):
    short = SamplingOptions(max_new_tokens=8)
    assert isinstance(PolicyModule(advantage=AdvantageOptions(estimator=valued_estimator), sampling=short).value_head,
                      torch.nn.Linear)
    assert PolicyModule(advantage=AdvantageOptions(estimator="rloo"), sampling=short).value_head is None


def test_rloo_fits_the_tiny_task_with_leave_one_out_advantages(tmp_path, monkeypatch):
    """Two steps of the tiny job with ``advantage.estimator: rloo`` (no reward model): every row's advantage, on each of its
    response tokens, is its outcome reward minus the mean of its group's other rows."""
    seen: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    loss = Actor.loss

    def recording_loss(self, micro, out, denominator, tokens, stats):
        seen.append((micro.outcome_rewards, micro.group_ids, micro.advantages.detach(), micro.response_mask))
        return loss(self, micro, out, denominator, tokens, stats)

    monkeypatch.setattr(Actor, "loss", recording_loss)
    L.seed_everything(0, verbose=False)
    module = PolicyModule(advantage=AdvantageOptions(estimator="rloo"),
                          sampling=SamplingOptions(num_samples=4, max_new_tokens=28), outcome_reward="binary",
                          optim=OptimOptions(lr=1e-4), update=UpdateOptions(skip_zero_advantage_rows=False))
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    assert trainer.global_step == 2 and len(seen) == 2  # one micro-batch (the whole batch) per step
    assert any(bool(advantages.ne(0).any()) for _, _, advantages, _ in seen)  # some group's outcomes differed
    for rewards, groups, advantages, mask in seen:
        assert len(rewards) == 8
        for row in range(len(rewards)):
            others = [float(rewards[j]) for j in range(len(rewards)) if j != row and groups[j] == groups[row]]
            expected = float(rewards[row]) - sum(others) / len(others)
            torch.testing.assert_close(advantages[row][mask[row] > 0], torch.full((int(mask[row].sum()),), expected))
