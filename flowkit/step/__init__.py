"""The RL engine (plain PyTorch): option groups, the actor (forward, log-probs, loss) and one RL step. LightningModules
drive it (:class:`~flowkit.modules.PolicyModule`) and supply what depends on the training strategy as callables."""

from flowkit.step.actor import Actor, ActorOutput, KLReference
from flowkit.step.options import AdvantageOptions, LossOptions, SamplingControls, SamplingOptions, UpdateOptions
from flowkit.step.stats import StepStats
from flowkit.step.step import NonFiniteStep, RLStep

__all__ = ["Actor", "ActorOutput", "AdvantageOptions", "KLReference", "LossOptions", "NonFiniteStep", "RLStep",
           "SamplingControls", "SamplingOptions", "StepStats", "UpdateOptions"]
