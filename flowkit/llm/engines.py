"""The rollout-engine contract, the engines registered by name (``PolicyModule.rollout.engine``) and their options.

An engine samples ``n`` responses per prompt into a :class:`~flowkit.batch.RolloutBatch` (rows prompt-major), with
its sampler's per-token log-probs (``rollout_logprobs``) and the policy version whose weights produced each row
(``policy_versions``); it learns of new weights through :meth:`RolloutEngine.sync_weights` after each optimizer step,
and releases what it holds in :meth:`RolloutEngine.close`. Sleeping and waking (vLLM on a GPU) happen inside
``generate``: an engine frees its memory between generations when it can.

Adding an engine is one file with a class that satisfies :class:`RolloutEngine` and a builder
``fn(setup: EngineSetup) -> RolloutEngine``, plus its line in :data:`ROLLOUT_ENGINES`. An engine that generates
apart from training also satisfies :class:`PrefetchingEngine` (``rollout.max_staleness`` needs one): the policy
module keeps later steps' rollouts in flight through it (:func:`prefetch_ahead`) and logs :func:`rollout_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from flowkit.batch import RolloutBatch
from flowkit.errors import ConfigError
from flowkit.llm.backbone import resolve_backbone_path
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.server_engine import LoraPush, build_server_engine, server_urls
from flowkit.llm.vllm_engine import VllmRolloutEngine, require_vllm
from flowkit.options import OptionGroup, bounded, registered


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


@runtime_checkable
class PrefetchingEngine(RolloutEngine, Protocol):
    """An engine that generates apart from training (``server``), which ``rollout.max_staleness`` ≥ 1 needs: it starts
    later steps' rollouts now (:meth:`prefetch`, run in order) from the weights it holds, and a later
    :meth:`generate` of the same prompts takes them when at most ``max_staleness`` versions behind, else regenerates
    them (counted in ``regenerated_rows``)."""

    max_staleness: int
    regenerated_rows: int

    def prefetch(self, prompts: list[str], n: int, temperature: float | None = None) -> None:
        """Start generating these prompts' rollouts, behind the requests already made."""

    def prefetched(self, prompts: list[str], n: int, temperature: float | None = None) -> bool:
        """Whether these prompts' rollouts were prefetched and not taken yet."""


def prefetch_ahead(engine: PrefetchingEngine, prompts_of: Callable[[int], list[str]], index: int, n: int,
                   steps_after: int) -> None:
    """At the start of the step that trains batch ``index``: keep the rollouts of batches ``index`` … ``index + k``
    in flight (k = ``engine.max_staleness``, at most the ``steps_after`` steps left after this one), so that while a
    step trains, the next k steps' rollouts are generated and a row is at most k versions behind. ``prompts_of(i)``
    is batch i's prompts (a :class:`~flowkit.modules.datamodule.PromptStream` batch is a pure function of its
    index). The requests run in order: a step whose own batch was not prefetched (the first, or the first resumed)
    asks for it first, and no step's prompts are generated twice for training."""
    depth = min(engine.max_staleness, steps_after)
    for upcoming in range(index, index + depth + 1) if depth > 0 else ():
        prompts = prompts_of(upcoming)
        if not engine.prefetched(prompts, n):
            engine.prefetch(prompts, n)


def rollout_metrics(engine: RolloutEngine, batch: RolloutBatch, max_staleness: int) -> dict[str, torch.Tensor | float]:
    """How many policy versions behind the weights this step trains (``engine.policy_version``) the rows were
    sampled: ``rollout/staleness_mean|max`` and the fraction of rows s behind, ``rollout/staleness_<s>`` for
    s = 0 … max(``max_staleness``, the largest); for a :class:`PrefetchingEngine`, the rows regenerated so far for
    being more than ``max_staleness`` behind (``rollout/regenerated_rows``)."""
    if batch.policy_versions is None:
        return {}
    staleness = (engine.policy_version - batch.policy_versions).float()
    metrics: dict[str, torch.Tensor | float] = {"rollout/staleness_mean": staleness.mean(),
                                                "rollout/staleness_max": staleness.max()}
    for behind in range(max(max_staleness, int(staleness.max())) + 1):
        metrics[f"rollout/staleness_{behind}"] = (staleness == behind).float().mean()
    if isinstance(engine, PrefetchingEngine):
        metrics["rollout/regenerated_rows"] = float(engine.regenerated_rows)
    return metrics


@dataclass(frozen=True)
class EngineSetup:
    """What a builder gets: the policy and its tokenizer, the backbone's path (an engine that loads its own copy
    builds the architecture from it), the sampling options, the rollout options (an engine's own settings, e.g.
    ``vllm_max_model_len``), and ``whole_weights``: a context in which the policy's weights are whole and its
    forwards run no collective (ZeRO-3), for engines that run the policy in this process."""

    policy: torch.nn.Module
    tokenizer: Any
    backbone: str
    max_new_tokens: int
    temperature: float
    top_p: float
    options: RolloutOptions
    whole_weights: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """An engine's builder and the check of its prerequisites (an installed package), which runs before the backbone
    loads so that a missing one is a one-line error before any work."""

    build: Callable[[EngineSetup], RolloutEngine]
    check: Callable[[], None] = lambda: None


