"""Triton implementations (``torch.ops.flowkit_triton``); imported lazily, only when Triton is selected.

On CPU they run only under ``TRITON_INTERPRET=1`` (set before Triton is imported), which the tests use.
"""
