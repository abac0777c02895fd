"""`flowkit convert-flow`: a checkpoint in the official RLFR layout, written here, converts to a flowkit field that
gives the official module's outputs on the same inputs.

``official_velocity`` restates the official ``SimpleMLPAdaLNTimePos`` forward from its published structure:
input Linear; y = layer embedding + Linear(condition) + time embedding, each embedding
``Linear→SiLU→Linear`` of ``[cos(v·freqs), sin(v·freqs)]`` (``freqs`` a stored buffer, v unscaled); residual
blocks ``x + gate·MLP(RMSNorm(x)·(1 + scale) + shift)`` with (shift, scale, gate) = Linear(SiLU(y)); final
RMSNorm, adaLN (shift, scale) and Linear. RMSNorm: w · h / sqrt(mean(h²) + ε).
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from flowkit.cli import main
from flowkit.commands.convert_flow import convert_official_flow, convert_official_state_dict
from flowkit.rewards.flow import VelocityField
from flow_options import flow_reward
from backbone_stub import backbone_stub

ROOT = Path(__file__).resolve().parents[2]


def official_state_dict(hidden: int, width: int, depth: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the official key names (as its RL trainer loads them: prefix ``model.``)."""
    g = torch.Generator().manual_seed(seed)

    def linear(name: str, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": torch.randn(fan_out, fan_in, generator=g) * fan_in**-0.5,
                f"{name}.bias": torch.randn(fan_out, generator=g) * 0.1}

    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(128, dtype=torch.float32) / 128)[None]
    state = {**linear("input_proj", hidden, width), **linear("cond_embed", hidden, width)}
    for embedder in ("time_embed", "layer_embed"):
        state.update({**linear(f"{embedder}.mlp.0", 256, width), **linear(f"{embedder}.mlp.2", width, width),
                      f"{embedder}.freqs": freqs.clone()})
    for i in range(depth):
        state.update({f"res_blocks.{i}.in_ln.weight": 1 + 0.1 * torch.randn(width, generator=g),
                      **linear(f"res_blocks.{i}.mlp.0", width, width), **linear(f"res_blocks.{i}.mlp.2", width, width),
                      **linear(f"res_blocks.{i}.adaLN_modulation.1", width, 3 * width)})
    state.update({"final_layer.norm_final.weight": 1 + 0.1 * torch.randn(width, generator=g),
                  **linear("final_layer.linear", width, hidden),
                  **linear("final_layer.adaLN_modulation.1", width, 2 * width)})
    return {f"model.{k}": v for k, v in state.items()}


def official_velocity(state, x, t, c, layer, depth: int, eps: float) -> torch.Tensor:
    s = {k.removeprefix("model."): v for k, v in state.items()}

    def linear(name, h):
        return h @ s[f"{name}.weight"].T + s[f"{name}.bias"]

    def embed(name, values):
        args = values[:, None] * s[f"{name}.freqs"]
        return linear(f"{name}.mlp.2", F.silu(linear(f"{name}.mlp.0", torch.cat([args.cos(), args.sin()], -1))))

    def rms(weight, h):
        return weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    h = linear("input_proj", x)
    y = embed("layer_embed", layer) + linear("cond_embed", c) + embed("time_embed", t)
    for i in range(depth):
        shift, scale, gate = linear(f"res_blocks.{i}.adaLN_modulation.1", F.silu(y)).chunk(3, -1)
        inner = rms(s[f"res_blocks.{i}.in_ln.weight"], h) * (1 + scale) + shift
        h = h + gate * linear(f"res_blocks.{i}.mlp.2", F.silu(linear(f"res_blocks.{i}.mlp.0", inner)))
    shift, scale = linear("final_layer.adaLN_modulation.1", F.silu(y)).chunk(2, -1)
    return linear("final_layer.linear", rms(s["final_layer.norm_final.weight"], h) * (1 + scale) + shift)


@pytest.mark.parametrize("layout", ["model.", "", "flow.model."])
def test_converted_field_gives_the_official_outputs(tmp_path, layout):
    hidden, width, depth, eps = 12, 20, 3, 1e-5
    state = official_state_dict(hidden, width, depth)
    on_disk = {layout + k.removeprefix("model."): v for k, v in state.items()}
    if layout == "flow.model.":  # a LLaMA-Factory pytorch_model.bin also holds the backbone
        on_disk["model.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    source = tmp_path / "flow_model.bin"
    torch.save(on_disk, source)

    architecture = convert_official_flow(source, tmp_path / "flow.safetensors")
    assert architecture == {"hidden_size": hidden, "width": width, "depth": depth}
    reward = flow_reward(depth=depth, width=width, condition="previous", weights=str(tmp_path / "flow.safetensors"))
    reward.bind(backbone_stub(hidden, eps), [0.25, 0.5, 0.75])

    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(7, hidden, generator=g), torch.randn(7, hidden, generator=g)
    t = torch.rand(7, generator=g)
    layer = torch.tensor([0.25, 0.5, 0.75, 0.25, 0.5, 0.75, 0.25])
    with torch.no_grad():
        ours = reward.field(x, t, layer, c)
    expected = official_velocity(state, x, t, c, layer, depth, eps)
    assert expected.abs().mean() > 0.1  # every weight is random: a real output, not the zero init
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=5e-6)


def test_converter_rejects_what_it_cannot_represent():
    state = official_state_dict(4, 4, 1)
    with pytest.raises(ValueError, match="unknown key"):
        convert_official_state_dict({**state, "model.extra.weight": torch.zeros(1)})
    bad = dict(state)
    bad["model.time_embed.freqs"] = bad["model.time_embed.freqs"] * 1000  # flowkit's old ×1000 scale
    with pytest.raises(ValueError, match="frequencies"):
        convert_official_state_dict(bad)
    with pytest.raises(ValueError, match="lacks"):
        convert_official_state_dict({k: v for k, v in state.items() if "cond_embed" not in k})


def test_cli_converts_and_loads_into_the_configs_flow(tmp_path, capsys):
    """`flowkit convert-flow --config configs/rlfr_tiny.yaml`: the tiny policy has d = 128, its flow depth 2."""
    source = tmp_path / "flow_model.bin"
    torch.save(official_state_dict(128, 128, 2), source)
    output = tmp_path / "flow.safetensors"
    main(["convert-flow", "--config", str(ROOT / "configs" / "rlfr_tiny.yaml"), "--input", str(source),
          "--output", str(output)])
    printed = capsys.readouterr().out
    assert "hidden_size 128, width 128, depth 2" in printed and "load into the config's FlowReward" in printed
    VelocityField(128, depth=2).load_state_dict(load_file(str(output)))  # strict: every key maps
