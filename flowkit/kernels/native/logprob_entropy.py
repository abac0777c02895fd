"""Fake tensors for the native LM-head softmax ops ``torch.ops.flowkit.logprob_entropy[_backward_]`` (no autograd:
the LM head's autograd Function calls the backward op itself). A ``flowkit._C`` built before these ops has neither;
the reference then runs (:func:`flowkit.kernels.backends.native_has`)."""

from __future__ import annotations

import torch
from torch.library import register_fake


def _logprob_entropy_fake(logits, targets, temperature):
    return tuple(logits.new_empty(logits.shape[:1]) for _ in range(3))


def _logprob_entropy_backward_fake(logits, targets, log_normalizer, entropy, grad_logprob, grad_entropy, temperature):
    return None


if hasattr(torch.ops.flowkit, "logprob_entropy"):
    register_fake("flowkit::logprob_entropy", _logprob_entropy_fake)
    register_fake("flowkit::logprob_entropy_backward_", _logprob_entropy_backward_fake)
