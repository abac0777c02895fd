"""RBRL (seed 002): ``SelectorModule`` (attention rule policy + discrete SAC) and ``RuleEnvDataModule``
(the environment-step data source whose replay buffer feeds the training steps).

Per training step (Alg. 1): the module asks the DataModule to take ``env_steps_per_update`` agent
steps with the current policy (rules generated, one selected, acted on, judged, transition stored),
then does one SAC update on a replay batch. At the end of ``fit`` it evaluates, over the DataModule's
evaluation seeds, the trained selector against uniform-random rule choice and every fixed rule, prints
the table and writes it to ``<log_dir>/results.json``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, IterableDataset

from flowkit.rbrl import sac
from flowkit.rbrl.agent import Observation, RuleAgent, StepRecord, evaluate, fixed_rule_chooser, random_chooser
from flowkit.rbrl.encoder import EmbeddingCache
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.judges import Judge
from flowkit.rbrl.policy import RuleAttentionNetwork, masked_log_softmax
from flowkit.rbrl.replay import ReplayBuffer, pad_rules
from flowkit.rbrl.sources import RuleSource

TRAIN_SEED_OFFSET = 1_000_000  # training episodes never reuse an evaluation episode's seed


class _ReplayBatches(IterableDataset):
    def __init__(self, datamodule: RuleEnvDataModule):
        self.datamodule = datamodule

    def __len__(self) -> int:
        return self.datamodule.updates_per_epoch

    def __iter__(self):
        dm = self.datamodule
        for _ in range(dm.updates_per_epoch):
            yield dm.buffer.sample(dm.batch_size, dm.generator)


class RuleEnvDataModule(LightningDataModule):
    """Environment, rule source, judge, embedding cache and replay buffer.

    Args:
        env: ``binpacking`` or ``wearables``; ``env_kwargs`` go to the environment.
        rules: where candidate rules and rule-following actions come from.
        judge: the rule-reward judge.
        max_rules: rule sets are truncated/padded to this many.
        embedding_cache: file for cached rule embeddings (default ``<default_root_dir>/rule_embeddings.pt``).
        eval_seeds / eval_episodes: the end-of-fit comparison (episodes per seed).
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
        batch_size: int = 16,
        buffer_size: int = 4096,
        updates_per_epoch: int = 500,
        embedding_cache: str | None = None,
        eval_seeds: list[int] = [1, 2, 3],  # noqa: B006  (jsonargparse reads the default)
        eval_episodes: int = 10,
        log_explanations: bool = True,
    ):
        super().__init__()
        self.env_name = env
        self.env_kwargs = dict(env_kwargs or {})
        self.source = rules
        self.judge = judge
        self.max_rules = max_rules
        self.batch_size = batch_size
        self.buffer = ReplayBuffer(buffer_size)
        self.updates_per_epoch = updates_per_epoch
        self.embedding_cache = embedding_cache
        self.eval_seeds = list(eval_seeds)
        self.eval_episodes = eval_episodes
        self.log_explanations = log_explanations
        self.generator = torch.Generator().manual_seed(0)
        self.embeddings: EmbeddingCache | None = None
        self.agent: RuleAgent | None = None
        self.observation: Observation | None = None
        self.episode_return = 0.0
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
        self.agent = self.make_agent()
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

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ReplayBatches(self), batch_size=None)

    # ---- interaction ------------------------------------------------------------------------------

    def collect(self, choose, steps: int) -> list[float]:
        """Take ``steps`` agent steps with ``choose(obs) -> (rule index, probabilities)``; store the
        transitions; return the environment returns of episodes finished meanwhile."""
        finished = []
        for _ in range(steps):
            if self.observation is None:
                self.observation = self.agent.reset(TRAIN_SEED_OFFSET + int(self._episode_seed.integers(2**30)))
                self.episode_return = 0.0
            obs = self.observation
            chosen, probabilities = choose(obs) if obs.rules else (None, None)
            env_reward, rule_reward, done, next_obs, record = self.agent.step(obs, chosen, probabilities)
            self.episode_return += env_reward
            self._log_record(record)
            if chosen is not None and (done or next_obs.rules):
                self.buffer.add(self._transition(obs, chosen, env_reward, rule_reward, done, next_obs))
            self.observation = next_obs
            if done:
                finished.append(self.episode_return)
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

    # ---- evaluation ---------------------------------------------------------------------------------

    def compare(self, trained_chooser) -> dict[str, np.ndarray]:
        """Mean return per evaluation seed for the trained selector, random choice and each fixed rule."""
        agent = self.make_agent()
        results = {
            "trained selector": evaluate(agent, lambda seed: trained_chooser, self.eval_seeds, self.eval_episodes),
            "random rule": evaluate(agent, random_chooser, self.eval_seeds, self.eval_episodes),
        }
        for name in getattr(self.source, "rule_names", []):
            results[f"fixed: {name}"] = evaluate(agent, lambda seed, n=name: fixed_rule_chooser(n), self.eval_seeds, self.eval_episodes)
        return results


