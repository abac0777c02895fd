import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(BUILD / "torch_extensions"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(BUILD / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(BUILD / "triton"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2`: each worker (and every job it launches) gets one intra-op thread, so the workers do not
    # oversubscribe the cores (two 2-thread processes on 2 cores run tiny ops 10-40x slower).
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def single_thread():
    """One intra-op thread for tests on tiny tensors: faster than two threads fighting over loaded CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
