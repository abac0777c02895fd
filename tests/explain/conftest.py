import pytest
import torch

from flowkit.explain.gridworld import DECISIONS
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:=?+-[]!\n"


@pytest.fixture(autouse=True)
def _tiny_tensors_use_one_thread(single_thread):
    """Every explain test runs with the root conftest's ``single_thread``."""


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
