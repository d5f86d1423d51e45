"""DeepGEMM MegaMoE backend: marshalling the layer's kernel-layout tensors to DeepGEMM's mega API.

The SM100 path is CONTRACT-TESTED ONLY. DeepGEMM's SM100 mega kernels (``fp8_fp4_mega_moe``,
``fp4_fp4_mega_moe``, ``nvfp4_mega_moe``, ``bf16_mega_moe``) run on SM100-family
GPUs only (B200 / GB200 / B300); every other architecture, the H200 this
project tests on included, raises "Unsupported architecture" inside DeepGEMM.
So that path has never launched a kernel: its argument marshalling (which
entry point, which keyword names, which tensors with which shapes, dtypes and
strides, what is staged into the symmetric buffer) is tested against recording
stand-ins of every documented API version (``tests/runtime/backends/test_deepgemm.py``).
Numerics are the reference backend's; run ``megamoe_runtime.testing.calc_diff``
against it on real hardware before trusting a new DeepGEMM version.

API versions handled (docs/KERNELS.md#entry-points, #symmetric-buffer; detected by introspection, not by
version strings):

=========  ==========================================================================
flavour    what it has
=========  ==========================================================================
dg-2604    ``fp8_fp4_mega_moe(y, l1, l2, sym_buffer, recipe, activation,
           activation_clamp, fast_math)``; ``SymmBuffer(group, E, T, K, H, I,
           use_fp8_dispatch, activation)``
dg-main    + ``cumulative_local_expert_recv_stats``; ``bf16_mega_moe``;
           ``get_symm_buffer_for_mega_moe(..., use_fp8_dispatch=None, mma_type,
           activation)`` (aligns T, ring tokens)
dg-newer   + ``shared_l1_weights``/``shared_l2_weights``, ``situ_beta``/
           ``situ_linear_beta``; ``fp4_fp4_mega_moe`` (x_bf16, l1_alphas,
           l2_alphas, a2_scales, routed_scaling_factor); ``SymmBuffer(...,
           num_shared_experts=0, mma_type, activation, base=None)``; MXFP8
           weights through ``fp8_fp4_mega_moe`` (mma_type 'fp8xfp8')
dgv        vllm-project/DeepGEMM: SiTU betas named ``activation_beta``/
           ``activation_linear_beta``; ``nvfp4_mega_moe`` + ``NVFP4SymmBuffer(...,
           num_shared_experts, base, shared_dtype)`` with per-token ``x_scales``
dgz        zyongye/DeepGEMM: ``fp8_fp8_mega_moe`` alias for MXFP8 weights
=========  ==========================================================================

What the backend does per call: stage the inputs into the symmetric buffer
(``x``/``x_sf`` quantized exactly like the reference's dispatch for the entry
point in use: NVFP4 ``reference.quantize_dispatch_nvfp4``, per-token
``x_scales`` for DGv, global 1.0 for newer DG; compare with
``reference_forward(..., nvfp4_entry_point=backend.entry_point(spec))``, ``topk_idx``
int64, ``topk_weights`` float32; padding tokens id -1 weight 0; masked slots
weight 0; the routed scaling factor folded into the weights except for newer
DG's NVFP4 entry which takes it), fill ``shared_l1_acts_sf`` for fused FP8
shared experts, run a one-time barrier before the first launch, and call the
entry point with keyword arguments filtered by its signature.

Buffers are collective (symmetric memory + rendezvous): they are created on
the first forward (every rank runs every layer's forward in lockstep) or by
`DeepGemmBackend.prepare`, never at layer construction (a meta-initialised
model must not rendezvous), and shared by every layer with the same
configuration.

SM90 (Hopper): SGLang's DeepGEMM build (PyPI ``sgl-deep-gemm``) adds ``fp8_mega_moe``, which runs
the block-FP8 row (``fp8_block``) on sm_90 (docs/KERNELS.md#sm90-fp8-mega). Its buffer
(``get_symm_buffer_for_sm90_mega_moe``) always rendezvouses torch symmetric memory over a process
group, so one rank without torch.distributed gets a world-size-1 NCCL group (an in-process store, no
port); EP ranks pass theirs. Each forward is ``mega_moe_pre_dispatch_sm90`` (quantizes x per 128,
stages ids and weights times the routed scaling factor) then ``fp8_mega_moe`` on the layer's own
tensors: nothing is copied or transformed per call, so a reload is visible to a captured graph.

CUDA-graph caveat: DGv's ``l2_activation_scale`` and newer DG's
``routed_scaling_factor`` are host floats passed by value; a graph captured
before a reload that changes them keeps the old values. Re-capture after a
reload that changes a w2 input scale (``layer.load_generation`` changes).
"""
from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import BackendUnavailableError, LayerSpecError, LayoutError, MegaMoEError
from ..format.formats import LAYOUT_SM100, LAYOUT_SM100_PACKED_FP4, LAYOUT_SM90_BLOCK_FP8, get_row
from ..format.roles import SHARED_ROLES
from ..format.scales import W13_RTOL, gate_up_disagreeing
from .reference import quantize_dispatch_nvfp4

__all__ = ["DeepGemmBackend", "MegaAPI", "SM90_ROW", "detect_api", "import_deep_gemm", "package_layouts",
           "import_failure_message", "shared_sf_rows", "sm90_weights", "stage_sm90_inputs"]

#: the block-FP8 row and the SM90 kernel that runs it (docs/KERNELS.md#sm90-fp8-mega)
SM90_ROW = "fp8_block"
_SM90_ENTRY = "fp8_mega_moe"
#: fp8_mega_moe's recipe: weights per 128x128 block, activations per 1x128
_SM90_RECIPE = (128, 128, 128)
_ENTRY_NAMES = ("fp8_fp4_mega_moe", "fp8_fp8_mega_moe", "fp4_fp4_mega_moe", "nvfp4_mega_moe", "bf16_mega_moe")
_SITU_NAMES = (("situ_beta", "situ_linear_beta"), ("activation_beta", "activation_linear_beta"))


