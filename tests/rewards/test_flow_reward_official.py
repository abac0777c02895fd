"""FlowReward's options for the official online protocol, against hand-computed values and the official formulas.

The official code is Jinghaoleven/RLFR (OpenRLHF-based); its formulas are re-stated here in plain terms with their
file and line, never copied:

- ``openrlhf/openrlhf/models/utils.py`` L210-216, ``masked_mean(x, m, dim)``: Σ(x·m)/Σm along ``dim``, except that
  when the whole mask sums to 0 it returns Σ(x·m) (i.e. 0).
- ``openrlhf/openrlhf/trainer/ppo_trainer.py`` L491-505 (``experience_sampling``, once per micro-batch): the batch
  mask b_r is 1 where the reward is ≥ 1 (``batch_correct``), else ``--soft_flow``; ``trajectory_entropy`` sets
  the token mask a_rj to 1 where the token entropy is ≥ ``torch.quantile(entropy, q, dim=1)``, else
  ``--soft_flow``, times the action mask; the micro-batch's flow loss is masked_mean(masked_mean(L, a, -1), b, 0).
  L520 backpropagates it through DeepSpeed, whose gradient accumulation averages the micro-batches' losses.
- ``ppo_trainer.py`` L485 / L523 / L547: the actor's backward and optimizer step run only when
  ``global_steps > --freezing_actor_steps_for_flow``; the flow's step (L551) always runs.
- ``models/utils.py`` L131-132: with ``--flow_gamma`` γ ≠ 1 the normalised scores (on the action mask) are raised to
  γ; the threshold of ``postprocess_flow_score`` (L89-96) comes after.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowkit import kernels
from flowkit.batch import RolloutBatch
from flowkit.errors import ConfigError
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import reward as reward_module
from flowkit.rewards.flow.matching import scored_token_mask
from flowkit.rewards.flow.online import FlowStep
from flowkit.rewards.flow.rejection import entropy_quantile_weights
from flowkit.rewards.flow.scoring import flow_token_rewards
from flowkit.seeding import flow_noise_seed
from backbone_stub import backbone_stub
from flow_options import flow_reward
from test_flow_reward_steps import D, P
from test_flow_reward_steps import scored_batch as step_batch

SEED, STEP = 5, 3


def scored_batch(rows: int, generator: torch.Generator) -> RolloutBatch:
    """The step tests' batch (random latents, lengths 2-5, every other row correct) with token entropies too."""
    batch = step_batch(rows, generator)
    batch.token_entropy = torch.rand(batch.response_mask.shape, generator=generator)
    return batch


def bound_reward(**options) -> FlowReward:
    """A fresh field: its output projection is zero-initialised, so v = 0 and a token's flow loss is
    mean_{ℓ,t,d} (x1 − ε)², computable by hand from the seeded noise."""
    reward = flow_reward(percentiles=(0.25, 0.5), depth=1, seed=SEED, **options)
    reward.bind(backbone_stub(D), [0.25, 0.5])
    return reward


def scored_in_micro_batches(reward: FlowReward, batch: RolloutBatch, size: int) -> FlowStep:
    scorer = reward.begin_step(STEP, batch)
    for start in range(0, batch.batch_size, size):
        rows = torch.arange(start, min(start + size, batch.batch_size))
        scorer.score(batch.select(rows), rows)
    return scorer


def per_token_flow_loss(batch: RolloutBatch, rows: list[int],
                        condition: str = "previous") -> dict[tuple[int, int], float]:
    """(row, position) → the token's flow loss with v = 0, for the rows the update packs (in order, each cut after
    its last response token): the noise of the k-th packed scored token is ``flow_noise`` counter k."""
    tokens = []
    for r in rows:
        scored = scored_token_mask(batch.response_mask[r:r + 1], condition)[0]
        tokens += [(r, int(j)) for j in scored.nonzero().flatten()]
    eps = kernels.flow_noise((len(tokens), P, 1, D),  # (token, layer, t, d)
                             seed=flow_noise_seed(SEED, STEP, online_loss=True))
    x1 = torch.stack([batch.latents[:, r, j] for r, j in tokens])  # token × layer × d
    per = ((x1[:, :, None] - eps) ** 2).mean(dim=(1, 2, 3))
    return {token: float(value) for token, value in zip(tokens, per)}


