"""A tiny DeepSpeed-on-CPU training job that tests/test_strategies.py runs as a subprocess.

It is a script (not an in-process call) because Lightning relaunches the script once per extra rank
(``devices=2``) and DeepSpeed's process group lives for the whole process.

The stand-in module has the policy's shape: two sub-networks ("policy" and "flow") trained by ONE
optimizer with two parameter groups of different learning rates. After fitting, every rank writes its
full (gathered) weights to ``OUT/weights_rank{R}.pt``. With ``--save CKPT --resume-steps N`` it then
builds a fresh module (other initial weights) and Trainer in the same process, resumes from CKPT up
to N steps and writes ``OUT/resumed_rank{R}.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from flowkit.strategies import CPUDeepSpeedStrategy, full_parameters

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "deepspeed"
DIM = 8
SAMPLES = 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, DIM, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class TwoGroupModule(LightningModule):
    def __init__(self, optimizer: str = "sgd", policy_lr: float = 0.05, flow_lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.policy = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.flow = torch.nn.Linear(DIM, DIM)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The flow sees detached inputs, as the RLFR flow sees detached latents.
        flow_loss = (self.flow(x.detach()) - x.flip(1)).pow(2).mean()
        return torch.nn.functional.mse_loss(self.policy(x), y) + flow_loss

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def configure_optimizers(self):
        groups = [
            {"params": self.policy.parameters(), "lr": self.hparams.policy_lr},
            {"params": self.flow.parameters(), "lr": self.hparams.flow_lr},
        ]
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.hparams.policy_lr)
        return torch.optim.AdamW(groups, lr=self.hparams.policy_lr)


def initial_module(optimizer: str) -> TwoGroupModule:
    seed_everything(0, verbose=False)
    return TwoGroupModule(optimizer=optimizer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="file name under configs/deepspeed")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--save", help="save a checkpoint here after fitting")
    parser.add_argument("--resume-steps", type=int, help="then resume from --save up to this many steps")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    module = initial_module(args.optimizer)
    trainer = fit(module, args, args.steps)
    if args.save:
        trainer.save_checkpoint(args.save)
    write_weights(module, trainer, out / f"weights_rank{trainer.global_rank}.pt")
    if args.resume_steps:
        seed_everything(99, verbose=False)
        fresh = TwoGroupModule(optimizer=args.optimizer)
        trainer = fit(fresh, args, args.resume_steps, ckpt_path=args.save)
        write_weights(fresh, trainer, out / f"resumed_rank{trainer.global_rank}.pt")


def fit(module: TwoGroupModule, args: argparse.Namespace, steps: int, ckpt_path: str | None = None) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=CPUDeepSpeedStrategy(config=str(CONFIGS / args.config)),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=args.batch_size, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def write_weights(module: TwoGroupModule, trainer: Trainer, path: Path) -> None:
    with full_parameters(trainer, module):
        weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    torch.save({"weights": weights, "global_step": trainer.global_step, "world_size": trainer.world_size}, path)


if __name__ == "__main__":
    main()
