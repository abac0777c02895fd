"""RBRL (seed 002): ``SelectorModule``, the attention rule policy trained with discrete SAC on the replay buffer of
the :class:`~flowkit.modules.rule_data.RuleEnvDataModule`; its reports are :mod:`flowkit.modules.selector_report`'s.

Per training step, as the official ``sac_attention.py``: the DataModule takes one step in each of its
``num_envs`` environments with the current policy (Alg. 1: rules generated, one sampled, acted on, judged,
transitions stored), then the module does ``critic_updates`` critic updates and ``actor_updates`` actor
(+ temperature) updates, each on its own replay batch; every ``target_update_interval`` steps the target
critics move by τ (τ = 1: a hard copy); every ``eval_interval`` steps the selector plays the DataModule's
``eval_envs`` fixed-seed episodes twice, greedily and sampling its rules, and the greedy and sampled episode
returns, rule reward, entropy of the rule choice, how often each named rule was chosen and how often the
selector's action agreed with each fixed rule's are logged (``eval/*``) and appended to
``<log_dir>/eval_curve.jsonl``. At the end of ``fit`` it evaluates, over the DataModule's evaluation seeds,
the trained selector (greedy and sampled) against uniform-random rule choice and every fixed rule, prints the
table — flagging a selector that behaves as one fixed rule — and writes it to ``<log_dir>/results.json``.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningModule

from flowkit.errors import require
from flowkit.modules.rule_data import RuleEnvDataModule
from flowkit.modules.selector_report import append_curve_point, write_final_report
from flowkit.rbrl import comparison, sac
from flowkit.rbrl.agent import Observation
from flowkit.rbrl.policy import RuleAttentionNetwork, masked_log_softmax

log = logging.getLogger(__name__)

CURVE_SEED_OFFSET = 500_000  # the learning curve's fixed evaluation episodes


class SelectorModule(LightningModule):
    """The rule selector π_θ (seed 002 §5.2) trained with discrete SAC (§5.4, App. Alg. 3): twin Q networks
    of the actor's shape with target copies, auto-tuned temperature α, reward r̃ = r_env + c · r_rule.

    Defaults are the official ``sac_attention.py``'s; flowkit's earlier choices stay as options:

    - ``heads`` 4, ``dropout`` 0.05, ``projection`` ``"layernorm_silu"`` (earlier: 1, 0, ``"linear"``);
    - ``lr`` 1e-4 for actor, critics and (unless ``alpha_lr``) the temperature;
    - ``tau`` 1 every ``target_update_interval`` = 64 steps, a hard copy (earlier: Polyak τ 0.005 every step);
    - ``twin_q`` ``"softmin"``: the target blends the twin Qs by softmin(10 Q) (earlier: ``"min"``);
    - ``init_alpha`` 0.1, ``target_entropy_ratio`` 0.89 (earlier 0.2, 0.5) of ``target_entropy_of``
      ``"actions"``: target entropy 0.89 · log |A| with |A| the environment's action count, as the official
      code (``"rules"``: 0.89 · log |R_s| over each state's rules, flowkit's earlier choice; with fewer rules than
      actions, e.g. 7 template rules in 9-action bin packing, the official target exceeds the largest possible
      entropy log |R| and α grows without bound);
    - ``next_state_rules`` ``"current"``: the critic's target evaluates the next state s_{t+1} with the current
      rules R_t, as the official ``update_critic`` does (it samples no next rules); ``"next"``: with R_{t+1},
      the augmented next state s̃_{t+1} = (s_{t+1}, R_{t+1}) of seed 002 §5.4 (flowkit's earlier choice);
    - Adam with eps 1e-4 for the actor, the critics and the temperature, as the official optimizers;
    - ``critic_updates`` 4 and ``actor_updates`` 4 per step (each actor update followed by a temperature
      update), each on a fresh replay batch, after one step in each of the DataModule's ``num_envs`` = 4 envs;
    - ``eval_interval`` 64: learning-curve evaluation on the DataModule's ``eval_envs`` = 4 fixed-seed
      episodes with greedy rule choice (0 disables it).

    ``warmup_steps`` transitions are collected with uniform-random rule choice before the first update.
    The updates use manual optimization (three Adams: actor, critics, temperature), so Lightning's
    ``global_step`` counts optimizer steps (4 + 2 · 4 = 12 per training step with the defaults); the run
    length is ``max_epochs × updates_per_epoch`` training steps, and ``steps_done`` counts those.
    Networks are built in ``setup`` once the DataModule knows the state and embedding sizes; in a training
    step they act and give targets in eval mode (no dropout) and only the network being updated runs in
    train mode, as in the official code.
    ``torch_threads`` (default 1) is applied with ``torch.set_num_threads`` in ``setup`` and undone in ``teardown``.
    """

    def __init__(
        self,
        hidden: int = 16,
        num_layers: int = 2,
        heads: int = 4,
        dropout: float = 0.05,
        projection: str = "layernorm_silu",
        gamma: float = 0.95,
        lr: float = 1e-4,
        alpha_lr: float | None = None,
        tau: float = 1.0,
        target_update_interval: int = 64,
        twin_q: str = "softmin",
        init_alpha: float = 0.1,
        target_entropy_ratio: float = 0.89,
        target_entropy_of: str = "actions",
        next_state_rules: str = "current",
        rule_reward_coef: float = 0.1,
        reward_scale: float = 1.0,
        critic_updates: int = 4,
        actor_updates: int = 4,
        warmup_steps: int = 256,
        eval_interval: int = 64,
        torch_threads: int | None = 1,
    ):
        super().__init__()
        name = type(self).__name__
        for option, value in (
            ("hidden", hidden), ("num_layers", num_layers), ("heads", heads), ("target_update_interval", target_update_interval),
            ("critic_updates", critic_updates), ("warmup_steps", warmup_steps),
        ):
            require(value >= 1, f"{name}.{option} must be >= 1, got {value}")
        require(hidden % heads == 0, f"{name}.hidden must be a multiple of heads ({heads}), got {hidden}")
        require(0.0 <= dropout < 1.0, f"{name}.dropout must be in [0, 1), got {dropout}")
        require(projection in RuleAttentionNetwork.PROJECTIONS,
                 f"{name}.projection must be one of {RuleAttentionNetwork.PROJECTIONS}, got {projection!r}")
        require(0.0 <= gamma <= 1.0, f"{name}.gamma must be in [0, 1], got {gamma}")
        require(lr > 0, f"{name}.lr must be > 0, got {lr}")
        require(alpha_lr is None or alpha_lr > 0, f"{name}.alpha_lr must be > 0 (or null: lr), got {alpha_lr}")
        require(0.0 < tau <= 1.0, f"{name}.tau must be in (0, 1], got {tau}")
        require(twin_q in sac.TWIN_Q_BLENDS, f"{name}.twin_q must be one of {sac.TWIN_Q_BLENDS}, got {twin_q!r}")
        require(init_alpha > 0, f"{name}.init_alpha must be > 0, got {init_alpha}")
        require(0.0 <= target_entropy_ratio < 1.0, f"{name}.target_entropy_ratio must be in [0, 1), got {target_entropy_ratio}")
        require(target_entropy_of in ("actions", "rules"),
                 f"{name}.target_entropy_of must be 'actions' (official) or 'rules', got {target_entropy_of!r}")
        require(next_state_rules in ("current", "next"),
                 f"{name}.next_state_rules must be 'current' (official) or 'next', got {next_state_rules!r}")
        require(math.isfinite(rule_reward_coef) and rule_reward_coef >= 0,
                 f"{name}.rule_reward_coef must be a finite value >= 0, got {rule_reward_coef}")
        require(reward_scale > 0 and math.isfinite(reward_scale), f"{name}.reward_scale must be a finite value > 0, got {reward_scale}")
        require(actor_updates >= 0, f"{name}.actor_updates must be >= 0, got {actor_updates}")
        require(eval_interval >= 0, f"{name}.eval_interval must be >= 0 (0: no learning-curve evaluation), got {eval_interval}")
        require(torch_threads is None or torch_threads >= 1, f"{name}.torch_threads must be >= 1 or null, got {torch_threads}")
        self.save_hyperparameters()
        self.automatic_optimization = False  # several critic/actor/temperature updates per step
        self.actor: RuleAttentionNetwork | None = None
        self.steps_done = 0  # training steps (one environment step in each env + the updates)
        self.curve_file: Path | None = None

    def build_networks(self, state_dim: int, embed_dim: int) -> None:
        if self.actor is not None:
            return
        hp = self.hparams
        make = lambda: RuleAttentionNetwork(state_dim, embed_dim, hp.hidden, hp.num_layers, hp.heads, hp.dropout, hp.projection)
        self.actor, self.q1, self.q2 = make(), make(), make()
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        for p in (*self.q1_target.parameters(), *self.q2_target.parameters()):
            p.requires_grad_(False)
        self.log_alpha = torch.nn.Parameter(torch.tensor(math.log(hp.init_alpha)))
        self.network_dims = (state_dim, embed_dim)
        self.num_actions: int | None = None  # the environment's |A|, for target_entropy_of: actions

    def setup(self, stage: str) -> None:
        self._threads_before = torch.get_num_threads()
        if self.hparams.torch_threads:
            # the networks are tiny (hidden 16): with more threads, synchronisation costs more than it saves
            torch.set_num_threads(self.hparams.torch_threads)
        dm = self.trainer.datamodule  # Lightning sets the DataModule up first
        self.build_networks(dm.state_dim, dm.embed_dim)
        self.num_actions = dm.num_actions

    def teardown(self, stage: str) -> None:
        torch.set_num_threads(self._threads_before)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["network_dims"] = self.network_dims
        checkpoint["selector_steps_done"] = self.steps_done

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.build_networks(*checkpoint["network_dims"])
        self.steps_done = checkpoint.get("selector_steps_done", 0)

    def configure_optimizers(self):
        hp = self.hparams
        # three optimizers with eps 1e-4, as the official code; foreach: one fused update per optimizer
        # instead of a Python loop per tensor (tiny nets)
        return [
            torch.optim.Adam(self.actor.parameters(), lr=hp.lr, eps=1e-4, foreach=True),
            torch.optim.Adam([*self.q1.parameters(), *self.q2.parameters()], lr=hp.lr, eps=1e-4, foreach=True),
            torch.optim.Adam([self.log_alpha], lr=hp.alpha_lr or hp.lr, eps=1e-4),
        ]

    # ---- acting -------------------------------------------------------------------------------------

    @torch.no_grad()
    def rule_log_probs(self, obs: Observation) -> torch.Tensor:
        mask = torch.ones(1, len(obs.rules), dtype=torch.bool)
        logits = self.actor(obs.state[None].to(self.device), obs.embeddings[None].to(self.device), mask.to(self.device))
        return masked_log_softmax(logits, mask.to(self.device))[0].cpu()

    def sample_rule(self, obs: Observation, generator: torch.Generator | None = None) -> tuple[int, list[float]]:
        probs = self.rule_log_probs(obs).exp()
        return int(torch.multinomial(probs, 1, generator=generator)), probs.tolist()

    def seeded_sampler(self, seed: int):
        """Sampled rule choice from its own generator: evaluations neither draw from nor perturb the
        training's random stream, and are reproducible."""
        generator = torch.Generator().manual_seed(seed)
        return lambda obs: self.sample_rule(obs, generator)

    def sampled_chooser(self, seed: int):
        """:meth:`seeded_sampler` as a chooser (the rule index only)."""
        sample = self.seeded_sampler(seed)
        return lambda obs: sample(obs)[0]

    def greedy_rule(self, obs: Observation) -> int:
        return int(self.rule_log_probs(obs).argmax())

    def _greedy_with_probs(self, obs: Observation) -> tuple[int, list[float]]:
        probs = self.rule_log_probs(obs).exp()
        return int(probs.argmax()), probs.tolist()

    def _uniform_rule(self, obs: Observation) -> tuple[int, list[float]]:
        n = len(obs.rules)
        return int(torch.randint(n, ())), [1.0 / n] * n

    # ---- training -----------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        if len(dm.buffer) < self.hparams.warmup_steps:
            dm.collect(self._uniform_rule, math.ceil(self.hparams.warmup_steps / dm.num_envs))
        self._check_target_entropy(dm)

    def _check_target_entropy(self, dm: RuleEnvDataModule) -> None:
        """Warn once when the official target entropy 0.89 · log |A| is above log |R|, the largest entropy a
        choice among the warm-up's rule sets can have: α would then grow without bound."""
        hp = self.hparams
        if hp.target_entropy_of != "actions" or not len(dm.buffer):
            return
        most_rules = int(dm.buffer.storage["mask"][: len(dm.buffer)].sum(-1).max())
        target = hp.target_entropy_ratio * math.log(self.num_actions)
        if target >= math.log(most_rules):
            log.warning(
                "target entropy %.3f (%.2f · log %d actions) is not below log %d = %.3f, the largest entropy over "
                "%d rules: α will grow without bound; set model.init_args.target_entropy_of: rules",
                target, hp.target_entropy_ratio, self.num_actions, most_rules, math.log(most_rules), most_rules,
            )

    def _reward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hp = self.hparams
        return hp.reward_scale * (batch["env_reward"] + hp.rule_reward_coef * batch["rule_reward"])

    def critic_loss(self, batch: dict[str, torch.Tensor], alpha: torch.Tensor) -> torch.Tensor:
        """L_Q on one batch, target y = r̃ + γ (1 − done) V̄(s') from the target critics and the actor, s' the next
        state with the current or the next rules (``next_state_rules``)."""
        hp = self.hparams
        with torch.no_grad():
            rules = ("next_rules", "next_mask") if hp.next_state_rules == "next" else ("rules", "mask")
            nxt = (batch["next_state"], batch[rules[0]], batch[rules[1]])
            next_log_pi = masked_log_softmax(self.actor(*nxt), nxt[2])
            target = sac.soft_q_target(
                self._reward(batch), batch["done"], next_log_pi, self.q1_target(*nxt), self.q2_target(*nxt),
                nxt[2], alpha, hp.gamma, hp.twin_q,
            )
        now = (batch["state"], batch["rules"], batch["mask"])
        return sac.critic_loss(self.q1(*now), self.q2(*now), batch["action"], target)

    def actor_loss(self, batch: dict[str, torch.Tensor], alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(L_π, log π) on one batch; the critics are evaluated without gradient."""
        now = (batch["state"], batch["rules"], batch["mask"])
        log_pi = masked_log_softmax(self.actor(*now), batch["mask"])
        with torch.no_grad():
            q1, q2 = self.q1(*now), self.q2(*now)
        return sac.actor_loss(log_pi, q1, q2, batch["mask"], alpha), log_pi

    def _update(self, optimizer, networks, loss: torch.Tensor) -> None:
        """One optimizer step on ``loss``; the networks it trained (in train mode) go back to eval mode."""
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        optimizer.step()
        for net in networks:
            net.eval()

    def training_step(self, step_index: int, batch_idx: int) -> None:
        """One official SAC iteration: environment steps, then the critic, actor and temperature updates."""
        hp = self.hparams
        dm = self.trainer.datamodule
        actor_opt, critic_opt, alpha_opt = self.optimizers()
        self.eval()  # act and compute targets without dropout; each update switches on its own network
        for episode_return in dm.collect(self.sample_rule, 1):
            dm.recent_returns = (dm.recent_returns + [episode_return])[-20:]

        for _ in range(hp.critic_updates):
            alpha = self.log_alpha.exp().detach()
            self.q1.train(), self.q2.train()
            critic_loss = self.critic_loss(dm.sample(), alpha)
            self._update(critic_opt, (self.q1, self.q2), critic_loss)
        for _ in range(hp.actor_updates):
            alpha = self.log_alpha.exp().detach()
            self.actor.train()
            actor_loss, log_pi = self.actor_loss(batch := dm.sample(), alpha)
            self._update(actor_opt, (self.actor,), actor_loss)
            num_actions = self.num_actions if hp.target_entropy_of == "actions" else None
            alpha_loss = sac.temperature_loss(self.log_alpha, log_pi.detach(), batch["mask"], hp.target_entropy_ratio, num_actions)
            self._update(alpha_opt, (), alpha_loss)

        self.steps_done += 1
        if self.steps_done % hp.target_update_interval == 0:
            sac.target_update(self.q1_target, self.q1, hp.tau)
            sac.target_update(self.q2_target, self.q2, hp.tau)
        if (batch_idx + 1) % self.trainer.log_every_n_steps == 0:  # when Lightning writes logs; self.log is costly
            metrics = {"critic_loss": critic_loss.detach(), "alpha": self.log_alpha.exp().detach()}
            if hp.actor_updates:
                metrics |= {"actor_loss": actor_loss.detach(), "entropy": sac.entropy(log_pi.detach(), batch["mask"]).mean()}
            if dm.recent_returns:
                metrics["episode_return"] = float(np.mean(dm.recent_returns))
            self.log_dict(metrics, prog_bar=True)
        if hp.eval_interval and self.steps_done % hp.eval_interval == 0:
            self._log_curve_point(dm)

    def _log_curve_point(self, dm: RuleEnvDataModule) -> None:
        point = comparison.curve_point(dm.make_agent(), self._greedy_with_probs,
                                       self.seeded_sampler(CURVE_SEED_OFFSET + self.steps_done), dm.eval_envs,
                                       CURVE_SEED_OFFSET)
        scalars = {k: v for k, v in point.items() if isinstance(v, float)}
        if point["agreement"]:
            scalars["max_agreement"] = max(point["agreement"].values())
        self.log_dict({f"eval/{k}": v for k, v in scalars.items()})
        if self.curve_file is None:
            self.curve_file = self._log_directory() / "eval_curve.jsonl"
        append_curve_point(self.curve_file, {"step": self.steps_done, "episodes": dm.episodes_done} | point)

    def on_fit_end(self) -> None:
        self.eval()
        write_final_report(self.trainer.datamodule, self.greedy_rule, self.sampled_chooser, self._log_directory())

    def _log_directory(self) -> Path:
        return Path(self.trainer.log_dir or self.trainer.default_root_dir)