def official_masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """models/utils.py L210-216, re-stated."""
    if mask.sum() == 0:
        return (x * mask).sum(dim)
    return (x * mask).sum(dim) / mask.sum(dim)


def official_micro_batch_losses(batch: RolloutBatch, size: int, soft: float, quantile: float | None,
                                batch_correct: bool, losses: dict[tuple[int, int], float]) -> float:
    """ppo_trainer.py L491-505 per micro-batch of ``size`` rows, averaged over the micro-batches (DeepSpeed's
    gradient accumulation). The quantile is over the row's scored tokens (flowkit; the official's spans the
    padded row)."""
    micro = []
    for start in range(0, batch.batch_size, size):
        rows = range(start, min(start + size, batch.batch_size))
        action = torch.stack([scored_token_mask(batch.response_mask[r:r + 1], "previous")[0] for r in rows]).float()
        loss = torch.tensor([[losses.get((r, j), 0.0) for j in range(action.shape[1])] for r in rows])
        token_mask = action
        if quantile is not None:
            entropy = batch.token_entropy[list(rows)]
            threshold = torch.stack([torch.quantile(entropy[i][action[i].bool()], quantile) for i in range(len(rows))])
            token_mask = torch.where(entropy >= threshold[:, None], 1.0, soft) * action
        batch_mask = torch.where(batch.correct[list(rows)], 1.0, soft) if batch_correct else torch.ones(len(rows))
        micro.append(official_masked_mean(official_masked_mean(loss, token_mask, -1), batch_mask, 0))
    return float(torch.stack(micro).mean())


@pytest.mark.parametrize("metric, soft, quantile, size", [
    ("correct", 0.0, None, 1),                     # the official scripts: batch_correct, micro_train_batch_size 1
    ("correct", 0.25, None, 2),                    # a soft weight on the wrong rollouts
    ("token_entropy", 0.0, 0.5, 3),                # trajectory_entropy alone
    ("correct+token_entropy", 0.25, 0.75, 2),      # batch_correct+trajectory_entropy
])
def test_micro_batch_update_is_the_official_masked_mean(metric, soft, quantile, size):
    batch = scored_batch(6, torch.Generator().manual_seed(0))
    reward = bound_reward(flow_update="micro_batch", rejection_metric=metric, soft_weight=soft,
                          entropy_quantile=quantile, max_rows_per_piece=6)
    scorer = scored_in_micro_batches(reward, batch, size)
    pieces = scorer.end_step(batch)
    assert len(pieces) > 1  # several pieces (6 field rows each) sum to the loss
    loss = float(sum(piece() for piece in pieces))
    weighted_rows = [r for r in range(6) if soft > 0 or metric == "token_entropy" or bool(batch.correct[r])]
    expected = official_micro_batch_losses(batch, size, soft, quantile, metric.startswith("correct"),
                                           per_token_flow_loss(batch, weighted_rows))
    assert loss == pytest.approx(expected, rel=1e-5)
    assert scorer.metrics()["flow/loss"] == pytest.approx(loss, rel=1e-6)


def test_micro_batch_update_of_correct_rows_by_hand():
    """Micro-batches of one row (the official scripts' micro_train_batch_size 1), soft weight 0: the loss is
    (1/M)·Σ over correct rows of the row's mean token loss; M = 6 micro-batches, rows 0, 2, 4 correct."""
    batch = scored_batch(6, torch.Generator().manual_seed(1))
    reward = bound_reward(flow_update="micro_batch")
    scorer = scored_in_micro_batches(reward, batch, 1)
    loss = float(sum(piece() for piece in scorer.end_step(batch)))
    losses = per_token_flow_loss(batch, [0, 2, 4])
    row_means = [sum(v for (r, _), v in losses.items() if r == row) / sum(1 for r, _ in losses if r == row)
                 for row in (0, 2, 4)]
    assert loss == pytest.approx(sum(row_means) / 6, rel=1e-5)
    assert scorer.metrics()["flow/accepted_frac"] == 0.5


