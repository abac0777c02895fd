"""The sm_90 compile gate (benchmarks/compile_sm90.py) on this CPU machine: Triton kernels built for an H100/H200 at
the paper's shapes (no spills, shared memory ≤ 227 KB, ≤ 2 s CPU each, one variant over 20 steps), and its
measuring parts checked against known inputs, so a broken parser or binder cannot pass the gate by seeing nothing."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE_TRITON_DIR = ROOT / "build" / "triton36"  # .ci/run installs the GPU image's Triton here
sys.path.insert(0, str(ROOT / "benchmarks"))
triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not hasattr(triton, "compile") or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="this Triton has no NVIDIA backend to compile for sm_90",
)

import compile_sm90  # noqa: E402

# kernels x dtypes x shape classes the gate compiles: 3 velocity-deviation kernels x 2 dtypes, 3 attention kernels x
# 2 dtypes x 2 flow-token classes, 2 softmax kernels (float32 logits only)
GATE_ROWS = 3 * 2 + 3 * 2 * 2 + 2

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_deviation_kernel' for 'sm_90a'
ptxas info    : Function properties for _deviation_kernel
    3440 bytes stack frame, 4460 bytes spill stores, 4392 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes smem, 448 bytes cmem[0]
"""


def test_ptxas_report_is_read():
    assert compile_sm90.parse_ptxas(PTXAS_LOG) == dict(registers=168, stack=3440, spill_stores=4460,
                                                       static_smem=128)
    with pytest.raises(RuntimeError, match="no ptxas resource report"):
        compile_sm90.parse_ptxas("ptxas info    : 0 bytes gmem\n")


def test_variant_count_sees_value_specialisation():
    """The binder the gate uses gives a new cache key where a launch on the GPU would compile a new variant."""
    import triton.language as tl

    def body(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    specialised, dynamic = triton.jit(body), triton.jit(do_not_specialize=["n"])(body)
    x = compile_sm90.meta(16)
    compiler = compile_sm90.Sm90Compiler(cache_dir="unused")

    def keys(kernel, values):
        return {compiler.bind(compile_sm90.Launch("toy", kernel, (1,), (x, n), {"BLOCK": 16}))[0] for n in values}

    values = [1, 16, 17, 2 ** 31 + 1]  # == 1, divisible by 16, neither, i64
    assert len(keys(specialised, values)) == 4
    assert len(keys(dynamic, values)) == 2  # the i32 / i64 type is part of the key even when not specialised
    assert len(keys(dynamic, values[:3])) == 1


def test_one_jit_variant_per_kernel_dtype_and_shape_over_20_steps():
    """Seeds over the full 64-bit range, token offsets, partial last pieces, batch, evaluations and context lengths
    all change from step to step; none of them may make the JIT compile a second variant."""
    variants = compile_sm90.jit_variants(compile_sm90.Sm90Compiler(cache_dir="unused"))
    assert len(variants) == GATE_ROWS
    assert {name: len(keys) for name, keys in variants.items() if len(keys) != 1} == {}


def test_triton_kernels_compile_for_sm90_at_paper_shapes():
    rows = compile_sm90.triton_rows()
    print("\n" + compile_sm90.format_table(rows))
    assert [r for r in rows if r.failures] == []
    # every kernel of flowkit.kernels.triton was compiled, for both dtypes and every shape class
    from flowkit.kernels.triton import flow_attention, logprob_entropy, velocity_deviation

    compiled = {r.kernel for r in rows}
    for module in (velocity_deviation, flow_attention, logprob_entropy):
        jitted = [v for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction)]
        kernels = {f.fn.__name__ for f in jitted if f.fn.__name__ in compiled}
        helpers = {f.fn.__name__ for f in jitted} - kernels
        # the rest are device functions that a compiled kernel calls
        assert all(any(h in module.__dict__[k].src for k in kernels) for h in helpers), helpers
    seen = {}
    for r in rows:
        seen.setdefault(r.kernel, set()).add((r.dtype, r.shape))
    assert {"_logprob_entropy_kernel", "_logprob_entropy_backward_kernel"} <= set(seen)
    for kernel, classes in seen.items():
        if kernel.startswith("_logprob_entropy"):  # float32 logits whatever the policy's dtype
            assert classes == {("fp32", f"V{compile_sm90.VOCAB} {compile_sm90.HEAD_CHUNK} rows")}, kernel
            continue
        shapes = len(compile_sm90.FLOW_TOKEN_CLASSES) if kernel.startswith("_flow_attention") else 1
        assert {dtype for dtype, _ in classes} == set(compile_sm90.DTYPES) and len(classes) == 2 * shapes, kernel


@pytest.mark.skipif(not (IMAGE_TRITON_DIR / "triton").is_dir(),
                    reason="build/triton36 is absent (.ci/run installs the GPU image's Triton 3.6.0 there)")
def test_triton_kernels_compile_for_sm90_under_the_gpu_images_triton():
    """The gate again under the Triton the GPU image runs (3.6.0, not this machine's): its front end and bundled
    ptxas allocate registers and shared memory differently, and its JIT binder is the one that keys recompiles."""
    image_packages = (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text()
    image_version = re.search(r"^triton==(\S+)", image_packages, re.MULTILINE)[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(IMAGE_TRITON_DIR), str(ROOT)])}
    result = subprocess.run([sys.executable, "benchmarks/compile_sm90.py", "--skip-nvcc"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    print(result.stdout)
    assert result.stdout.startswith(f"Triton {image_version},"), result.stdout[:300] + result.stderr[-3000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("_")]
    assert len(rows) == GATE_ROWS and all(line.endswith("  ok") for line in rows), result.stdout
