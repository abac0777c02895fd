"""Numeric baselines (seed 002 §7; the official ``sac_numeric.py`` and ``ppo_numeric.py``): discrete SAC
and PPO on the raw numeric state, choosing environment actions directly — no rules, no language, no
explanations.

The actor and twin critics are MLPs over ``env.state_features()`` with one output per environment
action. All actions are offered (as in the official numeric agent), so the agent must itself learn to
avoid invalid ones: in bin packing an invalid placement ends the episode with −100 − w (scaled). The
update is the rule selector's (:mod:`flowkit.rbrl.sac`) with every action "real": the same targets,
softmin twin-Q blend, temperature tuning, hard target copies and 4 critic + 4 actor updates per step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from flowkit.rbrl import sac
from flowkit.rbrl.language import LanguageEnv, mean_episode_returns
from flowkit.rl.advantages import gae
from flowkit.rl.losses import LossContext, clipped_policy_loss, clipped_value_loss


def _mlp(inputs: int, outputs: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.LayerNorm(inputs), nn.Linear(inputs, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
        nn.Linear(hidden, outputs),
    )


def evaluate_greedy(
    make_env: Callable[[], LanguageEnv], greedy_action: Callable[[LanguageEnv], int], seeds: list[int], episodes: int
) -> np.ndarray:
    """Mean greedy episode return per evaluation seed, with the rule agents' episode seeds ``1000·seed + k``."""

    def play_step(env: LanguageEnv) -> tuple[float, bool]:
        _, reward, terminated, truncated, _ = env.step(greedy_action(env))
        return float(reward), terminated or truncated

    return mean_episode_returns(make_env(), play_step, seeds, episodes)


