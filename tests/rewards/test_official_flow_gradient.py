"""The official RLFR online update under the official pins (transformers 4.50,
``--gradient_checkpointing_use_reentrant``) gives the flow no gradient: the reason ``FlowReward(protocol="official")`` freezes the flow (docs/methods/rlfr.md).
Run in a venv with those pins (``scripts/official_flow_gradient.py``); skipped under flowkit's own transformers."""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("4.50."):
    pytest.skip(f"needs the official pin transformers 4.50 (installed: {transformers.__version__})",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from official_flow_gradient import flow_gradient  # noqa: E402


def test_the_official_reentrant_checkpointing_leaves_the_flow_loss_without_a_graph():
    official = flow_gradient(use_reentrant=True)
    assert not official["flow loss has a graph"] and official["flow loss is a leaf"]
    assert official["flow gradient"] is None


def test_without_reentrant_checkpointing_the_same_hook_trains_the_flow():
    control = flow_gradient(use_reentrant=False)
    assert control["flow loss has a graph"] and control["flow gradient"] > 0
