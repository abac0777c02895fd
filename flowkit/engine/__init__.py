"""The RL engine (plain PyTorch): option groups, the actor (forward, log-probs, loss) and one RL step. LightningModules
drive it (:class:`~flowkit.modules.PolicyModule`) and supply what depends on the training strategy as callables."""

from flowkit.engine.actor import Actor, ActorOutput, KLReference
from flowkit.engine.options import AdvantageOptions, LossOptions, SamplingControls, SamplingOptions, UpdateOptions
from flowkit.engine.stats import StepStats
from flowkit.engine.step import NonFiniteStep, RLStep

__all__ = ["Actor", "ActorOutput", "AdvantageOptions", "KLReference", "LossOptions", "NonFiniteStep", "RLStep",
           "SamplingControls", "SamplingOptions", "StepStats", "UpdateOptions"]
