"""DAPO's sampling controls in the RL step: dynamic sampling on the raw outcomes (by hand, and 2 gloo ranks that keep
different numbers of groups and then train on different numbers of rows), the overlong penalty of DAPO eq. 13 and
truncation by hand, and truncated rows left out of the update (also under a token budget).

Facts re-stated (not copied): DAPO (Yu et al. 2025) eq. 13, R_length(y) = 0 for |y| ≤ L_max − L_cache,
((L_max − L_cache) − |y|)/L_cache inside the buffer, −1 beyond L_max; verl ``recipe/dapo`` / ``DAPORewardManager``
adds min(−(|y| − (L_max − L_c))/L_c · penalty_factor, 0) to the score, and its ``filter_groups`` keeps the groups
whose metric's std is > 0, generating further batches up to ``max_num_gen_batches``.
"""

from __future__ import annotations

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
    ActorOutput, AdvantageOptions, ExperienceMaker, LossOptions, PolicyUpdate, PromptBatch, RLStep, SamplingControls,
    UpdateOptions,
)
from flowkit.step.make_experience import _informative_rows, overlong_penalty
from flowkit.errors import ConfigError
from flowkit.rewards.base import TokenRewardModel

EOS, MAX_NEW = 9, 6


class StubRollout:
    """Prompt p's samples get the raw outcomes OUTCOMES[p] and the response lengths LENGTHS[p] (EOS last unless
    the response is MAX_NEW tokens long)."""

    tokenizer = SimpleNamespace(eos_token_id=EOS)
    saw_nonfinite_logits = False
    policy_version = 0

    def __init__(self, outcomes: dict[str, list[float]], lengths: dict[str, list[int]] | None = None):
        self.outcomes, self.lengths, self.calls = outcomes, lengths or {}, []

    def generate(self, prompts: list[str], n: int, answers: list[str]) -> RolloutBatch:
        self.calls.append(list(prompts))
        lengths = [length for p in prompts for length in self.lengths.get(p, [3] * n)]
        ids = torch.ones(len(lengths), 1 + MAX_NEW, dtype=torch.long)
        mask = torch.zeros(len(lengths), 1 + MAX_NEW)
        for row, length in enumerate(lengths):
            mask[row, 1:1 + length] = 1
            if length < MAX_NEW:
                ids[row, length] = EOS
        return RolloutBatch(input_ids=ids, attention_mask=(mask + (torch.arange(1 + MAX_NEW) == 0)).clamp(max=1),
                            response_mask=mask, group_ids=torch.arange(len(prompts)).repeat_interleave(n),
                            prompts=[p for p in prompts for _ in range(n)],
                            answers=[a for a in answers for _ in range(n)])


class ListedPrompts:
    """A prompt source whose extra draw d of any step is ``extra[d - 1]``."""

    def __init__(self, extra: list[list[str]]):
        self.extra = extra

    def extra_batch(self, step: int, draw: int) -> PromptBatch:
        return PromptBatch(self.extra[draw - 1], [""] * len(self.extra[draw - 1]))


def stub_step(rollout: StubRollout, controls: SamplingControls, extra: list[list[str]]) -> ExperienceMaker:
    def grade(batch: RolloutBatch) -> dict:
        rewards = [value for p in dict.fromkeys(batch.prompts) for value in rollout.outcomes[p]]
        batch.outcome_rewards = torch.tensor(rewards)
        batch.correct = batch.outcome_rewards >= 1
        return {}

    actor = SimpleNamespace(options=SimpleNamespace(max_new_tokens=MAX_NEW))
    return ExperienceMaker(actor, rollout, grade, None, AdvantageOptions(), UpdateOptions(), controls, 2,
                           ListedPrompts(extra))


def sampled(step: ExperienceMaker, prompts: list[str]) -> tuple[RolloutBatch, dict[str, float]]:
    metrics = {"time/generate_s": 0.0}
    batch = step._generated(PromptBatch(prompts, [""] * len(prompts)), metrics)
    batch = step._dynamic_sampling(batch, 0, metrics)
    return batch, {key: value for key, value in metrics.items() if key != "time/generate_s"}


def test_overlong_penalty_by_hand():
    # L_max 10, L_c 4: the buffer is (6, 10]; −p·(|y| − 6)/4 inside, −p at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), torch.tensor([0, 0, -0.125, -0.25, -0.5]))


def test_informative_rows_by_hand():
    batch = SimpleNamespace(group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
                            outcome_rewards=torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.0]))
    assert _informative_rows(batch).tolist() == [False, False, True, True, False, False]