def _step(optimizer: torch.optim.Optimizer, loss: Tensor) -> None:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class NumericSAC:
    """Discrete SAC over environment actions from the numeric state, trained by :meth:`train`."""

    def __init__(
        self, make_env: Callable[[], LanguageEnv], hidden: int = 64, gamma: float = 0.95, lr: float = 1e-4,
        init_alpha: float = 0.1, target_entropy_ratio: float = 0.89, twin_q: str = "softmin",
        target_update_interval: int = 64, updates_per_step: int = 4, batch_size: int = 16, buffer_size: int = 4096,
        num_envs: int = 4, warmup_steps: int = 256, seed: int = 0,
    ):
        self.make_env = make_env
        probe = make_env()
        probe.reset(seed=0)
        self.num_actions = int(probe.action_space.n)
        state_dim = probe.state_dim
        torch.manual_seed(seed)
        self.actor, self.q1, self.q2 = (_mlp(state_dim, self.num_actions, hidden) for _ in range(3))
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        self.log_alpha = torch.tensor(math.log(init_alpha), requires_grad=True)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr, eps=1e-4)  # eps as the official optimizers
        self.critic_opt = torch.optim.Adam([*self.q1.parameters(), *self.q2.parameters()], lr=lr, eps=1e-4)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr, eps=1e-4)
        self.gamma, self.ratio, self.twin_q = gamma, target_entropy_ratio, twin_q
        self.target_update_interval, self.updates_per_step = target_update_interval, updates_per_step
        self.batch_size, self.buffer_size, self.num_envs, self.warmup_steps = batch_size, buffer_size, num_envs, warmup_steps
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.states = torch.zeros(buffer_size, state_dim)
        self.next_states = torch.zeros(buffer_size, state_dim)
        self.actions = torch.zeros(buffer_size, dtype=torch.long)
        self.rewards = torch.zeros(buffer_size)
        self.dones = torch.zeros(buffer_size)
        self.stored = 0  # transitions ever stored; the buffer is a ring of the last buffer_size

    def _log_pi(self, state: Tensor) -> Tensor:
        return torch.log_softmax(self.actor(state), dim=-1)

    @torch.no_grad()
    def greedy_action(self, env: LanguageEnv) -> int:
        return int(self.actor(torch.from_numpy(env.state_features())).argmax())

    def _store(self, state, action, reward, done, next_state) -> None:
        i = self.stored % self.buffer_size
        self.states[i], self.next_states[i] = torch.from_numpy(state), torch.from_numpy(next_state)
        self.actions[i], self.rewards[i], self.dones[i] = action, reward, done
        self.stored += 1

    def _sample(self) -> dict[str, Tensor]:
        index = torch.randint(min(self.stored, self.buffer_size), (self.batch_size,), generator=self.generator)
        return {"state": self.states[index], "action": self.actions[index], "reward": self.rewards[index],
                "done": self.dones[index], "next_state": self.next_states[index]}

    def _update(self) -> None:
        alpha = self.log_alpha.exp().detach()
        for _ in range(self.updates_per_step):
            b = self._sample()
            mask = torch.ones(self.batch_size, self.num_actions, dtype=torch.bool)
            with torch.no_grad():
                target = sac.soft_q_target(b["reward"], b["done"], self._log_pi(b["next_state"]), self.q1_target(b["next_state"]),
                                           self.q2_target(b["next_state"]), mask, alpha, self.gamma, self.twin_q)
            _step(self.critic_opt, sac.critic_loss(self.q1(b["state"]), self.q2(b["state"]), b["action"], target))
        for _ in range(self.updates_per_step):
            b = self._sample()
            mask = torch.ones(self.batch_size, self.num_actions, dtype=torch.bool)
            log_pi = self._log_pi(b["state"])
            with torch.no_grad():
                q1, q2 = self.q1(b["state"]), self.q2(b["state"])
            _step(self.actor_opt, sac.actor_loss(log_pi, q1, q2, mask, alpha))
            _step(self.alpha_opt, sac.temperature_loss(self.log_alpha, log_pi.detach(), mask, self.ratio))
            alpha = self.log_alpha.exp().detach()

    def _act_all(self, envs: list[LanguageEnv], random_actions: bool) -> None:
        """One step in each env (uniformly random or sampled from π); stores the transitions."""
        for env in envs:
            state = env.state_features()
            if random_actions:
                action = int(self.rng.integers(self.num_actions))
            else:
                with torch.no_grad():
                    action = int(torch.multinomial(self._log_pi(torch.from_numpy(state)).exp(), 1, generator=self.generator))
            _, reward, terminated, truncated, _ = env.step(action)
            self._store(state, action, float(reward), float(terminated), env.state_features())
            if terminated or truncated:
                env.reset(seed=int(self.rng.integers(2**30)))

    def train(self, steps: int) -> None:
        """``warmup_steps`` uniformly random transitions (first call only), then ``steps`` training steps,
        each one environment step in each of the ``num_envs`` envs followed by the updates."""
        envs = [self.make_env() for _ in range(self.num_envs)]
        for env in envs:
            env.reset(seed=int(self.rng.integers(2**30)))
        while self.stored < self.warmup_steps:
            self._act_all(envs, random_actions=True)
        for step in range(1, steps + 1):
            self._act_all(envs, random_actions=False)
            self._update()
            if step % self.target_update_interval == 0:
                sac.target_update(self.q1_target, self.q1, 1.0)
                sac.target_update(self.q2_target, self.q2, 1.0)

    def evaluate(self, seeds: list[int], episodes: int) -> np.ndarray:
        return evaluate_greedy(self.make_env, self.greedy_action, seeds, episodes)

