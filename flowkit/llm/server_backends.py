"""What ``flowkit rollout-server`` generates with (``--backend``): its own copy of the model behind one small
interface, flowkit's HF decoding loop (``hf``, the default) or vLLM's in-process engine (``vllm``).

A backend has the model's ``config`` and ``tokenizer`` (the trainer compares them with its own at connect), the
``device`` its weights live on (NCCL pushes when both sides are on GPUs), the HF model's parameter ``shapes`` by name,
the ``vocab_size`` and ``max_model_len`` (the context, None: unknown) a token-in request is checked against, and three
methods: :meth:`generate` (``n`` samples of each prompt's token ids, generated from as they are — the server
tokenizes a request's strings — each row's response token ids, sampler log-probs and the policy version each token
was sampled from, prompt-major; it asks ``held_version()`` before each decoding step, which lets a push due
meanwhile land: partial rollouts), :meth:`load` (a pushed weight stream into the model) and :meth:`held` (a weight
as the model holds it, by its pushed name, whose digest the trainer compares with what it pushed). Both backends
check every pushed weight against those names and shapes; one that is not there is logged and not loaded, and the
trainer, told how many were, reports it.
Sampling draws from the process's global generators, which the server seeds per request.

A LoRA policy pushed as an adapter (``rollout.server_lora_push: adapter``) goes through :class:`ServedAdapter`, the
same for both backends: it keeps the base weights of the channel's first push and merges each push's adapters into
them, then hands the backend the merged weights as one ordinary push.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from flowkit.llm.backbone import load_backbone, load_tokenizer, resolve_backbone_path, torch_dtype
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.vllm_engine import (
    build_llm, held_weight, load_weights_one_by_one, merge_lora, require_vllm, sample, sampling_params,
)

log = logging.getLogger(__name__)

Rows = list[tuple[list[int], list[float], list[int]]]
"""Each row's response token ids, their sampler log-probs and the policy version each was sampled from."""


class _Known:
    """The pushed weights whose name and shape the model has (:attr:`count` of them so far); the others logged."""

    def __init__(self, weights: Iterable[tuple[str, Tensor]], shapes: dict[str, torch.Size], backbone: str):
        self.weights, self.shapes, self.backbone = weights, shapes, backbone
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self.weights:
            if self.shapes.get(name) != tensor.shape:
                log.error("pushed weight %s %s is not one of %s's", name, tuple(tensor.shape), self.backbone)
                continue
            self.count += 1
            yield name, tensor