def test_dynamic_sampling_draws_until_full_and_keeps_the_first_groups():
    """Draw 1 keeps b only (a: all 1, c: all 0); draw 2 keeps d and e: 3 kept ≥ 3 prompts — the first 3 in drawn
    order are b, d, e; f (draw 3) is never generated."""
    outcomes = {"a": [1, 1], "b": [0, 1], "c": [0, 0], "d": [1, 0], "e": [0.5, 0], "g": [0, 0], "f": [1, 0]}
    rollout = StubRollout(outcomes)
    step = stub_step(rollout, SamplingControls(dynamic_sampling_max_draws=5), [["d", "e", "g"], ["f", "a", "b"]])
    batch, stats = sampled(step, ["a", "b", "c"])
    assert rollout.calls == [["a", "b", "c"], ["d", "e", "g"]]
    assert list(dict.fromkeys(batch.prompts)) == ["b", "d", "e"]
    assert len(set(batch.group_ids.tolist())) == 3 and batch.batch_size == 6
    assert stats == {"train/groups_drawn": 6.0, "train/groups_kept": 3.0, "train/sampling_draws": 2.0,
                     "train/zero_advantage_group_frac": 0.5}


def test_dynamic_sampling_stops_at_max_draws_with_the_groups_it_kept():
    outcomes = {"a": [1, 1], "b": [0, 1], "c": [0, 0], "d": [0, 0]}
    step = stub_step(StubRollout(outcomes), SamplingControls(dynamic_sampling_max_draws=2), [["c", "d"]])
    batch, stats = sampled(step, ["a", "b"])
    assert list(dict.fromkeys(batch.prompts)) == ["b"]
    assert stats["train/groups_kept"] == 1.0 and stats["train/sampling_draws"] == 2.0


def test_dynamic_sampling_filters_on_the_raw_outcome_not_the_shaped_reward():
    """Group a's raw outcomes are equal (1, 1) but its lengths differ, so the overlong penalty would make its shaped
    rewards differ (the NeMo-RL #2431 bug keeps it): it is dropped; the penalty then shapes the kept group."""
    outcomes = {"a": [1, 1], "b": [0, 1]}
    lengths = {"a": [2, MAX_NEW], "b": [5, MAX_NEW]}
    controls = SamplingControls(dynamic_sampling_max_draws=1, mask_truncated=True, overlong_buffer_length=2,
                                overlong_penalty=1.0)
    step = stub_step(StubRollout(outcomes, lengths), controls, [])
    batch, stats = sampled(step, ["a", "b"])
    assert list(dict.fromkeys(batch.prompts)) == ["b"]
    in_loss = step._apply_length_controls(batch, stats)
    # b: lengths 5 (EOS, in the buffer (4, 6]: −0.5) and 6 (no EOS: truncated, −1)
    torch.testing.assert_close(batch.outcome_rewards, torch.tensor([-0.5, 0.0]))
    assert in_loss.tolist() == [1.0, 0.0] and stats["train/truncated_frac"] == 0.5


def test_sampling_controls_are_checked():
    with pytest.raises(ConfigError, match=r"^PolicyModule.controls.dynamic_sampling_max_draws must be >= 1, got 0$"):
        SamplingControls(dynamic_sampling_max_draws=0).check_within("PolicyModule.controls", 6)
    with pytest.raises(ConfigError, match=r"^PolicyModule.controls.overlong_penalty must be >= 0, got -1.0$"):
        SamplingControls(overlong_buffer_length=2, overlong_penalty=-1.0).check_within("PolicyModule.controls", 6)
    with pytest.raises(ConfigError, match=r"overlong_buffer_length must be <= sampling.max_new_tokens \(6\), got 7$"):
        SamplingControls(overlong_buffer_length=7).check_within("PolicyModule.controls", 6)
    SamplingControls(overlong_buffer_length=6).check_within("PolicyModule.controls", 6)  # the whole budget is allowed


