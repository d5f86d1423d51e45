"""The refusals a user meets when naming a device or backend this machine cannot run: one line, raised before
any parameter is allocated, naming the installed torch and what to do instead."""
from __future__ import annotations

import pytest
import torch

import megamoe_runtime as mr
from megamoe_runtime.errors import BackendUnavailableError


@pytest.mark.parametrize("backend", ["auto", "reference", "triton", "deepgemm"])
def test_cuda_device_without_cuda_is_one_line_naming_torch(ckpts, monkeypatch, backend):
    """Without the check, 'auto' and 'reference' reached torch's allocation ('AssertionError: Torch not compiled
    with CUDA enabled' on a CPU-only torch) and 'triton' said "cannot run on cuda: ... needs a CUDA device"."""
    _, out = ckpts.converted("fp8-block")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ck = mr.open_checkpoint(out)
    with pytest.raises(BackendUnavailableError) as e:
        ck.build_layer(ck.layers[0].index, device="cuda", backend=backend)
    msg = str(e.value)
    assert "\n" not in msg and f"backend {backend!r} on device 'cuda'" in msg and torch.__version__ in msg, msg
    assert "device='cpu'" in msg


def test_cpu_only_torch_is_named_as_such(monkeypatch):
    from megamoe_runtime.backends import _no_cuda_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU-only build" in _no_cuda_reason()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "(CUDA 12.8) sees no CUDA device" in _no_cuda_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _no_cuda_reason() is None


def test_triton_on_cpu_device_names_the_reference_backend(ckpts):
    _, out = ckpts.converted("fp8-block")
    ck = mr.open_checkpoint(out)
    with pytest.raises(BackendUnavailableError, match="cannot run on cpu") as e:
        ck.build_layer(ck.layers[0].index, device="cpu", backend="triton")
    assert "\n" not in str(e.value)


def test_deep_gemm_missing_says_the_build_needs_another_torch(monkeypatch):
    """The sgl-deep-gemm build the message names loads only with torch 2.11 and CUDA: with any other torch the
    line says so, instead of sending the user to a pip install that cannot load."""
    from megamoe_runtime.backends.deepgemm import import_failure_message

    missing = ModuleNotFoundError("No module named 'deep_gemm'", name="deep_gemm")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    msg = import_failure_message(missing)
    assert "\n" not in msg and "not installed; torch 2.13.0+cpu" in msg
    assert "loads only with torch 2.11, not this 2.13.0+cpu" in msg and "CUDA build of torch" in msg
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    msg = import_failure_message(missing)
    assert "pip install sgl-deep-gemm==0.1.5 apache-tvm-ffi==0.1.11;" in msg and "loads only" not in msg
