"""The KL reference (flowkit.step.KLReference): after an SFT start it is the SFT'd policy (TRL's reference model is
the SFT model) — a frozen second LoRA adapter, or a frozen full copy without LoRA — and PPO's steps do not move it;
without SFT it is the adapters-disabled base model."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from flowkit.step.actor import REFERENCE_ADAPTER
from flowkit.llm.backbone import load_backbone
from flowkit.llm.forward import forward_hidden
from flowkit.llm.packing import encode_pairs
from flowkit.modules.policy_options import OptimOptions, SFTOptions, UpdateOptions
from flowkit.rl.logprobs import lm_head_logprobs
from test_explanation import LORA, fit, policy, reward_model

pytestmark = pytest.mark.usefixtures("single_thread")


def logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return lm_head_logprobs(forward_hidden(model, batch), model.get_output_embeddings(), batch.input_ids,
                                batch.response_mask)[0]


class AtPpoStart(L.Callback):
    """Log-probs of fixed (prompt, preferred explanation) pairs when PPO starts (after the SFT start), and under the
    policy before SFT (the adapters disabled; without LoRA, a fresh load of the initial weights)."""

    def on_train_start(self, trainer, module):
        rows = trainer.datamodule.train_records[:2]
        self.batch = encode_pairs(module.tokenizer, [r["prompt"] for r in rows], [r["solution"] for r in rows])
        self.policy = logprobs(module.policy, self.batch)
        if module.hparams.lora is not None:
            with module.policy.disable_adapter():
                self.base = logprobs(module.policy, self.batch)
        else:
            self.base = logprobs(load_backbone(module.hparams.backbone)[0], self.batch)


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_after_sft_the_kl_reference_is_the_sft_policy_not_the_base_model(lora):
    torch.manual_seed(0)
    flow_backbone = None if lora else "bundled:explain_tiny/policy"  # without LoRA the flow reads a frozen copy
    module = policy(reward_model(backbone=flow_backbone), lora=lora, sft=SFTOptions(epochs=1, lr=1e-2),
                    update=UpdateOptions(ppo_epochs=2), optim=OptimOptions(lr=1e-2, flow_lr=1e-3))
    assert (REFERENCE_ADAPTER in module.policy.peft_config) if lora else module.reference is not None
    start = AtPpoStart()
    fit(module, rounds=1, callbacks=(start,))
    mask = start.batch.response_mask.bool()
    assert not torch.allclose(start.policy[mask], start.base[mask], atol=1e-3)  # SFT moved the policy
    reference = module.actor.reference_logprobs(start.batch)
    moved = logprobs(module.policy, start.batch)
    assert torch.equal(reference[mask], start.policy[mask])  # frozen through PPO, equal to the post-SFT policy
    assert not torch.allclose(moved[mask], reference[mask], atol=1e-4)  # while PPO's steps moved the policy
    if lora is None:
        assert not any(p.requires_grad for p in module.reference.parameters())
        return
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".default." in n for n in trainable)  # the reference stays frozen
    assert module.policy.active_adapter == "default"


def test_without_sft_the_reference_is_the_adapters_disabled_policy_and_no_adapter_is_added():
    torch.manual_seed(0)
    module, start = policy(), AtPpoStart()
    fit(module, rounds=1, callbacks=(start,))
    assert REFERENCE_ADAPTER not in module.policy.peft_config
    mask = start.batch.response_mask.bool()
    assert torch.equal(module.actor.reference_logprobs(start.batch)[mask], start.base[mask])


def test_adding_the_reference_adapter_leaves_the_random_stream_alone():
    torch.manual_seed(0)
    policy(sft=SFTOptions(epochs=1))
    after = torch.rand(3)
    torch.manual_seed(0)
    policy(sft=SFTOptions(epochs=0))
    assert torch.equal(torch.rand(3), after)
