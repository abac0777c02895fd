"""One decoding step of a Llama-family HF model (Qwen2, Qwen3, Llama, Mistral) without HF's per-step Python.

A decoding step is one token per row, so its products are small and HF's forward spends as long in Python as in
arithmetic: output capturing, argument deprecation and hub-kernel wrappers, the causal-mask builder, a module call per
norm and projection (on the bundled tiny policy, 128 rows: ~1.6 of ~6.3 ms per step on a Zen 4 core).
:class:`DecodeStep` runs the same tensor ops in the same order on the same tensors, as one Python loop over the
layers, but for the rotary embedding, :func:`~flowkit.kernels.rotary.rotary` (one native op where transformers runs
seven, to the bit), and the attention: :func:`~flowkit.kernels.decode_attention.decode_attention`, whose reference is
SDPA called as transformers calls it (with it the logits are bitwise HF's, step after step, with and without left
padding, rows leaving the batch, GQA and not: the test checks) and whose native CPU kernel agrees to float32
rounding. It reads the model's own parameters, so weights updated in place need no refresh, and the KV cache is
the one HF's prefill filled.

:func:`decode_step_for` returns None, and the caller runs HF's forward, for anything it does not mirror exactly: other
architectures, attention other than ``sdpa`` (transformers' or flowkit's, :mod:`~flowkit.llm.sdpa`), sliding
windows, RoPE that rescales with the sequence length, adapters or other layers where plain ``nn.Linear`` / RMSNorm
are expected, any module hook (ZeRO-3's parameter gathering, latent taps), a model in training mode, or
``FLOWKIT_KERNELS=reference`` (HF's forward, as other trainers run it).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from flowkit.kernels import cpu_linear
from flowkit.kernels.backends import forced_backend
from flowkit.kernels.decode_attention import decode_attention
from flowkit.kernels.reference.rms_norm import rms_norm as hf_rms_norm
from flowkit.kernels.reference.swiglu import swiglu as hf_swiglu
from flowkit.kernels.rms_norm import rms_norm
from flowkit.kernels.rotary import rotary
from flowkit.kernels.swiglu import swiglu
from flowkit.llm.fused_layers import HF_MLPS, HF_RMS_NORMS, FusedRMSNorm, FusedSwiGLUMLP
from flowkit.llm.sdpa import SDPA_IMPLEMENTATIONS

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _norm(module: nn.Module | None) -> tuple | None:
    """``(function, weight, eps)`` of an RMSNorm, the function its forward runs; None for no norm."""
    if module is None:
        return None
    function = rms_norm if isinstance(module, FusedRMSNorm) else hf_rms_norm
    return function, module.weight, module.variance_epsilon


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, FusedRMSNorm) or type(module).__name__ in HF_RMS_NORMS


def _normed(x: Tensor, norm: tuple) -> Tensor:
    function, weight, eps = norm
    return function(x, weight, eps)


def _linear(module: nn.Module) -> tuple:
    """``(product, weight, bias)`` of a projection: flowkit's oneDNN route for its own linear class, else
    ``F.linear`` — what the module's forward would run."""
    product = cpu_linear.linear if isinstance(module, cpu_linear.OneDNNLinear) else F.linear
    return product, module.weight, module.bias


def _hooked(model: nn.Module) -> bool:
    global_hooks = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
    return any(global_hooks) or any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def _mirrorable(model: PreTrainedModel) -> bool:
    config = model.config
    if (getattr(config, "model_type", None) not in ARCHITECTURES
            or config._attn_implementation not in SDPA_IMPLEMENTATIONS):
        return False
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    linear_types = (nn.Linear, cpu_linear.OneDNNLinear)
    layers_plain = all(
        type(layer.self_attn.q_proj) in linear_types and type(layer.self_attn.k_proj) in linear_types
        and type(layer.self_attn.v_proj) in linear_types and type(layer.self_attn.o_proj) in linear_types
        and all(type(getattr(layer.mlp, name, None)) in linear_types for name in ("gate_proj", "up_proj", "down_proj"))
        and (isinstance(layer.mlp, FusedSwiGLUMLP) or type(layer.mlp).__name__ in HF_MLPS)
        and _is_norm(layer.input_layernorm) and _is_norm(layer.post_attention_layernorm)
        and all(_is_norm(norm) for norm in (getattr(layer.self_attn, "q_norm", None),
                                             getattr(layer.self_attn, "k_norm", None)) if norm is not None)
        for layer in decoder.layers)
    return (getattr(config, "hidden_act", None) == "silu"
            and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
            and getattr(config, "sliding_window", None) is None
            and getattr(decoder.rotary_emb, "rope_type", "default") not in _LENGTH_DEPENDENT_ROPE
            and layers_plain and _is_norm(decoder.norm) and type(head) in linear_types
            and not model.training and not _hooked(model))