def import_deep_gemm() -> Any:
    """``import deep_gemm`` or BackendUnavailableError saying how to get it."""
    mod = sys.modules.get("deep_gemm")
    if mod is not None:
        return mod
    try:
        return importlib.import_module("deep_gemm")
    except Exception as e:  # noqa: BLE001 - sgl-deep-gemm asserts at import when it finds no CUDA toolkit
        raise BackendUnavailableError(import_failure_message(e)) from e


#: the sgl-deep-gemm build whose prebuilt extension links the libtorch symbols torch 2.11 exports
#: (docs/KERNELS.md#sm90-fp8-mega); later builds need symbols only newer torch has
_SGL_DEEP_GEMM_FOR_TORCH_2_11 = "sgl-deep-gemm==0.1.5 apache-tvm-ffi==0.1.11"


def import_failure_message(e: BaseException) -> str:
    """One line: why ``import deep_gemm`` failed, the installed torch, what to install.

    A prebuilt DeepGEMM extension linked against another torch fails with an undefined libtorch
    symbol; a missing package with ModuleNotFoundError. Both need the user to install a build
    for *their* torch, so the message names it."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    mismatch = []
    if not torch.__version__.startswith("2.11."):
        mismatch.append(f"that build loads only with torch 2.11, not this {torch.__version__}")
    if torch.version.cuda is None:
        mismatch.append("every DeepGEMM build needs a CUDA build of torch, and this one is CPU-only")
    hint = (f"for Hopper (the fp8_block row) with torch 2.11: pip install {_SGL_DEEP_GEMM_FOR_TORCH_2_11}"
            f"{' (' + '; '.join(mismatch) + ')' if mismatch else ''}; "
            f"for SM100: DeepGEMM (github.com/deepseek-ai/DeepGEMM) built against this torch")
    if "undefined symbol" in first:
        return (f"deep_gemm is built for another torch than the installed torch {torch.__version__} "
                f"(its extension needs a libtorch symbol this torch lacks: {first}); {hint}")
    if isinstance(e, ModuleNotFoundError) and getattr(e, "name", None) in ("deep_gemm", None):
        return f"the deepgemm backend needs the deep_gemm package (not installed; torch {torch.__version__}); {hint}"
    return f"importing deep_gemm failed with torch {torch.__version__}: {first}; {hint}"


def _params(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


@dataclass(frozen=True)
class MegaAPI:
    """What the installed DeepGEMM offers, found by introspection."""

    module: Any
    flavour: str
    functions: dict[str, Any]
    params: dict[str, dict[str, inspect.Parameter]]
    buffer_factory: Optional[Any]
    buffer_params: dict[str, inspect.Parameter]
    nvfp4_buffer: Optional[Any]
    nvfp4_buffer_params: dict[str, inspect.Parameter]
    block_m_fn: Optional[Any]
    #: DGv's ``get_block_m_for_nvfp4_mega_moe(R, E, T, num_tokens, K)``: the block M
    #: ``nvfp4_mega_moe`` uses (its shared SF row map follows it, not the upstream one)
    nvfp4_block_m_fn: Optional[Any] = None
    notes: tuple[str, ...] = field(default=())
    #: SGLang's Hopper build (docs/KERNELS.md#sm90-fp8-mega): ``fp8_mega_moe``, its buffer factory and
    #: its pre-dispatch (absent before 0.1.5: the backend then stages x itself), or None
    sm90_entry: Optional[Any] = None
    sm90_buffer: Optional[Any] = None
    sm90_pre_dispatch: Optional[Any] = None
    #: row -> the layout flavour this build's kernel for the row reads, and how that was told
    #: (`package_layouts`; docs/LAYOUT.md#layout-flavours)
    layouts: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the package's ``__version__`` (messages only: the API is told by introspection)
    version: Optional[str] = None

    def layout_problem(self, row: str, layout: str) -> Optional[str]:
        """Why a folder of ``row`` in layout flavour ``layout`` cannot run on this build (naming both
        flavours), or None when the build's kernel for the row reads that flavour or has no kernel for it."""
        theirs = self.layouts.get(row)
        if theirs is None or theirs[0] == layout:
            return None
        return (f"megamoe holds row {row!r} in DeepGEMM layout {layout!r} (every folder of it: megamoe.json "
                f"\"layout\"), but the "
                f"installed deep_gemm{' ' + self.version if self.version else ''} reads that row in layout "
                f"{theirs[0]!r} ({theirs[1]}); these bytes would be read in the wrong order: use a deep_gemm whose "
                f"kernel reads {layout!r} (docs/LAYOUT.md#layout-flavours) or backend='triton' / 'reference'")

    def has(self, fn: str) -> bool:
        return fn in self.functions

    def accepts(self, fn: str, name: str) -> bool:
        return name in self.params.get(fn, {})

    def situ_names(self, fn: str) -> Optional[tuple[str, str]]:
        for a, b in _SITU_NAMES:
            if self.accepts(fn, a) and self.accepts(fn, b):
                return a, b
        return None

    def swiglu_ab_names(self, fn: str) -> Optional[tuple[str, str]]:
        """(alpha, beta) keyword names for GPT-OSS SwiGLU, or None."""
        if not self.accepts(fn, "activation_alpha"):
            return None
        for beta in ("activation_beta", "activation_up_bias"):
            if self.accepts(fn, beta):
                return "activation_alpha", beta
        return None

    def entry_for(self, row: str) -> tuple[Optional[str], str]:
        """(function name, '') for a row, or (None, what is missing): the first of the row's
        ``entry_preference`` this module has and can run (`_entry_blocked`)."""
        if row == SM90_ROW:
            if self.sm90_entry is not None and self.sm90_buffer is not None:
                return _SM90_ENTRY, ""
            return None, (f"this deep_gemm has no {_SM90_ENTRY} + get_symm_buffer_for_sm90_mega_moe (the SM90 "
                          f"block-FP8 mega kernel of SGLang's DeepGEMM build); pip install "
                          f"{_SGL_DEEP_GEMM_FOR_TORCH_2_11} (torch 2.11)")
        try:
            r = get_row(row)
        except MegaMoEError:
            return None, f"unknown row {row!r}"
        blocked = ""
        for fn in r.entry_preference:
            if self.has(fn):
                why = self._entry_blocked(fn, r)
                if why is None:
                    return fn, ""
                blocked = blocked or why
        return None, blocked or r.no_kernel_hint

    def _entry_blocked(self, fn: str, row: Any) -> Optional[str]:
        """Why a present entry point cannot run ``row`` here ("" = silently not usable), None if it can."""
        layout = self.layout_problem(row.name, row.layout)
        if layout is not None:
            return layout
        if fn == "fp8_fp4_mega_moe" and row.weight.element == "e4m3" and self.flavour != "dg-newer":
            return ""  # older builds' fp8_fp4_mega_moe takes E2M1 weights only
        if fn == "nvfp4_mega_moe" and self.nvfp4_buffer is None:
            return "deep_gemm has nvfp4_mega_moe but no NVFP4SymmBuffer (deep_gemm.mega.nvfp4)"
        return None


