"""FlowReward on the bundled tiny policy: offline pretraining makes held-out expert latents score lower."""

import pytest
import torch

from flowkit.data.records import load_records
from flowkit.errors import ConfigError
from flowkit.llm.backbone import load_backbone
from flowkit.llm.latent_tap import LatentTap
from flowkit.rewards.flow.expert_latents import expert_latents
from flowkit.modules.datamodule import RolloutDataModule, resolve_data_path
from flow_options import flow_reward
from backbone_stub import backbone_stub


def test_pretrained_flow_scores_expert_latents_below_shuffled():
    torch.manual_seed(0)
    model, tokenizer = load_backbone("bundled:tiny_adder")
    model.eval()
    data = RolloutDataModule(val_path=None)
    data.setup("fit")
    reward = flow_reward(depth=2, seed=0, pretrain_timesteps=2)
    tap = LatentTap(model, reward.percentiles)
    reward.bind(model, tap.layer_positions)
    optimizer = torch.optim.AdamW(reward.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batches = data.expert_batches(32, seed=0)
    for _ in range(100):
        rows = next(batches)
        pieces = reward.pretrain_losses(*expert_latents(model, tokenizer, tap, rows["prompt"], rows["solution"], "cpu"),
                                        generator)
        optimizer.zero_grad()
        sum(piece() for piece in pieces).backward()
        optimizer.step()

    held_out = load_records(resolve_data_path("bundled:arithmetic/val.jsonl"), ["prompt", "solution"])[:64]
    latents, mask = expert_latents(model, tokenizer, tap, [r["prompt"] for r in held_out], [r["solution"] for r in held_out],
                                   "cpu")
    # Shuffle the response tokens' latents across positions and rows (all layers alike).
    rows_idx, cols_idx = mask.bool().nonzero(as_tuple=True)
    permutation = torch.randperm(len(rows_idx), generator=torch.Generator().manual_seed(1))
    shuffled = latents.clone()
    shuffled[:, rows_idx, cols_idx] = latents[:, rows_idx[permutation], cols_idx[permutation]]

    with torch.no_grad():
        real = reward.deviation_scores(latents, mask, seed=5)
        fake = reward.deviation_scores(shuffled, mask, seed=5)
    scored = real != 0
    assert real[scored].mean() < 0.8 * fake[scored].mean(), (real[scored].mean(), fake[scored].mean())


def test_bind_leaves_the_global_rng_alone_and_uses_the_backbone_eps():
    """The flow's initialisation must not shift the policy's sampling stream (paired ablations)."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    reward = flow_reward(depth=1, seed=7)
    reward.bind(backbone_stub(16, 1e-5), [0.25, 0.5, 0.75])
    torch.testing.assert_close(torch.rand(3), expected)
    assert {m.eps for m in reward.field.modules() if isinstance(m, torch.nn.RMSNorm)} == {1e-5}
    again = flow_reward(depth=1, seed=7)
    again.bind(backbone_stub(16, 1e-5), [0.25, 0.5, 0.75])
    for a, b in zip(reward.field.parameters(), again.field.parameters()):
        assert torch.equal(a, b)  # the field's seed alone decides its initialisation


def test_unknown_normalization_is_a_config_error():
    with pytest.raises(ConfigError, match="normalization"):
        flow_reward(normalization="zscore")
