"""The step's two phases apart, with fakes and no Lightning: make_experience returns a finished, immutable Experience;
train_on updates through the plain-PyTorch optimizer object, also on 2 gloo ranks holding different numbers of rows,
which skip a step together when one rank's loss is not finite."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowkit.batch import RolloutBatch
from flowkit.step import (
    ActorOutput, AdvantageOptions, Experience, ExperienceMaker, LossOptions, NonFiniteStep, PolicyUpdate, PromptBatch,
    SamplingControls, TorchOptimizer, UpdateOptions,
)

PROMPT, RESPONSE = 1, 3


class VersionedEngine:
    """Rows of 1 prompt token and ``RESPONSE`` response tokens, right-padded by one; sampled at version 7."""

    saw_nonfinite_logits = False
    policy_version = 7
    tokenizer = SimpleNamespace(eos_token_id=None)

    def generate(self, prompts, n=1, answers=None, temperature=None):
        rows = len(prompts) * n
        attention = torch.cat([torch.ones(rows, PROMPT + RESPONSE), torch.zeros(rows, 1)], dim=1).long()
        response = torch.cat([torch.zeros(rows, PROMPT), torch.ones(rows, RESPONSE), torch.zeros(rows, 1)], dim=1)
        return RolloutBatch(input_ids=torch.arange(rows * 5).view(rows, 5) % 5, attention_mask=attention,
                            response_mask=response, group_ids=torch.arange(len(prompts)).repeat_interleave(n),
                            prompts=[p for p in prompts for _ in range(n)], responses=["r"] * rows,
                            answers=[a for a in (answers or [""] * len(prompts)) for _ in range(n)],
                            policy_versions=torch.full((rows,), self.policy_version))


class LinearActor:
    """log π(token) = −w on every response token; the loss is the plain policy gradient −Σ log π · A / denominator."""

    padding_free = False  # padded forwards (Actor.padding_free)

    def __init__(self, nan_loss: bool = False):
        self.weight = torch.nn.Parameter(torch.tensor(0.5))
        self.options, self.reference, self.value_head, self.tap = LossOptions(), None, None, None
        self.nan_loss = nan_loss

    def forward(self, batch, tap=False, temperature=None) -> ActorOutput:
        logprobs = -self.weight * batch.response_mask
        return ActorOutput(logprobs, torch.full(batch.response_mask.shape, 2.0))

    def loss(self, micro, out, denominator, tokens, stats) -> torch.Tensor:
        loss = -(out.logprobs * micro.advantages * micro.loss_mask).sum() / denominator
        return loss * float("nan") if self.nan_loss else loss

    @staticmethod
    def padding_loss(out: ActorOutput) -> torch.Tensor:
        return out.logprobs.sum() * 0.0


def grade(batch: RolloutBatch) -> dict:
    batch.outcome_rewards = torch.tensor([float(i % 2) for i in range(batch.batch_size)])  # 0, 1 in every group
    batch.correct = batch.outcome_rewards > 0
    return {"train/reward/parity": batch.outcome_rewards.mean()}


def experience_of(actor: LinearActor, prompts: int, update: UpdateOptions = UpdateOptions()) -> Experience:
    maker = ExperienceMaker(actor, VersionedEngine(), grade, None, AdvantageOptions(), update, SamplingControls(), 2)
    return maker.make_experience(PromptBatch([f"p{i}" for i in range(prompts)], ["a"] * prompts), step=3)


def test_make_experience_returns_every_field_filled_and_immutable(single_thread):
    experience = experience_of(LinearActor(), 2, UpdateOptions(ppo_epochs=2))  # two updates: a scoring pass runs
    required = [f.name for f in dataclasses.fields(Experience)
                if f.name not in ("rollout_logprobs", "ref_logprobs", "token_rewards", "old_values", "returns",
                                  "reward_step")]
    assert all(getattr(experience, name) is not None for name in required)
    assert experience.batch_size == 4 and experience.policy_versions.shape == experience.input_ids.shape
    assert bool((experience.policy_versions == 7).all())
    # the loss counts the response tokens only; the attention mask also covers the prompt
    assert torch.equal(experience.loss_mask, experience.response_mask)
    assert not torch.equal(experience.loss_mask.long(), experience.attention_mask)
    torch.testing.assert_close(experience.old_logprobs, -0.5 * experience.response_mask)
    torch.testing.assert_close(experience.entropy, torch.full((4,), 2.0))
    # GRPO: outcomes (0, 1) in each group → ∓1/(std 0.707 + ε) on every response token
    torch.testing.assert_close(experience.advantages[:, PROMPT], torch.tensor([-0.7071, 0.7071] * 2), atol=1e-4,
                               rtol=0)
    assert experience.metrics["train/reward/parity"] == 0.5 and "time/score_s" in experience.metrics
    with pytest.raises(dataclasses.FrozenInstanceError):
        experience.advantages = None
    trimmed = experience.select([1, 2]).trimmed()
    assert trimmed.input_ids.shape == (2, PROMPT + RESPONSE) and trimmed.prompts == ["p0", "p1"]


def test_on_policy_experience_runs_no_forward_and_leaves_pi_old_to_the_update(single_thread):
    """One update, no reward model, reference, value head or entropy shaping: the advantages come from the outcomes
    alone (as with a scoring pass) and the policy never runs before the update."""
    actor, forwards = LinearActor(), []
    real_forward = actor.forward
    actor.forward = lambda *args, **kwargs: (forwards.append(1), real_forward(*args, **kwargs))[1]
    experience = experience_of(actor, 2)
    assert forwards == [] and experience.old_logprobs is None and experience.entropy is None
    scored = experience_of(LinearActor(), 2, UpdateOptions(ppo_epochs=2))
    assert torch.equal(experience.advantages, scored.advantages)


def test_train_on_steps_the_torch_optimizer_once_per_minibatch(single_thread):
    """Two minibatches (one group each, its second row out of the loss): each has gradient A·3 tokens / 3 tokens =
    −0.7071 and SGD (lr 1) steps twice: w = 0.5 + 2 · 0.7071."""
    actor = LinearActor()
    update = UpdateOptions(num_minibatches=2, micro_batch_size=1)
    experience = experience_of(actor, 2, update)
    experience = dataclasses.replace(experience, loss_mask=experience.loss_mask * torch.tensor([[1.0], [0.0]] * 2))
    steps = []
    optimizer = TorchOptimizer(torch.optim.SGD([{"params": [actor.weight], "name": "policy"}], lr=1.0))
    real_step = optimizer.step
    optimizer.step = lambda groups: (steps.append(sorted(groups)), real_step(groups))
    metrics = PolicyUpdate(actor, update).train_on(experience, optimizer)
    assert steps == [["policy", "value"]] * 2
    assert float(actor.weight.detach()) == pytest.approx(0.5 + 2 * 0.7071, abs=1e-4)
    assert "time/update_s" in metrics and actor.weight.grad is None  # zeroed after the step


def uneven_worker(rank: int, store: str, out: str, nan_rank: int) -> None:
    """Rank 0 trains on 2 groups (4 rows), rank 1 on 1 group (2 rows) whose advantages are doubled; SGD lr 1."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    actor = LinearActor(nan_loss=rank == nan_rank)
    update = UpdateOptions(micro_batch_size=1)
    experience = experience_of(actor, 2 if rank == 0 else 1, update)
    if rank == 1:
        experience = dataclasses.replace(experience, advantages=2 * experience.advantages,
                                         loss_mask=experience.loss_mask * torch.tensor([[1.0], [0.0]]))
    optimizer = TorchOptimizer(torch.optim.SGD([{"params": [actor.weight], "name": "policy"}], lr=1.0))
    backwards = []
    real_backward = optimizer.backward
    optimizer.backward = lambda loss: (backwards.append(float(loss.detach())), real_backward(loss))
    try:
        PolicyUpdate(actor, update).train_on(experience, optimizer)
        skipped = None
    except NonFiniteStep as bad:
        skipped = bad.what
    Path(out, f"rank{rank}.json").write_text(json.dumps({"weight": float(actor.weight.detach()), "backwards": len(backwards),
                                                          "skipped": skipped}))
    dist.destroy_process_group()


@pytest.mark.parametrize("nan_rank", [None, 1], ids=["finite", "nan_on_rank_1"])
def test_train_on_two_gloo_ranks_with_uneven_rows(tmp_path, nan_rank):
    """Rank 1 holds 2 rows to rank 0's 4: it runs 2 padding micro-batches so both run 4 backward passes; the
    gradients are averaged, so both ranks end with the same weight — rank 0's gradient Σ A·3/12 tokens = 0,
    rank 1's (its second row out of the loss) −2·0.7071·3/3: w = 0.5 + (0 + 1.4142)/2. When rank 1's loss is NaN
    both ranks skip the step (one decision) and no weight moves."""
    mp.spawn(uneven_worker, args=(str(tmp_path / "store"), str(tmp_path), nan_rank), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["backwards"] == rank1["backwards"] == 4
    if nan_rank is None:
        assert rank0["skipped"] is None and rank1["skipped"] is None
        assert rank0["weight"] == rank1["weight"] == pytest.approx(0.5 + 1.4142 / 2, abs=1e-4)
    else:
        assert rank0["skipped"] == ["values on another rank"] and rank1["skipped"] == ["policy loss"]
        assert rank0["weight"] == rank1["weight"] == 0.5
