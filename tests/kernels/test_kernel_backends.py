"""Dispatch between reference, Triton and native kernels (FLOWKIT_KERNELS, fallbacks, one warning)."""

import importlib.util
import warnings

import pytest
import torch
from kernel_cases import deviation_inputs

from flowkit.kernels import available_backends, backends, velocity_deviation


def test_reference_is_always_available_and_last():
    assert available_backends("cpu")[-1] == "reference"


def test_triton_runs_on_cpu_only_when_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in available_backends("cpu")


def test_forced_reference_is_used(monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.select_backend(torch.device("cpu")) == "reference"


def test_forced_native_is_used_when_flowkit_C_is_built(monkeypatch):
    if importlib.util.find_spec("flowkit._C") is None:
        pytest.skip("flowkit._C is not built here")
    monkeypatch.setenv("FLOWKIT_KERNELS", "native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.select_backend(torch.device("cpu")) == "native"


def test_forced_native_without_a_build_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", "native")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backends, "native_has", lambda device_type: False)
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(RuntimeWarning, match="FLOWKIT_KERNELS=native is not available"):
        assert backends.select_backend(torch.device("cpu")) == "reference"


def test_missing_forced_backend_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backends, "_warned", set())
    x1, ts, w, mask, v = deviation_inputs(1, 1, 4, 8)
    with pytest.warns(RuntimeWarning, match="FLOWKIT_KERNELS=triton"):
        velocity_deviation(v, x1, ts, w, 0, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        velocity_deviation(v, x1, ts, w, 0, mask)


def test_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("FLOWKIT_KERNELS", "cuda-magic")
    with pytest.raises(ValueError):
        backends.select_backend(torch.device("cpu"))


def test_automatic_cpu_choice_prefers_native(monkeypatch):
    monkeypatch.delenv("FLOWKIT_KERNELS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice = backends.select_backend(torch.device("cpu"))
    assert choice == ("native" if backends.native_has("cpu") else "reference")