def _hf(setup: EngineSetup) -> HFRolloutEngine:
    return HFRolloutEngine(setup.policy, setup.tokenizer, setup.max_new_tokens, setup.temperature, setup.top_p,
                           setup.options.batch_size, whole_weights=setup.whole_weights)


def _vllm(setup: EngineSetup) -> VllmRolloutEngine:
    options = setup.options
    return VllmRolloutEngine(setup.policy, setup.tokenizer, resolve_backbone_path(setup.backbone), setup.max_new_tokens,
                             setup.temperature, setup.top_p, options.vllm_gpu_memory_utilization,
                             options.vllm_max_model_len, options.vllm_enable_sleep_mode)


ROLLOUT_ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(_hf),
    "vllm": EngineSpec(_vllm, require_vllm),
    "server": EngineSpec(build_server_engine),
}


@dataclass(frozen=True)
class RolloutOptions(OptionGroup):
    """Which engine generates the rollouts, and its own settings."""

    engine: str = registered("hf", ROLLOUT_ENGINES)
    """a name of :data:`ROLLOUT_ENGINES`: ``hf`` (flowkit's decoding loop over the policy itself), ``vllm`` (a vLLM
    engine colocated in this process, one per rank, ``pip install flowkit[vllm]``, into which the policy's weights are
    synced after every training step: LoRA merged, ZeRO-3 gathered) or ``server`` (generation in a ``flowkit
    rollout-server`` process on its own devices, ``server_*`` below), or another one added to it (``module.name``:
    the one ``name`` that importing ``module`` adds). Each returns its sampler's log-probs for
    ``loss.rollout_correction``"""
    batch_size: int | None = bounded(None, 1)
    """sequences per decoding batch of ``hf`` and ``server`` (a multiple of ``sampling.num_samples``; bounds the KV
    cache; vLLM schedules its own batches); null: the whole batch in one call"""
    vllm_gpu_memory_utilization: float = bounded(0.3, 0, 1, open_low=True)
    """share of the GPU vLLM may take for its weights and KV cache (CPU: the KV cache is ``VLLM_CPU_KVCACHE_SPACE``
    GiB instead)"""
    vllm_max_model_len: int | None = bounded(None, 1)
    """longest prompt + response vLLM sizes its KV cache for; null: the model's maximum"""
    vllm_enable_sleep_mode: bool = True
    """on GPU, vLLM releases its memory while the trainer trains (weights offloaded to CPU, KV cache freed) and takes
    it back to generate; vLLM's CPU backend has no sleep mode"""
    server_url: str | list[str] | None = None
    """the ``server`` engine's address, where ``flowkit rollout-server`` listens (e.g. ``http://10.0.0.5:8000``), or
    a list of servers' addresses, over which generation is data parallel: with W trainer ranks and S servers, rank r
    generates on the servers s with s mod W = r if S > W (its prompts split into contiguous slices of whole prompts,
    one request per server at once), else on server r mod S; every server gets every push, server s from rank
    s mod W (:mod:`flowkit.llm.server_engine`). The weights are pushed over torch.distributed (gloo on CPU, NCCL on
    GPU)"""
    server_timeout: float = bounded(300.0, 0, open_low=True)
    """seconds any wait on the server may take (a request, a weight push, prefetched rollouts); past it, or when the
    server is down, restarted or serves another model, the run stops with one line naming the address"""
    server_sync_every: int = bounded(1, 1)
    """push the weights to the server every this many optimizer steps (1: each); rollouts in between come from
    weights up to that many versions old"""
    server_bucket_mb: int = bounded(256, 1)
    """a weight push moves the weights in buckets of this size (ZeRO-3: gathered one weight at a time), which bounds
    its memory"""
    server_lora_push: LoraPush = "merged"
    """how a LoRA policy's weights reach the server: ``merged`` (every weight, adapters merged, at each push) or
    ``adapter`` (needs ``lora``): the first push over a channel sends the base weights and the LoRA layout (per layer
    the rank and scaling), every later one only the adapters' A and B (and any weight that trains outside them), and
    the server merges W₀ + scaling·B·A into its own weights and generates from them as with ``merged``; its host
    keeps a copy of the base weights in the trainer's dtype"""
    max_staleness: int = bounded(0, 0)
    """k ≥ 1 overlaps generation with training (an engine that generates elsewhere: ``server``): while step t trains,
    the server generates the rollouts of steps t+1 … t+k from the weights it holds; rollouts more than k versions
    behind are regenerated (``rollout/regenerated_rows``), the staleness is logged (``rollout/staleness_mean|max``
    and the fraction of rows s behind, ``rollout/staleness_<s>``). The flow reward reads the latents of the
    trainer's own forward, so only the sampling distribution goes stale (``loss.rollout_correction`` weighs it).
    0: each step generates its own rollouts when it starts"""

    def check_rules(self, owner: str) -> None:
        """The ``server`` engine's addresses (:func:`~flowkit.llm.server_engine.server_urls`)."""
        if self.engine == "server":
            server_urls(self.server_url, owner)

    def check_group_size(self, owner: str, num_samples: int) -> None:
        """:meth:`check`, and a decoding batch holds whole groups of ``num_samples``."""
        self.check(owner)
        if self.batch_size is not None and self.batch_size % num_samples:
            raise ConfigError(f"{owner}.batch_size must be a positive multiple of sampling.num_samples ({num_samples}) "
                              f"(or null), got {self.batch_size}")


# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([RolloutOptions])
