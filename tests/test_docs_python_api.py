"""The Python-API example of docs/guides/extending.md runs as written, as a script in a fresh directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_python_api_example_of_the_extending_guide_runs(tmp_path):
    guide = (ROOT / "docs" / "guides" / "extending.md").read_text()
    block = re.search(r"```python\n(# fit_tiny\.py.*?)```", guide, re.S).group(1)
    (tmp_path / "fit_tiny.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "fit_tiny.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fit summary: 4 steps (0 → 4)" in result.stdout
    pass_at_1 = float(re.search(r"^pass@1 (\S+)$", result.stdout, re.M).group(1))
    assert 0.0 <= pass_at_1 <= 1.0
