"""`flowkit convert-flow`: an official RLFR flow checkpoint (``flow_model.bin``) → flowkit safetensors.

The official code (github Jinghaoleven/RLFR) saves its velocity field ``SimpleMLPAdaLNTimePos`` with torch's
pickle format: keys under ``model.`` as its RL trainer loads them (``FlowReward.model``), without a prefix as
``FlowReward.save_pretrained`` writes them, or under ``flow.model.`` inside a LLaMA-Factory ``pytorch_model.bin``.
The two sinusoidal embedders also store their frequencies as ``freqs`` buffers; flowkit computes them, so the
converter checks that they are the standard ones and drops them. The networks are otherwise the same (see
:class:`~flowkit.rewards.flow.VelocityField`): a converted field gives the official module's outputs on the same inputs.
The RMSNorm ε is not stored; :meth:`FlowReward.bind` takes it from the backbone's ``rms_norm_eps`` as the
official code does.

Usage (the config decides which FlowReward the converted weights must fit; they are loaded into it as a check)::

    flowkit convert-flow --config configs/rlfr_qwen.yaml --input result/flow_model/checkpoint-1453/flow_model.bin \\
        --output flow.safetensors
    flowkit fit --config configs/rlfr_qwen.yaml --model.init_args.reward_model.init_args.weights flow.safetensors
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from flowkit.errors import ConfigError
from flowkit.registry import subcommand
from flowkit.rewards.flow.field import sinusoidal_frequencies

# official name (after its prefix) → flowkit VelocityField name; {i} is a residual block's index
_RENAMES = [
    (r"input_proj\.(weight|bias)", r"input_proj.\1"),
    (r"time_embed\.mlp\.(0|2)\.(weight|bias)", r"t_embed.mlp.\1.\2"),
    (r"layer_embed\.mlp\.(0|2)\.(weight|bias)", r"layer_embed.mlp.\1.\2"),
    (r"cond_embed\.(weight|bias)", r"cond_proj.\1"),
    (r"res_blocks\.(\d+)\.in_ln\.weight", r"blocks.\1.norm.weight"),
    (r"res_blocks\.(\d+)\.mlp\.(0|2)\.(weight|bias)", r"blocks.\1.mlp.\2.\3"),
    (r"res_blocks\.(\d+)\.adaLN_modulation\.1\.(weight|bias)", r"blocks.\1.ada_ln.1.\2"),
    (r"final_layer\.norm_final\.weight", r"final_norm.weight"),
    (r"final_layer\.linear\.(weight|bias)", r"output_proj.\1"),
    (r"final_layer\.adaLN_modulation\.1\.(weight|bias)", r"final_ada_ln.1.\1"),
]
_FREQUENCY_BUFFERS = ("time_embed.freqs", "layer_embed.freqs")


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keys relative to ``SimpleMLPAdaLNTimePos``, whichever of the three official layouts ``state`` uses."""
    if any(k.startswith("flow.") for k in state):  # LLaMA-Factory's whole-model file: keep the flow's keys
        state = {k[len("flow."):]: v for k, v in state.items() if k.startswith("flow.")}
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items()}
    return state


def convert_official_state_dict(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Official ``SimpleMLPAdaLNTimePos`` state dict → (flowkit VelocityField state dict, its architecture).

    Raises ``ValueError`` on a key it does not know, a missing official key, or frequency buffers other than
    the standard 128 frequencies ``exp(−ln(10⁴)·i/128)``.
    """
    state = _strip_prefix(dict(state))
    converted: dict[str, Tensor] = {}
    for key, value in state.items():
        if key in _FREQUENCY_BUFFERS:
            expected = sinusoidal_frequencies(2 * value.numel())
            if not torch.allclose(value.float().reshape(-1), expected, rtol=1e-5, atol=1e-7):
                raise ValueError(f"{key} holds non-standard sinusoidal frequencies; flowkit cannot represent them")
            continue
        for pattern, target in _RENAMES:
            if re.fullmatch(pattern, key):
                converted[re.sub(pattern, target, key)] = value.contiguous()
                break
        else:
            raise ValueError(f"unknown key {key!r} in the official flow checkpoint")
    for required in ("input_proj.weight", "t_embed.mlp.0.weight", "layer_embed.mlp.0.weight", "cond_proj.weight",
                     "final_norm.weight", "output_proj.weight", "final_ada_ln.1.weight"):
        if required not in converted:
            raise ValueError(f"the official flow checkpoint lacks the weights of {required!r}")
    width, hidden_size = converted["input_proj.weight"].shape
    depth = len({k.split(".")[1] for k in converted if k.startswith("blocks.")})
    return converted, {"hidden_size": int(hidden_size), "width": int(width), "depth": depth}


def convert_official_flow(source: str | Path, destination: str | Path) -> dict[str, int]:
    """Read an official ``.bin`` flow checkpoint, write flowkit safetensors; returns the field's architecture.

    The file is loaded tensors-only (``torch.load(weights_only=True)``); one that is no ``torch.save`` file of a
    state dict (a plain pickle, a truncated file, another format) or that the converter cannot map is a
    :class:`~flowkit.errors.ConfigError` naming ``--input``.
    """
    if not Path(source).is_file():
        raise ConfigError(f"convert-flow --input {str(source)!r} is not a file")
    try:
        with warnings.catch_warnings():  # torch warns before refusing a pickle of another protocol: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(str(source), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise ConfigError(f"convert-flow --input {str(source)!r} is not a torch.save file of tensors "
                          f"({_load_failure(err)}); save the official flow's weights with "
                          "torch.save(model.state_dict(), PATH)") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ConfigError(f"convert-flow --input {str(source)!r} holds a {type(state).__name__}, not a state dict of "
                          "tensors; save it with torch.save(model.state_dict(), PATH)")
    try:
        converted, architecture = convert_official_state_dict(state)
    except ValueError as err:
        raise ConfigError(f"convert-flow --input {str(source)!r}: {err}") from None
    Path(destination).parent.mkdir(parents=True, exist_ok=True)
    metadata = {"source": "official RLFR flow_model.bin", **{k: str(v) for k, v in architecture.items()}}
    save_file(converted, str(destination), metadata=metadata)
    return architecture


def _load_failure(err: BaseException) -> str:
    """torch.load's reason in a few words (its messages run to paragraphs)."""
    refused = re.search(r"WeightsUnpickler error:\s*(.*)", str(err))
    if refused:
        return f"a pickle the tensors-only loader refuses: {refused.group(1).strip()}"
    if isinstance(err, EOFError):
        return "the file ends early"
    return str(err).split(". ")[0].strip() or type(err).__name__


@subcommand("convert-flow")
def convert_flow(trainer, model, datamodule, input: str, output: str = "flow.safetensors"):
    """Convert an official RLFR flow checkpoint to flowkit safetensors and load it into the config's FlowReward.

    Args:
        input: the official ``flow_model.bin`` (or a LLaMA-Factory ``pytorch_model.bin`` holding ``flow.*`` keys).
        output: the safetensors file to write; pass it as the FlowReward's ``weights``.
    """
    architecture = convert_official_flow(input, output)
    print(f"wrote {output}: hidden_size {architecture['hidden_size']}, width {architecture['width']}, "
          f"depth {architecture['depth']} (conditioned)")
    reward = getattr(model, "reward_model", None)
    if reward is not None and hasattr(reward, "load_field"):
        reward.load_field(output)  # the config's field must have the converted shapes
        print("the converted weights load into the config's FlowReward")
