"""The numeric-state SAC and PPO baselines: schedules, GAE, and evaluation on the rule agents' seeds."""

import numpy as np
import torch

from flowkit.rbrl.envs import make_env
from flowkit.rbrl.numeric import NumericPPO, NumericSAC


def test_training_schedule_warmup_then_updates_and_hard_target_copies(monkeypatch):
    from flowkit.rbrl import sac

    baseline = NumericSAC(lambda: make_env("binpacking"), seed=0, warmup_steps=30, target_update_interval=3)
    before = [p.clone() for p in baseline.actor.parameters()]
    updates, copies = [], []
    original_update, original_copy = baseline._update, sac.target_update
    baseline._update = lambda: (updates.append(baseline.stored), original_update())

    def copy(target, source, tau):
        original_copy(target, source, tau)
        copies.append((len(updates), tau, all(torch.equal(t, q) for t, q in zip(target.parameters(), source.parameters()))))

    monkeypatch.setattr(sac, "target_update", copy)
    baseline.train(7)
    # warm-up rounded up to whole steps of the 4 envs, then 4 transitions before each update
    assert updates == [32 + 4 * k for k in range(1, 8)] and baseline.stored == 32 + 4 * 7
    assert copies == [(3, 1.0, True), (3, 1.0, True), (6, 1.0, True), (6, 1.0, True)]  # both critics, steps 3 and 6
    assert any(not torch.equal(a, b) for a, b in zip(before, baseline.actor.parameters()))
    assert torch.isfinite(baseline.log_alpha)


def test_evaluation_uses_the_rule_agents_episode_seeds():
    baseline = NumericSAC(lambda: make_env("binpacking"), seed=0)
    env = make_env("binpacking")
    env.reset(seed=1000 * 2 + 1)
    first_item = env.unwrapped.item
    seen = []
    original = baseline.greedy_action

    def spy(e):
        if e.unwrapped.t == 0:
            seen.append(e.unwrapped.item)
        return original(e)

    baseline.greedy_action = spy
    baseline.evaluate([2], 2)
    assert seen[1] == first_item and np.isfinite(baseline.evaluate([2], 1)).all()


def test_ppo_trains_on_rollouts_and_evaluates():
    ppo = NumericPPO(lambda: make_env("binpacking"), seed=0, rollout_steps=8, update_epochs=2)
    before = [p.clone() for p in ppo.actor.parameters()]
    ppo.train(40)  # ceil(40 / (4 × 8)) = 2 rollouts
    assert any(not torch.equal(a, b) for a, b in zip(before, ppo.actor.parameters()))
    result = ppo.evaluate([1, 2], 1)
    assert result.shape == (2,) and np.isfinite(result).all()
