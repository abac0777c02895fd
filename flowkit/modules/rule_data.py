"""RBRL's data source: ``RuleEnvDataModule``, the environment-step source whose replay buffer feeds the
:class:`~flowkit.modules.selector.SelectorModule`'s training steps. Per training step it takes one step in each of
its ``num_envs`` environments with the current policy (Alg. 1: rules generated, one sampled, acted on, judged,
transitions stored).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from flowkit.errors import ConfigError, require
from flowkit.rbrl.agent import Observation, RuleAgent, StepRecord
from flowkit.llm.chat_backends import ChatBackend
from flowkit.rbrl.encoder import EmbeddingCache
from flowkit.rbrl.envs import ENVIRONMENTS, make_env
from flowkit.rbrl.judges import Judge
from flowkit.rbrl.replay import ReplayBuffer, pad_rules
from flowkit.rbrl.sources import RuleSource

TRAIN_SEED_OFFSET = 1_000_000  # training episodes never reuse an evaluation episode's seed


class _TrainingSteps(Dataset):
    """One item per training step (its index): the module samples its own replay batches, several per
    step (``critic_updates`` + ``actor_updates``), after the step's environment interaction."""

    def __init__(self, datamodule: RuleEnvDataModule):
        self.datamodule = datamodule

    def __len__(self) -> int:
        return self.datamodule.updates_per_epoch

    def __getitem__(self, index: int) -> int:
        return index


