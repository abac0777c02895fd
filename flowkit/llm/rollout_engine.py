"""The rollout-engine contract: what an engine is (:class:`RolloutEngine`, :class:`PrefetchingEngine`), what its
builder gets (:class:`EngineSetup`) and how it is registered (:class:`EngineSpec`); the registry of engines by name,
which imports every engine, and their options are :mod:`flowkit.llm.engines`.

An engine samples ``n`` responses per prompt into a :class:`~flowkit.batch.RolloutBatch` (rows prompt-major), with
its sampler's per-token log-probs (``rollout_logprobs``) and the policy version whose weights produced each row
(``policy_versions``); it learns of new weights through :meth:`RolloutEngine.sync_weights` after each optimizer step,
and releases what it holds in :meth:`RolloutEngine.close`. Sleeping and waking (vLLM on a GPU) happen inside
``generate``: an engine frees its memory between generations when it can.

An engine that generates apart from training also satisfies :class:`PrefetchingEngine` (``rollout.max_staleness``
needs one): the policy module keeps later steps' rollouts in flight through it, or later steps' episodes through the
episode rollout over it (both a :class:`Prefetcher`, :func:`prefetch_ahead`), and logs :func:`rollout_metrics`.

An engine that takes token ids also satisfies :class:`TokenInEngine` (every built-in one: ``hf``, ``vllm``,
``server``): :meth:`TokenInEngine.generate_from_ids` samples one continuation of each prompt's ids and returns the ids
it sampled as they are (:class:`TokenRollouts`), so a multi-turn episode (:mod:`flowkit.agents`) appends the policy's
own tokens and never decodes and encodes them again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from flowkit.batch import RolloutBatch
from flowkit.errors import ConfigError
from flowkit.options import OptionGroup


@runtime_checkable
class RolloutEngine(Protocol):
    """What :class:`flowkit.step.RLStep` and the policy module need of a rollout engine."""

    tokenizer: Any  # the policy's tokenizer, which the engine encodes prompts and decodes responses with
    saw_nonfinite_logits: bool  # after generate: a next-token score was NaN or inf (the step is skipped or fails)
    policy_version: int  # the optimizer steps behind the weights it samples from

    def generate(self, prompts: list[str], n: int = 1, answers: list[str] | None = None,
                 temperature: float | None = None) -> RolloutBatch:
        """``n`` samples per prompt (prompt i → rows i·n … i·n+n−1), ``rollout_logprobs`` and ``policy_versions``
        filled; ``temperature`` None: the engine's own, 0: greedy."""

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """``model``'s weights are those of policy version ``version`` (optimizer steps so far): sample from them
        from the next generation on."""

    def close(self) -> None:
        """Release the engine's processes and memory; it is not used afterwards."""


class Prefetcher(Protocol):
    """What :func:`prefetch_ahead` keeps ahead of training: a :class:`PrefetchingEngine` (its prompts a list of
    strings) or the episodes of :class:`flowkit.step.episodes.EpisodeRollout` (a step's whole prompt batch, the
    records its environment starts from). It starts later steps' rollouts now (:meth:`prefetch`, run in order) and a
    later generation of the same prompts takes them when at most ``max_staleness`` versions behind, else generates
    them again."""

    max_staleness: int

    def prefetch(self, prompts: Any, n: int) -> None:
        """Start generating these prompts' rollouts, behind the ones already asked for."""

    def prefetched(self, prompts: Any, n: int) -> bool:
        """Whether these prompts' rollouts were prefetched and not taken yet."""


@runtime_checkable
class PrefetchingEngine(RolloutEngine, Protocol):
    """An engine that generates apart from training (``server``), which ``rollout.max_staleness`` ≥ 1 needs: a
    :class:`Prefetcher` of prompt strings (whose :meth:`RolloutEngine.generate` takes the prefetched rollouts), and
    the count of rows regenerated for being more than ``max_staleness`` versions behind (``regenerated_rows``)."""

    max_staleness: int
    regenerated_rows: int

    def prefetch(self, prompts: list[str], n: int, temperature: float | None = None) -> None:
        """Start generating these prompts' rollouts, behind the requests already made."""

    def prefetched(self, prompts: list[str], n: int, temperature: float | None = None) -> bool:
        """Whether these prompts' rollouts were prefetched and not taken yet."""


