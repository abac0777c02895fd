"""The RL step (plain PyTorch): option groups, the actor (forward, log-probs, loss) and the step's two phases,
:meth:`ExperienceMaker.make_experience` (prompts → :class:`Experience`) and :meth:`PolicyUpdate.train_on`
(experience, optimizer → metrics). LightningModules drive it (:class:`~flowkit.modules.PolicyModule`) and hand it
what depends on the training strategy as a :class:`StepOptimizer` object."""

from flowkit.step.actor import Actor, ActorOutput, KLReference
from flowkit.step.experience import Experience, PromptBatch, PromptSource
from flowkit.step.finite import NonFiniteStep
from flowkit.step.grading import Grader
from flowkit.step.make_experience import ExperienceMaker
from flowkit.step.optimizer import StepOptimizer, TorchOptimizer
from flowkit.step.options import AdvantageOptions, LossOptions, SamplingControls, SamplingOptions, UpdateOptions
from flowkit.step.stats import StepStats
from flowkit.step.step import RLStep
from flowkit.step.train_on import PolicyUpdate

__all__ = ["Actor", "ActorOutput", "AdvantageOptions", "Experience", "ExperienceMaker", "Grader", "KLReference",
           "LossOptions", "NonFiniteStep", "PolicyUpdate", "PromptBatch", "PromptSource", "RLStep", "SamplingControls",
           "SamplingOptions", "StepOptimizer", "StepStats", "TorchOptimizer", "UpdateOptions"]
