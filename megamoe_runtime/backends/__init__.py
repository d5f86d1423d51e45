"""Backends: one interface, several ways to run the same kernel-layout bytes.

A backend turns a `DeepGemmMegaMoEExperts` layer plus routing inputs into the
bf16 MoE output. All of them read the layer's parameters as they are (kernel
layout, allocated once); none re-lays-out weights at load or per call.

* ``reference`` (`backends.reference`): the fp32 torch definition of the
  numerics, any device. Every other backend is tested against it.
* ``deepgemm`` (`backends.deepgemm`): marshalling to DeepGEMM's mega kernels.
  SM100 kernels are contract-tested against recording stand-ins (never run
  here); on SM90 the fp8_block row runs on SGLang's ``fp8_mega_moe``
  (sgl-deep-gemm); the kernel ran on an H200 (bench/deepgemm_sm90.py), the
  backend's GPU tests are written but have not run on a GPU yet.
* ``triton`` (`backends.triton`, GPU): registered lazily by name; the module
  is imported only when asked for.

``get_backend("auto", device)`` picks deepgemm when it is importable and the
device can run it, then triton on CUDA, then reference. Backends are looked up
by a ``"module:attr"`` path and imported on first use, so importing
`megamoe_runtime` never imports triton or deep_gemm.

May import: `megamoe_runtime.errors`, `files`, `format`, and its own modules (no circle). Never `layer`,
`load` or `integrations`: a backend is handed the layer and reads its attributes
(tests/test_import_floors.py).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch

from ..errors import BackendUnavailableError, MegaMoEError

__all__ = [
    "Backend",
    "backend_status",
    "get_backend",
    "register_backend",
    "AUTO_ORDER",
]


@runtime_checkable
class Backend(Protocol):
    """What a layer needs from a backend.

    ``supports(spec)`` returns True or a string saying why not (so `auto` and
    error messages can explain the choice). ``supports_fused_shared(spec)``
    says whether the shared expert of ``spec.shared`` can run inside the same
    launch; the layer decides fusion once, at construction, from it.
    ``forward(layer, hidden_states, topk_weights, topk_ids, shared_input)``
    returns bf16 ``[T, H]``; ``shared_input`` is the shared expert's input
    when fusion is on (the hidden states), else None. Backends should decide
    fusion from ``layer.shared_fused`` (a layer may hold ``spec.shared`` but
    run it outside). Optional: ``available(device)`` (static, True or a
    reason) and ``fused_shared_reason(spec)`` (why fusion is off).

    Expert parallelism through `megamoe_runtime.layer.ep` needs the expert side of
    the forward split off: ``pairs(layer, rows, weights, ids)`` returns the
    bf16 slot outputs of (token row, raw top-k weight, global expert id)
    pairs that all belong to this rank, and ``shared_slot(layer,
    shared_input)`` the fused shared expert's slot. A backend whose kernels do
    their own EP (deepgemm) sets both to None; `ep_forward` then refuses it.
    Optional flags read by the layer: ``native_ep`` (the kernels dispatch and
    combine over the EP group themselves) and ``counts_recv_stats`` (the
    kernels increment ``cumulative_local_expert_recv_stats``); both default
    to False.
    """

    name: str
    pairs: Optional[Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]
    shared_slot: Optional[Callable[[Any, torch.Tensor], torch.Tensor]]

    def supports(self, spec: Any) -> Union[bool, str]: ...

    def supports_fused_shared(self, spec: Any) -> bool: ...

    def forward(self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared_input: Optional[torch.Tensor] = None) -> torch.Tensor: ...


#: name -> "module:attr" (a class or factory taking ``device=``, or no argument).
_REGISTRY: dict[str, Union[str, Callable[..., Any]]] = {
    "reference": "megamoe_runtime.backends.reference:ReferenceBackend",
    "deepgemm": "megamoe_runtime.backends.deepgemm:DeepGemmBackend",
    "triton": "megamoe_runtime.backends.triton:TritonBackend",
}

#: The order `auto` tries.
AUTO_ORDER = ("deepgemm", "triton", "reference")


def register_backend(name: str, target: Union[str, Callable[..., Any]]) -> None:
    """Register (or replace) a backend: ``target`` is ``"module:attr"`` (imported
    lazily, on first `get_backend`) or a class / factory. A factory may take a
    ``device`` keyword and may define ``available(device) -> True | reason``."""
    if not isinstance(name, str) or not name or name == "auto":
        raise MegaMoEError(f"backend name {name!r} is not valid (a non-empty string other than 'auto')")
    _REGISTRY[name] = target


def _resolve(name: str) -> Callable[..., Any]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; valid: 'auto', {', '.join(repr(n) for n in _REGISTRY)}"
        ) from None
    if not isinstance(target, str):
        return target
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend {name!r} is not available: importing {mod_name} failed ({e})"
        ) from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise BackendUnavailableError(f"backend {name!r}: {mod_name} has no {attr}") from None


def _availability(factory: Callable[..., Any], device: torch.device) -> Union[bool, str]:
    check = getattr(factory, "available", None)
    if check is None:
        return True
    try:
        return check(device)
    except BackendUnavailableError as e:
        return str(e)


def _instantiate(factory: Callable[..., Any], device: torch.device, kwargs: dict) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kw = dict(kwargs)
    if "device" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kw.setdefault("device", device)
    return factory(**kw)


def _as_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def backend_status(device: Union[str, torch.device, None] = "cpu", spec: Any = None) -> dict[str, Union[bool, str]]:
    """name -> True (would run here) or the reason it would not. For diagnostics."""
    dev = _as_device(device)
    out: dict[str, Union[bool, str]] = {}
    for name in _REGISTRY:
        if name == "triton" and dev.type != "cuda":
            out[name] = "triton runs on CUDA devices only"
            continue
        try:
            factory = _resolve(name)
        except BackendUnavailableError as e:
            out[name] = str(e)
            continue
        ok = _availability(factory, dev)
        if ok is True and spec is not None:
            try:
                ok = _instantiate(factory, dev, {}).supports(spec)
            except BackendUnavailableError as e:
                ok = str(e)
        out[name] = ok
    return out


def _no_cuda_reason() -> Optional[str]:
    """Why this process cannot use a CUDA device (naming the installed torch), or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: it has no CUDA; a GPU needs a CUDA build of "
                "torch")
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device on this machine"