def detect_api(module: Any) -> MegaAPI:
    """Inspect a ``deep_gemm`` module (real or stand-in) and classify its mega API."""
    fns = {n: getattr(module, n) for n in _ENTRY_NAMES if callable(getattr(module, n, None))}
    params = {n: _params(f) for n, f in fns.items()}
    factory = getattr(module, "get_symm_buffer_for_mega_moe", None)
    if not callable(factory):
        factory = getattr(module, "SymmBuffer", None)
    nv_buf = getattr(module, "NVFP4SymmBuffer", None)
    if nv_buf is None and "nvfp4_mega_moe" in fns:
        try:
            nv_buf = getattr(importlib.import_module(f"{module.__name__}.mega.nvfp4"), "NVFP4SymmBuffer", None)
        except ImportError:
            nv_buf = None
    block_m = getattr(module, "get_block_m_for_mega_moe", None)
    if block_m is None:
        block_m = getattr(getattr(module, "_C", None), "get_block_m_for_mega_moe", None)
    nv_block_m = getattr(module, "get_block_m_for_nvfp4_mega_moe", None)
    if nv_block_m is None:
        nv_block_m = getattr(getattr(module, "_C", None), "get_block_m_for_nvfp4_mega_moe", None)
    fp = params.get("fp8_fp4_mega_moe", {})
    if "nvfp4_mega_moe" in fns or "activation_linear_beta" in fp:
        flavour = "dgv"
    elif "fp4_fp4_mega_moe" in fns or "situ_beta" in fp:
        flavour = "dg-newer"
    elif "fp8_fp8_mega_moe" in fns:
        flavour = "dgz"
    elif "cumulative_local_expert_recv_stats" in fp or "bf16_mega_moe" in fns:
        flavour = "dg-main"
    elif fns:
        flavour = "dg-2604"
    else:
        flavour = "none"
    sm90 = [getattr(module, n, None) for n in (_SM90_ENTRY, "get_symm_buffer_for_sm90_mega_moe",
                                                "mega_moe_pre_dispatch_sm90")]
    sm90 = [f if callable(f) else None for f in sm90]
    if flavour == "none" and sm90[0] is not None:
        flavour = "sgl-sm90"
    version = getattr(module, "__version__", None)
    return MegaAPI(module, flavour, fns, params, factory, _params(factory) if factory else {},
                   nv_buf, _params(nv_buf) if nv_buf else {}, block_m, nv_block_m,
                   sm90_entry=sm90[0], sm90_buffer=sm90[1], sm90_pre_dispatch=sm90[2],
                   layouts=package_layouts(module), version=version if isinstance(version, str) else None)


def package_layouts(module: Any) -> dict[str, tuple[str, str]]:
    """row -> (layout flavour, how it was told) of the kernel a ``deep_gemm`` module (real or stand-in) runs
    that row on, for the rows it has a kernel for; read from its Python API, as the contract test
    (tests/runtime/backends/test_deepgemm_transform.py) reads the package's own transform:

    * ``fp8_mega_moe`` (SGLang's SM90 build, every version): `LAYOUT_SM90_BLOCK_FP8`.
    * ``fp8_fp4_mega_moe`` (MXFP4 / MXFP8 weights, FP8 activations), ``bf16_mega_moe``: interleave8 in
      every build (`LAYOUT_SM100`).
    * NVFP4: upstream's ``fp4_fp4_mega_moe`` and vllm-project's ``nvfp4_mega_moe`` (with its
      ``NVFP4SymmBuffer``) read interleave8; an ``nvfp4_mega_moe`` without that buffer, in a build whose
      ``transform_weights_for_mega_moe`` takes ``mma_type`` (sgl-deep-gemm >= 0.1.7), runs the
      ``nvfp4xnvfp4`` kind, whose transform packs gate/up in 16-row groups: `LAYOUT_SM100_PACKED_FP4`."""
    fns = {n for n in _ENTRY_NAMES + (_SM90_ENTRY,) if callable(getattr(module, n, None))}
    out: dict[str, tuple[str, str]] = {}
    if _SM90_ENTRY in fns:
        out[SM90_ROW] = (LAYOUT_SM90_BLOCK_FP8, f"its {_SM90_ENTRY}")
    for fn, rows in (("fp8_fp4_mega_moe", ("mxfp4", "mxfp8")), ("fp8_fp8_mega_moe", ("mxfp8",)),
                     ("bf16_mega_moe", ("bf16",))):
        if fn in fns:
            for r in rows:
                out.setdefault(r, (LAYOUT_SM100, f"its {fn}"))
    if "fp4_fp4_mega_moe" in fns:
        out["nvfp4"] = (LAYOUT_SM100, "its fp4_fp4_mega_moe")
    elif "nvfp4_mega_moe" in fns:
        transform = getattr(module, "transform_weights_for_mega_moe", None)
        has_nv_buffer = getattr(module, "NVFP4SymmBuffer", None) is not None
        if not has_nv_buffer:
            try:
                has_nv_buffer = getattr(importlib.import_module(f"{module.__name__}.mega.nvfp4"),
                                        "NVFP4SymmBuffer", None) is not None
            except (ImportError, AttributeError):
                has_nv_buffer = False
        if not has_nv_buffer and "mma_type" in _params(transform):
            out["nvfp4"] = (LAYOUT_SM100_PACKED_FP4, "its nvfp4_mega_moe runs mma_type 'nvfp4xnvfp4', which "
                            "transform_weights_for_mega_moe packs gate/up for in 16-row groups")
        else:
            out["nvfp4"] = (LAYOUT_SM100, "its nvfp4_mega_moe")
    return out


