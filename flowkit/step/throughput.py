"""Throughput as the field reports it: tokens per second per device (verl's ``perf/throughput``) and model FLOPs
utilisation (MFU, Chowdhery et al. 2022, App. B: 6·N FLOPs per token for a forward and backward of N parameters).
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks per device (FLOP/s), from the vendors' datasheets (without sparsity; the SXM parts
# where a PCIe one differs); verl's flops_counter holds the same values. Matched as substrings of the CUDA device
# name, longest key first ("H100" inside "H100 PCIe" gets the SXM peak: set peak_flops for a PCIe card).
DEVICE_PEAK_FLOPS: dict[str, float] = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "A40": 149.7e12,
    "L20": 119.5e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """The table's peak for ``device`` (a CUDA device whose name contains a key), else None: a CPU has no
    meaningful default (its peak depends on cores, vector width and clock), nor has an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(DEVICE_PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return DEVICE_PEAK_FLOPS[key]
    return None


def model_flops_utilization(parameters: int, tokens: float, seconds: float, peak_flops: float) -> float:
    """6·N·tokens / seconds / peak: the share of the device's peak that one forward and backward of ``tokens``
    tokens through N parameters would use in ``seconds`` (attention FLOPs not counted, as in the 6·N rule)."""
    return 6.0 * parameters * tokens / seconds / peak_flops
