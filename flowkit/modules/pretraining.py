"""RLFR's offline start (§3.2): the velocity field pretrained on expert-solution latents with the policy frozen —
alone (:class:`FlowRewardModule`, ``rlfr_qwen_offline.yaml``) or inside an RL run before its first step
(:func:`pretrain_flow_reward`, ``PolicyModule.flow_pretrain.steps``, resumable and stoppable by SIGTERM). Both
backpropagate the loss in row-bounded pieces (``FlowReward.network.max_rows_per_piece``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch

from flowkit.checkpointing.atomic_files import AtomicCheckpointIO
from flowkit.checkpointing.preemption import PreemptionCheckpoint, PretrainingPreempted, sigterm_stops
from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.latent_tap import LatentTap
from flowkit.rewards.flow.expert_latents import ExpertLatentCache, expert_latents
from flowkit.modules.optim import LR_DECAYS, LrDecay, flow_pretraining_schedule
from flowkit.modules.progress import LoopProgress
from flowkit.rewards.flow.reward import FlowReward
from flowkit.strategies import accumulate_until_step, average_gradients, manual_backward

log = logging.getLogger(__name__)


def pretrain_flow_reward(trainer: L.Trainer, policy: torch.nn.Module, tokenizer, tap: LatentTap, reward: FlowReward,
                         steps: int, batch_size: int, lr: float, decay: LrDecay, cache_latents: bool,
                         device: torch.device | None = None) -> None:
    """``steps`` AdamW steps (lr ``lr``, 10 % warmup then ``decay``) of ``reward.pretrain_losses`` on batches of
    ``batch_size`` expert solutions from the trainer's datamodule, the policy frozen, on ``device`` (policy and reward
    model are moved there; default: where the policy is).

    Its state (reward-model weights, optimizer, schedule, noise generator, steps done, whether it finished) is saved
    to ``flow_pretrain.ckpt`` in the checkpoint directory when it finishes, and when SIGTERM stops it: then the process
    exits 0 (:class:`~flowkit.checkpointing.preemption.PretrainingPreempted`). A run of the job with no Lightning
    checkpoint to resume (``--ckpt_path last`` before the first one exists) continues from that file: a stopped
    pretraining skips the batches already seen and trains only the remaining steps of this run's ``steps``; a
    finished one is kept as it is (its weights loaded, nothing trained), with a one-line note when ``steps`` changed
    since. Every rank runs the same steps on the same batches (the noise and the batch order follow the run's seed),
    so the ranks' flows stay equal.
    """
    device = next(policy.parameters()).device if device is None else torch.device(device)
    policy.to(device)
    reward.to(device)
    optimizer = torch.optim.AdamW(reward.parameters(), lr=lr)
    schedule = flow_pretraining_schedule(optimizer, steps, decay=decay)
    generator = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    batches = trainer.datamodule.expert_batches(batch_size, seed=torch.initial_seed() % 2**31)
    state_path = PreemptionCheckpoint.pretraining_state_path(trainer)
    done = _resume_pretraining(state_path, device, steps, reward, optimizer, schedule, generator, batches)
    if done is None:
        return
    policy.eval()
    if cache_latents:
        encode = ExpertLatentCache(policy, tokenizer, tap, device)
    else:
        encode = lambda prompts, solutions: expert_latents(policy, tokenizer, tap, prompts, solutions, device)  # noqa: E731
    progress = LoopProgress("flow pretraining", steps, initial=done, enabled=trainer.is_global_zero)
    with sigterm_stops() as stop:
        for step in range(done, steps):
            rows = next(batches)
            latents, mask = encode(rows["prompt"], rows["solution"])
            optimizer.zero_grad()
            loss = 0.0
            for piece in reward.pretrain_losses(latents, mask, generator):  # one backward per row-bounded piece
                value = piece()
                value.backward()
                loss += float(value.detach())
            optimizer.step()
            schedule.step()
            done = step + 1
            progress.update(done, loss=loss)
            if stop():
                break
    progress.close()
    if trainer.is_global_zero:
        AtomicCheckpointIO().save_checkpoint(
            {"steps_done": done, "reward_model": reward.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict(), "generator": generator.get_state(), "finished": done >= steps},
            state_path)
    if done < steps:
        log.warning("SIGTERM during flow pretraining: saved step %d of %d to %s; run the job again with "
                    "--ckpt_path last to continue", done, steps, state_path)
        raise PretrainingPreempted()
    policy.train()
    log.info("flow pretraining: %d steps done, state in %s", steps, state_path)


def _resume_pretraining(state_path: Path, device: torch.device, steps: int, reward: FlowReward,
                        optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                        generator: torch.Generator, batches: Iterator[dict[str, list[str]]]) -> int | None:
    """The steps an earlier pretraining of this run saved in ``state_path`` (0 without the file), its reward model,
    optimizer, schedule and noise generator loaded and ``batches`` past the batches it saw; None when it finished
    (its weights loaded: nothing to train)."""
    if not state_path.is_file():
        return 0
    state = torch.load(state_path, map_location=device, weights_only=True)
    try:
        reward.load_state_dict(state["reward_model"])
    except RuntimeError as err:
        raise ConfigError(f"{state_path} holds the pretraining of another reward model: "
                          f"{str(err).splitlines()[0]}; move it away to pretrain afresh") from None
    done = int(state["steps_done"])
    if state.get("finished") or done >= steps:  # (older files have no "finished")
        if done != steps:
            log.warning("flow pretraining finished at step %d (%s); flow_pretrain.steps %d is not applied: move "
                        "the file away to pretrain afresh", done, state_path, steps)
        else:
            log.info("flow pretraining: %d steps done before (%s)", done, state_path)
        return None
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    generator.set_state(state["generator"])
    log.warning("flow pretraining: continuing from %s at step %d of %d", state_path, done, steps)
    for _ in range(done):  # the batches an uninterrupted run would see next
        next(batches)
    return done


class FlowRewardModule(L.LightningModule):
    """Pretrain a :class:`FlowReward`'s velocity field on latents of expert (prompt, solution) pairs.

    The frozen backbone runs in inference mode with a :class:`LatentTap`; only the field trains (eq. 4,
    logit-normal t), one backward per piece of at most ``reward_model.network.max_rows_per_piece`` field rows, then one
    optimizer step, so memory does not grow with the solutions' length. ``export_artifacts`` writes the field as
    safetensors for ``FlowReward(weights=...)``.

    Args:
        backbone: hub id, local dir or ``bundled:NAME`` of the policy whose latents are modelled.
        reward_model: the FlowReward whose field is trained (its percentiles, depth, condition).
        lr: peak learning rate (paper: 1e-4); warmup_ratio: linear warmup fraction of ``max_steps``;
        lr_decay: after the warmup, ``cosine`` to 0 (the official offline pretraining) or ``constant``
            (:func:`~flowkit.modules.optim.flow_pretraining_schedule`).
        dtype, trust_remote_code: backbone loading.
    """

    def __init__(
        self,
        backbone: str = "bundled:tiny_adder",
        reward_model: FlowReward | None = None,
        lr: float = 1e-4,
        warmup_ratio: float = 0.1,
        lr_decay: LrDecay = "cosine",
        dtype: str = "float32",
        trust_remote_code: bool = False,
    ):
        super().__init__()
        if lr_decay not in LR_DECAYS:
            raise ConfigError(f"FlowRewardModule.lr_decay must be cosine or constant, got {lr_decay!r}")
        self.save_hyperparameters(ignore=["reward_model"])
        self.backbone, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.backbone.requires_grad_(False).eval()
        self.reward_model = reward_model or FlowReward()
        self.tap = LatentTap(self.backbone, self.reward_model.percentiles)
        self.reward_model.bind(self.backbone, self.tap.layer_positions)
        self.generator = torch.Generator()
        self.automatic_optimization = False  # several backward passes (pieces) per step

    def setup(self, stage: str) -> None:
        if stage == "fit":
            accumulate_until_step(self.trainer, None)

    def on_fit_start(self) -> None:
        self.generator.manual_seed(torch.initial_seed() % 2**31)

    def training_step(self, rows: dict[str, Any], batch_idx: int) -> None:
        latents, mask = expert_latents(self.backbone, self.tokenizer, self.tap, rows["prompt"], rows["solution"],
                                       self.device)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = torch.zeros((), device=self.device)
        for piece in self.reward_model.pretrain_losses(latents, mask, self.generator):
            value = piece()
            manual_backward(self, value)
            loss += value.detach()
        average_gradients(self)
        optimizer.step()
        self.lr_schedulers().step()
        self.log("train/flow_loss", loss, prog_bar=True, batch_size=len(rows["prompt"]))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.reward_model.parameters(), lr=self.hparams.lr)
        total = max(1, self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches)
        schedule = flow_pretraining_schedule(optimizer, total, self.hparams.warmup_ratio, self.hparams.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def export_artifacts(self, directory: str | Path) -> dict[str, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "flow.safetensors"
        self.reward_model.save_field(path)
        return {"flow": path}
