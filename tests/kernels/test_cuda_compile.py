"""The CUDA sources compile for sm_90 (nvcc, no GPU needed, a CPU torch is enough) with no register spills and no
stack frame above 64 B per kernel (benchmarks/compile_sm90.py reads ``-Xptxas -v``)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compile_sm90  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(compile_sm90.find_nvcc() is None, reason="nvcc is not installed (PATH, /usr/local/cuda/bin)")
def test_cuda_kernels_compile_for_sm90_without_spills():
    rows = compile_sm90.cuda_rows()
    print("\n" + compile_sm90.format_table(rows))
    kernels = {row.kernel.split("<")[0] for row in rows}
    assert kernels == {f"flowkit::{name}" for name in ("interpolate_kernel", "deviation_kernel",
                                                        "deviation_backward_kernel", "flow_attention_fwd_kernel",
                                                        "flow_attention_dq_kernel", "flow_attention_dkv_kernel")}
    assert len(rows) == 4 * len(kernels)  # float, double, half, bfloat16 each
    assert all(row.stack <= compile_sm90.CUDA_STACK_LIMIT for row in rows), [(r.kernel, r.stack) for r in rows]
    # Per-element 64-bit divisions and a device sqrt(double) compiled to subroutine calls whose ABI made ptxas spill
    # (dK/dV 20-40 B per thread, dQ<double> 40 B); rows are now walked a warp per row, indices divide in 32 bits and
    # 1/sqrt(dh) comes from the host.
    assert [(r.kernel, r.spill_stores) for r in rows if r.spill_stores] == []