class HFServerBackend:
    """flowkit's HF decoding loop (:class:`HFRolloutEngine`) on the server's model, weights copied in place."""

    def __init__(self, backbone: str, dtype: str, device: str):
        self.backbone, self.device = backbone, torch.device(device)
        model, self.tokenizer = load_backbone(backbone, dtype)
        self.model = model.to(self.device).eval()
        self.config = self.model.config
        self.parameters = dict(self.model.named_parameters(remove_duplicate=False))  # tied: both names are pushed
        self.shapes = {name: p.shape for name, p in self.parameters.items()}
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_model_len = getattr(self.config, "max_position_embeddings", None)

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 rollout_batch_size: int | None, held_version: Callable[[], int]) -> tuple[Rows, bool]:
        """:meth:`HFRolloutEngine.generate_from_ids`, at most ``rollout_batch_size`` rows (whole groups of ``n``) per
        decoding batch. A push between two tokens lands in the model's parameters in place; the rows in flight then
        have their KV cache recomputed under the new weights (:class:`HFRolloutEngine`'s ``held_version``)."""
        engine = HFRolloutEngine(self.model, self.tokenizer, max_new_tokens, top_p=top_p)
        engine.held_version = held_version
        per_call = len(prompt_ids) if rollout_batch_size is None else max(1, rollout_batch_size // n)
        rows, nonfinite = [], False
        for start in range(0, len(prompt_ids), per_call):
            chunk = prompt_ids[start:start + per_call]
            sampled = engine.generate_from_ids(chunk, [max_new_tokens] * len(chunk), temperature, n)
            rows += zip(sampled.ids, sampled.logprobs, sampled.versions)
            nonfinite |= engine.saw_nonfinite_logits
        return rows, nonfinite

    def load(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        known = _Known(weights, self.shapes, self.backbone)
        with torch.no_grad():
            for name, tensor in known:
                self.parameters[name].copy_(tensor)
        return known.count

    def held(self, name: str) -> Tensor | None:
        """The weight the model holds under a pushed name (its digest goes back to the trainer after a push)."""
        return self.parameters.get(name)


class VllmServerBackend:
    """vLLM's in-process engine (:func:`flowkit.llm.vllm_engine.build_llm`, as the colocated engine builds it) on the
    device vLLM's platform runs on; pushed weights go through vLLM's own loader as they arrive
    (:func:`load_weights_one_by_one`: a push may fail part way). vLLM schedules its own decoding batches (a request's
    ``rollout_batch_size`` does not apply; its KV cache is sized by ``gpu_memory_utilization``, on CPU by
    ``VLLM_CPU_KVCACHE_SPACE``).

    ``tensor_parallel_size`` > 1 shards the model over that many vLLM workers (GPUs; on CPU, processes), which vLLM
    runs in processes of their own (its multiprocessing executor) while its engine core stays in this one. Pushes
    then arrive in host memory (gloo) whatever the devices: every worker is sent each weight from this process, and
    a CUDA tensor would go through the pickle whole (its bucket's storage), not out of band."""

    def __init__(self, backbone: str, dtype: str, gpu_memory_utilization: float, max_model_len: int | None,
                 tensor_parallel_size: int = 1):
        require_vllm("flowkit rollout-server --backend vllm", "use --backend hf")
        from vllm.platforms import current_platform

        self.backbone = backbone
        path = resolve_backbone_path(backbone)
        self.tokenizer = load_tokenizer(path)
        self.config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):  # the HF model's parameter table, without its weights
            skeleton = AutoModelForCausalLM.from_config(self.config)
        self.shapes = {name: p.shape for name, p in skeleton.named_parameters(remove_duplicate=False)}
        on_gpu = current_platform.is_cuda_alike()
        self.device = torch.device("cuda" if on_gpu and tensor_parallel_size == 1 else "cpu")
        self.llm = build_llm(path, torch_dtype(dtype), 0, on_gpu, gpu_memory_utilization, max_model_len,
                             tensor_parallel_size=tensor_parallel_size)
        self.vocab_size = self.config.vocab_size
        self.max_model_len = self.llm.model_config.max_model_len
        # a fresh engine's first generation is slow (once over 20 s on a loaded 2-core CPU, later ones about 1 s):
        # it runs here, before the server listens, not inside a trainer's first request and its timeout
        sample(self.llm, [[self.tokenizer.eos_token_id or 0]], 1, sampling_params(None, 1, 0.0, 1.0))

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 rollout_batch_size: int | None, held_version: Callable[[], int]) -> tuple[Rows, bool]:
        """``n`` samples of each prompt's ids, handed to vLLM as they are, its engine stepped one decoding step at a
        time (``LLM.generate``'s own loop, :func:`sample_in_steps`), so that a push lands between two steps."""
        rows = sample_in_steps(self.llm, [ids for ids in prompt_ids for _ in range(n)], held_version,
                               sampling_params(self.tokenizer.eos_token_id, max_new_tokens, temperature, top_p))
        nonfinite = not bool(torch.isfinite(torch.tensor([p for _, logprobs, _ in rows for p in logprobs])).all())
        return rows, nonfinite

    def load(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        known = _Known(weights, self.shapes, self.backbone)
        load_weights_one_by_one(self.llm, known)
        return known.count

    def held(self, name: str) -> Tensor | None:
        """The weight vLLM holds under a pushed name, whole and alike on every worker (:func:`held_weight`: a norm;
        None for one its loader fused or sharded into its own, ``qkv_proj``, ...)."""
        shape = self.shapes.get(name)
        return None if shape is None else held_weight(self.llm, name, shape)


def sample_in_steps(llm, prompt_ids: list[list[int]], held_version: Callable[[], int], params) -> Rows:
    """One sample of each prompt (token ids), vLLM's engine stepped as ``LLM.generate`` steps it, asking
    ``held_version()`` before each step. When the version changed (a push landed between two steps), the prefix cache
    is reset with the requests in flight preempted (``reset_prefix_cache(reset_running_requests=True)``, what vLLM's
    ``pause_generation(mode="keep", clear_cache=True)`` does in its async engine): vLLM recomputes their KV cache,
    prompt and tokens generated so far, under the new weights when it schedules them again, so each token is sampled,
    and its log-prob taken, as the new weights alone would."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, call = llm.llm_engine, uuid.uuid4().hex
    tokens: list[list[int]] = [[] for _ in prompt_ids]
    logprobs: list[list[float]] = [[] for _ in prompt_ids]
    versions: list[list[int]] = [[] for _ in prompt_ids]
    live: dict[str, int] = {}  # request id → its row
    request = params.clone()
    request.output_kind = RequestOutputKind.DELTA  # each step's new tokens
    for row, ids in enumerate(prompt_ids):
        engine.add_request(f"{call}-{row}", TokensPrompt(prompt_token_ids=ids), request)
        live[f"{call}-{row}"] = row
    version = held_version()
    while live:
        now = held_version()
        if now != version:
            llm.reset_prefix_cache(reset_running_requests=True)
            version = now
        for output in engine.step():
            row, sample = live[output.request_id], output.outputs[0]
            tokens[row] += sample.token_ids
            logprobs[row] += [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
            versions[row] += [version] * len(sample.token_ids)
            if output.finished:
                del live[output.request_id]
    return list(zip(tokens, logprobs, versions))


class ServedAdapter:
    """A LoRA policy pushed as an adapter: the base weights of the channel's first push, kept on the host in the
    trainer's dtype, and the latest A and B of every adapter of the pushed ``layout``
    (:func:`~flowkit.llm.vllm_engine.lora_layout`).

    Each push's tensors update what it keeps (:meth:`receive`: an adapter tensor by its layout's name and shape, any
    other by the model's); then :meth:`merged` yields every base weight with its layer's adapters merged,
    ``W = W₀ + scaling·B·A`` (:func:`~flowkit.llm.vllm_engine.merge_lora`, the trainer's own arithmetic, so the
    served weights are those of a merged push bit for bit), which the backend loads as an ordinary push. Merging on
    the server, rather than serving the adapter unmerged (peft, or vLLM's LoRA support), keeps generation as fast as
    with merged pushes and the same for both backends; the price is the host copy of the base weights.
    """

    def __init__(self, layout: dict[str, dict], shapes: dict[str, torch.Size], channel: object, backbone: str):
        self.layout, self.shapes, self.channel, self.backbone = layout, shapes, channel, backbone
        self.base: dict[str, Tensor] = {}
        self.adapters: dict[str, Tensor] = {}
        self.adapter_shapes: dict[str, torch.Size] = {}  # name of an adapter's A or B → its shape
        for layer, entry in layout.items():
            weight_shape = shapes.get(f"{layer}.weight")
            if weight_shape is None or len(weight_shape) != 2:
                continue  # its tensors are then unknown names, logged as they arrive
            out_features, in_features = reversed(weight_shape) if entry["fan_in_fan_out"] else weight_shape
            for adapter, spec in entry["adapters"].items():
                self.adapter_shapes[f"{layer}.lora_A.{adapter}.weight"] = torch.Size([spec["r"], in_features])
                self.adapter_shapes[f"{layer}.lora_B.{adapter}.weight"] = torch.Size([out_features, spec["r"]])

    def receive(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Keep a push's tensors (copied to the host); returns how many were known by name and shape."""
        count = 0
        for name, tensor in weights:
            adapter = name in self.adapter_shapes
            if (self.adapter_shapes if adapter else self.shapes).get(name) != tensor.shape:
                log.error("pushed tensor %s %s is neither one of %s's weights nor an adapter of its layout", name,
                          tuple(tensor.shape), self.backbone)
                continue
            (self.adapters if adapter else self.base)[name] = tensor.to("cpu", copy=True)
            count += 1
        return count

    def missing(self) -> list[str]:
        """The adapter tensors of the layout not received yet (nothing is merged while there are any)."""
        return [name for name in self.adapter_shapes if name not in self.adapters]

    def merged(self, device: torch.device) -> Iterator[tuple[str, Tensor]]:
        """Every base weight, those of the layout's layers with their adapters merged (computed on ``device``)."""
        for name, weight in self.base.items():
            entry = self.layout.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            if entry:
                layer, weight = name.removesuffix(".weight"), weight.to(device)
                for adapter, spec in entry["adapters"].items():
                    weight = merge_lora(weight, self.adapters[f"{layer}.lora_A.{adapter}.weight"].to(device),
                                        self.adapters[f"{layer}.lora_B.{adapter}.weight"].to(device),
                                        spec["scaling"], entry["fan_in_fan_out"])
            yield name, weight
