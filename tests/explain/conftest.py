import importlib.util
import sys
import types

import pytest
import torch

from flowkit.explain.gridworld import DECISIONS
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:=?+-[]!\n"


@pytest.fixture(autouse=True)
def flow_attention_op(monkeypatch):
    """Local stand-in until ``flowkit.kernels.flow_token_attention`` lands: the kernels' own reference."""
    try:
        from flowkit.kernels import flow_token_attention  # noqa: F401
    except ImportError:
        path = "flowkit/kernels/reference/flow_attention.py"
        spec = importlib.util.spec_from_file_location("_flow_attention_reference", path)
        reference = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reference)
        standin = types.ModuleType("flowkit.kernels")
        standin.flow_token_attention = reference.flow_token_attention
        monkeypatch.setitem(sys.modules, "flowkit.kernels", standin)


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer(ALPHABET)


@pytest.fixture(scope="session")
def backbone(tokenizer):
    torch.manual_seed(0)
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128)
    model.config._attn_implementation = "eager"
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def decisions():
    return list(DECISIONS)
