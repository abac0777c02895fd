import json
import math

import lightning as L
import pytest
import torch

from flowkit.llm.lora import LoraSettings
from flowkit.modules.explanation import (
    ExplanationDataModule,
    ExplanationPolicyModule,
    ExplanationRewardModule,
    normalize_record,
    whitened,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_records_accept_decision_by_label_or_index(tmp_path):
    assert normalize_record({"context": "c", "decisions": ["a", "b"], "decision": "b"})["decision"] == 1
    assert normalize_record({"context": "c", "decisions": ["a", "b"], "decision": 0})["decision"] == 0
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"context": f"c{i}", "decisions": ["x", "y", "z"], "decision": "z"})
                              for i in range(5)))
    data = ExplanationDataModule(train_path=str(path), test_path=str(path), num_test=2, batch_size=2)
    data.setup("fit")
    assert data.num_decisions == 3 and len(data.test_records) == 2
    assert next(iter(data.train_dataloader()))[0]["decision"] == 2


def test_bundled_gridworld_loads_with_balanced_decisions():
    data = ExplanationDataModule()
    data.setup("fit")
    assert data.num_decisions == 4 and len(data.train_records) >= 1000
    counts = torch.bincount(torch.tensor([r["decision"] for r in data.train_records]), minlength=4)
    assert counts.min() > 0.15 * counts.sum()


def test_whitened_advantages_are_zero_mean_unit_std_on_the_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = whitened(values, mask)
    picked = out[mask.bool()]
    assert abs(picked.mean().item()) < 1e-6 and abs(picked.pow(2).mean().sqrt().item() - 1) < 1e-4
    assert (out[~mask.bool()] == 0).all()


def _fit(module, data, max_epochs):
    trainer = L.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=data)
    return trainer.logged_metrics


def _policy(reward="flow", flow_attention=True):
    return ExplanationPolicyModule(
        lora=LoraSettings(r=4, alpha=4, target_modules=["q_proj", "v_proj"]), reward=reward,
        flow_attention=flow_attention, ode_steps=3, num_draws=4, flow_time_dim=16, flow_projector_dim=32,
        explanations_per_context=2, round_contexts=8, heldout_contexts=8, flow_epochs_per_round=2,
        flow_batch_size=16, policy_epochs_per_round=1, num_samples=2, max_new_tokens=16, ppo_epochs=1, lr=1e-3,
        flow_lr=1e-3)


def _data():
    return ExplanationDataModule(num_train=8, num_test=8, batch_size=4)


def test_policy_rounds_train_flow_and_lora_and_log_the_metrics():
    torch.manual_seed(0)
    module = _policy()
    lora_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    metrics = _fit(module, _data(), max_epochs=2)
    for key in ("round/acceptance", "round/flow_loss", "round/explanation_accuracy", "train/reward_mean",
                "train/reward_std", "train/explanation_accuracy", "train/policy_loss", "train/approx_kl",
                "train/flow_prediction_accuracy"):
        assert key in metrics and math.isfinite(float(metrics[key])), key
    assert any(k.startswith("round/flow_accuracy_") for k in metrics)
    assert metrics["round/index"] == 1.0  # two rounds ran
    changed = [n for n, p in module.policy.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed and all("lora_" in n for n in changed)
    base = [p for n, p in module.policy.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in base)


@pytest.mark.slow
@pytest.mark.parametrize("reward,flow_attention", [("sparse", True), ("proxy", True), ("flow", False)])
def test_ablations_run(reward, flow_attention):
    torch.manual_seed(0)
    module = _policy(reward, flow_attention)
    metrics = _fit(module, _data(), max_epochs=1)
    assert math.isfinite(float(metrics["train/policy_loss"]))
    assert ("round/flow_loss" in metrics) == (reward != "proxy")
    if reward == "proxy":
        assert "train/flow_prediction_accuracy" not in metrics and math.isfinite(float(metrics["train/reward_mean"]))


def test_reward_module_trains_the_flow_on_reference_explanations_and_validates():
    torch.manual_seed(0)
    module = ExplanationRewardModule(ode_steps=3, num_draws=4, time_dim=16, projector_dim=32, lr=1e-3)
    before = [p.detach().clone() for p in module.reward_model.parameters()]
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=3, limit_val_batches=2,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=ExplanationDataModule(num_train=48, num_test=32, batch_size=16))
    metrics = trainer.logged_metrics
    assert math.isfinite(float(metrics["train/flow_loss"])) and 0 < float(metrics["train/acceptance"]) <= 1
    assert "val/flow_accuracy_positive" in metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, module.reward_model.parameters()))
    assert all(not p.requires_grad for p in module.backbone.parameters())
