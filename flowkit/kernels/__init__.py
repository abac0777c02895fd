"""Fused ops for flow-matching rewards (DESIGN §5): RLFR velocity deviation and flow-token attention.

Each has a PyTorch reference, Triton kernels, and native C++/CUDA kernels (``torch.ops.flowkit``, built
from ``csrc/``); :func:`available_backends` lists what runs here and ``FLOWKIT_KERNELS`` forces one. More ops
serve the policy: :mod:`.cpu_linear` (float32 CPU linear layers through oneDNN), :mod:`.logprob_entropy` (the LM
head's softmax over the vocabulary: native on CPU, Triton on CUDA), and native CPU kernels for Llama-family layers:
:mod:`.rms_norm`, :mod:`.swiglu`, :mod:`.decode_attention` (one decoding step's attention) and :mod:`.rotary` (one
decoding step's rotary embedding).
"""

from .backends import available_backends
from .flow_attention import flow_token_attention
from .rng import flow_noise
from .velocity_deviation import (
    debias_weights, interpolate_latents, token_chunks, velocity_deviation, velocity_deviation_in_chunks,
)

__all__ = [
    "available_backends",
    "debias_weights",
    "flow_noise",
    "flow_token_attention",
    "interpolate_latents",
    "token_chunks",
    "velocity_deviation",
    "velocity_deviation_in_chunks",
]