def uneven_worker(rank: int, store: str, out: str) -> None:
    """Rank 0's first draw is all informative; rank 1 keeps one group per draw: both must draw until rank 1 is full."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    outcomes = {"a": [0, 1], "b": [1, 0], "c": [1, 1], "d": [0, 1], "e": [0, 0], "f": [1, 0], "g": [0, 0]}
    first, extra = (["a", "b"], [["d", "f"], ["b", "a"]]) if rank == 0 else (["c", "d"], [["e", "f"], ["g", "g"]])
    rollout = StubRollout(outcomes)
    batch, stats = sampled(stub_step(rollout, SamplingControls(dynamic_sampling_max_draws=3), extra), first)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"calls": rollout.calls, "stats": stats,
                                                          "kept": list(dict.fromkeys(batch.prompts))}))
    dist.destroy_process_group()


def test_ranks_draw_equally_often_while_keeping_different_groups(tmp_path):
    mp.spawn(uneven_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert len(rank0["calls"]) == len(rank1["calls"]) == 2  # rank 0 was full after 1 draw, rank 1 after 2
    assert rank0["kept"] == ["a", "b"] and rank1["kept"] == ["d", "f"]
    assert rank0["stats"]["train/groups_drawn"] == rank1["stats"]["train/groups_drawn"] == 4.0


class EventActor:
    """Log-probs through one trainable weight; appends each call that is a collective under ZeRO-3 (a forward, a
    backward) to ``events``."""

    padding_free = False  # padded forwards (Actor.padding_free)

    def __init__(self, events: list[str]):
        self.weight = torch.nn.Parameter(torch.tensor(0.5))
        self.options = LossOptions().with_budget(MAX_NEW)
        self.reference, self.value_head, self.tap, self.events = None, None, None, events

    def forward(self, batch: RolloutBatch, tap: bool = False, temperature: float | None = None) -> ActorOutput:
        self.events.append("forward")
        logprobs = -self.weight * batch.response_mask
        return ActorOutput(logprobs, torch.ones(batch.response_mask.shape))

    def loss(self, micro, out, denominator, tokens, stats) -> torch.Tensor:
        return -(out.logprobs * micro.advantages).sum() / denominator

    @staticmethod
    def padding_loss(out: ActorOutput) -> torch.Tensor:
        return out.logprobs.sum() * 0.0


class EventOptimizer:
    """A StepOptimizer appending each backward and step (collectives under ZeRO) to ``events``."""

    def __init__(self, events: list[str]):
        self.events = events

    def backward(self, loss: torch.Tensor) -> None:
        self.events.append("backward")
        loss.backward()

    def nonfinite(self, groups) -> list[str]:
        return []

    def step(self, groups) -> None:
        self.events.append("step")


class EventReward(TokenRewardModel):
    """A reward model whose every scoring call (real or padding) is a collective, as a ZeRO-3-sharded one's."""

    percentiles = None

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def begin_step(self, step, batch):
        return EventScorer(self.events)


class EventScorer:
    def __init__(self, events: list[str]):
        self.events = events

    def score(self, micro, rows):
        self.events.append("score")
        return torch.zeros(micro.response_mask.shape)

    def pad(self, micro):
        self.events.append("score")


# rank 0 keeps both groups of its first draw; rank 1 keeps only c (e, g, h: every sample alike) after max_draws 2
UNEVEN_OUTCOMES = {"a": [0, 1], "b": [1, 0], "c": [1, 0], "e": [1, 1], "d": [0, 1], "f": [1, 0], "g": [0, 0],
                   "h": [1, 1]}
UNEVEN_DRAWS = {0: (["a", "b"], [["d", "f"]]), 1: (["c", "e"], [["g", "h"]])}
UNEVEN_UPDATES = {  # each breaks an agreement when ranks hold 4 and 2 rows
    "micro_batch_size_1": UpdateOptions(micro_batch_size=1, ppo_epochs=2),  # scoring pass and updates: 4 vs 2
    "token_budget": UpdateOptions(micro_batch_tokens=4, ppo_epochs=2),  # one row of 4 tokens per micro-batch
    "num_minibatches_4": UpdateOptions(num_minibatches=4),  # 4 rows in 4 minibatches, 2 rows in 2 (or 4)
    "one_update_micro_batch_size_1": UpdateOptions(micro_batch_size=1),  # scoring pass, then one update
}