def format_results(title: str, results: dict[str, np.ndarray], seeds: list[int], episodes: int) -> str:
    lines = [
        f"{title}: mean episode return ± std over {len(seeds)} evaluation seeds {seeds} ({episodes} episodes each)",
        f"{'policy':32s} {'mean':>9s} {'± std':>8s}   per-seed means",
    ]
    for name, per_seed in sorted(results.items(), key=lambda kv: -kv[1].mean()):
        per = " ".join(f"{v:8.2f}" for v in per_seed)
        lines.append(f"{name:32s} {per_seed.mean():9.2f} {per_seed.std(ddof=1) if len(per_seed) > 1 else 0.0:8.2f}   {per}")
    return "\n".join(lines)


class SelectorModule(LightningModule):
    """The rule selector π_θ (seed 002 §5.2) trained with discrete SAC (§5.4): twin Q networks of the
    actor's shape with target copies, auto-tuned temperature α, reward r̃ = r_env + c · r_rule.

    Networks are built in ``setup`` once the DataModule knows the state and embedding sizes.
    ``torch_threads`` (default 1) is applied with ``torch.set_num_threads`` in ``setup`` and undone in ``teardown``.
    """

    def __init__(
        self,
        hidden: int = 16,
        num_layers: int = 2,
        heads: int = 1,
        gamma: float = 0.95,
        lr: float = 1e-4,
        alpha_lr: float | None = None,
        tau: float = 0.005,
        init_alpha: float = 0.2,
        target_entropy_ratio: float = 0.5,
        rule_reward_coef: float = 0.1,
        reward_scale: float = 1.0,
        env_steps_per_update: int = 1,
        warmup_steps: int = 256,
        torch_threads: int | None = 1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.actor: RuleAttentionNetwork | None = None

    def build_networks(self, state_dim: int, embed_dim: int) -> None:
        if self.actor is not None:
            return
        hp = self.hparams
        make = lambda: RuleAttentionNetwork(state_dim, embed_dim, hp.hidden, hp.num_layers, hp.heads)
        self.actor, self.q1, self.q2 = make(), make(), make()
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        for p in (*self.q1_target.parameters(), *self.q2_target.parameters()):
            p.requires_grad_(False)
        self.log_alpha = torch.nn.Parameter(torch.tensor(math.log(hp.init_alpha)))
        self.network_dims = (state_dim, embed_dim)

    def setup(self, stage: str) -> None:
        self._threads_before = torch.get_num_threads()
        if self.hparams.torch_threads:
            # the networks are tiny (hidden 16): with more threads, synchronisation costs more than it saves
            torch.set_num_threads(self.hparams.torch_threads)
        dm = self.trainer.datamodule  # Lightning sets the DataModule up first
        self.build_networks(dm.state_dim, dm.embed_dim)

    def teardown(self, stage: str) -> None:
        torch.set_num_threads(self._threads_before)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["network_dims"] = self.network_dims

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.build_networks(*checkpoint["network_dims"])

    def configure_optimizers(self):
        hp = self.hparams
        # foreach: one fused update per group instead of a Python loop per tensor (tiny nets)
        return torch.optim.Adam(
            [
                {"params": self.actor.parameters()},
                {"params": [*self.q1.parameters(), *self.q2.parameters()]},
                {"params": [self.log_alpha], "lr": hp.alpha_lr or hp.lr},
            ],
            lr=hp.lr, foreach=True,
        )

    # ---- acting -------------------------------------------------------------------------------------

    @torch.no_grad()
    def rule_log_probs(self, obs: Observation) -> torch.Tensor:
        mask = torch.ones(1, len(obs.rules), dtype=torch.bool)
        logits = self.actor(obs.state[None].to(self.device), obs.embeddings[None].to(self.device), mask.to(self.device))
        return masked_log_softmax(logits, mask.to(self.device))[0].cpu()

    def sample_rule(self, obs: Observation) -> tuple[int, list[float]]:
        probs = self.rule_log_probs(obs).exp()
        return int(torch.multinomial(probs, 1)), probs.tolist()

    def greedy_rule(self, obs: Observation) -> int:
        return int(self.rule_log_probs(obs).argmax())

    def _uniform_rule(self, obs: Observation) -> tuple[int, list[float]]:
        n = len(obs.rules)
        return int(torch.randint(n, ())), [1.0 / n] * n

    # ---- training -----------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        dm.collect(self._uniform_rule, self.hparams.warmup_steps)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Collect, then one SAC update. The three losses touch disjoint parameters (the actor loss
        sees detached Q values, the temperature loss a detached policy, the critic target no graph),
        so one backward of their sum and one Adam step equal three separate updates."""
        hp = self.hparams
        dm = self.trainer.datamodule
        for episode_return in dm.collect(self.sample_rule, hp.env_steps_per_update):
            dm.recent_returns = (dm.recent_returns + [episode_return])[-20:]
        alpha = self.log_alpha.exp().detach()
        reward = hp.reward_scale * (batch["env_reward"] + hp.rule_reward_coef * batch["rule_reward"])

        with torch.no_grad():
            next_log_pi = masked_log_softmax(self.actor(batch["next_state"], batch["next_rules"], batch["next_mask"]), batch["next_mask"])
            target = sac.soft_q_target(
                reward, batch["done"], next_log_pi,
                self.q1_target(batch["next_state"], batch["next_rules"], batch["next_mask"]),
                self.q2_target(batch["next_state"], batch["next_rules"], batch["next_mask"]),
                batch["next_mask"], alpha, hp.gamma,
            )
        q1 = self.q1(batch["state"], batch["rules"], batch["mask"])
        q2 = self.q2(batch["state"], batch["rules"], batch["mask"])
        critic_loss = sac.critic_loss(q1, q2, batch["action"], target)
        log_pi = masked_log_softmax(self.actor(batch["state"], batch["rules"], batch["mask"]), batch["mask"])
        actor_loss = sac.actor_loss(log_pi, q1, q2, batch["mask"], alpha)
        alpha_loss = sac.temperature_loss(self.log_alpha, log_pi.detach(), batch["mask"], hp.target_entropy_ratio)

        if (batch_idx + 1) % self.trainer.log_every_n_steps == 0:  # when Lightning writes logs; self.log is costly
            metrics = {
                "critic_loss": critic_loss, "actor_loss": actor_loss, "alpha": alpha,
                "entropy": sac.entropy(log_pi.detach(), batch["mask"]).mean(),
            }
            if dm.recent_returns:
                metrics["episode_return"] = float(np.mean(dm.recent_returns))
            self.log_dict(metrics, prog_bar=True)
        return critic_loss + actor_loss + alpha_loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        sac.soft_update(self.q1_target, self.q1, self.hparams.tau)
        sac.soft_update(self.q2_target, self.q2, self.hparams.tau)

    def on_fit_end(self) -> None:
        dm = self.trainer.datamodule
        self.eval()
        results = dm.compare(self.greedy_rule)
        table = format_results(f"RBRL {dm.env_name}", results, dm.eval_seeds, dm.eval_episodes)
        print("\n" + table, flush=True)
        out = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: v.tolist() for k, v in results.items()} | {"eval_seeds": dm.eval_seeds}, indent=1))
