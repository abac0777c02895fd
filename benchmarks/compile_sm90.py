"""sm_90 compile gate, no GPU needed: every Triton kernel flowkit launches, compiled for an H100/H200 at the paper's shapes.

Each op's Python body (the ``triton_op``'s function) runs on ``meta`` tensors with ``wrap_triton`` swapped for a
recorder, so the gate sees exactly the launches the op makes: kernel, grid, arguments, ``num_warps``. For each launch
the JIT's own binder (built for ``GPUTarget("cuda", 90, 32)``) gives the specialisation and cache key a real launch
would get, and ``triton.compile`` builds it for that target with Triton's ``ptxas -v`` (a fresh cache directory per
run, so nothing is served from a cache). Shapes: d 3584, 3 hooked layers, |T| 1 (configs/rlfr_qwen.yaml), pieces of
8,192 stacked rows, fp32 and bf16, forward and backward; the flow attention at Qwen2.5-7B's heads (28 / 4 KV, head dim
128) with 2 flow tokens (the explanation reward's) and 64 (448 query rows per KV head, well past one block); the LM
head's softmax over Qwen2's 152,064-token vocabulary in chunks of 1,024 tokens (float32 logits only).

Checks, per compiled kernel: zero spill stores, shared memory ≤ 227 KB (sm_90's opt-in per block), compile ≤ 2 s of
CPU time (Triton's front end plus ptxas; CPU time, so a loaded CI machine does not fail it); and per op, dtype and
shape class, one JIT cache key over 20 steps' worth of changing seeds, token offsets, chunk sizes, batch and context
lengths (a second key is a recompile on the GPU). The ``.cu`` files are compiled with ``nvcc -arch=sm_90 -Xptxas -v``
(csrc/check_cuda_compile.sh): no spills, no stack frame above 64 B.

    python benchmarks/compile_sm90.py [--skip-nvcc] [--only velocity|attention|softmax]  # exit 1 on a failure

The GPU image runs Triton 3.6.0 and this machine 3.9.0; the gate runs under both (CI installs 3.6.0 into
build/triton36 and tests/kernels/test_compile_sm90.py runs the gate with it first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_MEMORY_LIMIT = 232_448  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KB)
COMPILE_LIMIT_S = 2.0
CUDA_STACK_LIMIT = 64
STEPS = 20

DIM, LAYERS, TIMESTEPS, PIECE_ROWS = 3584, 3, 1, 8192
HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
FLOW_TOKEN_CLASSES = (2, 64)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB, HEAD_CHUNK = 152_064, 1024  # Qwen2's vocabulary; update.lm_head_chunk_size's default


@dataclass
class Launch:
    op: str
    kernel: object  # triton JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recorded_launches(module, op_name: str, launches: list[Launch]):
    """Runs ``module``'s ops with ``wrap_triton(kernel)[grid](*args)`` recorded instead of launched."""
    real = module.wrap_triton

    def record(kernel):
        return _Recorder(op_name, kernel, launches)

    module.wrap_triton = record
    try:
        yield
    finally:
        module.wrap_triton = real


class _Recorder:
    def __init__(self, op, kernel, launches):
        self.op, self.kernel, self.launches = op, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.op, self.kernel, tuple(grid), args, kwargs))
        return launch