class TokenRollouts(NamedTuple):
    """What :meth:`TokenInEngine.generate_from_ids` returns, one entry per prompt in order: the ids sampled (through
    the EOS that ended the row, or cut at the row's ``max_new_tokens``), each one's log-probability under the sampler
    (after temperature and top-p, as ``rollout_logprobs``), and the policy version whose weights sampled each one (per
    token: a ``server`` engine's push may land between two tokens of a row, ``rollout.partial_rollouts``)."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]


@runtime_checkable
class TokenInEngine(RolloutEngine, Protocol):
    """An engine with a token-in/token-out path, which the episode runner generates each turn with
    (:func:`flowkit.agents.engine_generate`)."""

    # each call is a collective (hf under ZeRO-3): every rank calls it together, with no prompts if need be
    lockstep: bool

    def generate_from_ids(self, prompts: list[list[int]], max_new_tokens: list[int],
                          temperature: float | None = None) -> TokenRollouts:
        """One sample per prompt (token ids, none empty), row i at most ``max_new_tokens[i]`` ≥ 1 tokens and at most
        the engine's own bound; ``temperature`` as :meth:`RolloutEngine.generate`'s. The ids are the sampled ones,
        never re-tokenized; :attr:`RolloutEngine.saw_nonfinite_logits` as after ``generate``. Each call samples
        from the weights the engine holds when it runs (the ``server`` engine's: those it last pushed, or later ones
        under ``rollout.partial_rollouts``); the ``server`` engine's may run in a thread of its own while the step
        trains (a later step's episodes, :class:`flowkit.step.episodes.EpisodeRollout`)."""


def check_token_in(engine: RolloutEngine, owner: str = "PolicyModule.rollout") -> TokenInEngine:
    """``engine`` if multi-turn episodes can run on it, else one :class:`ConfigError` line (raised before any
    episode runs): it has no token-in path."""
    if not isinstance(engine, TokenInEngine):
        raise ConfigError(f"{owner}.engine: {type(engine).__name__} has no token-in path (generate_from_ids), which "
                          "episodes need; use engine hf, vllm or server")
    return engine


def prefetch_ahead(engine: Prefetcher, prompts_of: Callable[[int], Any], index: int, n: int,
                   steps_after: int) -> None:
    """At the start of the step that trains batch ``index``: keep the rollouts of batches ``index`` … ``index + k``
    in flight (k = ``engine.max_staleness``, at most the ``steps_after`` steps left after this one), so that while a
    step trains, the next k steps' rollouts are generated and a row is at most k versions behind. ``prompts_of(i)``
    is batch i's prompts as ``engine`` takes them (a :class:`~flowkit.modules.datamodule.PromptStream` batch is a pure
    function of its index). The requests run in order: a step whose own batch was not prefetched (the first, or the
    first resumed) asks for it first, and no step's prompts are generated twice for training."""
    depth = min(engine.max_staleness, steps_after)
    for upcoming in range(index, index + depth + 1) if depth > 0 else ():
        prompts = prompts_of(upcoming)
        if not engine.prefetched(prompts, n):
            engine.prefetch(prompts, n)


def rollout_metrics(engine: RolloutEngine, batch: RolloutBatch, max_staleness: int) -> dict[str, torch.Tensor | float]:
    """How many policy versions behind the weights this step trains (``engine.policy_version``) the rows were
    sampled, ``batch``'s ``policy_versions`` per token (B×S, an :class:`~flowkit.step.Experience`'s). Per row, by its
    oldest token (what ``max_staleness`` bounds): ``rollout/staleness_mean|max`` and the fraction of rows s behind,
    ``rollout/staleness_<s>`` for s = 0 … max(``max_staleness``, the largest); per response token,
    ``rollout/token_staleness_mean``; the fraction of rows whose tokens came from more than one version (partial
    rollouts), ``rollout/mixed_rows``. For a :class:`PrefetchingEngine`, the rows regenerated so far for being more
    than ``max_staleness`` behind (``rollout/regenerated_rows``)."""
    if batch.policy_versions is None:
        return {}
    versions, real = batch.policy_versions, batch.attention_mask.bool()
    oldest = torch.where(real, versions, torch.iinfo(versions.dtype).max).amin(-1)
    newest = torch.where(real, versions, torch.iinfo(versions.dtype).min).amax(-1)
    staleness = (engine.policy_version - oldest).float()
    response = batch.response_mask
    token_staleness = ((engine.policy_version - versions) * response).sum() / response.sum().clamp(min=1)
    metrics: dict[str, torch.Tensor | float] = {"rollout/staleness_mean": staleness.mean(),
                                                "rollout/staleness_max": staleness.max(),
                                                "rollout/token_staleness_mean": token_staleness,
                                                "rollout/mixed_rows": (newest > oldest).float().mean()}
    for behind in range(max(max_staleness, int(staleness.max())) + 1):
        metrics[f"rollout/staleness_{behind}"] = (staleness == behind).float().mean()
    if isinstance(engine, PrefetchingEngine):
        metrics["rollout/regenerated_rows"] = float(engine.regenerated_rows)
    return metrics


@dataclass(frozen=True)
class EngineSetup:
    """What a builder gets: the policy and its tokenizer, the backbone's path (an engine that loads its own copy
    builds the architecture from it), the sampling options, the rollout options (an engine's own settings, e.g.
    ``vllm_max_model_len``: a :class:`~flowkit.llm.engines.RolloutOptions`, typed by its base here because that group
    names the registry, which imports every engine), and ``whole_weights``: a context in which the policy's weights are whole and its
    forwards run no collective (ZeRO-3), for engines that run the policy in this process."""

    policy: torch.nn.Module
    tokenizer: Any
    backbone: str
    max_new_tokens: int
    temperature: float
    top_p: float
    options: OptionGroup
    whole_weights: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """An engine's builder and the check of its prerequisites (an installed package), which runs before the backbone
    loads so that a missing one is a one-line error before any work."""

    build: Callable[[EngineSetup], RolloutEngine]
    check: Callable[[], None] = lambda: None
