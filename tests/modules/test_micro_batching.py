"""The RL step does not depend on how it is split: micro-batches, LM-head chunks, and an on-policy update's scoring
pass against its training forward.

Each run fits the tiny policy with an RLFR flow reward for 3 steps and records, at every optimizer step, the
gradient of every parameter (policy and flow) just before the step.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import lightning as L
import pytest
import torch

import flowkit.modules.policy_optimizer as policy_optimizer
import flowkit.step.train_on as train_on
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.step import Actor
from flowkit.step.optimizer import step_groups
from flowkit.modules.policy_options import AdvantageOptions, LossOptions, OptimOptions, SamplingOptions, UpdateOptions
from flow_options import flow_reward


def fit_recording_gradients(tmp_path, monkeypatch, steps: int = 3, **options) -> tuple[list[dict], dict, PolicyModule]:
    """Gradients at each optimizer step and the weight changes (final − initial) of a short fit (fp32, fixed seeds)."""
    recorded: list[dict[str, torch.Tensor]] = []

    def recording_step_groups(optimizer, names):
        recorded.append({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        step_groups(optimizer, names)

    monkeypatch.setattr(policy_optimizer, "step_groups", recording_step_groups)
    L.seed_everything(0, verbose=False)
    reward = flow_reward(depth=1, kappa=1, rejection_metric="entropy", seed=3)
    settings = dict(reward_model=reward, sampling=SamplingOptions(num_samples=4, max_new_tokens=16),
                    outcome_reward="binary", optim=OptimOptions(lr=5e-5, flow_lr=1e-3))
    module = PolicyModule(**(settings | options))
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    per_step = module.update.updates  # Lightning counts optimizer steps
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=steps * per_step, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    updates = {n: p.detach() - initial[n] for n, p in module.named_parameters()}
    return recorded, updates, module


def group_gradient(grads: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """All gradients of one parameter group (``policy.`` or ``reward_model.``) as one vector."""
    return torch.cat([g.flatten() for name, g in sorted(grads.items()) if name.startswith(prefix)])


def assert_same_gradients(runs: list[list[dict]], reference: list[dict]) -> None:
    """Relative error of each group's whole gradient vector < 1e-5 at the first optimizer step (same weights: the
    pure effect of the split) and < 1e-4 at later ones, whose weights already differ by float noise that Adam
    amplifies (measured ≈ 2e-7 at the first step, up to ≈ 1e-5 after 11 steps). Per group, not per tensor: a
    per-tensor ratio is meaningless for tensors whose exact gradient is 0 (attention key biases: softmax is
    shift-invariant)."""
    assert all(group_gradient(grads, "policy.").norm() > 0 for grads in reference)
    assert group_gradient(reference[0], "reward_model.").norm() > 0  # the flow trains on the first minibatch
    for run in runs:
        assert len(run) == len(reference)
        for step, (grads, expected) in enumerate(zip(run, reference)):
            assert grads.keys() == expected.keys()
            for prefix in {name.split(".")[0] + "." for name in expected}:
                want = group_gradient(expected, prefix)
                error = float((group_gradient(grads, prefix) - want).norm() / want.norm())
                assert error < (1e-5 if step == 0 else 1e-4), (step, prefix, error)


def assert_same_updates(run: dict, reference: dict) -> None:
    """The 3 steps moved each group's weights the same way: relative error of the whole update < 1e-4 (Adam turns
    the ~1e-7 float noise of gradients whose exact value is ~0 into updates of up to ±lr, so not 1e-5)."""
    for prefix in ("policy.", "reward_model."):
        want = group_gradient(reference, prefix)
        assert want.norm() > 0, f"{prefix} did not move"
        error = float((group_gradient(run, prefix) - want).norm() / want.norm())
        assert error < 1e-4, (prefix, error)


ON_POLICY_AND_PPO = pytest.mark.parametrize("update", [UpdateOptions(), UpdateOptions(ppo_epochs=2, num_minibatches=2)],
                                            ids=["on-policy", "ppo"])


@ON_POLICY_AND_PPO
def test_micro_batch_size_changes_no_gradient_and_no_weight(tmp_path, monkeypatch, update):
    """Policy and flow gradients agree to 1e-5 (relative, fp32) for micro-batches of 1, 3 and the whole batch,
    and 3 RL steps give the same weights; also with the LM head in chunks of 5 tokens."""
    whole, whole_updates, _ = fit_recording_gradients(tmp_path / "whole", monkeypatch, update=update)
    runs, finals = [], []
    for split in [{"micro_batch_size": 1}, {"micro_batch_size": 3, "lm_head_chunk_size": 5}]:
        grads, weight_updates, _ = fit_recording_gradients(tmp_path / str(split), monkeypatch,
                                                           update=replace(update, **split))
        runs.append(grads)
        finals.append(weight_updates)
    assert len(whole) == 3 * update.updates
    assert_same_gradients(runs, whole)
    for updates in finals:
        assert_same_updates(updates, whole_updates)


@pytest.mark.parametrize("reward", [True, False], ids=["flow", "grpo"])
def test_on_policy_scoring_and_training_forwards_agree_to_the_bit(tmp_path, monkeypatch, reward):
    """ppo_epochs × num_minibatches = 1 with the flow reward: the no-grad scoring pass (whose latent tap the reward
    reads) and the training forward give the same log-probs to the bit, so the update's ratio π/π_old is exactly 1
    (the gradient is ∇log π · A). Plain GRPO runs no scoring pass at all: π_old is the training forward's own."""
    forwards, same = [], []
    real_forward, real_loss = Actor.forward, Actor.loss

    def counting_forward(self, batch, tap=False):
        forwards.append(torch.is_grad_enabled())
        return real_forward(self, batch, tap)

    def comparing_loss(self, micro, out, *args):
        response = micro.response_mask.bool()
        same.append(micro.old_logprobs is None if not reward
                    else torch.equal(out.logprobs.detach()[response], micro.old_logprobs[response]))
        return real_loss(self, micro, out, *args)

    monkeypatch.setattr(Actor, "forward", counting_forward)
    monkeypatch.setattr(Actor, "loss", comparing_loss)
    options = {} if reward else dict(reward_model=None, update=UpdateOptions(skip_zero_advantage_rows=False))
    fit_recording_gradients(tmp_path, monkeypatch, **options)
    assert forwards == ([False, True] if reward else [True]) * 3  # a scoring forward (flow), then the training one
    assert same == [True] * 3


