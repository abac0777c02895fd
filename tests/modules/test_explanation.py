"""The explanation method (TPL) on the shared RL engine: PolicyModule + ExplanationReward + ExplanationRounds over an
ExplanationDataModule, and ExplanationRewardModule (the flow alone)."""

import json
import math
from dataclasses import replace

import lightning as L
import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.lora import LoraSettings
from flowkit.modules import PolicyModule
from flowkit.modules.policy_options import (
    AdvantageOptions, LossOptions, OptimOptions, SamplingOptions, SFTOptions, UpdateOptions,
)
from flowkit.modules.explanation import (
    ExplanationDataModule,
    ExplanationRewardModule,
    ExplanationRounds,
    normalize_record,
)
from flowkit.rewards import ExplanationReward
from flowkit.rewards.explanation import rank_share

pytestmark = pytest.mark.usefixtures("single_thread")
LORA = LoraSettings(r=4, alpha=4, target_modules=["q_proj", "v_proj"])


def test_records_accept_decision_by_label_or_index_and_reach_the_reward_model_as_columns(tmp_path):
    assert normalize_record({"context": "c", "decisions": ["a", "b"], "decision": "b"})["decision"] == 1
    assert normalize_record({"context": "c", "decisions": ["a", "b"], "decision": 0})["decision"] == 0
    with pytest.raises(ValueError, match="none of the decisions"):
        normalize_record({"context": "c", "decisions": ["a", "b"], "decision": "z"})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"context": f"c{i}", "decisions": ["x", "y", "z"], "decision": "z",
                                          "preferred": "because."}) for i in range(5)))
    data = ExplanationDataModule(train_path=str(path), test_path=str(path), num_test=2, batch_size=2)
    data.setup("fit")
    assert len(data.test_records) == 2 and data.steps_per_epoch() == 2
    batch = next(iter(data.train_dataloader()))
    assert batch["decision"] == [2, 2] and batch["answer"] == ["z", "z"] and batch["solution"] == ["because."] * 2
    assert batch["decisions"] == [["x", "y", "z"]] * 2 and batch["prompt"][0].startswith("Given c")


def test_bundled_gridworld_loads_with_balanced_decisions():
    data = ExplanationDataModule()
    data.setup("fit")
    assert len(data.train_records) >= 1000
    counts = torch.bincount(torch.tensor([r["decision"] for r in data.train_records]), minlength=4)
    assert counts.min() > 0.15 * counts.sum()


def test_rank_shares_are_equal_disjoint_and_cover_all_but_the_remainder():
    rows = list(range(10))
    shares = [rank_share(rows, rank, 4) for rank in range(4)]
    assert [len(s) for s in shares] == [2, 2, 2, 2]
    assert sorted(x for s in shares for x in s) == list(range(8))
    assert rank_share(rows, 0, 1) == rows


def reward_model(**options) -> ExplanationReward:
    settings = dict(proxies=[f"bundled:explain_tiny/proxy{i}" for i in (0, 1)], evaluators=["bundled:explain_tiny/proxy2"],
                    ode_steps=3, num_draws=4, flow_time_dim=16, flow_projector_dim=32, explanations_per_context=2,
                    round_contexts=8, heldout_contexts=8, flow_epochs_per_round=2, flow_batch_size=16)
    return ExplanationReward(**(settings | options))


PPO_LOSS = LossOptions(kl_coef=0.05, kl_estimator="k1", kl_in="reward")


def policy(reward: ExplanationReward | None = None, **options) -> PolicyModule:
    settings = dict(backbone="bundled:explain_tiny/policy", lora=LORA, reward_model=reward or reward_model(),
                    sampling=SamplingOptions(num_samples=2, max_new_tokens=16), outcome_reward="none",
                    advantage=AdvantageOptions(estimator="gae"), loss=PPO_LOSS, optim=OptimOptions(lr=1e-3, flow_lr=1e-3))
    return PolicyModule(**(settings | options))


def fit(module: PolicyModule, rounds: int = 2, epochs: int = 1, data: ExplanationDataModule | None = None,
        callbacks: tuple[L.Callback, ...] = ()) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=-1, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ExplanationRounds(rounds, epochs), *callbacks])
    trainer.fit(module, datamodule=data or ExplanationDataModule(num_train=8, num_test=8, batch_size=4))
    return trainer


