"""The per-GPU memory table at paper scale (docs/guides/paper-setting.md) is benchmarks/memory_budget.py's output,
not a hand-kept copy."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_paper_setting_memory_table_is_the_scripts_output():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_budget.py")], capture_output=True,
                            text=True, timeout=300, check=True)
    guide = (ROOT / "docs" / "guides" / "paper-setting.md").read_text()
    block = re.search(r"<!-- memory_budget.py -->\n(.*?)\n<!-- /memory_budget.py -->", guide, re.DOTALL)
    assert block is not None, "docs/guides/paper-setting.md lost its memory_budget.py block"
    assert block.group(1) == result.stdout.strip()
