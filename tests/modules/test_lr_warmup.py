"""``optim.lr_warmup_steps``: the policy's learning rate rises linearly over the first optimizer steps (Adam's first
steps move every weight by about ``lr``, which the small agent policies' format did not survive at 3e-4), the flow's
stays ``flow_lr``, and a resume inside the warmup keeps the schedule without a note of a changed rate."""

from __future__ import annotations

import logging

import lightning as L
import pytest
from flow_options import flow_reward

from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_checkpoints import apply_configured_lr
from flowkit.modules.policy_options import OptimOptions, SamplingOptions


def test_the_warmup_rises_linearly_to_lr_and_then_leaves_the_groups_alone():
    optim = OptimOptions(lr=1e-3, lr_warmup_steps=4)
    rates = [optim.warmup_rates(step).get("policy") for step in range(6)]
    assert rates == [None, pytest.approx(2.5e-4), pytest.approx(5e-4), pytest.approx(7.5e-4), pytest.approx(1e-3),
                     None]
    assert optim.warmup_rates(2)["value"] == optim.warmup_rates(2)["policy"] and "reward" not in optim.warmup_rates(2)
    assert all(OptimOptions(lr=1e-3).warmup_rates(step) == {} for step in range(4))


class _Rates(L.Callback):
    """Each step's group learning rates and the largest move of a policy weight in it."""

    def __init__(self):
        self.lrs, self.moves, self.before = [], [], None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = [p.detach().clone() for p in module.policy.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.lrs.append({group["name"]: group["lr"] for group in trainer.optimizers[0].param_groups})
        self.moves.append(max(float((p.detach() - b).abs().max())
                              for p, b in zip(module.policy.parameters(), self.before, strict=True)))


@pytest.mark.parametrize("warmup", [0, 2])
def test_a_fit_steps_the_policy_at_the_warmed_rates(tmp_path, warmup):
    """Adam's first step moves a weight by at most its learning rate (exactly lr·sign(g) where the gradient is
    nonzero), so the largest move of step 1 shows the rate the step really took: lr / 2 with a 2-step warmup."""
    L.seed_everything(0, verbose=False)
    lr = 1e-3
    module = PolicyModule(reward_model=flow_reward(depth=1, kappa=2, rejection_metric="entropy"),
                          outcome_reward="binary", sampling=SamplingOptions(num_samples=4, max_new_tokens=8),
                          optim=OptimOptions(lr=lr, flow_lr=2e-3, lr_warmup_steps=warmup))
    rates = _Rates()
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[rates])
    trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    expected = [lr / 2, lr, lr] if warmup else [lr, lr, lr]
    assert [r["policy"] for r in rates.lrs] == pytest.approx(expected)
    assert [r["reward"] for r in rates.lrs] == [2e-3] * 3
    assert expected[0] * 0.9 < rates.moves[0] <= expected[0] * 1.001


def test_a_resume_inside_the_warmup_keeps_its_rate_without_a_note(caplog):
    optim = OptimOptions(lr=1e-3, lr_warmup_steps=4)
    groups = [{"name": "policy", "lr": 5e-4}, {"name": "reward", "lr": optim.flow_lr}]
    with caplog.at_level(logging.WARNING, logger="flowkit.modules.policy_checkpoints"):
        apply_configured_lr(groups, optim, step=2)  # the checkpoint's last step was step 2 of the warmup
        assert groups[0]["lr"] == pytest.approx(5e-4) and caplog.text == ""
        apply_configured_lr(groups, optim, step=6)  # past the warmup the rate is lr
    assert groups[0]["lr"] == 1e-3
    assert "the policy group's learning rate 0.0005 → 0.001" in caplog.text
