"""Timing, peak-memory and CSV helpers shared by the benchmarks (results go to benchmarks/results/results.csv)."""

from __future__ import annotations

import csv
import ctypes
import gc
import os
import re
import statistics
import time
from pathlib import Path

import torch

RESULTS_CSV = Path(__file__).resolve().parent / "results" / "results.csv"


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}  # process: this process's CPU seconds

def return_freed_memory_to_the_os() -> None:
    """glibc keeps freed blocks below a growing mmap threshold resident, which hides peaks from the RSS high-water
    mark; a fixed 64 KiB threshold makes tensor allocations mmap'd and unmapped on free. For the rest of the process:
    every large allocation then costs page faults, so step-time benchmarks must not call it (importing this module
    does not). No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1)) / 1024


def peak_extra_memory_mb(fn, device: str) -> float | None:
    """Peak memory one call of ``fn`` adds on top of what was allocated before it.

    CUDA: the caching allocator's peak. CPU: the process's resident-set high-water mark, reset through
    ``/proc/self/clear_refs`` (Linux), with freed memory returned to the OS (:func:`return_freed_memory_to_the_os`);
    ``None`` where that is not possible.
    """
    if device != "cuda":
        return_freed_memory_to_the_os()
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        base = _status_mb("VmRSS")
        fn()
        return max(_status_mb("VmHWM") - base, 0.0)
    except OSError:
        return None


def measure(fn, warmup: int = 2, reps: int = 10, device: str | None = None) -> dict:
    """Median / 20th / 80th percentile wall time in ms over ``reps`` calls after ``warmup``, plus peak extra memory
    (on CPU the timed calls run with the memory reading's malloc setting, so every implementation a run times gets
    the same)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda":
        return_freed_memory_to_the_os()
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    quantiles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return dict(median_ms=statistics.median(times), p20_ms=quantiles[1], p80_ms=quantiles[7],
                peak_mem_mb=peak_extra_memory_mb(fn, device))


def append_csv(path: str | Path | None, row: dict) -> None:
    """Appends ``row`` to the CSV at ``path`` (default ``RESULTS_CSV``), widening the header when new keys appear.

    Every row gets this process's ``run`` id, so plots and ratios compare rows measured in one run.
    """
    row = {**row, "run": RUN_ID}
    path = Path(path) if path else RESULTS_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, header = [], []
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
    missing = [key for key in row if key not in header]
    if missing or not header:
        header += missing
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows + [row])
        return
    with path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=header).writerow(row)


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


RUN_ID = f"{timestamp()}-{os.getpid()}"
