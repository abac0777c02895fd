"""Runs triton_interpret_cases.py in a subprocess with TRITON_INTERPRET=1 (see that file for why)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "FLOWKIT_KERNELS": "triton"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "triton_interpret_cases.py"), "-q", "-p", "no:cacheprovider",
         "-W", "ignore::DeprecationWarning"],
        cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