def hand_batch() -> RolloutBatch:
    """Rows 0-3 with 2, 4, 3 and 1 response tokens (all scored: ``previous``), from column 2; rows 0 and 2 correct;
    token entropies chosen for the quantiles below."""
    lengths, entropies = [2, 4, 3, 1], [[0.2, 0.6], [0.1, 0.5, 0.3, 0.9], [0.3, 0.1, 0.2], [0.7]]
    mask, token_entropy = torch.zeros(4, 7), torch.zeros(4, 7)
    for row, (length, values) in enumerate(zip(lengths, entropies)):
        mask[row, 2:2 + length] = 1.0
        token_entropy[row, 2:2 + length] = torch.tensor(values)
    batch = RolloutBatch(input_ids=torch.zeros(4, 7, dtype=torch.long), attention_mask=torch.ones(4, 7),
                         response_mask=mask, group_ids=torch.arange(4))
    batch.latents = torch.randn(P, 4, 7, D, generator=torch.Generator().manual_seed(6))
    batch.correct, batch.entropy, batch.token_entropy = torch.tensor([True, False, True, False]), torch.rand(4), \
        token_entropy
    return batch


# Token weights a_rj / Σ_j a_rj · b_r / Σ_{r∈m} b_r / M by hand: micro-batches {0, 1} and {2, 3} (M = 2), soft
# weight s = 0.25, so b = (1, .25) in each and Σ b = 1.25: rows 0 and 2 get 1 / 1.25 / 2 = 0.4, rows 1 and 3 get
# 0.25 / 1.25 / 2 = 0.1 (columns 0-1 are the prompt).
HAND_WEIGHTS = {
    # correct, s 0.25: every token of a row alike — 0.4 / 2, 0.1 / 4, 0.4 / 3, 0.1 / 1
    "correct": [[0, 0, 0.2, 0.2, 0, 0], [0, 0, 0.025, 0.025, 0.025, 0.025],
                [0, 0, 0.4 / 3, 0.4 / 3, 0.4 / 3, 0], [0, 0, 0.1, 0, 0, 0]],
    # correct+token_entropy, s 0.25, q 0.5: row 0's median entropy 0.4 → a = (s, 1) = (.2, .8)·0.4; row 1's 0.4 →
    # (s, 1, s, 1) = (.1, .4, .1, .4)·0.1; row 2's 0.2 → (1, s, 1) = (4, 1, 4)/9·0.4; row 3: its one token, 0.1
    "correct+token_entropy": [[0, 0, 0.08, 0.32, 0, 0], [0, 0, 0.01, 0.04, 0.01, 0.04],
                              [0, 0, 1.6 / 9, 0.4 / 9, 1.6 / 9, 0], [0, 0, 0.1, 0, 0, 0]],
}


@pytest.mark.parametrize("metric", sorted(HAND_WEIGHTS))
def test_soft_weight_and_token_entropy_weights_by_hand(metric, monkeypatch):
    """The token weights the micro_batch update hands the flow loss, against the literal values of HAND_WEIGHTS;
    the loss is their sum over the tokens' flow losses."""
    seen = {}
    original = reward_module.flow_matching_loss_pieces

    def recording(*args, token_weights=None, **kwargs):
        seen["weights"] = token_weights
        return original(*args, token_weights=token_weights, **kwargs)
    monkeypatch.setattr(reward_module, "flow_matching_loss_pieces", recording)
    batch = hand_batch()
    reward = bound_reward(flow_update="micro_batch", rejection_metric=metric, soft_weight=0.25,
                          entropy_quantile=0.5 if metric.endswith("token_entropy") else None)
    loss = float(sum(piece() for piece in scored_in_micro_batches(reward, batch, 2).end_step(batch)))
    torch.testing.assert_close(seen["weights"], torch.tensor(HAND_WEIGHTS[metric]))
    losses = per_token_flow_loss(batch, [0, 1, 2, 3])
    expected = sum(HAND_WEIGHTS[metric][r][j] * value for (r, j), value in losses.items())
    assert loss == pytest.approx(expected, rel=1e-5)


def test_micro_batch_update_skips_a_step_without_weighted_rows():
    batch = scored_batch(4, torch.Generator().manual_seed(2))
    batch.correct[:] = False
    reward = bound_reward(flow_update="micro_batch")
    scorer = scored_in_micro_batches(reward, batch, 2)
    assert not scorer.candidates  # no wrong row's latents were even kept
    assert scorer.end_step(batch) == []