def test_paper_config_instantiates_on_cpu_with_its_batch_and_memory_settings(tmp_path, monkeypatch):
    """configs/rlfr_qwen.yaml with the tiny backbone: 128 prompts per step over 8 ranks (16 each), clip (0.2, 0.28),
    and the micro-batch / LM-head / rollout settings the README's memory budget assumes."""
    from pathlib import Path

    from flowkit.cli import FlowkitCLI

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cli = FlowkitCLI(run=False, args=[
        "--config", "configs/rlfr_qwen.yaml", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.precision", "32-true", "--model.init_args.backbone", "bundled:tiny_adder",
        "--model.init_args.dtype", "float32", "--data.init_args.train_path", "bundled:arithmetic/train.jsonl",
        *([] if importlib.util.find_spec("vllm") else ["--model.init_args.rollout.engine", "hf"])])
    model = cli.model
    rollout, sampling, update = model.rollout, model.sampling, model.update
    assert (rollout.vllm_gpu_memory_utilization, rollout.vllm_max_model_len, rollout.vllm_enable_sleep_mode) == (
        0.35, 4096, True)
    assert sampling.max_new_tokens + 1024 == rollout.vllm_max_model_len  # Qwen2.5-Math-7B's 4096-token context
    assert (sampling.num_samples, model.loss_options.clip_low, model.loss_options.clip_high) == (8, 0.2, 0.28)
    assert (update.micro_batch_size, update.lm_head_chunk_size, model.hparams.gradient_checkpointing) == (4, 1024, True)
    assert rollout.batch_size % sampling.num_samples == 0
    assert cli.datamodule.batch_size == 128 and cli.datamodule.per_rank_batch_size(8) == 16


