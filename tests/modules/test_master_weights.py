"""bf16 weights train only where an fp32 master copy exists (DeepSpeed); elsewhere they are a one-line ConfigError and
``float32`` weights with ``bf16-mixed`` (autocast) train instead — at the paper's lr 1e-6, where bf16 loses updates."""

import lightning as L
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import FlowPretrainOptions, OptimOptions, SamplingOptions


def trainer(**options) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, **options)


def tiny_policy(dtype: str) -> PolicyModule:
    L.seed_everything(0)
    return PolicyModule(dtype=dtype, sampling=SamplingOptions(num_samples=4, max_new_tokens=28),
                        optim=OptimOptions(lr=1e-6), flow_pretrain=FlowPretrainOptions(steps=0))


def test_adamw_at_lr_1e6_loses_the_update_of_bf16_weights():
    """Why the error exists: the same AdamW step (lr 1e-6, so each weight moves by ~1e-6) changes fp32 weights and
    leaves nearly every bf16 weight where it was (bf16 resolves ~|w|·2⁻⁹, 4e-5 at |w| = 0.02)."""
    torch.manual_seed(0)
    weights = torch.randn(1000) * 0.02
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(weights.to(dtype, copy=True))
        optimizer = torch.optim.AdamW([param], lr=1e-6, weight_decay=0.0)
        param.grad = torch.randn(1000).to(dtype)
        optimizer.step()
        moved[dtype] = float((param.detach() != weights.to(dtype)).float().mean())
    assert moved[torch.float32] == 1.0 and moved[torch.bfloat16] < 0.05, moved


def test_bf16_weights_without_deepspeed_are_a_one_line_config_error_before_any_step():
    module = tiny_policy("bfloat16")
    with pytest.raises(ConfigError, match=r"^PolicyModule.dtype bfloat16 trains bfloat16 weights with no fp32 master "
                                          r"copy under SingleDeviceStrategy .*lr 1e-06.*dtype float32 with "
                                          r"trainer.precision bf16-mixed") as raised:
        trainer().fit(module, RolloutDataModule(batch_size=4, val_path=None))
    assert "\n" not in str(raised.value)
    assert module.global_step == 0


def test_bf16_weights_under_deepspeed_pass_the_check():
    """DeepSpeed's ZeRO optimizers step fp32 partitions of bf16 weights: no error."""
    from flowkit.strategies import CPUDeepSpeedStrategy

    module = tiny_policy("bfloat16")
    module.trainer = trainer(strategy=CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 2}}))
    module.setup("fit")


def test_fp32_weights_with_bf16_mixed_keep_an_lr_1e6_update():
    """The setting the error points to: one RL step at lr 1e-6 moves the fp32 weights (bf16 autocast compute)."""
    module = tiny_policy("float32")
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    fit = trainer()
    fit.fit(module, RolloutDataModule(batch_size=4, val_path=None))
    assert fit.global_step == 1 and 0 < fit.logged_metrics["train/outcome_reward"] < 1  # advantages not all zero
    moved = [name for name, p in module.policy.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(moved) > 0.9 * len(before), (len(moved), len(before))
