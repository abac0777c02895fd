"""A rank whose environment fails stops every rank: the failure is agreed before any rank goes on to a collective the
failed one never reaches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("rank_fault_job.py")  # run, not imported: importing it registers its environment


@pytest.mark.slow
def test_an_environment_failing_on_one_rank_stops_both_ranks(tmp_path, single_thread):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(JOB), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [json.loads((tmp_path / f"rank{rank}.json").read_text())["error"] for rank in range(2)]
    assert errors[1] is not None and "refused the connection" in errors[1], errors
    assert errors[0] is not None and "another rank" in errors[0], errors