@pytest.mark.parametrize("update", [UpdateOptions(), UpdateOptions(ppo_epochs=2)], ids=["on-policy", "ppo"])
def test_zero_advantage_rows_are_skipped_without_changing_the_update(tmp_path, monkeypatch, update):
    """Plain GRPO: the rows of a group whose samples all earned the same reward have advantage 0 and add nothing
    to the loss, so skipping their forward/backward leaves every gradient and the 3-step weights as they were;
    also when this rank pads with zero-loss micro-batches (as when another rank keeps more rows)."""
    forwarded: list[int] = []
    real_forward, real_micro_batches = Actor.forward, train_on.micro_batch_rows

    def counting_forward(self, batch, tap=False):
        if torch.is_grad_enabled():
            forwarded.append(batch.batch_size)
        return real_forward(self, batch, tap)

    monkeypatch.setattr(Actor, "forward", counting_forward)
    update = replace(update, micro_batch_size=2)
    # 28 new tokens: room to finish, so rewards vary
    options = dict(reward_model=None, sampling=SamplingOptions(num_samples=4, max_new_tokens=28), update=update)
    every, every_updates, _ = fit_recording_gradients(tmp_path / "every", monkeypatch, **(options | dict(
        update=replace(update, skip_zero_advantage_rows=False))))
    rows_every, forwarded[:] = sum(forwarded), []
    skipped, skipped_updates, _ = fit_recording_gradients(tmp_path / "skipped", monkeypatch, **options)
    rows_skipped, forwarded[:] = sum(forwarded), []
    assert rows_skipped < rows_every  # this seed's 6 groups include some with equal rewards
    monkeypatch.setattr(train_on, "micro_batch_rows", lambda mask, rows, budget, keep=None, padding_free=False: (
        real_micro_batches(mask, rows, budget, keep, padding_free) + ([None] * 2 if keep is not None else [])))
    padded, padded_updates, _ = fit_recording_gradients(tmp_path / "padded", monkeypatch, **options)
    assert sum(forwarded) == rows_skipped + 2 * len(padded)  # one row per padding micro-batch
    for run, run_updates in [(skipped, skipped_updates), (padded, padded_updates)]:
        assert len(run) == len(every)
        assert any(group_gradient(expected, "policy.").norm() > 0 for expected in every)
        for step, (grads, expected) in enumerate(zip(run, every)):  # tolerances as assert_same_gradients
            want = group_gradient(expected, "policy.")  # exactly 0 on a step whose groups all had equal rewards
            error = float((group_gradient(grads, "policy.") - want).norm() / want.norm().clamp(min=1e-30))
            assert error < (1e-5 if step == 0 else 1e-4), (step, error)
        want = group_gradient(every_updates, "policy.")
        assert float((group_gradient(run_updates, "policy.") - want).norm() / want.norm()) < 1e-4


def test_entropy_advantage_shapes_the_policy_gradient(tmp_path, monkeypatch):
    """entropy_advantage_alpha > 0 (Entropy Adv.) adds min(α·H_t, |A_t|/κ) to the advantages: same rollouts (seeded),
    another gradient; α = 0 is plain GRPO, to the bit."""
    options = dict(reward_model=None, steps=1,  # room to finish: rewards vary within groups
                   sampling=SamplingOptions(num_samples=4, max_new_tokens=28))
    plain, _, _ = fit_recording_gradients(tmp_path / "plain", monkeypatch, **options)
    off, _, _ = fit_recording_gradients(tmp_path / "off", monkeypatch, advantage=AdvantageOptions(entropy_alpha=0.0),
                                        **options)
    shaped, _, _ = fit_recording_gradients(tmp_path / "shaped", monkeypatch,
                                           advantage=AdvantageOptions(entropy_alpha=0.4), **options)
    base = group_gradient(plain[0], "policy.")
    assert base.norm() > 0 and torch.equal(group_gradient(off[0], "policy."), base)
    difference = group_gradient(shaped[0], "policy.") - base
    assert float(difference.norm()) > 1e-3 * float(base.norm())


