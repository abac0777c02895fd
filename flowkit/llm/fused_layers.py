"""Llama-family RMSNorm and MLP modules on flowkit's fused kernels (:mod:`flowkit.kernels.rms_norm`,
:mod:`flowkit.kernels.swiglu`): one pass each way over the activations where PyTorch makes about a dozen, which on
CPU at small hidden sizes costs as much as the products around them. :func:`use_fused_layers` swaps the classes of a
model's modules in place, as :func:`~flowkit.kernels.cpu_linear.use_onednn_linears` does for its linear layers: the
same module objects, parameters, state dict and hooks, and the projections stay the MLP's own modules (adapters
that wrap them keep working). Off the native kernels (CUDA, other dtypes, ``FLOWKIT_KERNELS=reference``) each module
computes exactly what transformers' would.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers.activations import SiLUActivation

from flowkit.kernels.rms_norm import rms_norm
from flowkit.kernels.swiglu import swiglu

HF_RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")  # w · x / rms(x), in float32
HF_MLPS = ("Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP")  # down(act(gate(x)) · up(x))


class FusedRMSNorm(nn.Module):
    """An HF RMSNorm of :data:`HF_RMS_NORMS` whose forward is :func:`~flowkit.kernels.rms_norm.rms_norm`."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class FusedSwiGLUMLP(nn.Module):
    """An HF MLP of :data:`HF_MLPS` with SiLU whose gate is :func:`~flowkit.kernels.swiglu.swiglu`."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def use_fused_layers(model: nn.Module) -> int:
    """Turn the RMSNorms and SiLU-gated MLPs of ``model`` into :class:`FusedRMSNorm` / :class:`FusedSwiGLUMLP` in
    place (their classes only); returns how many modules changed."""
    swapped = 0
    for module in model.modules():
        name = type(module).__name__
        if name in HF_RMS_NORMS:
            module.__class__ = FusedRMSNorm
        elif name in HF_MLPS and isinstance(module.act_fn, nn.SiLU | SiLUActivation):
            module.__class__ = FusedSwiGLUMLP
        else:
            continue
        swapped += 1
    return swapped

