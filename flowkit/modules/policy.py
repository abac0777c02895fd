"""`PolicyModule`: GRPO with a pluggable dense reward model (RLFR Alg. 1 when the reward is a FlowReward)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import Tensor
from torchmetrics import MeanMetric
from tqdm.auto import tqdm

from flowkit.batch import RolloutBatch
from flowkit.llm.backbone import load_backbone
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout import RolloutEngine, expert_latents, forward_logits
from flowkit.modules.optim import step_groups
from flowkit.rewards.base import TokenRewardModel
from flowkit.rewards.grader import grade, outcome_reward
from flowkit.rl.advantages import rlfr_advantages
from flowkit.rl.logprobs import token_entropy, token_logprobs
from flowkit.rl.losses import Aggregation, clipped_policy_loss, kl_penalty
from flowkit.rl.metrics import pass_at_k

log = logging.getLogger(__name__)


class PolicyModule(L.LightningModule):
    """Train a causal LM with GRPO on verifier rewards, shaped by a dense :class:`TokenRewardModel`.

    One RL step (one prompt batch): sample ``num_samples`` responses per prompt → grade them → one no-grad
    forward gives old log-probs, entropies and (through a :class:`LatentTap`) the latents → the reward
    model's token rewards → advantages (eq. 9) → ``ppo_epochs × num_minibatches`` clipped-surrogate updates.
    The reward model's online loss (e.g. the flow update on rejection-sampled rollouts) joins the first
    update's backward; policy and reward model are two parameter groups of one optimizer.

    Args:
        backbone: hub id, local dir, or ``bundled:tiny_adder``.
        dtype: parameter dtype of the backbone (``bfloat16`` for real models).
        trust_remote_code: passed to ``from_pretrained``; off unless you trust the model repo.
        lora: LoRA settings (peft); ``None`` fine-tunes all weights.
        reward_model: dense reward (e.g. :class:`~flowkit.rewards.FlowReward`); ``None`` is plain GRPO.
        num_samples: responses per prompt (GRPO group size).
        max_new_tokens, temperature, top_p: sampling.
        outcome_reward: ``official`` (1 correct, 0.5 wrong but boxed, 0 otherwise) or ``binary``.
        gamma: discount of the dense rewards' reward-to-go.
        clip_low, clip_high: ε and ε_high of the clipped surrogate.
        aggregation: ``token-mean`` or ``seq-mean`` loss aggregation.
        ppo_epochs: μ, passes over each generation; num_minibatches: updates per pass.
        kl_coef: weight of the k3 KL to the frozen initial policy (0 = off, the paper's setting).
        lr, flow_lr: learning rates of the policy and reward-model parameter groups.
        max_grad_norm: gradient clipping over both groups (``None`` = off); under DeepSpeed it becomes the
            config's ``gradient_clipping`` (Lightning leaves clipping to DeepSpeed there).
        flow_pretrain_steps: offline start — steps of reward-model pretraining on the DataModule's expert
            solutions with the backbone frozen, run once before RL (skipped when resuming).
        flow_pretrain_batch_size: expert solutions per pretraining step.
        val_num_samples, val_temperature: samples per prompt in validation (pass@1 and pass@k, k = n);
            temperature 0 is greedy with one sample.
        nonfinite: what to do when logits, rewards or advantages are not finite: ``skip`` the step
            (logged as ``train/skipped_steps``) or ``fail``.
        grader_timeout: seconds allowed to grade one response.
    """

    def __init__(
        self,
        backbone: str = "bundled:tiny_adder",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        reward_model: TokenRewardModel | None = None,
        num_samples: int = 8,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        outcome_reward: Literal["official", "binary"] = "official",
        gamma: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: Aggregation = "token-mean",
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        kl_coef: float = 0.0,
        lr: float = 1e-6,
        flow_lr: float = 1e-4,
        max_grad_norm: float | None = 1.0,
        flow_pretrain_steps: int = 0,
        flow_pretrain_batch_size: int = 128,
        val_num_samples: int = 4,
        val_temperature: float = 1.0,
        nonfinite: Literal["skip", "fail"] = "skip",
        grader_timeout: float = 1.0,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["reward_model"])
        self.automatic_optimization = False
        self.policy, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.reference = None
        if kl_coef > 0:
            self.reference, _ = load_backbone(backbone, dtype, trust_remote_code)
            self.reference.requires_grad_(False).eval()
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
        self.reward_model = reward_model
        self.tap = None
        if reward_model is not None and reward_model.percentiles:
            self.tap = LatentTap(self.policy, reward_model.percentiles)
        if reward_model is not None:
            positions = self.tap.layer_positions if self.tap is not None else []
            reward_model.bind(self.policy.config.hidden_size, positions)
        self.engine = RolloutEngine(self.policy, self.tokenizer, max_new_tokens, temperature, top_p)
        self.skipped_steps = 0
        self.val_metrics = torch.nn.ModuleDict()

    @torch.no_grad()
    def score_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        """One no-grad forward: old log-probs, entropies and (if the reward model wants them) latents."""
        if self.tap is not None:
            with self.tap:
                logits = forward_logits(self.policy, batch)
            batch.latents = self.tap.latents
        else:
            logits = forward_logits(self.policy, batch)
        temperature = self.hparams.temperature or 1.0
        batch.old_logprobs = token_logprobs(logits, batch.input_ids, temperature)
        entropy = token_entropy(logits, temperature)
        batch.entropy = (entropy * batch.response_mask).sum(-1) / batch.response_mask.sum(-1).clamp(min=1)
        if self.reference is not None:
            batch.ref_logprobs = token_logprobs(forward_logits(self.reference, batch), batch.input_ids, temperature)
        self._logits_finite = bool(torch.isfinite(logits).all())
        return batch

    def grade_rollouts(self, batch: RolloutBatch) -> RolloutBatch:
        scheme, timeout = self.hparams.outcome_reward, self.hparams.grader_timeout
        batch.outcome_rewards = torch.tensor(
            [outcome_reward(r, a, scheme, timeout) for r, a in zip(batch.responses, batch.answers)],
            device=self.device, dtype=torch.float32,
        )
        batch.correct = batch.outcome_rewards == 1.0  # both schemes give 1 exactly for a correct answer
        return batch

    # ----------------------------------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._hand_clipping_to_deepspeed()
        if stage == "fit" and self.hparams.flow_pretrain_steps > 0 and self.trainer.ckpt_path is None:
            self.pretrain_reward_model()

    def _hand_clipping_to_deepspeed(self) -> None:
        """``clip_gradients`` does nothing under DeepSpeed, so ``max_grad_norm`` goes into its config (read when
        the engine is built, after this hook); a different ``gradient_clipping`` there is a conflict."""
        strategy, clip = self.trainer.strategy, self.hparams.max_grad_norm
        if not isinstance(strategy, DeepSpeedStrategy) or clip is None:
            return
        configured = strategy.config.get("gradient_clipping") or None
        if configured is not None and configured != clip:
            raise ValueError(f"max_grad_norm {clip} conflicts with the DeepSpeed config's gradient_clipping {configured}")
        strategy.config["gradient_clipping"] = clip

    def pretrain_reward_model(self) -> None:
        """Offline start (RLFR §3.2): fit the reward model to expert-solution latents, backbone frozen."""
        reward = self.reward_model
        if reward is None or not hasattr(reward, "pretrain_loss") or self.tap is None:
            raise ValueError("flow_pretrain_steps > 0 needs a reward model with latents and pretrain_loss (FlowReward)")
        steps = self.hparams.flow_pretrain_steps
        optimizer = torch.optim.AdamW(reward.parameters(), lr=self.hparams.flow_lr)
        warmup = max(1, steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        generator = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
        batches = self.trainer.datamodule.expert_batches(self.hparams.flow_pretrain_batch_size, seed=torch.initial_seed() % 2**31)
        self.policy.eval()
        device = next(self.policy.parameters()).device
        reward.to(device)
        progress = tqdm(range(steps), desc="flow pretraining", disable=not self.trainer.is_global_zero)
        for _ in progress:
            rows = next(batches)
            latents, mask = expert_latents(self.policy, self.tokenizer, self.tap, rows["prompt"], rows["solution"], device)
            loss = reward.pretrain_loss(latents, mask, generator)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.4f}")
        self.policy.train()
        log.info("flow pretraining: %d steps, final loss %.4f", steps, loss.item())

    def training_step(self, prompts: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        step = int(prompts["index"])
        batch = self.engine.generate(prompts["prompt"], self.hparams.num_samples, prompts["answer"])
        batch = self.score_rollouts(self.grade_rollouts(batch))
        if self.reward_model is not None:
            batch.token_rewards = self.reward_model.token_rewards(batch, step)
        batch.advantages = rlfr_advantages(batch.outcome_rewards, batch.group_ids, batch.response_mask,
                                           batch.token_rewards, self.hparams.gamma)
        if not self._all_finite(batch):
            return
        reward_loss = self.reward_model.update_loss(batch, step) if self.reward_model is not None else None
        stats = self.policy_updates(batch, reward_loss)
        generated = float(batch.response_mask.sum())
        metrics = {
            "train/outcome_reward": batch.outcome_rewards.mean(),
            "train/accuracy": batch.correct.float().mean(),
            "train/entropy": batch.entropy.mean(),
            "train/response_length": batch.response_lengths.float().mean(),
            "train/tokens_per_s": generated / (time.perf_counter() - start),
            "train/skipped_steps": float(self.skipped_steps),
            **stats,
        }
        if self.reward_model is not None:
            metrics.update(self.reward_model.step_metrics())
        self.log_dict({k: float(v) for k, v in metrics.items()}, batch_size=batch.batch_size)
        self.log("reward", batch.outcome_rewards.mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        self.log("acc", batch.correct.float().mean(), prog_bar=True, logger=False, batch_size=batch.batch_size)

    def _all_finite(self, batch: RolloutBatch) -> bool:
        checks = {"logits": self._logits_finite, "advantages": bool(torch.isfinite(batch.advantages).all())}
        if batch.token_rewards is not None:
            checks["token rewards"] = bool(torch.isfinite(batch.token_rewards).all())
        bad = [name for name, ok in checks.items() if not ok]
        if not bad:
            return True
        if self.hparams.nonfinite == "fail":
            raise FloatingPointError(f"non-finite {', '.join(bad)} at step {self.global_step}")
        self.skipped_steps += 1
        log.warning("skipping RL step %d: non-finite %s (%d skipped so far)", self.global_step, ", ".join(bad), self.skipped_steps)
        self.log("train/skipped_steps", float(self.skipped_steps))
        return False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["skipped_steps"] = self.skipped_steps  # a resumed run keeps counting

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))

    def policy_updates(self, batch: RolloutBatch, reward_loss: Tensor | None) -> dict[str, Tensor]:
        """μ epochs × minibatches of clipped-surrogate steps; ``reward_loss`` joins the first backward."""
        optimizer = self.optimizers()
        hp = self.hparams
        totals: dict[str, list[Tensor]] = {"train/policy_loss": [], "train/clip_fraction": [], "train/approx_kl": []}
        rows = torch.arange(batch.batch_size)
        for _ in range(hp.ppo_epochs):
            for chunk in rows.chunk(hp.num_minibatches):
                mini = batch.select(chunk)
                logprobs = token_logprobs(forward_logits(self.policy, mini), mini.input_ids, hp.temperature or 1.0)
                loss, info = clipped_policy_loss(logprobs, mini.old_logprobs, mini.advantages, mini.response_mask,
                                                 hp.clip_low, hp.clip_high, hp.aggregation)
                totals["train/policy_loss"].append(loss.detach())
                if self.reference is not None:
                    kl = kl_penalty(logprobs, mini.ref_logprobs, mini.response_mask, hp.aggregation)
                    totals.setdefault("train/kl", []).append(kl.detach())
                    loss = loss + hp.kl_coef * kl
                stepped = {"policy"}
                if reward_loss is not None:
                    loss, reward_loss = loss + reward_loss, None
                    stepped.add("reward")
                self.manual_backward(loss)
                if hp.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                step_groups(optimizer, stepped)  # the flow only moves on the minibatch that carried its loss
                optimizer.zero_grad()
                for key in ("clip_fraction", "approx_kl"):
                    totals[f"train/{key}"].append(info[key])
        return {k: torch.stack(v).mean() for k, v in totals.items()}

    def configure_optimizers(self):
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": self.hparams.lr, "name": "policy"}]
        if self.reward_model is not None and any(True for _ in self.reward_model.parameters()):
            groups.append({"params": list(self.reward_model.parameters()), "lr": self.hparams.flow_lr, "name": "reward"})
        return torch.optim.AdamW(groups, weight_decay=0.0)

    # ----------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        names = getattr(self.trainer.datamodule, "val_names", None) or ["heldout"]
        k = self._val_k()
        for name in names:
            if name not in self.val_metrics:
                self.val_metrics[name] = torch.nn.ModuleDict({"pass@1": MeanMetric(), f"pass@{k}": MeanMetric()}).to(self.device)

    def _val_k(self) -> int:
        return 1 if self.hparams.val_temperature == 0 else self.hparams.val_num_samples

    def validation_step(self, prompts: dict[str, list[str]], batch_idx: int, dataloader_idx: int = 0) -> None:
        k = self._val_k()
        batch = self.engine.generate(prompts["prompt"], k, prompts["answer"], temperature=self.hparams.val_temperature)
        correct = torch.tensor([grade(r, a, self.hparams.grader_timeout) for r, a in zip(batch.responses, batch.answers)])
        per_prompt = correct.view(-1, k).sum(-1)
        name = list(self.val_metrics)[dataloader_idx]
        metrics = self.val_metrics[name]
        metrics["pass@1"].update(pass_at_k(k, per_prompt, 1))
        metrics[f"pass@{k}"].update(pass_at_k(k, per_prompt, k))
        for key, metric in metrics.items():
            self.log(f"val/{name}/{key}", metric, add_dataloader_idx=False, batch_size=len(prompts["prompt"]))

    # ----------------------------------------------------------------------------------------- artifacts
    def export_artifacts(self, directory: str | Path) -> dict[str, Path]:
        """Policy in HF format (full weights or the PEFT adapter) + tokenizer, and the flow in safetensors."""
        directory = Path(directory)
        paths = {"policy": directory / "hf_policy"}
        self.policy.save_pretrained(paths["policy"], safe_serialization=True)
        self.tokenizer.save_pretrained(paths["policy"])
        if self.reward_model is not None and hasattr(self.reward_model, "save_field"):
            paths["flow"] = directory / "flow.safetensors"
            self.reward_model.save_field(paths["flow"])
        return paths