class RuleEnvDataModule(LightningDataModule):
    """Environment, rule source, judge, embedding cache and replay buffer.

    Args:
        env: ``binpacking``, ``wearables`` or ``heatalerts``; ``env_kwargs`` go to the environment.
        rules: where candidate rules and rule-following actions come from.
        judge: the rule-reward judge.
        max_rules: rule sets are truncated/padded to this many.
        num_envs: environments stepped in lockstep, one transition each per training step (official 4).
        batch_size / buffer_size: replay batch and capacity (official 16 / 4096).
        updates_per_epoch: training steps per epoch; the default 1216 after the selector's 256-transition
            warm-up (64 steps of the 4 envs) is the official run length, 1280 iterations × 4 envs.
        embedding_cache: file for cached rule embeddings (default ``<default_root_dir>/rule_embeddings.pt``).
        eval_envs: fixed-seed episodes of each learning-curve evaluation (official 4, greedy rule choice;
            flowkit plays them a second time with sampled rule choice).
        eval_seeds / eval_episodes: the end-of-fit comparison (episodes per seed).
        numeric_sac_steps: when > 0, the comparison also trains and evaluates the numeric baseline
            (:class:`flowkit.rbrl.numeric.NumericSAC`: discrete SAC on the raw state over environment
            actions, no rules) for this many training steps.
        numeric_ppo_transitions: when > 0, the comparison also trains and evaluates
            :class:`flowkit.rbrl.numeric.NumericPPO` (PPO on the raw state) for this many environment transitions.
        cot_backend: when set, the comparison also runs the chain-of-thought LLM agent baseline
            (:class:`flowkit.rbrl.llm_source.CoTLLMAgent`, actions straight from the LLM) with this backend.
        log_explanations: append every training step's rule, action and explanation to
            ``<log_dir>/explanations.jsonl``.
    """

    def __init__(
        self,
        env: str,
        rules: RuleSource,
        judge: Judge,
        env_kwargs: dict | None = None,
        max_rules: int = 10,
        num_envs: int = 4,
        batch_size: int = 16,
        buffer_size: int = 4096,
        updates_per_epoch: int = 1216,
        embedding_cache: str | None = None,
        eval_envs: int = 4,
        eval_seeds: list[int] = [1, 2, 3],  # noqa: B006  (jsonargparse reads the default)
        eval_episodes: int = 10,
        numeric_sac_steps: int = 0,
        numeric_ppo_transitions: int = 0,
        cot_backend: ChatBackend | None = None,
        log_explanations: bool = True,
    ):
        super().__init__()
        name = type(self).__name__
        require(env in ENVIRONMENTS, f"{name}.env must be one of {sorted(ENVIRONMENTS)}, got {env!r}")
        for option, value in (
            ("max_rules", max_rules), ("num_envs", num_envs), ("batch_size", batch_size),
            ("updates_per_epoch", updates_per_epoch), ("eval_envs", eval_envs), ("eval_episodes", eval_episodes),
        ):
            require(value >= 1, f"{name}.{option} must be >= 1, got {value}")
        require(buffer_size >= batch_size, f"{name}.buffer_size must be >= batch_size ({batch_size}), got {buffer_size}")
        require(len(eval_seeds) >= 1, f"{name}.eval_seeds must list at least one seed, got {eval_seeds}")
        require(numeric_sac_steps >= 0, f"{name}.numeric_sac_steps must be >= 0 (0: no numeric baseline), got {numeric_sac_steps}")
        require(numeric_ppo_transitions >= 0,
                 f"{name}.numeric_ppo_transitions must be >= 0 (0: no PPO baseline), got {numeric_ppo_transitions}")
        self.env_name = env
        self.env_kwargs = dict(env_kwargs or {})
        self.source = rules
        self.judge = judge
        self.max_rules = max_rules
        self.num_envs = num_envs
        self.batch_size = batch_size
        self.buffer = ReplayBuffer(buffer_size)
        self.updates_per_epoch = updates_per_epoch
        self.embedding_cache = embedding_cache
        self.eval_envs = eval_envs
        self.eval_seeds = list(eval_seeds)
        self.eval_episodes = eval_episodes
        self.numeric_sac_steps = numeric_sac_steps
        self.numeric_ppo_transitions = numeric_ppo_transitions
        self.cot_backend = cot_backend
        self.log_explanations = log_explanations
        self.generator = torch.Generator().manual_seed(0)
        self.embeddings: EmbeddingCache | None = None
        self.agent: RuleAgent | None = None  # the first training env; its env gives the state size
        self.agents: list[RuleAgent] = []
        self.observations: list[Observation | None] = []
        self.episode_returns: list[float] = []
        self.episodes_done = 0
        self.recent_returns: list[float] = []
        self.explanation_file: Path | None = None
        self.state_dim: int | None = None

    # ---- setup ------------------------------------------------------------------------------------

    def _run_dir(self) -> Path:
        return Path(self.trainer.log_dir or self.trainer.default_root_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.agent is not None:
            return
        root = Path(self.trainer.default_root_dir) if self.trainer else Path(".")
        self.embeddings = EmbeddingCache(self.embedding_cache or root / "rule_embeddings.pt")
        self.agents = [self.make_agent() for _ in range(self.num_envs)]
        self.observations = [None] * self.num_envs
        self.episode_returns = [0.0] * self.num_envs
        self.agent = self.agents[0]
        self.agent.env.reset(seed=0)
        self.state_dim = self.agent.env.state_dim
        seed = int(torch.initial_seed()) % 2**31
        self.generator.manual_seed(seed)
        self._episode_seed = np.random.default_rng(seed)

    def make_agent(self) -> RuleAgent:
        return RuleAgent(make_env(self.env_name, **self.env_kwargs), self.source, self.judge, self.embeddings, self.max_rules)

    @property
    def embed_dim(self) -> int:
        return self.embeddings.dim

    @property
    def num_actions(self) -> int:
        """The environment's action count |A| (the official SAC's target entropy is 0.89 · log |A|)."""
        return int(self.agent.env.action_space.n)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TrainingSteps(self), batch_size=None)

    def sample(self) -> dict[str, torch.Tensor]:
        if not len(self.buffer):
            raise ConfigError(
                f"{type(self).__name__}: no transition to learn from after the warm-up: every step lacked valid rules, "
                "a valid action or a rule reward (see the warnings above); check data.init_args.rules and judge"
            )
        return self.buffer.sample(self.batch_size, self.generator)

    # ---- interaction ------------------------------------------------------------------------------

    def collect(self, choose, steps: int) -> list[float]:
        """Take ``steps`` steps in each of the ``num_envs`` environments with
        ``choose(obs) -> (rule index, probabilities)``; store the transitions; return the environment
        returns of episodes finished meanwhile."""
        finished = []
        for _ in range(steps):
            for i, agent in enumerate(self.agents):
                if self.observations[i] is None:
                    self.observations[i] = agent.reset(TRAIN_SEED_OFFSET + int(self._episode_seed.integers(2**30)))
                    self.episode_returns[i] = 0.0
                obs = self.observations[i]
                chosen, probabilities = choose(obs) if obs.rules else (None, None)
                env_reward, rule_reward, done, next_obs, record = agent.step(obs, chosen, probabilities)
                self.episode_returns[i] += env_reward
                self._log_record(record)
                # a step without rules, without a rule reward (the judge failed) or followed by a state
                # without rules has nothing the critic could learn from: not stored
                if chosen is not None and rule_reward is not None and (done or next_obs.rules):
                    self.buffer.add(self._transition(obs, chosen, env_reward, rule_reward, done, next_obs))
                self.observations[i] = next_obs
                if done:
                    finished.append(self.episode_returns[i])
                    self.episodes_done += 1
        self.embeddings.save()
        return finished

    def _transition(self, obs, chosen, env_reward, rule_reward, done, next_obs) -> dict:
        rules, mask = pad_rules(obs.embeddings, self.max_rules)
        # a terminal transition's next state is never evaluated (done = 1); reuse s̃_t to keep shapes valid
        following = obs if done else next_obs
        next_rules, next_mask = pad_rules(following.embeddings, self.max_rules)
        return {
            "state": obs.state, "rules": rules, "mask": mask, "action": torch.tensor(chosen),
            "env_reward": torch.tensor(env_reward), "rule_reward": torch.tensor(rule_reward),
            "done": torch.tensor(float(done)), "next_state": following.state, "next_rules": next_rules,
            "next_mask": next_mask,
        }

    def _log_record(self, record: StepRecord) -> None:
        if not self.log_explanations or self.trainer is None:
            return
        if self.explanation_file is None:
            self.explanation_file = self._run_dir() / "explanations.jsonl"
            self.explanation_file.parent.mkdir(parents=True, exist_ok=True)
        chosen = record.rules[record.chosen] if record.chosen is not None else None
        line = {
            "episode": self.episodes_done, "t": record.t, "state": record.state_text,
            "rule": chosen, "action": record.action_text, "explanation": record.explanation,
            "env_reward": record.env_reward, "rule_reward": record.rule_reward,
        }
        with self.explanation_file.open("a") as f:
            f.write(json.dumps(line) + "\n")