def run_op(module, op, *inputs) -> list[Launch]:
    launches: list[Launch] = []
    with recorded_launches(module, op._name, launches):
        op._init_fn(*inputs)
    return launches


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def velocity_launches(dtype: torch.dtype, rng: random.Random) -> list[Launch]:
    """One step's prologue, epilogue and epilogue backward on one piece: a random seed (full 64-bit range, as
    ``seed_everything`` and the per-step seeds give), a random token offset and the piece's token count (the last
    piece of a micro-batch is partial)."""
    from flowkit.kernels.triton import velocity_deviation as ops

    tokens = rng.choice([PIECE_ROWS // (LAYERS * TIMESTEPS), rng.randint(1, PIECE_ROWS // (LAYERS * TIMESTEPS))])
    seed, offset = rng.randrange(2 ** 63), rng.randrange(4 * 3072)
    x1, ts, w, mask = meta(LAYERS, tokens, DIM, dtype=dtype), meta(TIMESTEPS), meta(TIMESTEPS), meta(tokens)
    v = meta(LAYERS * TIMESTEPS * tokens, DIM, dtype=dtype)
    return (run_op(ops, ops.interpolate_latents, x1, ts, seed, offset)
            + run_op(ops, ops.velocity_deviation, v, x1, ts, w, seed, offset, mask)
            + run_op(ops, ops.velocity_deviation_backward, meta(tokens), v, x1, ts, w, seed, offset, mask))


def attention_launches(dtype: torch.dtype, num_flow: int, rng: random.Random) -> list[Launch]:
    """One step's flow attention forward and backward: random batch, evaluations per example and context length."""
    from flowkit.kernels.triton import flow_attention as ops

    batch, steps, context = rng.randint(1, 8), rng.randint(1, 16), rng.randint(64, 4096)
    q = meta(batch, steps, num_flow, HEADS, HEAD_DIM, dtype=dtype)
    fk = meta(batch, steps, num_flow, KV_HEADS, HEAD_DIM, dtype=dtype)
    ck = meta(batch, KV_HEADS, context, HEAD_DIM, dtype=dtype)
    prefix = meta(batch, steps, dtype=torch.int64)
    out, lse = q.clone(), meta(batch, steps, num_flow, HEADS)
    return (run_op(ops, ops.flow_attention_core, q, fk, fk.clone(), ck, ck.clone(), prefix)
            + run_op(ops, ops.flow_attention_backward, q.clone(), q, fk, fk.clone(), ck, ck.clone(), prefix, out, lse))


def softmax_launches(rng: random.Random) -> list[Launch]:
    """One LM-head chunk's softmax forward and backward over Qwen2's vocabulary: a full chunk or the last, partial
    one (float32 logits whatever the policy's dtype; no entropy bonus, the default)."""
    from flowkit.kernels.triton import logprob_entropy as ops

    rows = rng.choice([HEAD_CHUNK, rng.randint(1, HEAD_CHUNK)])
    logits, targets, values = meta(rows, VOCAB), meta(rows, dtype=torch.int64), meta(rows)
    return (run_op(ops, ops.logprob_entropy, logits, targets, 1.0)
            + run_op(ops, ops.logprob_entropy_backward_, logits, targets, values, values.clone(), values.clone(), None,
                     1.0))


@dataclass
class Row:
    kernel: str
    dtype: str
    shape: str
    variants: int
    num_warps: int = 0
    registers: int = -1
    spill_stores: int = -1
    stack: int = -1
    shared: int = -1
    compile_s: float = float("nan")
    wall_s: float = float("nan")
    failures: str = ""


class Sm90Compiler:
    """The JIT's launch-time binding and ``triton.compile`` for sm_90, with ptxas's resource report."""

    def __init__(self, cache_dir: str):
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.knobs, self.target = knobs, GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self.cache_dir = cache_dir
        self._binders = {}

    def warm_up(self):
        """Compiles a one-store kernel, untimed: the first ``triton.compile`` of a process also loads the NVIDIA
        backend, LLVM and ptxas (about a second of CPU), a cost no single kernel's compile should carry."""
        import triton
        import triton.language as tl

        def store_one(x_ptr, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)

        launch = Launch("warm-up", triton.jit(store_one), (1,), (meta(16),), {"BLOCK": 16})
        self.compile(launch, self.bind(launch)[1])

    def bind(self, launch: Launch):
        """(cache key, bound arguments) exactly as ``JITFunction.run`` computes them on an sm_90 device."""
        from triton.runtime.jit import create_function_from_signature

        kernel = launch.kernel
        if kernel not in self._binders:
            self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, specialization, options = self._binders[kernel](*launch.args, **launch.kwargs)
        return str(specialization) + str(options), (bound, specialization, options)

    def compile(self, launch: Launch, binding) -> dict:
        import triton
        from triton.compiler import ASTSource

        bound, specialization, options = binding
        options, signature, constexprs, attrs = launch.kernel._pack_args(self.backend, dict(launch.kwargs), bound,
                                                                         specialization, options)
        log = io.StringIO()
        knobs = self.knobs
        saved = knobs.cache.dir, knobs.nvidia.dump_ptxas_log
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log = self.cache_dir, True
        cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=self.target,
                                          options=options.__dict__)
        finally:
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = saved
        report = parse_ptxas(log.getvalue())
        report.update(shared=compiled.metadata.shared + report["static_smem"], num_warps=compiled.metadata.num_warps,
                      compile_s=_cpu_seconds() - cpu_before, wall_s=time.perf_counter() - wall_before)
        return report


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parse_ptxas(log: str) -> dict:
    """Registers, spill stores, stack frame and static shared memory from a ``ptxas -v`` log of one kernel."""
    registers = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    if registers is None or frame is None:
        raise RuntimeError(f"no ptxas resource report in:\n{log}")
    return dict(registers=int(registers[1]), stack=int(frame[1]), spill_stores=int(frame[2]),
                static_smem=int(smem[1]) if smem else 0)


def shape_classes(only: str | None = None) -> list[tuple]:
    """(dtype name, shape label, step → launches) for every dtype and shape class."""
    classes = []
    for name, dtype in DTYPES.items():
        if only in (None, "velocity"):
            classes.append((name, f"d{DIM} P{LAYERS} T{TIMESTEPS} {PIECE_ROWS} rows",
                            lambda rng, dtype=dtype: velocity_launches(dtype, rng)))
        if only in (None, "attention"):
            for num_flow in FLOW_TOKEN_CLASSES:
                classes.append((name, f"F{num_flow} x G{HEADS // KV_HEADS} dh{HEAD_DIM}",
                                lambda rng, dtype=dtype, f=num_flow: attention_launches(dtype, f, rng)))
    if only in (None, "softmax"):
        classes.append(("fp32", f"V{VOCAB} {HEAD_CHUNK} rows", softmax_launches))
    return classes


def jit_variants(compiler: Sm90Compiler, only: str | None = None, steps: int = STEPS) -> dict[tuple, dict]:
    """(kernel, dtype, shape) → {cache key: (launch, binding)} over ``steps`` steps of changing seeds and sizes."""
    variants: dict[tuple, dict] = {}
    for dtype_name, shape, make in shape_classes(only):
        rng = random.Random(0)
        for _ in range(steps):
            for launch in make(rng):
                key, binding = compiler.bind(launch)
                variants.setdefault((launch.kernel.fn.__name__, dtype_name, shape), {}).setdefault(key, (launch, binding))
    return variants


def triton_rows(only: str | None = None, steps: int = STEPS) -> list[Row]:
    """One row per (kernel, dtype, shape class): its distinct cache keys over ``steps`` steps and its sm_90 build."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="flowkit-sm90-") as cache_dir:
        compiler = Sm90Compiler(cache_dir)
        compiler.warm_up()
        for (kernel_name, dtype_name, shape), keys in jit_variants(compiler, only, steps).items():
            row = Row(kernel_name, dtype_name, shape, len(keys))
            launch, binding = next(iter(keys.values()))
            try:
                report = compiler.compile(launch, binding)
            except Exception as error:  # a failed build is this row's result (ptxas killed, out of resources)
                row.failures = f"compile failed: {str(error).strip().splitlines()[0]}"
            else:
                for field in ("num_warps", "registers", "spill_stores", "stack", "shared", "compile_s", "wall_s"):
                    setattr(row, field, report[field])
                row.failures = "; ".join(triton_failures(row))
            rows.append(row)
    return rows


def triton_failures(row: Row) -> list[str]:
    failures = []
    if row.variants != 1:
        failures.append(f"{row.variants} compiled variants over {STEPS} steps")
    if row.spill_stores:
        failures.append(f"{row.spill_stores} B spill stores")
    if row.shared > SHARED_MEMORY_LIMIT:
        failures.append(f"{row.shared} B shared memory > {SHARED_MEMORY_LIMIT}")
    if row.compile_s > COMPILE_LIMIT_S:
        failures.append(f"compile {row.compile_s:.1f} s CPU > {COMPILE_LIMIT_S}")
    return failures


def find_nvcc() -> str | None:
    candidates = [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def cuda_rows() -> list[Row]:
    """Every kernel of csrc/**/*.cu, from ``nvcc -arch=sm_90 -Xptxas -v`` (raises if nvcc is absent or fails)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, /usr/local/cuda/bin)")
    result = subprocess.run(["bash", "csrc/check_cuda_compile.sh", "-Xptxas", "-v"], cwd=ROOT, capture_output=True,
                            text=True, timeout=1800, env={**os.environ, "NVCC": nvcc})
    if result.returncode != 0:
        raise RuntimeError("nvcc failed:\n" + result.stdout[-3000:] + result.stderr[-6000:])
    rows = []
    # ptxas prints "Compiling entry function '<mangled>' for 'sm_90'" then its resource lines, per kernel
    for entry in re.split(r"ptxas info\s+: Compiling entry function ", result.stderr)[1:]:
        name = re.match(r"'(\w+)'", entry)[1]
        report = parse_ptxas(entry)
        row = Row(_demangle(name), "-", "nvcc sm_90", 1, registers=report["registers"],
                  spill_stores=report["spill_stores"], stack=report["stack"], shared=report["static_smem"])
        failures = []
        if row.spill_stores:
            failures.append(f"{row.spill_stores} B spill stores")
        if row.stack > CUDA_STACK_LIMIT:
            failures.append(f"{row.stack} B stack > {CUDA_STACK_LIMIT}")
        row.failures = "; ".join(failures)
        rows.append(row)
    if not rows:
        raise RuntimeError("no kernel resource reports in nvcc's output:\n" + result.stderr[-3000:])
    return rows