def test_entropy_quantile_weights_by_hand():
    entropy = torch.tensor([0.1, 0.5, 0.3, 0.9, 7.0])
    scored = torch.tensor([True, True, True, True, False])  # the unscored 7.0 takes no part in the quantile
    # q = 0.5 over [0.1, 0.3, 0.5, 0.9]: (0.3 + 0.5) / 2 = 0.4 → tokens 0.5 and 0.9 weigh 1, the others s
    torch.testing.assert_close(entropy_quantile_weights(entropy, scored, 0.5, 0.2), torch.tensor([0.2, 1, 0.2, 1, 0]))
    # q = 0.75: 0.5 + 0.25·(0.9 − 0.5) = 0.6 → only 0.9
    torch.testing.assert_close(entropy_quantile_weights(entropy, scored, 0.75, 0.0), torch.tensor([0.0, 0, 0, 1, 0]))
    assert torch.equal(entropy_quantile_weights(entropy, torch.zeros(5, dtype=torch.bool), 0.5, 0.2), torch.zeros(5))


def test_score_power_by_hand():
    """official flow_gamma: r̂ ← r̂^γ before the threshold (minmax); sign(r̂)·|r̂|^γ two-sided."""
    scores, mask = torch.tensor([[0.0, 1.0, 2.0, 4.0]]), torch.ones(1, 4)
    # minmax r̂ = [0, .25, .5, 1]; γ = 2 → [0, .0625, .25, 1]; η = 0.2 keeps .25 and 1
    rewards = flow_token_rewards(scores, mask, eta=0.2, beta=0.1, normalization="minmax", power=2.0)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, -0.025, -0.1]]))
    # without γ, η = 0.2 keeps .25 too
    torch.testing.assert_close(flow_token_rewards(scores, mask, eta=0.2, beta=0.1),
                               torch.tensor([[0.0, -0.025, -0.05, -0.1]]))
    # bilateral r̂ = [−1, −.5, 0, 1]; γ = 0.5 → [−1, −.7071, 0, 1]; |r̂| > 0.6 keeps all but 0: bonuses stay bonuses
    rewards = flow_token_rewards(scores, mask, eta=0.6, beta=0.1, normalization="bilateral", power=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[0.1, 0.5 ** 0.5 * 0.1, 0.0, -0.1]]))


def test_score_power_reaches_the_rewards():
    batch = scored_batch(4, torch.Generator().manual_seed(3))
    plain, powered = bound_reward(), bound_reward(score_power=3.0)
    a = plain.begin_step(0, batch).score(batch, torch.arange(4))
    b = powered.begin_step(0, batch).score(batch, torch.arange(4))
    assert not torch.equal(a, b)
    assert ((b != 0) <= (a != 0)).all()  # r̂³ ≤ r̂ on [0, 1]: no token passes η that did not before


@pytest.mark.parametrize("options, message", [
    ({"soft_weight": 0.5}, "flow_update: micro_batch"),
    ({"rejection_metric": "token_entropy", "entropy_quantile": 0.5}, "flow_update: micro_batch"),
    ({"flow_update": "micro_batch", "rejection_metric": "token_entropy"}, "set both or neither"),
    ({"flow_update": "micro_batch", "entropy_quantile": 0.5}, "set both or neither"),
    ({"flow_update": "micro_batch", "update_every_step": True}, "update_every_step"),
    ({"flow_update": "steps"}, "flow_update"),
    ({"rejection_metric": "trajectory_entropy"}, "rejection_metric"),
    ({"soft_weight": 1.5, "flow_update": "micro_batch"}, "soft_weight"),
    ({"score_power": 0.0}, "score_power"),
    ({"flow_warmup_steps": 2, "online_update": False}, "online_update"),
])
def test_online_protocol_options_are_checked(options, message):
    with pytest.raises(ConfigError, match=message):
        flow_reward(**options)


def test_reward_loop_host_syncs_do_not_grow_with_rows(monkeypatch):
    """issue 35 item 8: scoring a micro-batch syncs with the host a fixed number of times, however many rows it
    keeps for the online update (before: one ``nonzero().max()`` and one ``.cpu()`` per kept row, four ``float()``
    per micro-batch). Every Tensor method that hands a value to the host is counted."""
    counted = ["cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"]
    calls = {"n": 0}
    for name in counted:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)

    def syncs(rows: int, metric: str) -> int:
        batch = scored_batch(rows, torch.Generator().manual_seed(4))
        reward = bound_reward(rejection_metric=metric)
        scorer = reward.begin_step(0, batch)
        calls["n"] = 0
        scorer.score(batch, torch.arange(rows))
        return calls["n"]

    few, many = syncs(2, "entropy"), syncs(16, "entropy")  # every row is kept for the entropy metric
    assert few == many, (few, many)
    assert syncs(16, "correct") == many