def uneven_rows_worker(rank: int, store: str, out: str, case: str) -> None:
    """One RL step with dynamic sampling on ranks that keep 2 and 1 groups; writes the rank's collective calls."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    events: list[str] = []
    rollout = StubRollout(UNEVEN_OUTCOMES)
    first, extra = UNEVEN_DRAWS[rank]

    def grade(batch: RolloutBatch) -> dict:
        batch.outcome_rewards = torch.tensor([v for p in dict.fromkeys(batch.prompts) for v in UNEVEN_OUTCOMES[p]])
        batch.correct = batch.outcome_rewards >= 1
        return {}

    actor, update = EventActor(events), UNEVEN_UPDATES[case]
    maker = ExperienceMaker(actor, rollout, grade, EventReward(events), AdvantageOptions(), update,
                            SamplingControls(dynamic_sampling_max_draws=2), 2, ListedPrompts(extra))
    step = RLStep(maker, PolicyUpdate(actor, update))
    batch, stats = step(PromptBatch(first, [""] * len(first)), 0, EventOptimizer(events))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"events": events, "rows": batch.batch_size,
                                                          "kept": stats["train/groups_kept"]}))
    dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(UNEVEN_UPDATES))
def test_ranks_with_different_kept_rows_make_the_same_collective_calls(tmp_path, case):
    """Rank 0 trains on 4 rows (2 groups), rank 1 on 2 (it ran out of draws with 1 group); yet both run the same
    sequence of forwards, scoring calls, backwards and optimizer steps (each a collective under ZeRO-3): padding
    micro-batches, agreed micro-batch counts under micro_batch_size and micro_batch_tokens, and num_minibatches
    minibatches on every rank."""
    mp.spawn(uneven_rows_worker, args=(str(tmp_path / "store"), str(tmp_path), case), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (rank0["kept"], rank0["rows"], rank1["kept"], rank1["rows"]) == (2.0, 4, 1.0, 2)
    assert rank0["events"] == rank1["events"]
    update = UNEVEN_UPDATES[case]
    assert rank0["events"].count("step") == update.ppo_epochs * update.num_minibatches
    assert rank0["events"].count("score") == (4 if "micro_batch_size" in case or case == "token_budget" else 1)


class LossMaskActor(EventActor):
    """Records, per row of each loss call, (generated length, tokens left in the loss) and each denominator."""

    def __init__(self):
        super().__init__([])
        self.rows: list[tuple[int, int]] = []
        self.denominators: list[float] = []

    def loss(self, micro, out, denominator, tokens, stats) -> torch.Tensor:
        lengths = micro.attention_mask.sum(-1) - 1  # the prompt is one token; the mask in the loss may be cut
        self.rows += list(zip(lengths.tolist(), micro.loss_mask.sum(-1).int().tolist()))
        self.denominators.append(float(denominator))
        return super().loss(micro, out, denominator, tokens, stats)


@pytest.mark.parametrize("update", [UpdateOptions(), UpdateOptions(micro_batch_tokens=7),
                                    UpdateOptions(micro_batch_tokens=14, num_minibatches=2)],
                         ids=["one_update", "token_budget", "token_budget_2_minibatches"])
def test_mask_truncated_leaves_truncated_rows_out_of_the_update(update):
    """Rows of lengths 6, 6 (no EOS: truncated at MAX_NEW 6), 2, 4, 6 (truncated), 3. Each loss sees the truncated
    rows with no token and the others whole, and divides by the 9 tokens of the untruncated rows (token-mean) — also
    under a token budget, which runs the rows longest first (the truncated ones first), so the mask must follow
    the reordering."""
    outcomes = {"long": [0, 1], "short": [1, 0], "mixed": [0, 1]}
    lengths = {"long": [MAX_NEW, MAX_NEW], "short": [2, 4], "mixed": [MAX_NEW, 3]}
    rollout, actor = StubRollout(outcomes, lengths), LossMaskActor()

    def grade(batch: RolloutBatch) -> dict:
        batch.outcome_rewards = torch.tensor([v for p in dict.fromkeys(batch.prompts) for v in outcomes[p]]).float()
        batch.correct = batch.outcome_rewards >= 1
        return {}
    maker = ExperienceMaker(actor, rollout, grade, None, AdvantageOptions(), update,
                            SamplingControls(mask_truncated=True), 2)
    step = RLStep(maker, PolicyUpdate(actor, update))
    _, stats = step(PromptBatch(["long", "short", "mixed"], [""] * 3), 0, EventOptimizer([]))
    assert sorted(actor.rows) == [(2, 2), (3, 3), (4, 4), (MAX_NEW, 0), (MAX_NEW, 0), (MAX_NEW, 0)]
    if update.num_minibatches == 1:
        assert set(actor.denominators) == {9.0}
    else:  # longest first, then by minibatch: rows (6, 6, 2) and (4, 6, 3) in generated order → 2 and 7 tokens
        assert set(actor.denominators) == {2.0, 7.0}
    assert stats["train/truncated_frac"] == pytest.approx(0.5)
