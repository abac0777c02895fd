"""One decoding step's attention: each row's new query per head against its cached keys and values.

With one query per row, PyTorch's flash kernel for CPU spends most of its time setting up blocks sized for long
queries: ~1.3 of ~6.3 ms per decoding step of the bundled tiny policy (128 rows, 4 layers, ~30 keys). The native CPU
kernel (``csrc/decode_attention/``) scores, normalises and sums each (row, KV head) over a scores buffer, its output
held in registers for head dimensions 32, 64 and 128 (2.2× faster than SDPA at 20 keys, 1.3× at 200, head
dimension 32; 3× at 200, dimension 128). Its results match the reference to float32 rounding (summation order), not
bitwise. Everything else (CUDA, other dtypes, CPU autocast, a ``flowkit._C`` without the op,
``FLOWKIT_KERNELS=reference``) runs the reference: SDPA, called as transformers calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import runs_native_cpu_float32
from .reference import decode_attention as reference

NATIVE_HEAD_DIMS = (32, 64, 128)  # compiled for; at other sizes the native kernel is no faster than SDPA


def backend_for(query: Tensor) -> str:
    """The implementation the op runs for this query: "native" or "reference"."""
    native = query.shape[-1] in NATIVE_HEAD_DIMS and runs_native_cpu_float32(query, "decode_attention")
    return "native" if native else "reference"


def decode_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``query`` (B, Hkv, G, D): each row's new queries, the G heads that share a KV head together; ``keys``,
    ``values`` (B, Hkv, L, D), any strides but a dense last one (views of a KV cache's buffer); ``mask`` (B, L) bool,
    False where a key is left out (None: none is). The attention output, (B, Hkv, G, D)."""
    if backend_for(query) == "native" and keys.dtype == values.dtype == torch.float32:
        return torch.ops.flowkit.decode_attention(query, keys, values, mask, scale)
    return reference.decode_attention(query, keys, values, mask, scale)