def decode_step_for(model: PreTrainedModel) -> DecodeStep | None:
    """A :class:`DecodeStep` over ``model``, or None where HF's forward must run (module docstring)."""
    if forced_backend() == "reference" or not _mirrorable(model):
        return None
    return DecodeStep(model)


class DecodeStep:
    """Next-token logits for one new token per row, as ``model(input_ids, attention_mask, position_ids, cache,
    use_cache=True, logits_to_keep=1).logits[:, -1]`` computes them; build it with :func:`decode_step_for`."""

    def __init__(self, model: PreTrainedModel):
        decoder = model.get_decoder()
        self.decoder, self.head = decoder, _linear(model.get_output_embeddings())
        self.norm = _norm(decoder.norm)
        attention = decoder.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attention.head_dim, attention.num_key_value_groups, attention.scaling
        self.layers = [self._layer(layer) for layer in decoder.layers]

    @staticmethod
    def _layer(layer: nn.Module) -> tuple:
        attention, mlp = layer.self_attn, layer.mlp
        head_norms = (_norm(getattr(attention, "q_norm", None)), _norm(getattr(attention, "k_norm", None)))  # Qwen3's
        gated = swiglu if isinstance(mlp, FusedSwiGLUMLP) else hf_swiglu
        return (_norm(layer.input_layernorm), _linear(attention.q_proj), _linear(attention.k_proj),
                _linear(attention.v_proj), head_norms, _linear(attention.o_proj), _norm(layer.post_attention_layernorm),
                gated, _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj))

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache) -> Tensor:
        """Logits (B × V) of the token after ``input_ids`` (B × 1), whose key and value ``cache`` takes in;
        ``attention_mask`` (B × cached positions + 1) and ``position_ids`` (B × 1) as HF's forward takes them."""
        rows = input_ids.shape[0]
        hidden = self.decoder.embed_tokens(input_ids)
        cos, sin = (part[:, 0] for part in self.decoder.rotary_emb(hidden, position_ids))  # rows × head_dim
        mask = None if bool(attention_mask.all()) else attention_mask.bool()  # HF's: none where nothing is padding
        heads = (rows, 1, -1, self.head_dim)
        for index, (norm_in, q, k, v, (q_norm, k_norm), o, norm_out, gated, gate, up, down) in enumerate(self.layers):
            x = _normed(hidden, norm_in)
            query, key, value = (product(x, weight, bias).view(heads) for product, weight, bias in (q, k, v))
            if q_norm is not None:
                query, key = _normed(query, q_norm), _normed(key, k_norm)
            query = rotary(query.reshape(rows, -1, self.head_dim), cos, sin).unsqueeze(2)  # rows × heads × 1 × dim
            key = rotary(key.reshape(rows, -1, self.head_dim), cos, sin).unsqueeze(2)
            keys, values = cache.layers[index].update(key, value.transpose(1, 2))
            attended = self._attention(query, keys, values, mask)
            hidden = hidden + o[0](attended, o[1], o[2])
            x = _normed(hidden, norm_out)
            hidden = hidden + down[0](gated(gate[0](x, gate[1], gate[2]), up[0](x, up[1], up[2])), down[1], down[2])
        product, weight, bias = self.head
        return product(_normed(hidden, self.norm), weight, bias)[:, -1]

    def _attention(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of one query per row and head (B × heads × 1 × head_dim): B × 1 × heads·head_dim."""
        rows, heads = query.shape[0], query.shape[1]
        grouped = query.reshape(rows, heads // self.groups, self.groups, self.head_dim)  # by the KV head they read
        return decode_attention(grouped, keys, values, mask, self.scaling).reshape(rows, 1, -1)
