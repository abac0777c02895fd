"""flowkit: flow-matching rewards for LLM reinforcement learning on PyTorch Lightning."""

__all__ = ["RolloutBatch"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `flowkit --help` (which imports this package) must not wait for torch.
    if name == "RolloutBatch":
        from flowkit.batch import RolloutBatch

        return RolloutBatch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