@pytest.mark.parametrize("minibatches", [1, 2])
def test_flow_warmup_trains_the_flow_with_the_policy_frozen(tmp_path, monkeypatch, minibatches):
    """Three RL steps of the tiny job, the first two inside flow_warmup_steps: in those no backward reaches the
    policy (its gradients stay None) and no optimizer step moves its group, and its weights are the initial ones bit
    for bit when step 3 starts; the flow trains in all three; step 3 trains the policy (backward and step), and the
    exported policy differs from the initial one. A warm-up step is one optimizer step of ``trainer.max_steps``, a
    later one ``num_minibatches``: max_steps 2 + num_minibatches is three RL steps."""
    import flowkit.modules.policy_optimizer as policy_optimizer
    from flowkit.cli import FlowkitCLI
    from flowkit.llm.backbone import load_backbone
    from flowkit.modules.policy_optimizer import LightningOptimizer
    from flowkit.step import RLStep

    backwards, optimizer_steps, weights_at_start = [], [], []  # (RL step, policy reached / groups moved)
    current = {}
    original_call, original_backward = RLStep.__call__, policy_optimizer.manual_backward
    original_step = LightningOptimizer.step

    def call(self, prompts, step, optimizer):
        current["step"], current["policy"] = step, self.update.actor.policy
        weights_at_start.append([p.detach().clone() for p in current["policy"].parameters()])
        return original_call(self, prompts, step, optimizer)

    def backward(module, loss):
        original_backward(module, loss)
        reached = any(p.grad is not None for p in current["policy"].parameters())
        backwards.append((current["step"], reached))

    def step_optimizer(self, groups):
        optimizer_steps.append((current["step"], sorted(groups)))
        original_step(self, groups)
    monkeypatch.setattr(RLStep, "__call__", call)
    monkeypatch.setattr(policy_optimizer, "manual_backward", backward)
    monkeypatch.setattr(LightningOptimizer, "step", step_optimizer)
    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[2] / "configs" / "rlfr_tiny.yaml")
    FlowkitCLI(args=["fit", "--config", config, "--trainer.max_steps", str(2 + minibatches),
                     "--model.init_args.flow_pretrain.steps", "0",
                     "--model.init_args.update.num_minibatches", str(minibatches),
                     "--model.init_args.reward_model.init_args.online.flow_update", "micro_batch",
                     "--model.init_args.reward_model.init_args.online.kappa", "1",
                     "--model.init_args.reward_model.init_args.online.flow_warmup_steps", "2"])
    assert [s for s, _ in optimizer_steps] == [0, 1] + [2] * minibatches
    assert [groups for s, groups in optimizer_steps if s < 2] == [["reward"], ["reward"]]
    assert "policy" in optimizer_steps[2][1]
    warmup = [reached for s, reached in backwards if s < 2]
    assert warmup and not any(warmup)  # flow pieces only: 0 policy backward calls in the warm-up
    assert sum(reached for s, reached in backwards if s == 2) >= 1
    for before, after in zip(weights_at_start[0], weights_at_start[2]):
        assert torch.equal(before, after)
    run_dir = next(tmp_path.glob("runs/rlfr_tiny/version_*"))
    initial, _ = load_backbone("bundled:tiny_adder", "float32")
    trained, _ = load_backbone(str(run_dir / "export" / "hf_policy"), "float32")
    assert any(not torch.equal(want, got) for want, got in zip(initial.state_dict().values(),
                                                                 trained.state_dict().values()))
    with open(run_dir / "metrics.csv") as f:
        losses = [float(r["flow/loss"]) for r in csv.DictReader(f) if r.get("flow/loss")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)  # a flow loss backpropagated in every step
    reward = flow_reward(percentiles=(0.25,), depth=2, timesteps=(0.9,), seed=0)
    reward.bind(initial, [0.25])
    flow = load_file(str(run_dir / "export" / "flow.safetensors"))
    assert any(not torch.equal(value, flow[name]) for name, value in reward.field.state_dict().items())