class _LocalGroup:
    """Single-rank stand-in for a process group (DeepGEMM's R == 1 path uses
    ``torch.empty`` and never communicates; it only asks size/rank/barrier)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def barrier(self) -> None:
        return None


#: the one single-rank stand-in: buffers are cached by group identity, so a fresh
#: stand-in per call would allocate (and zero, barrier, synchronize) a new buffer per forward
_LOCAL_GROUP = _LocalGroup()

def shared_sf_rows(num_tokens: int, block_m: int, device: Any = None) -> torch.Tensor:
    """Row of ``shared_l1_acts_sf`` for each token (docs/KERNELS.md#shared-sf-rows): with
    ``i = r % bm``, ``(r//bm)*align(bm,128) + (i//128)*128 + (i%32)*4 + (i%128)//32``.
    Built on ``device`` directly (a host tensor moved per forward is a synchronizing copy)."""
    r = torch.arange(num_tokens, dtype=torch.int64, device=device)
    i = r % block_m
    abm = (block_m + 127) // 128 * 128
    return (r // block_m) * abm + (i // 128) * 128 + (i % 32) * 4 + (i % 128) // 32


# buffers are collective and big: one per (group, device, configuration), shared by layers
_BUFFERS: dict[tuple, Any] = {}


class DeepGemmBackend:
    """Runs a `DeepGemmMegaMoEExperts` layer through DeepGEMM's mega kernels (SM100).

    Args:
        device: the layer's device.
        max_num_tokens: tokens per rank the symmetric buffer holds (DeepGEMM
            aligns it up); a forward with more raises.
        group: the EP process group (default: the world group when
            torch.distributed is initialised, else a single-rank stand-in).
        fast_math: passed to the kernels.
        check_device: refuse devices that are not SM100 (tests turn it off to
            drive a recording stand-in on CPU tensors).
        module: a ``deep_gemm`` module to use instead of importing it.
    """

    name = "deepgemm"
    #: the kernel increments ``cumulative_local_expert_recv_stats`` itself
    counts_recv_stats = True
    #: the mega kernels dispatch and combine over the EP group themselves (NVLink, symmetric memory)
    native_ep = True
    #: so there is no separate expert-side compute for `megamoe_runtime.layer.ep` (Backend protocol)
    pairs = None
    shared_slot = None

    def __init__(self, device: Any = "cuda", *, max_num_tokens: int = 1024, group: Any = None,
                 fast_math: bool = True, check_device: bool = True, module: Any = None):
        self.device = torch.device(device)
        if check_device:
            ok = self.available(self.device)
            if ok is not True:
                raise BackendUnavailableError(ok)
        self.module = module if module is not None else import_deep_gemm()
        self.api = detect_api(self.module)
        #: compute capability major of a CUDA device (9: only fp8_mega_moe, 10: the SM100 kernels);
        #: None when the device check is off (stand-ins on CPU), where every entry is marshalled
        self.arch = (torch.cuda.get_device_capability(self.device)[0]
                     if check_device and self.device.type == "cuda" else None)
        if not self.api.functions and self.api.sm90_entry is None:
            raise BackendUnavailableError(
                f"deep_gemm ({getattr(self.module, '__file__', '?')}) has no mega MoE entry point "
                f"({', '.join(_ENTRY_NAMES)}); it is too old or built without the mega kernels")
        if int(max_num_tokens) < 1:
            raise MegaMoEError(f"max_num_tokens={max_num_tokens!r} must be >= 1")
        self.max_num_tokens = int(max_num_tokens)
        self._group = group
        self.fast_math = bool(fast_math)
        self._barrier_done = False
        self._x_bf16: dict[tuple, torch.Tensor] = {}
        self._dgv_cache: dict[int, tuple[int, float]] = {}

    # ------------------------------------------------------------------ availability

    @staticmethod
    def available(device: Any) -> Any:
        """True, or why DeepGEMM's mega kernels cannot run on ``device``."""
        dev = torch.device(device)
        try:
            import_deep_gemm()
        except BackendUnavailableError as e:
            return str(e)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return f"DeepGEMM mega kernels run on CUDA SM90 / SM100-family GPUs only; device is {dev}"
        major, minor = torch.cuda.get_device_capability(dev)
        if major == 9:
            mod = import_deep_gemm()
            if not callable(getattr(mod, _SM90_ENTRY, None)):
                return (f"on {torch.cuda.get_device_name(dev)} (sm_90) the deepgemm backend runs SGLang's "
                        f"{_SM90_ENTRY}, which this deep_gemm ({getattr(mod, '__file__', '?')}) lacks; "
                        f"pip install {_SGL_DEEP_GEMM_FOR_TORCH_2_11} (torch 2.11)")
            return True
        if major != 10:
            return (f"DeepGEMM mega kernels need an SM100-family GPU (B200/GB200/B300, sm_100/sm_103); "
                    f"{torch.cuda.get_device_name(dev)} is sm_{major}{minor}")
        return True

    # ------------------------------------------------------------------ support

    def supports(self, spec: Any) -> Any:
        """True, or a string naming what this DeepGEMM lacks for ``spec``."""
        api = self.api
        fn, why = api.entry_for(spec.row)
        if fn is None:
            return why
        if self.arch is not None and (self.arch == 9) != (fn == _SM90_ENTRY):
            return (f"row {spec.row} runs on DeepGEMM's {fn}, an {'SM90' if fn == _SM90_ENTRY else 'SM100'} "
                    f"kernel; this GPU is sm_{self.arch}x (on SM90 only the {SM90_ROW} row has a mega kernel)")
        if fn == _SM90_ENTRY:
            return self._sm90_supports(spec)
        act = spec.activation
        if act.kind == "situ":
            if spec.row_spec.mma_type != "fp8xfp4":
                return f"DeepGEMM runs SiTU only with fp8xfp4 (mxfp4 weights), not row {spec.row}"
            if api.situ_names(fn) is None:
                return (f"{fn} of this DeepGEMM ({api.flavour}) has no SiTU parameters "
                        f"(situ_beta/situ_linear_beta or activation_beta/activation_linear_beta)")
        elif not act.is_plain_swiglu and api.swiglu_ab_names(fn) is None:
            return (f"{fn} of this DeepGEMM ({api.flavour}) has no activation_alpha/activation_beta for "
                    f"SwiGLU alpha={act.alpha}, beta={act.beta}")
        if act.clamp is not None and fn != "nvfp4_mega_moe" and not api.accepts(fn, "activation_clamp"):
            return f"{fn} has no activation_clamp parameter"
        if fn == "fp4_fp4_mega_moe" and (spec.hidden % 512 or spec.intermediate % 512):
            return (f"newer DeepGEMM's fp4_fp4_mega_moe needs hidden and intermediate multiples of 512 "
                    f"(got {spec.hidden}, {spec.intermediate})")
        if spec.ep_size > 1 and self._group is None and not _dist_ready():
            return f"EP size {spec.ep_size} needs an initialised torch.distributed group"
        return True

    @staticmethod
    def _sm90_supports(spec: Any) -> Any:
        """fp8_mega_moe's limits (docs/KERNELS.md#sm90-fp8-mega): plain SwiGLU (+ clamp), H and I
        multiples of 128, H <= 8192 (pre-dispatch's one thread per 8 elements), top-k <= 32."""
        act = spec.activation
        if act.kind != "swiglu" or not act.is_plain_swiglu:
            return f"{_SM90_ENTRY} runs plain SwiGLU (optional clamp) only, not {act}"
        if spec.hidden % 128 or spec.intermediate % 128:
            return (f"{_SM90_ENTRY} needs hidden and intermediate multiples of 128 "
                    f"(got {spec.hidden}, {spec.intermediate})")
        if spec.hidden > 8192:
            return f"{_SM90_ENTRY}'s pre-dispatch quantizes hidden <= 8192 (got {spec.hidden})"
        if spec.top_k > 32:
            return f"{_SM90_ENTRY} combines at most 32 top-k slots (got top_k={spec.top_k})"
        return True

    def _shared_ok(self, spec: Any) -> tuple[bool, str]:
        if spec.shared is None:
            return False, "no shared experts"
        fn, why = self.api.entry_for(spec.row)
        if fn is None:
            return False, why
        if fn == _SM90_ENTRY:
            return False, f"{_SM90_ENTRY} has no shared-expert input; the shared expert runs outside it"
        prec = spec.shared.precision
        width = spec.shared.folded_intermediate
        if width % spec.intermediate:
            return False, (f"DeepGEMM folds shared experts in units of the routed intermediate {spec.intermediate}; "
                           f"shared width {width} is not a multiple")
        if fn == "nvfp4_mega_moe":
            if "shared_dtype" not in self.api.nvfp4_buffer_params and prec == "bf16":
                return False, "this NVFP4SymmBuffer has no shared_dtype (BF16 shared experts)"
            if prec == "mxfp8" and self.api.nvfp4_block_m_fn is None:
                return False, ("deep_gemm has no get_block_m_for_nvfp4_mega_moe, needed to lay out "
                               "shared_l1_acts_sf for fused FP8 shared experts of nvfp4_mega_moe")
            return (True, "") if prec in ("mxfp8", "bf16") else (False, f"nvfp4_mega_moe fuses mxfp8/bf16, not {prec}")
        if not self.api.accepts(fn, "shared_l1_weights"):
            return False, f"{fn} of this DeepGEMM ({self.api.flavour}) takes no shared_l1_weights"
        if fn == "fp4_fp4_mega_moe":
            if prec != "bf16":
                return False, "newer DeepGEMM's fp4_fp4_mega_moe fuses BF16 shared experts only (with x_bf16)"
            if width % 128:
                return False, "fp4_fp4_mega_moe needs S*I_s % 128 == 0"
            return True, ""
        if fn == "bf16_mega_moe":
            return (prec == "bf16", "" if prec == "bf16" else "bf16_mega_moe fuses BF16 shared experts only")
        if fn == "fp8_fp8_mega_moe":
            return False, "zyongye/DeepGEMM's fp8_fp8_mega_moe fuses no shared experts"
        if prec != "mxfp8":
            return False, f"{fn} fuses FP8 (MXFP8) shared experts only, not {prec}"
        if self.api.block_m_fn is None:
            return False, ("deep_gemm has no get_block_m_for_mega_moe, needed to lay out shared_l1_acts_sf "
                           "for fused FP8 shared experts")
        return True, ""

    def supports_fused_shared(self, spec: Any) -> bool:
        return self._shared_ok(spec)[0]

    def entry_point(self, spec: Any) -> Optional[str]:
        """The DeepGEMM function a layer of ``spec`` runs on (None: none here).
        For nvfp4 pass it as ``reference_forward(..., nvfp4_entry_point=...)``
        (or ``ReferenceBackend(nvfp4_entry_point=...)``): the two NVFP4 entry
        points take differently quantized x, and the reference models one."""
        return self.api.entry_for(spec.row)[0]

    def fused_shared_reason(self, spec: Any) -> str:
        """Why ``spec``'s shared expert cannot be fused ('' if it can)."""
        return self._shared_ok(spec)[1]

    # ------------------------------------------------------------------ buffers

    def _group_of(self, spec: Any) -> Any:
        if self._group is not None:
            return self._group
        if _dist_ready():
            import torch.distributed as dist

            return dist.group.WORLD
        if spec.ep_size > 1:
            raise BackendUnavailableError(f"EP size {spec.ep_size} needs torch.distributed to be initialised "
                                          "(or pass group= to the deepgemm backend)")
        return _LOCAL_GROUP

    def _sm90_group(self, spec: Any) -> Any:
        """A real process group: the SM90 buffer rendezvouses symmetric memory even for one rank."""
        if self._group is not None:
            return self._group
        import torch.distributed as dist

        if not _dist_ready():
            if spec.ep_size > 1:
                raise BackendUnavailableError(f"EP size {spec.ep_size} needs torch.distributed to be initialised "
                                              "(or pass group= to the deepgemm backend)")
            # one rank: a world-size-1 NCCL group over an in-process store (no port, no peer)
            dev = self.device if self.device.index is not None else torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        return dist.group.WORLD

    def _sm90_buffer(self, layer: Any) -> Any:
        spec = layer.spec
        group = self._sm90_group(spec)
        key = (id(group), str(self.device), _SM90_ENTRY, spec.num_experts, self.max_num_tokens, spec.top_k,
               spec.hidden, spec.intermediate)
        buf = _BUFFERS.get(key)
        if buf is None:
            buf = _BUFFERS[key] = self.api.sm90_buffer(group, spec.num_experts, self.max_num_tokens, spec.top_k,
                                                       spec.hidden, spec.intermediate)
        return buf

    def _buffer(self, layer: Any, fn: str) -> Any:
        if fn == _SM90_ENTRY:
            return self._sm90_buffer(layer)
        spec = layer.spec
        api = self.api
        group = self._group_of(spec)
        row = spec.row_spec
        shared = spec.shared if layer.shared_fused else None
        n_shared = 0 if shared is None else shared.folded_intermediate // spec.intermediate
        act = spec.activation.kind
        shared_dtype = None
        if fn == "nvfp4_mega_moe":
            factory, fparams = api.nvfp4_buffer, api.nvfp4_buffer_params
            if shared is not None:
                shared_dtype = get_row(shared.precision).weight.kernel_dtype  # bf16 | float8_e4m3fn
        else:
            factory, fparams = api.buffer_factory, api.buffer_params
        if factory is None:
            raise BackendUnavailableError("deep_gemm has neither get_symm_buffer_for_mega_moe nor SymmBuffer")
        key = (id(group), str(self.device), fn, spec.num_experts, self.max_num_tokens, spec.top_k, spec.hidden,
               spec.intermediate, n_shared, row.mma_type, act, shared_dtype)
        buf = _BUFFERS.get(key)
        if buf is not None:
            return buf
        kw: dict[str, Any] = {}
        if "num_shared_experts" in fparams:
            kw["num_shared_experts"] = n_shared
        elif n_shared:
            raise BackendUnavailableError(f"{getattr(factory, '__name__', factory)} has no num_shared_experts")
        if "mma_type" in fparams:
            kw["mma_type"] = row.mma_type
        elif "use_fp8_dispatch" in fparams:
            kw["use_fp8_dispatch"] = row.dispatch == "mxfp8"
        if "activation" in fparams:
            kw["activation"] = act
        if shared_dtype is not None:
            kw["shared_dtype"] = shared_dtype
        buf = factory(group, spec.num_experts, self.max_num_tokens, spec.top_k, spec.hidden, spec.intermediate, **kw)
        _BUFFERS[key] = buf
        return buf

    def prepare(self, layer: Any) -> Any:
        """Create (collectively) the symmetric buffer this layer uses, now."""
        fn, why = self.api.entry_for(layer.spec.row)
        if fn is None:
            raise BackendUnavailableError(why)
        return self._buffer(layer, fn)

    # ------------------------------------------------------------------ forward

    def forward(self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_input: Optional[torch.Tensor] = None) -> torch.Tensor:
        from ..format import codecs

        spec = layer.spec
        api = self.api
        fn, why = api.entry_for(spec.row)
        if fn is None:
            raise BackendUnavailableError(why)
        T, H = hidden_states.shape[0], spec.hidden
        if T > self.max_num_tokens:
            raise MegaMoEError(f"{T} tokens exceed the deepgemm backend's max_num_tokens={self.max_num_tokens}; "
                               "build the backend with a larger max_num_tokens (backend_kwargs)")
        if fn == _SM90_ENTRY:
            return self._forward_sm90(layer, hidden_states, topk_weights, topk_ids)
        buf = self._buffer(layer, fn)
        if T > buf.num_max_tokens_per_rank:
            raise MegaMoEError(f"{T} tokens exceed the symmetric buffer's {buf.num_max_tokens_per_rank} rows")
        row = spec.row_spec
        fused = bool(layer.shared_fused) and shared_input is not None
        dev = hidden_states.device

        # --- stage x / x_sf
        x = hidden_states.contiguous()
        if row.dispatch == "bf16":
            buf.x[:T].copy_(x)
        elif row.dispatch == "mxfp8":
            q, sf = codecs.quantize_mxfp8(x)
            buf.x[:T].copy_(q)
            buf.x_sf[:T].copy_(codecs.pack_bytes_int32(sf))
        else:
            # the entry point's dispatch convention, defined once in the reference
            # (reference.NVFP4_DISPATCH_BY_ENTRY): DGv nvfp4_mega_moe takes a per-token
            # FP32 scale in x_scales; upstream fp4_fp4_mega_moe takes x at global 1.0
            packed, sf, tok = quantize_dispatch_nvfp4(x, fn)
            buf.x[:T].copy_(packed.view(buf.x.dtype))
            buf.x_sf[:T].copy_(codecs.pack_bytes_int32(sf))
            if tok is not None:
                buf.x_scales[:T].copy_(tok)

        # --- stage routing: int64 ids, f32 weights; masked / padding: id -1, weight 0
        ids = topk_ids.to(device=dev, dtype=torch.int64)
        w = topk_weights.to(device=dev, dtype=torch.float32)
        rsf_in_kernel = fn == "fp4_fp4_mega_moe"
        if not rsf_in_kernel and spec.routed_scaling_factor != 1.0:
            # a Python scalar, multiplied in fp32 (as the reference folds it): no host tensor to copy
            w = w * float(spec.routed_scaling_factor)
        w = w.masked_fill(ids < 0, 0.0)
        buf.topk_idx[:T].copy_(ids)
        buf.topk_weights[:T].copy_(w)
        if T < buf.topk_idx.shape[0]:
            buf.topk_idx[T:].fill_(-1)
            buf.topk_weights[T:].fill_(0.0)

        # --- arguments
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        if row.has_scales:
            l1, l2 = (layer.l1_weight, layer.l1_scale), (layer.l2_weight, layer.l2_scale)
        else:
            l1, l2 = layer.l1_weight, layer.l2_weight
        kw: dict[str, Any] = {}
        act = spec.activation
        if fn != "nvfp4_mega_moe":
            if api.accepts(fn, "recipe"):
                kw["recipe"] = (1, 1, 16) if fn == "fp4_fp4_mega_moe" else (1, 1, 32)
            kw["activation"] = act.kind
        if act.clamp is not None or api.accepts(fn, "activation_clamp"):
            kw["activation_clamp"] = None if act.clamp is None else float(act.clamp)
        if api.accepts(fn, "fast_math"):
            kw["fast_math"] = self.fast_math
        if act.kind == "situ":
            a, b = api.situ_names(fn)
            kw[a], kw[b] = float(act.situ_beta), float(act.situ_linear_beta)
        elif not act.is_plain_swiglu:
            a, b = api.swiglu_ab_names(fn)
            kw[a], kw[b] = float(act.alpha), float(act.beta)
        elif fn == "nvfp4_mega_moe":
            kw["activation_alpha"], kw["activation_beta"] = 1.0, 0.0
        if fused:
            kw.update(self._shared_args(layer, fn, buf, x, T))
        if fn == "fp4_fp4_mega_moe":
            kw.update(l1_alphas=layer.l1_alpha, l2_alphas=layer.l2_global_scale, a2_scales=layer.a2_scales,
                      routed_scaling_factor=float(spec.routed_scaling_factor))
        elif fn == "nvfp4_mega_moe":
            kw.update(l1_alpha=layer.l1_alpha_gate, l2_alpha=layer.l2_alpha,
                      l2_activation_scale=self._dgv_a2(layer), use_x_scales=True)
        if layer.expert_recv_stats is not None:
            if not api.accepts(fn, "cumulative_local_expert_recv_stats"):
                raise BackendUnavailableError(
                    f"{fn} of this DeepGEMM ({api.flavour}) takes no cumulative_local_expert_recv_stats; "
                    "expert receive statistics need DeepGEMM from 2026-04-24 or later")
            kw["cumulative_local_expert_recv_stats"] = layer.expert_recv_stats
        kw = {k: v for k, v in kw.items() if api.accepts(fn, k)}

        if not self._barrier_done:
            # one-time: every rank has allocated, staged and loaded before the first launch
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            group = self._group_of(spec)
            group.barrier()
            self._barrier_done = True
        api.functions[fn](y, l1, l2, buf, **kw)
        return y

    def _forward_sm90(self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
        """Pre-dispatch then ``fp8_mega_moe`` on the layer's own tensors (docs/KERNELS.md#sm90-fp8-mega)."""
        spec = layer.spec
        T, H = hidden_states.shape[0], spec.hidden
        dev = hidden_states.device
        l1, l2 = sm90_weights(layer)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        if T == 0:
            return y
        buf = self._sm90_buffer(layer)
        x = hidden_states.to(torch.bfloat16).contiguous()
        ids = topk_ids.to(device=dev, dtype=torch.int32).contiguous()
        w = topk_weights.to(device=dev, dtype=torch.float32).masked_fill(ids < 0, 0.0).contiguous()
        rsf = float(spec.routed_scaling_factor)
        if self.api.sm90_pre_dispatch is not None:
            self.api.sm90_pre_dispatch(x, ids, w, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, T, 128, rsf)
        else:  # 0.1.3 has no pre-dispatch: stage the same values in torch
            stage_sm90_inputs(buf, x, ids, w, rsf)
        if not self._barrier_done:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self._sm90_group(spec).barrier()
            self._barrier_done = True
        clamp = spec.activation.clamp
        self.api.sm90_entry(y, l1, l2, buf, cumulative_local_expert_recv_stats=layer.expert_recv_stats,
                            recipe=_SM90_RECIPE, activation="swiglu",
                            activation_clamp=None if clamp is None else float(clamp), fast_math=self.fast_math)
        return y

    def _dgv_a2(self, layer: Any) -> float:
        """DGv's host-side a2 (and the gate == up check its 1-D l1_alpha needs),
        read once per load generation (CUDA-graph caveat in the module doc)."""
        gen = layer.load_generation
        cached = self._dgv_cache.get(id(layer))
        if cached is not None and cached[0] == gen:
            return cached[1]
        g, u = layer.l1_alpha[:, 0], layer.l1_alpha[:, 1]
        # the loaders' and converter's agreement rule (docs/SCALES.md#w1-w3-agreement): relative W13_RTOL; the gate
        # value is the one passed (l1_alpha_gate), as vLLM does
        bad = gate_up_disagreeing(g, u)
        if bad:
            raise LayerSpecError(f"{layer.prefix or 'layer'}: vllm-project/DeepGEMM's nvfp4_mega_moe takes one L1 "
                                 f"alpha per expert, but gate and up weight_scale_2 differ for local experts {bad[:8]} "
                                 f"(beyond relative {W13_RTOL:g}); re-convert with --on-scale-mismatch requantize")
        a2 = float(layer.l2_activation_scale)
        self._dgv_cache[id(layer)] = (gen, a2)
        return a2

    def _shared_args(self, layer: Any, fn: str, buf: Any, x: torch.Tensor, T: int) -> dict[str, Any]:
        from ..format import codecs

        spec = layer.spec
        prec = spec.shared.precision
        # SHARED_ROLES is KernelTensors order: l1 weight, l1 scale, l2 weight, l2 scale (bf16 has no scales)
        s1w, s1s, s2w, s2s = (getattr(layer, role, None) for role in SHARED_ROLES)
        if prec == "bf16":
            out: dict[str, Any] = {"shared_l1_weights": s1w, "shared_l2_weights": s2w}
            if fn == "fp4_fp4_mega_moe":
                key = (str(x.device), self.max_num_tokens, spec.hidden)
                xb = self._x_bf16.get(key)
                if xb is None:  # persistent: CUDA graphs burn in the x_bf16 allocation
                    xb = self._x_bf16[key] = torch.zeros(buf.num_max_tokens_per_rank, spec.hidden,
                                                         dtype=torch.bfloat16, device=x.device)
                xb[:T].copy_(x)
                out["x_bf16"] = xb
            elif fn == "nvfp4_mega_moe":
                buf.shared_l1_acts[:T].copy_(x)
            return out
        # MXFP8 shared: (weight, sf) pairs, activations in MXFP8 with their SF in the shared row map
        q, sf = codecs.quantize_mxfp8(x)
        if fn == "nvfp4_mega_moe":
            buf.shared_l1_acts[:T].copy_(q)
        group = self._group_of(spec)
        bm_args = (group.size(), spec.num_experts, buf.num_max_tokens_per_rank, T, spec.top_k)
        if fn == "nvfp4_mega_moe":  # DGv's NVFP4 kernel has its own block-M choice (no mma_type)
            bm_fn, bm_name = self.api.nvfp4_block_m_fn, "get_block_m_for_nvfp4_mega_moe"
        else:
            bm_fn, bm_name = self.api.block_m_fn, "get_block_m_for_mega_moe"
            bm_args += (spec.row_spec.mma_type,)
        if bm_fn is None:
            raise BackendUnavailableError(f"deep_gemm has no {bm_name} (needed for shared_l1_acts_sf)")
        rows = shared_sf_rows(T, int(bm_fn(*bm_args)), device=x.device)
        buf.shared_l1_acts_sf[rows] = codecs.pack_bytes_int32(sf)
        return {"shared_l1_weights": (s1w, s1s), "shared_l2_weights": (s2w, s2s)}


def sm90_weights(layer: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The layer's ``(l1_weight, l1_scale), (l2_weight, l2_scale)``, checked against what
    ``fp8_mega_moe`` reads through raw pointers (docs/KERNELS.md#weight-layout): E4M3
    ``[E_l, 2I, H]`` (gate/up interleaved by 8), fp32 ``[E_l, 2I/128, H/128]`` (gate blocks then
    up blocks), E4M3 ``[E_l, H, I]``, fp32 ``[E_l, H/128, I/128]``, all contiguous. A wrong
    shape, dtype or stride would be read as other bytes without any error, hence the check."""
    spec = layer.spec
    E, H, I = spec.experts_per_rank, spec.hidden, spec.intermediate
    want = {
        "l1_weight": ((E, 2 * I, H), torch.float8_e4m3fn),
        "l1_scale": ((E, 2 * I // 128, H // 128), torch.float32),
        "l2_weight": ((E, H, I), torch.float8_e4m3fn),
        "l2_scale": ((E, H // 128, I // 128), torch.float32),
    }
    got = {}
    for name, (shape, dtype) in want.items():
        t = getattr(layer, name, None)
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                or not t.is_contiguous()):
            desc = ("missing" if not isinstance(t, torch.Tensor) else
                    f"{t.dtype} {list(t.shape)} strides {list(t.stride())}")
            raise LayoutError(f"{getattr(layer, 'prefix', '') or 'layer'}.{name}: {_SM90_ENTRY} reads "
                              f"{dtype} {list(shape)} contiguous, the layer holds {desc}")
        got[name] = t
    return (got["l1_weight"], got["l1_scale"]), (got["l2_weight"], got["l2_scale"])


def stage_sm90_inputs(buf: Any, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, rsf: float) -> None:
    """What ``mega_moe_pre_dispatch_sm90`` writes, in torch (for builds without it): per 128
    elements ``s = max(amax, 1e-10) / 448``, ``x / s`` to E4M3; int64 ids; weights times the routed
    scaling factor; id -1 and weight 0 in the padded rows (docs/KERNELS.md#numerics)."""
    T, H = x.shape
    g = x.float().view(T, H // 128, 128)
    sf = g.abs().amax(-1).clamp_min(1e-10) / 448.0
    buf.x[:T].copy_((g / sf[..., None]).clamp(-448.0, 448.0).view(T, H).to(torch.float8_e4m3fn))
    buf.x_sf[:T].copy_(sf)
    buf.topk_idx[:T].copy_(ids)
    buf.topk_weights[:T].copy_(w * rsf)
    buf.topk_idx[T:].fill_(-1)
    buf.topk_weights[T:].fill_(0.0)


def _dist_ready() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:  # pragma: no cover
        return False
