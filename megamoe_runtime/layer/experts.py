"""`DeepGemmMegaMoEExperts`: one MoE layer's routed experts in DeepGEMM kernel layout.

Why this shape. DeepGEMM's mega kernels read the routed-expert weights in one
exact byte layout (docs/LAYOUT.md). This layer allocates those tensors ONCE,
at construction, as the very tensors a kernel reads (MN-major scale views over
contiguous physical storage, registered as parameters with
``requires_grad=False``), and every loader afterwards only ``copy_``s into
them. Nothing is reallocated or rebound at load or reload, so pointers
captured by a CUDA graph stay valid and a reload cannot leave a stale copy
behind (docs/RELOAD.md#storage-identity, #field-failures). The one transform:
a backend that reads the routed weights faster tiled (the triton backend on a
GPU) gets them rearranged in place after each load and restored before the
next load writes (``weight_tiles``; docs/LAYOUT.md#tiled-weights-in-memory).

Attributes (= manifest roles, `megamoe_runtime.format.manifest`):

* ``l1_weight [E_l, 2I, Dw]``, ``l2_weight [E_l, H, Iw]``: kernel dtype of the row.
* ``l1_scale [E_l, 2I, P1]`` / ``l2_scale [E_l, H, P2]``: int32 kernel views with
  strides ``(P*N, 1, N)``; ``layout.physical(p)`` (= ``p.transpose(-1, -2)``)
  is the contiguous storage a file tensor copies into. None for bf16; fp8_block: contiguous fp32
  ``[E_l, 2I/128, H/128]`` / ``[E_l, H/128, I/128]`` block scales (docs/LAYOUT.md#sm90-block-fp8).
* nvfp4: ``l1_alpha [E_l, 2]`` (gate, up ``weight_scale_2``) and
  ``l2_global_scale [E_l]`` (w2 ``weight_scale_2``) parameters, the buffer
  ``l2_activation_scale`` (0-d, a2 = max w2 input scale over ALL experts), and
  derived buffers the kernels read (``a2_scales [E_l]`` for newer DG,
  ``l2_alpha [E_l] = l2_global_scale * a2`` and ``l1_alpha_gate [E_l]`` for
  DGv). All are device tensors updated in place (``copy_``/``fill_``) at the
  end of every load, never rebound. CUDA-graph caveat: DGv's
  ``l2_activation_scale`` argument and newer DG's ``routed_scaling_factor``
  are HOST scalars baked into a captured graph; a reload that changes a2 (any
  w2 input scale) leaves such a graph stale -- re-capture after such a reload
  (``layer.load_generation`` counts loads, ``layer.host_scalars()`` shows the
  values a graph would have burnt in).
* shared expert, fused: ``shared_l1_weight``, ``shared_l1_scale``,
  ``shared_l2_weight``, ``shared_l2_scale`` (2-D). Unfused but present in the
  checkpoint: the same tensors live in ``layer.shared_mlp`` (a module the
  layer builds) and the forward adds its output once.

Shared-expert fusion is decided at construction, never at runtime: fused when
the shared MLP's weight dtype, scale dtype and shape match one of the row's
fusable specs AND the backend can run it in the same launch. Otherwise the
forward adds ``shared_experts(hidden_states)`` (or the layer-built shared MLP)
once. A fused layer refuses a shared module at forward time: that would count
the shared expert twice.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import knobs
from ..backends import get_backend
from ..errors import LayerSpecError, LayerUnusableError, LayoutError, MegaMoEError, ScaleError
from ..files.limits import MAX_LAYER_BYTES
from ..format import layout, scales, weight_tiles
from ..format.formats import LayerSpec, SharedSpec, get_row, spec_differences
from ..format.roles import KERNEL_ROLES, SCALAR_ROLES, SHARED_ROLES, STORAGE_CONTIGUOUS, is_shared_role, shared_role
from . import compiled, loaders

__all__ = ["DeepGemmMegaMoEExperts", "MegaMoESharedExpert"]


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
_libc: Any = None


#: `DeepGemmMegaMoEExperts.unusable_reason` of a layer allocated and not loaded yet: its parameters hold
#: whatever memory they were given (``init="empty"``) or zeros, not weights.
_NEVER_LOADED = "it was allocated and never loaded (its parameters hold no weights yet)"


def _advise_hugepages(t: torch.Tensor) -> None:
    """Opt-in (``MEGAMOE_THP=1``): ask Linux for transparent huge pages on a
    fresh, untouched CPU allocation.

    Expert parameters are large and live as long as the model: 2 MiB pages
    cut the page faults of the first load into fresh host memory (its
    dominant cost on CPU) and the TLB misses of every forward. Measured on a
    shared 2-core VM it made a first load 4x faster when huge pages were free
    but 2-3x slower when the kernel had to compact memory for them
    (``defrag=madvise`` compacts synchronously), hence off by default.
    """
    global _libc
    nbytes = t.untyped_storage().nbytes()
    if (t.device.type != "cpu" or nbytes < 2 * _HUGE or not sys.platform.startswith("linux")
            or knobs.value("MEGAMOE_THP") != "1"):
        return
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        ptr = t.untyped_storage().data_ptr()
        start = (ptr + _HUGE - 1) // _HUGE * _HUGE
        end = (ptr + nbytes) // _HUGE * _HUGE
        if end > start:
            _libc.madvise(start, end - start, _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # pragma: no cover - platform dependent
        pass


def _alloc_like_layout(row: Any, E_l: Optional[int], H: int, I: int, device: torch.device,
                       init: str) -> layout.KernelTensors:
    """Kernel tensors with layout's exact shapes and strides, materialized
    once on `device` (``empty_strided`` keeps the MN-major strides, so a scale
    view's ``transpose(-1, -2)`` is its contiguous physical storage).

    The size is known from the meta prototype before anything is allocated: beyond
    ``limits.MAX_LAYER_BYTES``, or when the allocator refuses, a LayerSpecError says how many bytes the spec
    needs (never torch's allocator traceback)."""
    proto = layout.allocate_kernel_tensors(row, E_l, H, I, "meta")
    if torch.device(device).type == "meta":
        return proto
    need = sum(t.untyped_storage().nbytes() for t in (getattr(proto, r) for r in KERNEL_ROLES) if t is not None)
    row_name = getattr(row, "name", row)
    what = f"{'shared expert' if E_l is None else f'{E_l} experts'} of hidden {H}, intermediate {I} ({row_name})"
    if need > MAX_LAYER_BYTES:
        raise LayerSpecError(f"{what} need {need} bytes, over megamoe's limit of {MAX_LAYER_BYTES} bytes per "
                             "layer and rank (megamoe_runtime.files.limits): not allocated")
    try:
        if init == "zeros":
            return layout.allocate_kernel_tensors(row, E_l, H, I, device)
        out = {}
        for role in KERNEL_ROLES:
            t = getattr(proto, role)
            if t is not None:
                t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                _advise_hugepages(t)
            out[role] = t
        return layout.KernelTensors(**out)
    except RuntimeError as e:  # torch.OutOfMemoryError included
        raise LayerSpecError(f"{what}: cannot allocate the {need} bytes they need on {device}: "
                             f"{str(e).splitlines()[0][:200]}") from None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# --------------------------------------------------------------------------- shared module inspection


def _find_proj(module: nn.Module, names: tuple[str, ...]) -> Optional[nn.Module]:
    for n in names:
        sub = getattr(module, n, None)
        if isinstance(sub, nn.Module) and isinstance(getattr(sub, "weight", None), torch.Tensor):
            return sub
    return None


def _describe_shared_module(module: nn.Module, hidden: int) -> tuple[Optional[SharedSpec], dict, str]:
    """(SharedSpec or None, canonical tensors, reason) for an engine's shared MLP.

    Recognises ``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``
    or a merged ``gate_up_proj`` (gate half first), each with ``.weight`` and,
    for MXFP8, ``.weight_scale`` (UE8M0 bytes per 32 along K). bf16 weights
    without scales -> "bf16"; e4m3 weights + UE8M0/32 -> "mxfp8"; anything else
    (fp8 with 128x128 block scales, fp16, ...) matches no fusable spec.
    """
    down = _find_proj(module, ("down_proj", "w2"))
    gate = _find_proj(module, ("gate_proj", "w1"))
    up = _find_proj(module, ("up_proj", "w3"))
    merged = _find_proj(module, ("gate_up_proj",))
    if down is None or ((gate is None or up is None) and merged is None):
        return None, {}, (f"{type(module).__name__} has no gate/up/down projections with a .weight "
                          "(expected gate_proj/up_proj/down_proj, w1/w3/w2 or gate_up_proj/down_proj)")

    def ws(m: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        s = getattr(m, "weight_scale", None)
        return m.weight.detach(), (s.detach() if isinstance(s, torch.Tensor) else None)

    dw, ds = ws(down)
    if merged is not None and (gate is None or up is None):
        mw, ms = ws(merged)
        n = mw.shape[0] // 2
        gw, uw = mw[:n], mw[n:]
        gs, us = (ms[:n], ms[n:]) if ms is not None else (None, None)
    else:
        (gw, gs), (uw, us) = ws(gate), ws(up)
    if getattr(down, "weight_scale_inv", None) is not None or getattr(gate or merged, "weight_scale_inv", None) is not None:
        return None, {}, "shared MLP uses 128x128 block FP8 scales (weight_scale_inv), not a fusable spec (bf16 or MXFP8 1x32)"
    if gw.dim() != 2 or dw.dim() != 2:
        return None, {}, "shared MLP weights are not 2-D"
    inter = int(gw.shape[0])
    if gw.dtype == torch.bfloat16 and uw.dtype == dw.dtype == torch.bfloat16 and gs is None and ds is None:
        precision = "bf16"
        shapes_ok = tuple(gw.shape) == (inter, hidden) == tuple(uw.shape) and tuple(dw.shape) == (hidden, inter)
    elif gw.dtype == uw.dtype == dw.dtype == torch.float8_e4m3fn and gs is not None and us is not None and ds is not None:
        precision = "mxfp8"
        sdt = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
        shapes_ok = (tuple(gw.shape) == (inter, hidden) == tuple(uw.shape) and tuple(dw.shape) == (hidden, inter)
                     and gs.dtype in sdt and us.dtype in sdt and ds.dtype in sdt
                     and tuple(gs.shape) == (inter, hidden // 32) == tuple(us.shape)
                     and tuple(ds.shape) == (hidden, inter // 32))
        if not shapes_ok:
            return None, {}, ("shared MLP is e4m3 but its scales are not UE8M0 bytes per 32 along K "
                              f"(gate scale {None if gs is None else (gs.dtype, tuple(gs.shape))})")
    else:
        return None, {}, (f"shared MLP weight dtype {gw.dtype} (scale "
                          f"{None if gs is None else gs.dtype}) matches no fusable spec (bf16, or e4m3 + UE8M0/32)")
    if not shapes_ok:
        return None, {}, (f"shared MLP shapes gate {tuple(gw.shape)}, up {tuple(uw.shape)}, down {tuple(dw.shape)} "
                          f"do not fit hidden={hidden}")
    try:
        sspec = SharedSpec(precision, 1, inter)
    except MegaMoEError as e:
        return None, {}, f"shared MLP cannot be folded into the kernel: {e}"
    return sspec, {"gate": (gw, gs), "up": (uw, us), "down": (dw, ds)}, ""


# --------------------------------------------------------------------------- the shared MLP the layer can build


class MegaMoESharedExpert(nn.Module):
    """The shared expert from the checkpoint, run outside the mega kernel.

    Built by the layer when the manifest holds shared weights but fusion is
    off (backend cannot fuse, or the caller said no). It owns the same 2-D
    kernel-layout tensors a fused layer would (so loading is identical) and
    computes the reference backend's shared-slot numerics.
    """

    def __init__(self, spec: LayerSpec, device: torch.device, init: str = "empty"):
        super().__init__()
        self.spec = spec
        sh = spec.shared
        kt = _alloc_like_layout(sh.precision, None, spec.hidden, sh.folded_intermediate, device, init)
        for role in KERNEL_ROLES:
            t = getattr(kt, role)
            self.register_parameter(shared_role(role), None if t is None else _frozen(t))

    def kernel_tensors(self) -> layout.KernelTensors:
        return layout.KernelTensors(*(getattr(self, r) for r in SHARED_ROLES))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from ..backends.reference import shared_slot

        kt = self.kernel_tensors()
        return shared_slot(self.spec, kt, hidden_states)


# --------------------------------------------------------------------------- the layer


class DeepGemmMegaMoEExperts(nn.Module):
    """The routed experts of one MoE layer on one EP rank, in kernel layout.

    Args:
        spec: the validated `LayerSpec` (row, sizes, activation, EP rank/size,
            shared spec when the checkpoint holds kernel-layout shared weights).
        device: where the parameters live (allocated here, once).
        backend: "auto" | "deepgemm" | "triton" | "reference" or a backend instance.
        shared_experts: an engine's shared MLP offered for fusion (only when
            ``spec.shared`` is None). Fused if it matches a fusable spec of the
            row and the backend supports it (its weights are then packed into
            this layer once); otherwise pass it to `forward` every call.
        fuse_shared: None = fuse when possible; False = never; True = fuse or raise.
        prefix: the MoE block's checkpoint prefix (``model.layers.3.mlp``);
            loaders route tensors by it.
        layer_index: the model's layer index (for messages and checkpoints).
        init: "empty" (default; loaders fill everything) or "zeros".
        backend_kwargs: passed to the backend constructor.
    """

    def __init__(self, spec: LayerSpec, *, device: Union[str, torch.device, None] = None,
                 backend: Any = "auto", shared_experts: Optional[nn.Module] = None,
                 fuse_shared: Optional[bool] = None, prefix: str = "", layer_index: Optional[int] = None,
                 init: str = "empty", backend_kwargs: Optional[dict] = None):
        super().__init__()
        if not isinstance(spec, LayerSpec):
            raise LayerSpecError(f"spec must be a megamoe_runtime.LayerSpec, got {type(spec).__name__}")
        if init not in ("empty", "zeros"):
            raise LayerSpecError(f"init={init!r}; valid: 'empty', 'zeros'")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        self.prefix = prefix
        self.layer_index = layer_index
        self._load_state: Optional[loaders.LoadState] = None
        self.load_generation = 0
        #: why the layer may not run (never loaded yet, or a load failed after writing started), None when usable
        self.unusable_reason: Optional[str] = _NEVER_LOADED
        #: int32 [E_l] ``cumulative_local_expert_recv_stats`` (DeepGEMM's name), or None: see
        #: `track_expert_recv_stats`.
        self.expert_recv_stats: Optional[torch.Tensor] = None
        #: rows per tile of the routed weights' in-memory arrangement (`megamoe_runtime.format.weight_tiles`): 0 while
        #: they hold the converted layout; the backend's ``weight_tiles`` choice after every successful load.
        self.weight_tiles = 0

        # Shared-expert fusion: decided here, once.
        module_tensors: Optional[dict] = None  # an engine's shared MLP that matches a fusable spec
        module_reason = "fusion disabled by the caller (fuse_shared=False)"
        spec_with_module = spec
        if spec.shared is not None and shared_experts is not None:
            raise LayerSpecError(
                "spec.shared is set (the checkpoint holds kernel-layout shared weights) and a shared_experts "
                "module was given too; use one source of shared experts"
            )
        if spec.shared is None and shared_experts is not None and fuse_shared is not False:
            sspec, tensors, module_reason = _describe_shared_module(shared_experts, spec.hidden)
            if sspec is not None:
                ok, module_reason = spec.row_spec.can_fuse_shared(sspec.precision)
                if ok:
                    try:
                        spec_with_module = LayerSpec.from_dict({**spec.to_dict(), "shared": sspec.to_dict()})
                        module_tensors = tensors
                    except MegaMoEError as e:
                        module_reason = str(e)
        self.spec = spec_with_module
        self.backend = get_backend(backend, dev, spec=self.spec, **(backend_kwargs or {}))
        #: this layer's name for ``torch.ops.megamoe.routed_experts`` (``compiled``: how torch.compile sees it)
        self.op_handle = compiled.register(self)

        fused, reason = False, "no shared experts"
        if self.spec.shared is not None:
            if fuse_shared is False:
                reason = "fusion disabled by the caller (fuse_shared=False)"
            elif not self.backend.supports_fused_shared(self.spec):
                why = getattr(self.backend, "fused_shared_reason", None)
                why = why(self.spec) if callable(why) else ""
                reason = (f"backend {self.backend.name!r} cannot fuse a {self.spec.shared.precision} shared expert"
                          + (f": {why}" if why else " here"))
            else:
                fused, reason = True, ""
        elif shared_experts is not None:
            reason = module_reason
        if fuse_shared is True and not fused:
            raise LayerSpecError(f"fuse_shared=True but the shared expert cannot be fused: {reason}")
        if module_tensors is not None and not fused:
            self.spec = spec  # the module stays outside; the layer's spec keeps no shared part
        self.shared_fused = fused
        self.shared_reason = reason
        self.shared_from_module = module_tensors is not None and fused

        row = self.spec.row_spec
        E_l, H, I = self.spec.experts_per_rank, self.spec.hidden, self.spec.intermediate
        kt = _alloc_like_layout(row, E_l, H, I, dev, init)
        for role in KERNEL_ROLES:
            t = getattr(kt, role)
            self.register_parameter(role, None if t is None else _frozen(t))
        if row.weight.has_global_scale:
            nan = float("nan")
            # NaN until loaded: a forward on never-loaded scales fails loudly.
            self.l1_alpha = _frozen(torch.full((E_l, 2), nan, dtype=torch.float32, device=dev))
            self.l2_global_scale = _frozen(torch.full((E_l,), nan, dtype=torch.float32, device=dev))
            self.register_buffer("l2_activation_scale", torch.full((), nan, dtype=torch.float32, device=dev))
            self.register_buffer("a2_scales", torch.full((E_l,), nan, dtype=torch.float32, device=dev),
                                 persistent=False)
            self.register_buffer("l2_alpha", torch.full((E_l,), nan, dtype=torch.float32, device=dev),
                                 persistent=False)
            self.register_buffer("l1_alpha_gate", torch.full((E_l,), nan, dtype=torch.float32, device=dev),
                                 persistent=False)

        self.shared_mlp: Optional[MegaMoESharedExpert] = None
        if self.spec.shared is not None:
            if fused:
                skt = _alloc_like_layout(self.spec.shared.precision, None, H,
                                         self.spec.shared.folded_intermediate, dev, init)
                for role in KERNEL_ROLES:
                    t = getattr(skt, role)
                    self.register_parameter(shared_role(role), None if t is None else _frozen(t))
            else:
                self.shared_mlp = MegaMoESharedExpert(self.spec, dev, init)
        if module_tensors is not None and fused:
            self._pack_shared_from_module(module_tensors)

    # ------------------------------------------------------------------ introspection

    @property
    def device(self) -> torch.device:
        return self.l1_weight.device

    def extra_repr(self) -> str:
        s = self.spec
        return (f"row={s.row}, hidden={s.hidden}, intermediate={s.intermediate}, experts={s.num_experts} "
                f"(local {s.local_experts.start}..{s.local_experts.stop - 1}), top_k={s.top_k}, "
                f"activation={s.activation.kind}, backend={self.backend.name}, shared_fused={self.shared_fused}"
                + (f", prefix={self.prefix!r}" if self.prefix else ""))

    def param_for_role(self, role: str) -> Optional[torch.Tensor]:
        """The tensor a manifest role loads into (None if this layer has none)."""
        if role in KERNEL_ROLES or role in SCALAR_ROLES:
            return getattr(self, role, None)
        if role in SHARED_ROLES:
            if self.shared_fused:
                return getattr(self, role, None)
            if self.shared_mlp is not None:
                return getattr(self.shared_mlp, role, None)
            return None
        if role == "l2_activation_scale":
            return getattr(self, "l2_activation_scale", None)
        raise LayoutError(f"unknown role {role!r}; valid: {', '.join(self.roles())}")

    def roles(self) -> list[str]:
        """Roles this layer loads (= the manifest roles it expects)."""
        out = [r for r in KERNEL_ROLES if getattr(self, r, None) is not None]
        if self.spec.row_spec.weight.has_global_scale:
            out += list(SCALAR_ROLES)
        if self.spec.shared is not None:
            out += [r for r in SHARED_ROLES if self.param_for_role(r) is not None]
        return out

    def checkpoint_roles(self) -> list[str]:
        """Roles a checkpoint load writes: `roles` minus a shared expert packed
        from an engine module at construction (the engine owns those weights)."""
        if self.shared_from_module:
            return [r for r in self.roles() if not is_shared_role(r)]
        return self.roles()

    def role_of(self, t: torch.Tensor) -> str:
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if p is t:
                return name
        return f"<tensor {list(t.shape)} {t.dtype}>"

    def kernel_tensors(self) -> layout.KernelTensors:
        """The routed kernel tensors (the parameters themselves, no copy)."""
        return layout.KernelTensors(self.l1_weight, self.l1_scale, self.l2_weight, self.l2_scale)

    def shared_kernel_tensors(self) -> Optional[layout.KernelTensors]:
        if self.shared_fused:
            return layout.KernelTensors(*(getattr(self, r) for r in SHARED_ROLES))
        if self.shared_mlp is not None:
            return self.shared_mlp.kernel_tensors()
        return None

    def storage_snapshot(self) -> dict[str, tuple]:
        """name -> (data_ptr, storage_offset, shape, stride, dtype, device) of
        every parameter and buffer: what a CUDA graph burns in. A reload must
        leave this unchanged."""
        return {n: (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                for n, t in list(self.named_parameters()) + list(self.named_buffers())}

    def host_scalars(self) -> dict[str, float]:
        """Host-side scalars a kernel call passes by value (captured by a CUDA
        graph at capture time): a2 for DGv's ``l2_activation_scale`` and
        newer DG's ``routed_scaling_factor``."""
        out = {"routed_scaling_factor": float(self.spec.routed_scaling_factor)}
        if self.spec.row_spec.weight.has_global_scale:
            out["l2_activation_scale"] = float(self.l2_activation_scale)
        return out

    # ------------------------------------------------------------------ loading

    def begin_load(self, mode: str = "stored") -> None:
        """Start a load pass (resets the per-load pending state: the w1/w3
        pairs and the a2 inputs of THIS load only)."""
        self._restore_converted_layout()
        self._load_state = loaders.LoadState(mode=mode)

    def _restore_converted_layout(self) -> None:
        """Loaders write the converted layout: a tiled arrangement goes back to it, in place, before the first
        write of any load (a partial reload then leaves no expert in the other arrangement). If no scratch can
        be allocated nothing moved and the layer stays as it was; a failure after bytes moved makes the layer
        unusable until a load succeeds."""
        self._backend_hook("weights_changing")
        wt = self.weight_tiles
        if not wt:
            return
        for i, w in enumerate((self.l1_weight, self.l2_weight)):
            try:
                with torch.no_grad():
                    weight_tiles.untile_in_place(w, wt, self._copy_bits())
            except weight_tiles.ScratchError:
                if i == 0:
                    raise
                self.mark_unusable("restoring the converted weight layout stopped half way (no scratch memory)")
                raise
            except BaseException as e:
                self.mark_unusable(f"restoring the converted weight layout failed: {type(e).__name__}: {e}")
                raise
        self.weight_tiles = 0

    def _copy_bits(self):
        """The backend's one-pass form of the tiled arrangement's E2M1 bit permutation (its
        ``copy_e2m1_bits``), or None for the format layer's torch steps."""
        return getattr(self.backend, "copy_e2m1_bits", None)

    def _arrange_for_backend(self) -> None:
        """After a successful load: the arrangement the backend reads fastest (its ``weight_tiles``), derived in
        place (same storage, one pass per tensor, `megamoe_runtime.format.weight_tiles`). The forward hands
        ``self.weight_tiles`` to the backend. Without scratch memory the layer keeps the converted layout (a
        warning; the forward is as correct, only slower)."""
        want = getattr(self.backend, "weight_tiles", None)
        wt = int(want(self.spec, self.device)) if callable(want) else 0
        if not wt or wt == self.weight_tiles or self.device.type == "meta":
            return
        self._restore_converted_layout()
        done = []
        for w in (self.l1_weight, self.l2_weight):
            try:
                with torch.no_grad():
                    weight_tiles.tile_in_place(w, wt, self._copy_bits())
            except weight_tiles.ScratchError as e:
                try:
                    with torch.no_grad():
                        for d in done:
                            weight_tiles.untile_in_place(d, wt, self._copy_bits())
                except BaseException:
                    self.mark_unusable(f"tiling the weights stopped half way ({e}) and undoing it failed")
                    raise
                import warnings

                warnings.warn(f"{self.prefix or 'layer'}: weights keep the converted layout: {e}")
                return
            except BaseException as e:
                self.mark_unusable(f"tiling the weights failed: {type(e).__name__}: {e}")
                raise
            done.append(w)
        self.weight_tiles = wt

    def _apply(self, fn, recurse=True):
        """A module-wide cast (``model.to(torch.float32)``, ``.half()``, ``.bfloat16()``) leaves this layer's
        tensors in their kernel dtypes and storage (E4M3 weights, fp32 scales and NVFP4 alphas cast to bf16
        broke the layer, or ran with rounded alphas); a device move or any other conversion still applies.
        Whether ``fn`` casts is read from an empty tensor of the same dtype and device."""
        kept: set[str] = set()

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            probe = fn(t.new_empty(0))
            if probe.dtype == t.dtype:
                return fn(t)
            kept.add(f"{t.dtype} -> {probe.dtype}")
            return t if probe.device == t.device else t.to(probe.device)

        out = super()._apply(keep_dtype, recurse)
        if kept:
            import warnings

            # the same text for every layer: Python shows it once per model cast, not once per layer
            warnings.warn(f"megamoe layers keep their kernel-layout dtypes: the cast ({', '.join(sorted(kept))}) "
                          "left their tensors as they were", stacklevel=3)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """A state dict holds the converted layout whatever the in-memory arrangement (converted copies of
        tiled weights), so it loads into any layer."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight_tiles:
            for name in ("l1_weight", "l2_weight"):
                destination[prefix + name] = weight_tiles.untiled_copy(getattr(self, name).detach(),
                                                                       self.weight_tiles)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """``load_state_dict`` is a load: restore the converted layout first; after it, the NVFP4 device scalars
        derived from the loaded ones are refreshed and, when the state dict held every entry of this layer (its
        shared expert's included), the load is complete (`_load_succeeded`: usable, ``load_generation``
        advances so a backend's cached host scalars are read again); then the backend's arrangement."""
        self._restore_converted_layout()
        complete = all(prefix + k in state_dict for k in self.state_dict(keep_vars=True))  # cheap: untiled now
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.refresh_derived_scalars()
        if complete:
            self._load_succeeded()
            return
        self._arrange_for_backend()
        self._backend_hook("weights_loaded")

    def load_state(self, mode: Optional[str] = None) -> Optional[loaders.LoadState]:
        """The pending state of the load pass in progress (the loaders' only
        way to it). With ``mode``, a pass is started if none is (a raw
        ``weight_loader`` call without `begin_load`, as vLLM makes them)."""
        if self._load_state is None and mode is not None:
            self._restore_converted_layout()
            self._load_state = loaders.LoadState(mode=mode)
        return self._load_state

    def abort_load(self) -> None:
        """Drop the pending state of a failed load pass (no scalar is finished from it)."""
        self._load_state = None

    def load_stored(self, role: str, tensor: torch.Tensor, *, storage: str = STORAGE_CONTIGUOUS,
                    experts: Optional[tuple[int, int]] = None, name: str = "") -> None:
        """Pre-laid-out load of one stored tensor (one ``copy_``), see `loaders.copy_stored`."""
        if not tensor.is_meta:  # a meta source is a dry run: it moves no byte
            self._restore_converted_layout()
        with torch.no_grad():
            loaders.copy_stored(self, role, tensor, storage=storage, experts=experts, name=name)

    def weight_loader(self, param: Optional[torch.Tensor], loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int) -> bool:
        """vLLM-style raw loader, see `loaders.raw_weight_loader`."""
        with torch.no_grad():
            return loaders.raw_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id)

    def shared_weight_loader(self, param: Optional[torch.Tensor], loaded_weight: torch.Tensor,
                             weight_name: str, shard_id: str) -> bool:
        """Raw loader for the shared expert, see `loaders.shared_weight_loader`."""
        with torch.no_grad():
            return loaders.shared_weight_loader(self, param, loaded_weight, weight_name, shard_id)

    def set_l2_activation_scale(self, a2: float) -> None:
        """Write a2 in place (the buffer keeps its storage). Outside a load pass
        the derived device scalars (``a2_scales``, ``l2_alpha``) are refreshed
        at once and ``load_generation`` advances, so a backend caching host
        scalars (DGv's ``l2_activation_scale``) re-reads it; inside a load,
        `finish_load` does both once at the end."""
        if not self.spec.row_spec.weight.has_global_scale:
            raise ScaleError(f"{self.prefix or 'layer'}: row {self.spec.row} has no l2_activation_scale (a2); only "
                             "nvfp4 layers take one")
        self._write_a2(a2)
        if self._load_state is None:
            self.refresh_derived_scalars()
            self.load_generation += 1

    def _write_a2(self, a2: float) -> None:
        if not scales.is_valid_fp32_scale(a2):
            raise ScaleError(f"{self.prefix or 'layer'}: l2_activation_scale (a2) = {a2!r}; must be "
                             f"{scales.SCALE_RULE} as a float32 (it is stored as one)")
        with torch.no_grad():
            self.l2_activation_scale.fill_(float(a2))

    def finish_load(self, scalars: Optional[dict] = None) -> None:
        """End a load pass: complete the raw path's NVFP4 checks (pairs, a2 over
        all experts), apply the manifest's scalars on the pre-laid-out path,
        check the NVFP4 scales are set, and refresh the derived device scalars
        in place. Also the vLLM ``process_weights_after_loading`` hook."""
        st, self._load_state = self._load_state, None
        nv = self.spec.row_spec.weight.has_global_scale
        if st is not None and st.mode == "raw":
            try:
                a2 = loaders.finish_raw_load(self, st, require_all=self.unusable_reason is not None)
            except BaseException as e:
                if st.written:  # the pass wrote: the layer holds what it wrote over what it had
                    self.mark_unusable(f"a raw load's final checks failed: {type(e).__name__}: {e}")
                raise
            if a2 is not None:
                self._write_a2(a2)
        if nv and scalars is not None:
            if "l2_activation_scale" not in scalars:
                raise ScaleError(f"{self.prefix or 'layer'}: the manifest scalars lack l2_activation_scale "
                                 f"(have {sorted(scalars)})")
            self._write_a2(float(scalars["l2_activation_scale"]))
        if nv:
            self._check_nv_scalars()
            self.refresh_derived_scalars()
        self._load_succeeded()

    process_weights_after_loading = finish_load

    def _load_succeeded(self) -> None:
        """The one place a load is declared complete: the layer is usable again and the generation advances
        (post-load hooks belong here)."""
        self.unusable_reason = None
        self.load_generation += 1
        self._arrange_for_backend()
        self._backend_hook("weights_loaded")

    def _backend_hook(self, name: str) -> None:
        """Let the backend keep facts it derives from the weights in step with them: ``weights_changing``
        before a load writes a byte, ``weights_loaded`` after a load succeeded (the triton backend's
        per-expert fold flags, `megamoe_runtime.backends.triton.moe.fold_flags`). Optional hooks."""
        fn = getattr(self.backend, name, None)
        if callable(fn) and self.device.type != "meta":
            fn(self)

    def mark_unusable(self, reason: str) -> None:
        """A load failed after it started writing: until a load succeeds, `forward` raises LayerUnusableError
        with `reason` instead of running on a mix of two checkpoints."""
        self.unusable_reason = reason

    def adopt_spec(self, spec: LayerSpec) -> None:
        """Take a spec that differs from the layer's only in semantic fields (top_k, activation,
        routed_scaling_factor; `formats.SEMANTIC_FIELDS`), as a reload with ``adopt_semantics=True`` does:
        afterwards the layer computes what a fresh build from that spec computes. Storage fields must be equal."""
        storage, _ = spec_differences(self.spec, spec, compare_shared=not self.shared_from_module)
        if storage:
            raise LayerSpecError(f"{self.prefix or 'layer'}: adopt_spec cannot change storage fields {storage}")
        sup = self.backend.supports(spec) if hasattr(self.backend, "supports") else True
        if sup is not True:
            raise LayerSpecError(f"{self.prefix or 'layer'}: backend {self.backend.name!r} cannot run {spec}: {sup}")
        self.spec = spec
        if self.shared_mlp is not None:
            self.shared_mlp.spec = spec

    def _check_nv_scalars(self) -> None:
        lo = self.spec.local_experts.start
        for name in SCALAR_ROLES:
            t = getattr(self, name)
            bad = ~(torch.isfinite(t) & (t >= scales.FP32_MIN_NORMAL))
            if bool(bad.any()):
                rows = bad.reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
                raise ScaleError(
                    f"{self.prefix or 'layer'}: {name} is unset or invalid for experts "
                    f"{[lo + r for r in rows[:8]]} (values {t[rows[:4]].tolist()}); every local expert's "
                    f"weight_scale_2 must be loaded, {scales.SCALE_RULE}")
        a2 = float(self.l2_activation_scale)
        if not scales.is_valid_scale(a2):
            raise ScaleError(f"{self.prefix or 'layer'}: l2_activation_scale (a2) = {a2!r} is unset or invalid")

    def refresh_derived_scalars(self) -> None:
        """Recompute the device scalars the kernels read, in place."""
        if not self.spec.row_spec.weight.has_global_scale:
            return
        with torch.no_grad():
            self.a2_scales.copy_(self.l2_activation_scale.expand_as(self.a2_scales))
            torch.mul(self.l2_global_scale, self.l2_activation_scale, out=self.l2_alpha)
            self.l1_alpha_gate.copy_(self.l1_alpha[:, 0])

    def _pack_shared_from_module(self, tensors: dict) -> None:
        from ..format.canonical import ExpertTensors, ProjectionTensors

        prec = self.spec.shared.precision

        def proj(key: str) -> ProjectionTensors:
            w, s = tensors[key]
            if get_row(prec).has_scales:  # a shared precision names the row whose 2-D layout it uses
                return ProjectionTensors(w.to(self.device), s.to(self.device).view(torch.uint8))
            return ProjectionTensors(w.to(self.device), None)

        ex = ExpertTensors(proj("gate"), proj("up"), proj("down"))
        with torch.no_grad():
            layout.write_expert(prec, self.shared_kernel_tensors(), None, ex, where="shared_experts module")

    def track_expert_recv_stats(self) -> torch.Tensor:
        """Start counting, per local expert, the (token, slot) pairs it receives
        from all ranks: DeepGEMM's ``cumulative_local_expert_recv_stats``
        (int32 ``[E_l]``, incremented by every forward, never reset; EPLB reads
        it). Returns the counter, zeroed; every backend updates the same tensor."""
        if self.expert_recv_stats is None:
            self.expert_recv_stats = torch.zeros(self.spec.experts_per_rank, dtype=torch.int32, device=self.device)
        else:
            self.expert_recv_stats.zero_()
        return self.expert_recv_stats

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_experts: Optional[nn.Module] = None) -> torch.Tensor:
        """bf16 ``[T, H]`` = routed experts (+ shared expert, once).

        hidden_states bf16 ``[T, H]``; topk_weights float32 ``[T, K]``; topk_ids
        integer ``[T, K]`` GLOBAL expert ids, -1 = masked slot.
        """
        spec = self.spec
        if self.unusable_reason is not None:
            raise LayerUnusableError(f"{self.prefix or 'layer'} is unusable: {self.unusable_reason}; load it "
                                     "(Checkpoint.load_layer, load_raw_weights, load_state_dict, or begin_load ... "
                                     "finish_load around your own copies) before running it")
        if self._load_state is not None:
            raise LayerUnusableError(
                f"{self.prefix or 'layer'}: a load pass is open (begin_load, or weight_loader calls, without "
                f"finish_load): its weights may be half written; call finish_load (vLLM: "
                "process_weights_after_loading) before running it")
        if self.shared_fused and shared_experts is not None:
            raise LayerSpecError(
                f"{self.prefix or 'layer'}: the shared expert is fused into this layer (decided at construction); "
                "passing shared_experts again would add it twice. Call forward without it."
            )
        if shared_experts is not None and self.shared_mlp is not None:
            raise LayerSpecError(
                f"{self.prefix or 'layer'}: this layer runs the checkpoint's shared expert itself (shared_mlp); "
                "passing shared_experts as well would add a shared expert twice"
            )
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 \
                or hidden_states.shape[1] != spec.hidden or hidden_states.dtype != torch.bfloat16:
            raise MegaMoEError(
                f"hidden_states must be bf16 [T, {spec.hidden}], got "
                f"{getattr(hidden_states, 'dtype', type(hidden_states).__name__)} "
                f"{list(getattr(hidden_states, 'shape', []))}")
        T = hidden_states.shape[0]
        for label, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if not isinstance(t, torch.Tensor):
                raise MegaMoEError(f"{label} must be a torch.Tensor [{T}, {spec.top_k}], got {type(t).__name__}")
        if topk_weights.shape != (T, spec.top_k) or topk_weights.dtype != torch.float32:
            raise MegaMoEError(f"topk_weights must be float32 [{T}, {spec.top_k}], got {topk_weights.dtype} "
                               f"{list(topk_weights.shape)}")
        if topk_ids.shape != (T, spec.top_k) or topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
            raise MegaMoEError(f"topk_ids must be integer [{T}, {spec.top_k}] global expert ids (-1 masked), "
                               f"got {topk_ids.dtype} {list(topk_ids.shape)}")
        for label, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if t.device != self.device:
                raise MegaMoEError(f"{label} is on {t.device} but the layer's parameters are on {self.device}")
        if knobs.value("MEGAMOE_CHECK_ROUTING") == "1" and not torch.compiler.is_compiling() and not (
                topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):  # eager only: it syncs the host
            from ..backends.reference import check_routing

            check_routing(spec, topk_ids)
        if spec.ep_size > 1 and not getattr(self.backend, "native_ep", False):
            # backends without their own dispatch/combine (reference, triton) go through the
            # portable expert-parallel path: pairs computed on their owning rank, combined here
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise MegaMoEError(
                    f"{self.prefix or 'layer'}: EP rank {spec.ep_rank} of {spec.ep_size} with the "
                    f"{self.backend.name!r} backend needs torch.distributed initialised (tokens are dispatched "
                    "to the ranks owning their experts); initialise the process group, or build with ep_size=1")
            from .ep import ep_forward

            return ep_forward(self, hidden_states, topk_weights, topk_ids, shared_experts=shared_experts,
                              recv_stats=self.expert_recv_stats)
        shared_input = hidden_states if self.shared_fused else None
        y = compiled.routed_call(self, hidden_states, topk_weights, topk_ids, shared_input)
        stats = self.expert_recv_stats
        if stats is not None and not getattr(self.backend, "counts_recv_stats", False):
            # fixed-shape scatter (other ranks' and masked ids into a spill bin): boolean-mask
            # indexing or bincount would have a data-dependent shape, i.e. a host sync per forward
            E_l = spec.experts_per_rank
            local = topk_ids.reshape(-1).to(torch.int64) - spec.local_experts.start
            local = local.masked_fill((local < 0) | (local >= E_l), E_l)
            counts = torch.zeros(E_l + 1, dtype=stats.dtype, device=stats.device)
            counts.scatter_add_(0, local, torch.ones_like(local, dtype=stats.dtype))
            stats.add_(counts[:E_l])
        extra = shared_experts if shared_experts is not None else self.shared_mlp
        if extra is not None:
            y = (y.to(torch.float32) + extra(hidden_states).to(torch.float32)).to(torch.bfloat16)
        return y