@pytest.mark.parametrize("loss", [LossOptions(policy_loss="gspo"), LossOptions(policy_loss="cispo"),
                                  LossOptions(entropy_coef=0.01)], ids=["gspo", "cispo", "entropy"])
def test_loss_variants_do_not_depend_on_the_micro_batch_size(tmp_path, monkeypatch, loss):
    """GSPO's sequence ratio (a whole row per micro-batch), CISPO's clipped weight and the entropy bonus keep "the
    micro-batches' losses add up to the minibatch's": the same gradients for micro-batches of 1 and the whole batch,
    over one step of two PPO epochs (the second with ratios ≠ 1)."""
    options = dict(steps=1, loss=loss)
    whole, _, _ = fit_recording_gradients(tmp_path / "whole", monkeypatch, update=UpdateOptions(ppo_epochs=2), **options)
    ones, _, _ = fit_recording_gradients(tmp_path / "ones", monkeypatch,
                                         update=UpdateOptions(ppo_epochs=2, micro_batch_size=1), **options)
    assert_same_gradients([ones], whole)


@ON_POLICY_AND_PPO
def test_token_budget_micro_batches_keep_the_gradients_and_bound_the_padded_tokens(tmp_path, monkeypatch, update):
    """micro_batch_tokens: every forward holds at most the budget (rows × longest row), and the policy and flow
    gradients are those of one micro-batch holding the whole (reordered) batch; plain GRPO's those of the batch in
    generation order."""
    budget = 40
    shapes: list[tuple[int, int]] = []
    real_forward = Actor.forward

    def recording_forward(self, batch, tap=False):
        shapes.append(tuple(batch.input_ids.shape))
        return real_forward(self, batch, tap)

    monkeypatch.setattr(Actor, "forward", recording_forward)
    options = dict(steps=2, sampling=SamplingOptions(num_samples=4, max_new_tokens=28))
    whole, whole_updates, _ = fit_recording_gradients(tmp_path / "whole", monkeypatch,
                                                      update=replace(update, micro_batch_tokens=10 ** 6), **options)
    passes = 1 + update.updates  # the scoring pass, then the updates
    assert len(shapes) == 2 * passes  # one micro-batch per pass
    shapes.clear()
    packed, packed_updates, _ = fit_recording_gradients(tmp_path / "packed", monkeypatch,
                                                        update=replace(update, micro_batch_tokens=budget), **options)
    assert len(shapes) > 2 * passes and all(rows * length <= budget or rows == 1 for rows, length in shapes), shapes
    assert_same_gradients([packed], whole)
    assert_same_updates(packed_updates, whole_updates)
    plain = replace(update, skip_zero_advantage_rows=False)
    in_order, _, _ = fit_recording_gradients(tmp_path / "in_order", monkeypatch, reward_model=None, update=plain,
                                             **options)
    plain_packed, _, _ = fit_recording_gradients(tmp_path / "plain_packed", monkeypatch, reward_model=None,
                                                 update=replace(plain, micro_batch_tokens=budget), **options)
    assert any(group_gradient(expected, "policy.").norm() > 0 for expected in in_order)
    for step, (grads, expected) in enumerate(zip(plain_packed, in_order)):
        want = group_gradient(expected, "policy.")  # exactly 0 on a step whose groups all had equal rewards
        error = float((group_gradient(grads, "policy.") - want).norm() / want.norm().clamp(min=1e-30))
        assert error < (1e-5 if step == 0 else 1e-4), (step, error)
