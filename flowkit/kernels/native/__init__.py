"""Python side of the native ops in ``csrc/`` (``torch.ops.flowkit``): fake tensors and autograd registrations.

Importing this package loads ``flowkit._C``; ``LOADED`` says whether that worked.
"""

try:
    import flowkit._C  # noqa: F401  (static TORCH_LIBRARY registrations run on load)
except ImportError:
    LOADED = False
else:
    LOADED = True
    from . import (  # noqa: F401  (register fakes + autograd)
        decode_attention, flow_attention, logprob_entropy, rms_norm, rotary, swiglu, velocity_deviation,
    )