class NumericPPO:
    """PPO on the raw numeric state over environment actions (the official ``ppo_numeric.py``'s defaults:
    4 envs × 512-step rollouts, γ = λ = 0.95, 64 epochs × 4 minibatches, clip 0.2 also on the value,
    entropy 0.01, value 0.5, grad norm 0.5, lr 2.5e-4, hidden 16, normalised advantages)."""

    def __init__(
        self, make_env: Callable[[], LanguageEnv], hidden: int = 16, lr: float = 2.5e-4, num_envs: int = 4,
        rollout_steps: int = 512, gamma: float = 0.95, gae_lambda: float = 0.95, update_epochs: int = 64,
        num_minibatches: int = 4, clip: float = 0.2, ent_coef: float = 0.01, vf_coef: float = 0.5,
        max_grad_norm: float = 0.5, seed: int = 0,
    ):
        self.make_env = make_env
        probe = make_env()
        probe.reset(seed=0)
        torch.manual_seed(seed)
        self.actor = _mlp(probe.state_dim, int(probe.action_space.n), hidden)
        self.critic = _mlp(probe.state_dim, 1, hidden)
        self.optimizer = torch.optim.Adam([*self.actor.parameters(), *self.critic.parameters()], lr=lr, eps=1e-5)
        self.num_envs, self.rollout_steps, self.gamma, self.gae_lambda = num_envs, rollout_steps, gamma, gae_lambda
        self.update_epochs, self.num_minibatches, self.clip = update_epochs, num_minibatches, clip
        self.ent_coef, self.vf_coef, self.max_grad_norm = ent_coef, vf_coef, max_grad_norm
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def greedy_action(self, env: LanguageEnv) -> int:
        return int(self.actor(torch.from_numpy(env.state_features())).argmax())

    def _rollout(self, envs: list[LanguageEnv]) -> dict[str, Tensor]:
        T, N = self.rollout_steps, self.num_envs
        states, actions, log_probs = [], torch.zeros(T, N, dtype=torch.long), torch.zeros(T, N)
        rewards, dones, values = torch.zeros(T, N), torch.zeros(T, N), torch.zeros(T, N)
        for t in range(T):
            state = torch.from_numpy(np.stack([env.state_features() for env in envs]))
            with torch.no_grad():
                dist = torch.distributions.Categorical(logits=self.actor(state))
                action = dist.sample()
                log_probs[t], values[t] = dist.log_prob(action), self.critic(state).squeeze(-1)
            states.append(state)
            actions[t] = action
            for i, env in enumerate(envs):
                _, reward, terminated, truncated, _ = env.step(int(action[i]))
                rewards[t, i], dones[t, i] = float(reward), float(terminated or truncated)
                if terminated or truncated:
                    env.reset(seed=int(self.rng.integers(2**30)))
        with torch.no_grad():
            last_value = self.critic(torch.from_numpy(np.stack([env.state_features() for env in envs]))).squeeze(-1)
        advantages, returns = gae(rewards, values, dones, last_value, self.gamma, self.gae_lambda)
        flat = lambda x: x.reshape(T * N, *x.shape[2:])
        return {"state": flat(torch.stack(states)), "action": flat(actions), "log_prob": flat(log_probs),
                "advantage": flat(advantages), "return": flat(returns), "value": flat(values)}

    def _update(self, batch: dict[str, Tensor]) -> None:
        size = batch["action"].shape[0]
        minibatch = size // self.num_minibatches
        for _ in range(self.update_epochs):
            order = torch.randperm(size, generator=self.generator)
            for start in range(0, size - minibatch + 1, minibatch):
                idx = order[start : start + minibatch]
                dist = torch.distributions.Categorical(logits=self.actor(batch["state"][idx]))
                adv = batch["advantage"][idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                every = torch.ones_like(adv)
                policy_loss, _ = clipped_policy_loss(dist.log_prob(batch["action"][idx]), batch["log_prob"][idx], adv,
                                                     every, LossContext(clip_low=self.clip, clip_high=self.clip))
                value = self.critic(batch["state"][idx]).squeeze(-1)
                value_loss = clipped_value_loss(value, batch["value"][idx], batch["return"][idx], every, self.clip)
                loss = policy_loss + self.vf_coef * value_loss - self.ent_coef * dist.entropy().mean()
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_([*self.actor.parameters(), *self.critic.parameters()], self.max_grad_norm)
                self.optimizer.step()

    def train(self, transitions: int) -> None:
        """Rollouts of ``num_envs × rollout_steps`` transitions, each followed by the PPO epochs, until at
        least ``transitions`` environment transitions were taken."""
        envs = [self.make_env() for _ in range(self.num_envs)]
        for env in envs:
            env.reset(seed=int(self.rng.integers(2**30)))
        for _ in range(math.ceil(transitions / (self.num_envs * self.rollout_steps))):
            self._update(self._rollout(envs))

    def evaluate(self, seeds: list[int], episodes: int) -> np.ndarray:
        return evaluate_greedy(self.make_env, self.greedy_action, seeds, episodes)
