"""A stand-in for a policy where a test binds a reward model without loading one: only its ``config`` is read."""

from types import SimpleNamespace


def backbone_stub(hidden_size: int, rms_norm_eps: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size, rms_norm_eps=rms_norm_eps))
