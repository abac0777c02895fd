"""flowkit: flow-matching rewards for LLM reinforcement learning on PyTorch Lightning."""

from flowkit.batch import RolloutBatch

__all__ = ["RolloutBatch"]
__version__ = "0.1.0"
