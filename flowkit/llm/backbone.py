"""Load a causal LM + tokenizer from a hub id, a local directory or a bundled tiny model."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.tokenization_utils_tokenizers import TokenizersBackend
from transformers.utils import logging as hf_logging

from flowkit.errors import ConfigError
from flowkit.kernels.cpu_linear import use_onednn_linears
from flowkit.llm.fused_layers import use_fused_layers
from flowkit.llm.sdpa import use_flowkit_sdpa

ASSETS = Path(__file__).resolve().parent.parent / "assets"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


# Files that hold a tokenizer's vocabulary; a local model directory without any loads an empty tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Weights in torch's pickle format, which flowkit never loads (unpickling a file can run its code).
_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth")


class BackboneError(ValueError):
    """A model path or hub id that cannot be loaded as a causal LM (one-line message)."""


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def resolve_backbone_path(name_or_path: str) -> str:
    """``bundled:NAME`` → the packaged model under ``flowkit/assets/NAME``; anything else unchanged."""
    if name_or_path.startswith("bundled:"):
        path = ASSETS / name_or_path.removeprefix("bundled:")
        if not path.is_dir():
            available = sorted(p.name for p in ASSETS.iterdir() if p.is_dir()) if ASSETS.is_dir() else []
            raise BackboneError(f"no bundled model {name_or_path!r}; available: {available}")
        return str(path)
    return name_or_path


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(sorted(_DTYPES))}, got {name!r}")
    return _DTYPES[name]


def load_backbone(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` with ``from_pretrained``; errors are one line naming the path.

    A local path that does not exist fails before any hub lookup, so a typo never turns into a
    download attempt. A bad ``dtype`` is a :class:`~flowkit.errors.ConfigError`, found before anything loads;
    a config that is not a causal LM's, weights that do not load (e.g. a truncated file), weights only in pickle
    format (``pytorch_model.bin``: only safetensors are loaded, a pickle is never opened) and a local directory
    without tokenizer files are each a :class:`BackboneError`. The model's linear layers run float32 CPU inputs
    through oneDNN (:mod:`flowkit.kernels.cpu_linear`), a Llama-family model's RMSNorms and MLP gates through
    flowkit's fused kernels (:mod:`flowkit.llm.fused_layers`), and ``sdpa`` attention's short masked float32 calls
    on CPU without copies of the KV heads (:mod:`flowkit.llm.sdpa`).
    """
    torch_dtype(dtype)
    path = resolve_backbone_path(name_or_path)
    looks_local = path.startswith((".", "/", "~")) or Path(path).expanduser().exists()
    if looks_local and Path(path).expanduser().is_file():
        raise BackboneError(f"model path {path!r} is a file; give the model's directory (config, weights, tokenizer)")
    if looks_local and not Path(path).expanduser().is_dir():
        raise BackboneError(f"model path {path!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # HF raises OSError/ValueError/EnvironmentError variants
        raise BackboneError(f"cannot load a model config from {path!r}: {_first_line(err)}") from None
    remote_causal_lm = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote_causal_lm:
        raise BackboneError(f"{path!r} is not a causal LM (config type {config.model_type!r})")
    if looks_local and not any((Path(path).expanduser() / name).is_file() for name in _TOKENIZER_FILES):
        raise BackboneError(f"model directory {path!r} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")
    if looks_local:
        _check_safetensors_weights(Path(path).expanduser())
    try:
        with _weights_bar_only_on_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code, use_safetensors=True
            )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # e.g. truncated or mismatched weights
        raise BackboneError(f"cannot load the weights of {path!r}: {_first_line(err)}") from None
    use_onednn_linears(model)
    use_fused_layers(model)
    use_flowkit_sdpa(model)
    return model, load_tokenizer(path, trust_remote_code)


def _check_safetensors_weights(directory: Path) -> None:
    """A model directory whose weights are only pickles: say what to do instead of failing in ``from_pretrained``."""
    if any(directory.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pattern in _PICKLE_WEIGHTS for p in directory.glob(pattern))
    if pickles:
        raise BackboneError(
            f"model directory {str(directory)!r} holds its weights as pickle ({', '.join(pickles[:3])}), which flowkit "
            "never loads (unpickling can run code); convert them to safetensors where you trust the file: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR) writes model.safetensors")


@contextlib.contextmanager
def _weights_bar_only_on_a_terminal() -> Iterator[None]:
    """transformers' "Loading weights" bar, redrawn in place on a terminal, is a stack of lines in a redirected log."""
    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path``, padding with its EOS token if it names no padding token of its own.

    A tokenizer saved as a plain ``TokenizersBackend`` (the tiny char/word tokenizers) is loaded as saved:
    ``AutoTokenizer`` would swap in the architecture's own class (``Qwen2Tokenizer``), whose byte-level
    pipeline does not match the saved one (it drops spaces, for instance).
    """
    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") == "TokenizersBackend":
        tokenizer = TokenizersBackend.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The list of transformer blocks of a HF causal LM (Llama/Qwen/Mistral style ``model.model.layers``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, base.base_model_prefix, base)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise BackboneError(f"{type(base).__name__} has no `.{base.base_model_prefix}.layers`; cannot tap latents")
    return layers
