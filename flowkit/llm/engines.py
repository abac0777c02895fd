"""The rollout-engine contract and the engines registered by name (``PolicyModule.rollout_engine``).

An engine samples ``n`` responses per prompt into a :class:`~flowkit.batch.RolloutBatch` (rows prompt-major), with
its sampler's per-token log-probs (``rollout_logprobs``) and the policy version whose weights produced each row
(``policy_versions``); it learns of new weights through :meth:`RolloutEngine.sync_weights` after each optimizer step,
and releases what it holds in :meth:`RolloutEngine.close`. Sleeping and waking (vLLM on a GPU) happen inside
``generate``: an engine frees its memory between generations when it can.

Adding an engine is one file with a class that satisfies :class:`RolloutEngine` and a builder
``fn(setup: EngineSetup) -> RolloutEngine``, plus its line in :data:`ROLLOUT_ENGINES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from flowkit.batch import RolloutBatch
from flowkit.llm.backbone import resolve_backbone_path
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.server_engine import build_server_engine
from flowkit.llm.vllm_engine import VllmRolloutEngine, require_vllm


@runtime_checkable
class RolloutEngine(Protocol):
    """What :class:`flowkit.engine.RLStep` and the policy module need of a rollout engine."""

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


@dataclass(frozen=True)
class EngineSetup:
    """What a builder gets: the policy and its tokenizer, the backbone's path (an engine that loads its own copy
    builds the architecture from it), the sampling options, the module's hyper-parameters (an engine's own
    settings, e.g. ``vllm_max_model_len``), and ``whole_weights``: a context in which the policy's weights are whole
    and its forwards run no collective (ZeRO-3), for engines that run the policy in this process."""

    policy: torch.nn.Module
    tokenizer: Any
    backbone: str
    max_new_tokens: int
    temperature: float
    top_p: float
    hparams: Mapping[str, Any]
    whole_weights: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """An engine's builder and the check of its prerequisites (an installed package), which runs before the backbone
    loads so that a missing one is a one-line error before any work."""

    build: Callable[[EngineSetup], RolloutEngine]
    check: Callable[[], None] = lambda: None


def _hf(setup: EngineSetup) -> HFRolloutEngine:
    return HFRolloutEngine(setup.policy, setup.tokenizer, setup.max_new_tokens, setup.temperature, setup.top_p,
                           setup.hparams["rollout_batch_size"], whole_weights=setup.whole_weights)


def _vllm(setup: EngineSetup) -> VllmRolloutEngine:
    hp = setup.hparams
    return VllmRolloutEngine(setup.policy, setup.tokenizer, resolve_backbone_path(setup.backbone), setup.max_new_tokens,
                             setup.temperature, setup.top_p, hp["vllm_gpu_memory_utilization"],
                             hp["vllm_max_model_len"], hp["vllm_enable_sleep_mode"])


ROLLOUT_ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(_hf),
    "vllm": EngineSpec(_vllm, require_vllm),
    "server": EngineSpec(build_server_engine),
}
