"""The rollout engines registered by name (``PolicyModule.rollout.engine``) and their options.

Adding an engine is one file with a class that satisfies :class:`~flowkit.llm.rollout_engine.RolloutEngine` and a
builder ``fn(setup: EngineSetup) -> RolloutEngine``, plus its line in :data:`ROLLOUT_ENGINES`
(:mod:`flowkit.llm.rollout_engine` is the contract; this file imports every engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowkit.errors import ConfigError
from flowkit.llm.backbone import resolve_backbone_path
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.rollout_engine import EngineSetup, EngineSpec
from flowkit.llm.server_engine import LoraPush, build_server_engine, server_urls
from flowkit.llm.vllm_engine import VllmRolloutEngine, require_vllm
from flowkit.options import OptionGroup, bounded, registered


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
    server_token_file: str | None = None
    """the file holding the servers' secret (the server's ``--token-file``, or the file it generated and printed),
    sent with every request; null: the ``FLOWKIT_SERVER_TOKEN`` environment variable, else none (a server started
    with ``--insecure-no-auth``)"""
    server_timeout: float = bounded(300.0, 0, 7 * 24 * 3600, open_low=True)
    """seconds any wait on the server may take (a request, a weight push, prefetched rollouts), at most a week
    (604800; a socket's timeout overflows far beyond); past it, or when the server is down, restarted or serves
    another model, the run stops with one line naming the address"""
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
    the server generates the rollouts of steps t+1 … t+k from the weights it holds (with ``episodes``: their
    episodes run meanwhile, each turn on the servers); rollouts more than k versions behind are regenerated (``rollout/regenerated_rows``), the staleness is logged (``rollout/staleness_mean|max``
    and the fraction of rows s behind, ``rollout/staleness_<s>``). The flow reward reads the latents of the
    trainer's own forward, so only the sampling distribution goes stale (``loss.rollout_correction`` weighs it).
    0: each step generates its own rollouts when it starts"""
    partial_rollouts: bool = False
    """(``server``) a weight push lands between two tokens of the generation in flight instead of waiting for it to
    end: the rows in flight go on from the new weights at their next token (their KV cache recomputed), every token
    carries the policy version that sampled it (staleness logged per token, ``rollout/token_staleness_mean``, and
    per row, by its oldest token), ``max_staleness`` bounds a row's oldest token and ``loss.rollout_correction``
    weighs each token by the sampler's own log-prob of it (docs/guides/rollout-engines.md)"""

    def check_rules(self, owner: str) -> None:
        """The ``server`` engine's addresses (:func:`~flowkit.llm.server_engine.server_urls`)."""
        if self.engine == "server":
            server_urls(self.server_url, owner)
        elif self.partial_rollouts:
            raise ConfigError(f"{owner}.partial_rollouts lands weight pushes mid-generation on rollout servers and "
                              f"needs {owner}.engine: server, got {self.engine!r}")

    def check_group_size(self, owner: str, num_samples: int) -> None:
        """:meth:`check`, and a decoding batch holds whole groups of ``num_samples``."""
        self.check(owner)
        if self.batch_size is not None and self.batch_size % num_samples:
            raise ConfigError(f"{owner}.batch_size must be a positive multiple of sampling.num_samples ({num_samples}) "
                              f"(or null), got {self.batch_size}")


# Saved in the hyper-parameters of a checkpoint, which Lightning and flowkit load with weights_only.
torch.serialization.add_safe_globals([RolloutOptions])