def test_rounds_train_the_flow_and_ppo_trains_lora_and_the_value_head():
    """2 rounds × 1 epoch of 8 contexts in batches of 4: a flow phase and a held-out evaluation per round, 4 PPO
    steps (GAE, value head, KL in the reward), the final evaluation, then the run stops by itself."""
    torch.manual_seed(0)
    module = policy()
    lora_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    flow_before = [p.detach().clone() for p in module.reward_model.flow.parameters()]
    value_before = module.value_head.weight.detach().clone()
    metrics = fit(module).logged_metrics
    for key in ("round/acceptance", "round/flow_loss", "round/explanation_accuracy", "train/reward_mean",
                "train/reward_std", "train/explanation_accuracy", "train/policy_loss", "train/approx_kl",
                "train/flow_prediction_accuracy", "train/value_loss", "final/explanation_accuracy", "final/reward_mean"):
        assert key in metrics and math.isfinite(float(metrics[key])), key
    assert any(k.startswith("round/flow_accuracy_") for k in metrics)
    assert metrics["round/index"] == 1.0  # two rounds ran
    changed = [n for n, p in module.policy.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert all(not p.requires_grad for n, p in module.policy.named_parameters() if "lora_" not in n)
    assert any(not torch.equal(a, b) for a, b in zip(flow_before, module.reward_model.flow.parameters()))
    assert not torch.equal(module.value_head.weight, value_before)


def test_ppo_epochs_move_the_ratio_off_one_so_the_clip_acts():
    """ppo_epochs = 3 optimizer steps per batch: from the second one the ratio differs from 1 and tokens clip."""
    torch.manual_seed(0)
    metrics = fit(policy(update=UpdateOptions(ppo_epochs=3), optim=OptimOptions(lr=2e-2, flow_lr=1e-3),
                        loss=replace(PPO_LOSS, clip_low=0.05, clip_high=0.05)), rounds=1).logged_metrics
    assert float(metrics["train/clip_fraction"]) > 0


def test_reinforce_has_no_value_head_and_bad_options_are_config_errors():
    module = policy(advantage=AdvantageOptions(estimator="reinforce"), loss=replace(PPO_LOSS, kl_coef=0.0))
    assert module.value_head is None
    for options, key in (({"advantage": AdvantageOptions(estimator="a2c")}, "advantage.estimator"),
                         ({"advantage": AdvantageOptions(lam=1.5)}, "advantage.lam"),
                         ({"loss": LossOptions(value_clip=0.0)}, "loss.value_clip"),
                         ({"loss": LossOptions(kl_in="both")}, "loss.kl_in"),
                         ({"loss": LossOptions(kl_estimator="k9")}, "loss.kl_estimator"),
                         ({"sft": SFTOptions(epochs=-1)}, "sft.epochs")):
        with pytest.raises(ConfigError, match=rf"^PolicyModule\.{key} must be"):
            PolicyModule(**options)
    for options in ({"num_decisions": 1}, {"reward": "judge"}, {"sigma": 0.0}, {"flow_batch_size": 0}):
        with pytest.raises(ConfigError, match=next(iter(options))):
            ExplanationReward(**options)
    with pytest.raises(ConfigError, match="LoRA"):  # the flow reads the frozen policy: its base model
        policy(lora=None)


def test_sft_on_preferred_explanations_runs_before_the_first_round_and_lowers_their_loss():
    torch.manual_seed(0)
    module = policy(sft=SFTOptions(epochs=3, lr=1e-2))
    fit(module, rounds=1)
    assert len(module.sft_losses) == 3 * 2  # 8 records in global batches of 4, 3 epochs
    assert sum(module.sft_losses[-2:]) < sum(module.sft_losses[:2])


def test_sft_needs_solutions(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"context": f"d=+{i},+2 a=?", "decisions": ["north", "south", "east", "west"],
                                          "decision": "north"}) for i in range(4)))
    with pytest.raises(ConfigError, match="solution"):
        fit(policy(sft=SFTOptions(epochs=1)), rounds=1, data=ExplanationDataModule(train_path=str(path), test_path=str(path),
                                                                       batch_size=2))


def test_the_held_out_evaluator_judges_and_flowkit_validate_reports_the_evaluation():
    torch.manual_seed(0)
    module = policy()
    judged = []
    module.reward_model.evaluators[0].model.register_forward_hook(lambda *_: judged.append(1))
    data = ExplanationDataModule(num_train=8, num_test=8, batch_size=4)
    trainer = fit(module, rounds=1, data=data)
    assert judged  # the held-out evaluator, not the proxies, judged the explanations
    judged.clear()
    trainer.limit_val_batches = 1.0
    (validated,) = trainer.validate(module, datamodule=data, verbose=False)
    assert 0 <= validated["val/heldout/explanation_accuracy"] <= 1 and "val/heldout/reward_mean" in validated
    assert judged


@pytest.mark.slow
@pytest.mark.parametrize("reward,flow_attention", [("sparse", True), ("proxy", True), ("flow", False)])
def test_ablations_run(reward, flow_attention):
    torch.manual_seed(0)
    metrics = fit(policy(reward_model(reward=reward, flow_attention=flow_attention)), rounds=1).logged_metrics
    assert math.isfinite(float(metrics["train/policy_loss"]))
    assert ("round/flow_loss" in metrics) == (reward != "proxy")
    if reward == "proxy":
        assert "train/flow_prediction_accuracy" in metrics and math.isfinite(float(metrics["train/reward_mean"]))


def test_reward_module_trains_the_flow_on_reference_explanations_and_validates():
    torch.manual_seed(0)
    module = ExplanationRewardModule(ode_steps=3, num_draws=4, time_dim=16, projector_dim=32, lr=1e-3)
    before = [p.detach().clone() for p in module.reward_model.parameters()]
    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=2, val_check_interval=3,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, datamodule=ExplanationDataModule(num_train=48, num_test=32, batch_size=16))
    metrics = trainer.logged_metrics
    assert math.isfinite(float(metrics["train/flow_loss"])) and 0 < float(metrics["train/acceptance"]) <= 1
    assert "val/flow_accuracy_positive" in metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, module.reward_model.parameters()))
    assert all(not p.requires_grad for p in module.backbone.parameters())