def _demangle(name: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        return name
    full = subprocess.run([cxxfilt, name], capture_output=True, text=True).stdout.strip()
    full = full.replace("(anonymous namespace)::", "").removeprefix("void ")
    return full[:full.index("(")] if "(" in full else full  # the name and template arguments, not the parameters


def format_table(rows: list[Row]) -> str:
    header = f"{'kernel':<52} {'dtype':<5} {'shape':<26} {'var':>3} {'warps':>5} {'regs':>4} {'spill B':>7} " \
             f"{'stack B':>7} {'smem B':>7} {'cpu s':>6} {'wall s':>6}  failures"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.kernel[:52]:<52} {r.dtype:<5} {r.shape[:26]:<26} {r.variants:>3} {r.num_warps or '-':>5} "
                     f"{r.registers:>4} {r.spill_stores:>7} {r.stack:>7} {r.shared:>7} {r.compile_s:>6.2f} "
                     f"{r.wall_s:>6.2f}  {r.failures or 'ok'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-nvcc", action="store_true", help="only the Triton kernels")
    parser.add_argument("--only", choices=["velocity", "attention", "softmax"], help="one family of Triton kernels")
    args = parser.parse_args(argv)
    import triton

    print(f"Triton {triton.__version__}, torch {torch.__version__}, sm_90 target")
    rows = triton_rows(args.only)
    if not args.skip_nvcc:
        if find_nvcc() is None:
            print("nvcc not found: the .cu kernels are not checked", file=sys.stderr)
        else:
            rows += cuda_rows()
    print(format_table(rows))
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