def get_backend(name: str = "auto", device: Union[str, torch.device, None] = "cpu", *,
                spec: Any = None, **kwargs: Any) -> Any:
    """A backend instance by name, for `device`.

    ``auto`` tries deepgemm (importable and the device supports it), then
    triton (CUDA only), then reference; with ``spec`` given, a backend that
    does not support the spec is skipped too. A named backend that cannot run
    raises BackendUnavailableError saying what is missing. Extra keyword
    arguments go to the backend's constructor (e.g. ``max_num_tokens`` for
    deepgemm).
    """
    if not isinstance(name, str):  # a backend instance passes through (its support still checked)
        if spec is not None:
            sup = name.supports(spec)
            if sup is not True:
                raise BackendUnavailableError(f"backend {getattr(name, 'name', name)!r} does not support this "
                                              f"layer: {sup}")
        return name
    dev = _as_device(device)
    if dev.type == "cuda":
        why = _no_cuda_reason()
        if why is not None:  # before any backend or allocation: torch's own error names neither
            raise BackendUnavailableError(
                f"backend {name!r} on device {str(dev)!r}: {why}; on the CPU use device='cpu' (backend 'auto' "
                "picks the reference backend there)")
    if name == "auto":
        reasons = []
        for cand in AUTO_ORDER:
            if cand not in _REGISTRY:
                continue
            if cand == "triton" and dev.type != "cuda":
                reasons.append("triton: needs a CUDA device")
                continue
            try:
                factory = _resolve(cand)
            except BackendUnavailableError as e:
                reasons.append(f"{cand}: {e}")
                continue
            ok = _availability(factory, dev)
            if ok is not True:
                reasons.append(f"{cand}: {ok}")
                continue
            try:
                inst = _instantiate(factory, dev, kwargs if cand == "deepgemm" else {})
            except BackendUnavailableError as e:
                reasons.append(f"{cand}: {e}")
                continue
            if spec is not None:
                sup = inst.supports(spec)
                if sup is not True:
                    reasons.append(f"{cand}: {sup}")
                    continue
            return inst
        raise BackendUnavailableError("no backend can run here: " + "; ".join(reasons))
    factory = _resolve(name)
    ok = _availability(factory, dev)
    if ok is not True:
        raise BackendUnavailableError(f"backend {name!r} cannot run on {dev}: {ok}")
    inst = _instantiate(factory, dev, kwargs)
    if spec is not None:
        sup = inst.supports(spec)
        if sup is not True:
            raise BackendUnavailableError(f"backend {name!r} does not support this layer: {sup}")
    return inst
