"""PPO's KL reference after SFT is the SFT'd policy (TRL's reference model is the SFT model), held in a frozen
second LoRA adapter; without SFT it stays the adapters-disabled base model."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from flowkit.llm.lora import LoraSettings
from flowkit.llm.rollout import forward_hidden
from flowkit.modules.explanation import REFERENCE_ADAPTER, ExplanationDataModule, ExplanationPolicyModule


LORA = LoraSettings(r=4, alpha=4, target_modules=["q_proj", "v_proj"])


def _policy(sft_epochs: int, lora: LoraSettings | None = LORA) -> ExplanationPolicyModule:
    return ExplanationPolicyModule(
        lora=lora, sft_epochs=sft_epochs, sft_lr=1e-2,
        ode_steps=2, num_draws=2, flow_time_dim=8, flow_projector_dim=16, explanations_per_context=1,
        round_contexts=4, heldout_contexts=4, flow_epochs_per_round=1, policy_epochs_per_round=1, num_samples=2,
        max_new_tokens=12, ppo_epochs=2, lr=1e-2, flow_lr=1e-3)


class PostSft(L.Callback):
    """Log-probs of fixed explanations under the policy when PPO starts (after SFT) and under the model before
    SFT (the adapters disabled; without LoRA, the frozen copy the flow reads)."""

    def on_train_start(self, trainer, module):
        self.batch = module._sft_batch(trainer.datamodule.train_records[:2])  # prompts + preferred explanations
        with torch.no_grad():
            self.policy = module._logprobs(module.policy, forward_hidden(module.policy, self.batch), self.batch)
            if module.flow_backbone is not None:
                base = module.flow_backbone
                self.base = module._logprobs(base, forward_hidden(base, self.batch), self.batch)
            else:
                with module.policy.disable_adapter():
                    self.base = module._logprobs(module.policy, forward_hidden(module.policy, self.batch),
                                                 self.batch)


def _fit(module: ExplanationPolicyModule, callback: PostSft) -> dict:
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    trainer.fit(module, datamodule=ExplanationDataModule(num_train=4, num_test=4, batch_size=4))
    return trainer.logged_metrics


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_after_sft_the_kl_reference_is_the_sft_policy_not_the_base_model(lora):
    torch.manual_seed(0)
    module, start = _policy(sft_epochs=1, lora=lora), PostSft()
    state = torch.get_rng_state()
    module._build_reference()  # as setup() does; the reference's initial draws leave the run's random stream alone
    assert torch.equal(torch.get_rng_state(), state)
    assert (REFERENCE_ADAPTER in module.policy.peft_config) if lora else module.reference_policy is not None
    metrics = _fit(module, start)
    mask = start.batch.response_mask.bool()
    assert not torch.allclose(start.policy[mask], start.base[mask], atol=1e-3)  # SFT moved the policy
    # The one training batch is PPO's first: its rollouts' KL to the reference is exactly 0.
    assert float(metrics["train/kl_to_initial"]) == 0.0
    with torch.no_grad():
        reference = module._reference_logprobs(start.batch)
        moved = module._logprobs(module.policy, forward_hidden(module.policy, start.batch), start.batch)
    assert torch.equal(reference[mask], start.policy[mask])  # frozen through PPO, equal to the post-SFT policy
    assert not torch.allclose(reference[mask], start.base[mask], atol=1e-3)  # not the pre-SFT model
    assert not torch.allclose(moved[mask], reference[mask], atol=1e-4)  # while PPO's steps moved the policy
    if lora is None:  # a frozen full copy
        assert not any(p.requires_grad for p in module.reference_policy.parameters())
        return
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".default." in n for n in trainable)  # the reference stays frozen
    assert module.policy.active_adapter == "default" and module.reference_policy is None


def test_without_sft_the_reference_is_the_adapters_disabled_policy_and_no_adapter_is_added():
    torch.manual_seed(0)
    module, start = _policy(sft_epochs=0), PostSft()
    metrics = _fit(module, start)
    assert REFERENCE_ADAPTER not in module.policy.peft_config
    assert float(metrics["train/kl_to_initial"]) == 0.0  # fresh LoRA adapters are the identity
    mask = start.batch.response_mask.bool()
    with torch.no_grad():
        reference = module._reference_logprobs(start.batch)
    assert torch.equal(reference[mask], start.base[mask])
