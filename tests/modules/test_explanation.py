import json
import math

import lightning as L
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.lora import LoraSettings
from flowkit.modules.explanation import (
    ExplanationDataModule,
    ExplanationPolicyModule,
    ExplanationRewardModule,
    normalize_record,
    rank_share,
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


def test_rank_shares_are_equal_disjoint_and_cover_all_but_the_remainder():
    rows = list(range(10))
    shares = [rank_share(rows, rank, 4) for rank in range(4)]
    assert [len(s) for s in shares] == [2, 2, 2, 2]
    assert sorted(x for s in shares for x in s) == list(range(8))
    assert rank_share(rows, 0, 1) == rows


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


def test_ppo_accumulates_rollouts_and_takes_ppo_epochs_steps_with_a_clip_that_acts():
    """Two training batches form one PPO batch (gradient_accumulation 2); it gets ppo_epochs = 3 optimizer steps,
    after the first of which the ratio moves off 1 and some tokens are clipped; the value head trains."""
    torch.manual_seed(0)
    module = _policy()
    module.hparams.update(ppo_epochs=3, gradient_accumulation=2, lr=2e-2, clip=0.05)
    value_before = module.value_head.weight.detach().clone()
    metrics = _fit(module, _data(), max_epochs=1)
    assert module.lr_schedulers().last_epoch == 3  # one PPO batch × 3 steps
    assert float(metrics["train/clip_fraction"]) > 0
    assert math.isfinite(float(metrics["train/value_loss"])) and math.isfinite(float(metrics["train/kl_to_initial"]))
    assert not torch.equal(module.value_head.weight, value_before)


def test_reinforce_advantage_has_no_value_head_and_bad_options_are_config_errors():
    module = ExplanationPolicyModule(advantage="reinforce", lora=LoraSettings(r=4, alpha=4, target_modules=["q_proj"]))
    assert module.value_head is None
    for options in ({"advantage": "a2c"}, {"lam": 1.5}, {"gradient_accumulation": 0}, {"value_clip": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(options))):
            ExplanationPolicyModule(**options)


def test_sft_on_preferred_explanations_runs_before_the_first_round_and_lowers_their_loss():
    torch.manual_seed(0)
    module = _policy()
    module.hparams.update(sft_epochs=3, sft_lr=1e-2)
    _fit(module, _data(), max_epochs=1)
    assert len(module.sft_losses) == 3 * 2  # 8 records in batches of 4, 3 epochs
    assert sum(module.sft_losses[-2:]) < sum(module.sft_losses[:2])


def test_sft_needs_a_preferred_explanation_in_every_record(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"context": "d=+1,+2 a=?", "decisions": ["north", "south", "east", "west"],
                                "decision": "north"}))
    module = _policy()
    module.hparams.update(sft_epochs=1)
    with pytest.raises(ValueError, match="preferred"):
        _fit(module, ExplanationDataModule(train_path=str(path), test_path=str(path), batch_size=1), max_epochs=1)


def test_a_held_out_evaluator_judges_the_final_evaluation_and_flowkit_validate():
    torch.manual_seed(0)
    module = _policy()
    module = ExplanationPolicyModule(**{**module.hparams, "proxies": [f"bundled:explain_tiny/proxy{i}" for i in (0, 1)],
                                        "evaluators": ["bundled:explain_tiny/proxy2"]})
    judged = []
    module.evaluators[0].register_forward_hook(lambda *_: judged.append(1))
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, check_val_every_n_epoch=10)
    data = _data()
    trainer.fit(module, datamodule=data)
    final = dict(trainer.logged_metrics)
    for key in ("final/explanation_accuracy", "final/reward_mean", "final/reward_std"):
        assert key in final and math.isfinite(float(final[key])), key
    assert float(final["final/heldout_positives"]) + float(final["final/heldout_negatives"]) == 8
    assert judged  # the evaluator, not only the proxies, scored the explanations
    judged.clear()
    (validated,) = trainer.validate(module, datamodule=data, verbose=False)
    assert 0 <= validated["val/explanation_accuracy"] <= 1 and "val/reward_mean" in validated and judged


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
