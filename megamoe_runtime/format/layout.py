"""Checkpoint encoding <-> DeepGEMM MegaMoE kernel layout, both directions.

This is the only packing code in the project: the converter, the runtime's
raw (vLLM-style) weight loader and the inverse used by `verify` all call the
primitives below, so there is exactly one definition of where every byte goes.

What the kernels read (docs/LAYOUT.md), per routed expert stack
(`[E_l, ...]`) or 2-D shared expert (no expert dim):

* ``l1_weight [.., 2I, Dw]``: gate rows and up rows interleaved in groups of 8,
  ``gate n -> 16*(n//8) + n%8``, ``up m -> 16*(m//8) + 8 + m%8`` (`interleave_row`).
* ``l2_weight [.., H, Iw]``: unchanged.
* Scales (not bf16): per-group bytes packed four to an int32 (byte j of int p
  = group 4p+j), exposed as an MN-major kernel view ``[.., MN, P]`` with
  strides ``(P*MN, 1, MN)`` over a contiguous *physical* ``[.., P, MN]``, and
  rows permuted in 128-row blocks for UTCCP: logical row r is stored at
  ``(r & ~127) + (r%32)*4 + (r//32)%4`` (`utccp_row`). L1 scales are
  interleaved first, then UTCCP-permuted; L2 scales are UTCCP-permuted only.

Why strided views and not index tensors: each primitive is ONE ``copy_`` from
a source in checkpoint encoding into a strided view of the destination (or
out of it, for the readers). No index tensor, no full-size temporary, no
reallocation: the destination can be a slice of live, CUDA-graph-captured
storage, and a meta-tensor dry run sees exactly the writes a real load does.

Derivation of the L1 scale view. Write the gate/up source row as
``n = 64b + 16j + 8q + m`` (j<4, q<2, m<8) and half h (0 gate, 1 up). Then
``il(n) = 128b + 32j + 16q + 8h + m`` and ``utccp(il) = 128b + 64q + 32h + 4m + j``.
So the physical ``[P, 2I]`` viewed as ``[P, 2I/128, 2, 2, 8, 4]`` = (p, b, q, h, m, j),
with h selected and permuted to (b, j, q, m, p), lines up element for element
with the packed source ``[I, P]`` viewed as ``[I/64, 4, 2, 8, P]``.
L2 scale: source row ``r = 128b + 32j + i`` is stored at ``128b + 4i + j``, so
the physical ``[P, H]`` viewed ``[P, H/128, 32, 4]`` = (p, b, i, j) permuted to
(b, j, i, p) lines up with the source ``[H, P]`` viewed ``[H/128, 4, 32, P]``.
L1 weight: ``dst.view(2I/16, 2, 8, Dw)[:, h]`` lines up with ``src.view(I/8, 8, Dw)``.

Block-FP8 row (docs/LAYOUT.md#sm90-block-fp8): the scales are fp32 multipliers,
one per 128x128 weight block, kept unpacked and contiguous: ``l1_scale [.., 2I/128,
H/128]`` holds the gate blocks then the up blocks (NOT interleaved: the kernel
finds a gate row's block at ``n/128`` and its up block at ``I/128 + n/128``) and
``l2_scale [.., H/128, I/128]``; only the L1 weight rows are interleaved by 8, as
above. The scale primitives tell the two kinds apart by the destination's dtype
(int32 packed bytes vs float32 blocks); `block_fp8_kernel_layout` is the whole
transform as one pure function.

All primitives act on the last two dims and accept matching leading dims, so
the same call writes one expert (``kt.l1_weight[e]``), a 2-D shared expert,
or a whole stack at once.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ..errors import LayoutError
from .canonical import ExpertTensors, ProjectionTensors
from .formats import Row, get_row, nearest_multiples
from .roles import KERNEL_ROLES

__all__ = [
    "interleave_row",
    "l1_half_row_runs",
    "deinterleave_row",
    "utccp_row",
    "KernelTensors",
    "allocate_kernel_tensors",
    "allocate_scale",
    "physical",
    "kernel_view_from_physical",
    "check_kernel_strides",
    "check_kernel_tensors",
    "kernel_shapes",
    "write_l1_weight",
    "write_l1_scale",
    "write_l2_weight",
    "write_l2_scale",
    "read_l1_weight",
    "read_l1_scale",
    "read_l2_scale",
    "write_expert",
    "write_expert_scales",
    "read_expert",
    "pack_expert_stack",
    "unpack_expert_stack",
    "pack_shared",
    "unpack_shared",
    "fold_shared",
    "block_fp8_kernel_layout",
    "block_fp8_canonical",
]

_UTCCP_BLOCK = 128
_INTERLEAVE = 8


def _codecs():
    # Imported lazily: codecs is written alongside this module and its import
    # must not be a hard dependency of merely importing layout.
    from . import codecs

    return codecs


# --------------------------------------------------------------------------- index maps


def interleave_row(n: int, intermediate: int) -> int:
    """Kernel row of logical L1 row n (n < I gate, else up row n - I)."""
    I = intermediate
    if not 0 <= n < 2 * I:
        raise LayoutError(f"interleave_row: n={n} out of range [0, {2 * I})")
    if n < I:
        return 16 * (n // 8) + n % 8
    m = n - I
    return 16 * (m // 8) + 8 + m % 8


def l1_half_row_runs(intermediate: int, half: int) -> list[tuple[int, int, int]]:
    """``(source row, kernel row, rows)`` runs of the gate (``half`` 0) or up
    (1) weight that stay contiguous under interleave8 (8 rows each), in source
    order: where a reader that fills the kernel buffer itself (the converter's
    direct reads) puts each run, from `interleave_row` rather than re-derived."""
    if half not in (0, 1) or intermediate % 8:
        raise LayoutError(f"l1_half_row_runs: half={half!r} (0 gate, 1 up), intermediate={intermediate} (needs % 8)")
    return [(s, interleave_row(s + half * intermediate, intermediate), 8) for s in range(0, intermediate, 8)]


def deinterleave_row(r: int, intermediate: int) -> int:
    """Inverse of `interleave_row`: logical L1 row stored at kernel row r."""
    I = intermediate
    if not 0 <= r < 2 * I:
        raise LayoutError(f"deinterleave_row: r={r} out of range [0, {2 * I})")
    blk, rem = divmod(r, 16)
    half, m = divmod(rem, 8)
    return half * I + 8 * blk + m


def utccp_row(r: int) -> int:
    """Physical position of logical scale row r: 128-row blocks viewed (4, 32), transposed."""
    return (r & ~127) + (r % 32) * 4 + (r // 32) % 4


# --------------------------------------------------------------------------- kernel tensors


@dataclass
class KernelTensors:
    """The four kernel-layout tensors of one routed stack ([E_l, ...]) or one
    2-D shared expert. Scales are MN-major kernel views (None for bf16)."""

    l1_weight: torch.Tensor
    l1_scale: torch.Tensor | None
    l2_weight: torch.Tensor
    l2_scale: torch.Tensor | None

    def named(self) -> dict[str, torch.Tensor]:
        """role -> tensor, scales omitted when absent (bf16)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def is_stack(self) -> bool:
        return self.l1_weight.dim() == 3

    @property
    def num_experts(self) -> int | None:
        return int(self.l1_weight.shape[0]) if self.is_stack else None

    @property
    def hidden(self) -> int:
        return int(self.l2_weight.shape[-2])

    @property
    def intermediate(self) -> int:
        return int(self.l1_weight.shape[-2]) // 2

    def experts(self, lo: int, hi: int) -> "KernelTensors":
        """Views of experts [lo, hi) of a stack: the converter streams a layer through
        buffers of a few experts, and each role's bytes for consecutive experts are
        one contiguous run of its stored tensor (the expert dim leads, scales too)."""
        if not self.is_stack:
            raise LayoutError("KernelTensors.experts: not an expert stack")
        return KernelTensors(*(None if t is None else t[lo:hi] for t in
                               (self.l1_weight, self.l1_scale, self.l2_weight, self.l2_scale)))

    def expert(self, e: int) -> "KernelTensors":
        """Views of expert e of a stack (2-D, writes go to the stack)."""
        if not self.is_stack:
            raise LayoutError("KernelTensors.expert: not an expert stack")
        return KernelTensors(*(None if t is None else t[e] for t in
                               (self.l1_weight, self.l1_scale, self.l2_weight, self.l2_scale)))


def _align4(x: int) -> int:
    return (x + 3) // 4 * 4


def allocate_scale(lead: tuple[int, ...], mn: int, p: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Zeroed int32 kernel view [*lead, mn, p] over a contiguous physical [*lead, p, mn]."""
    if mn % 4:
        raise LayoutError(f"scale MN={mn} must be a multiple of 4 (TMA alignment)")
    return torch.zeros((*lead, p, mn), dtype=torch.int32, device=device).transpose(-1, -2)


def kernel_shapes(row: "Row | str", num_experts: int | None, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """role -> kernel shape (scales: logical [.., MN, P])."""
    row = get_row(row)
    w = row.weight
    lead = () if num_experts is None else (num_experts,)
    out = {
        "l1_weight": (*lead, 2 * intermediate, w.stored_cols(hidden)),
        "l2_weight": (*lead, hidden, w.stored_cols(intermediate)),
    }
    if w.block_scaled:
        b = w.scale_block_rows
        out["l1_scale"] = (*lead, 2 * intermediate // b, hidden // w.scale_group)
        out["l2_scale"] = (*lead, hidden // b, intermediate // w.scale_group)
    elif w.has_scales:
        out["l1_scale"] = (*lead, 2 * intermediate, w.scale_ints(hidden))
        out["l2_scale"] = (*lead, hidden, w.scale_ints(intermediate))
    return out


def _check_layout_sizes(row: Row, hidden: int, intermediate: int, where: str) -> None:
    w = row.weight
    for label, v in (("hidden", hidden), ("intermediate", intermediate)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise LayoutError(f"{where}: {label}={v!r} must be a positive int")
    if intermediate % _INTERLEAVE:
        raise LayoutError(
            f"{where}: intermediate={intermediate} must be a multiple of 8 for the gate/up interleave; "
            f"nearest valid: {nearest_multiples(intermediate, 8)}"
        )
    if w.block_scaled:
        b = w.scale_block_rows
        if hidden % b or intermediate % b:
            raise LayoutError(
                f"{where}: hidden={hidden} and intermediate={intermediate} must be multiples of the "
                f"{b}x{b} scale block of row {row.name}; nearest valid: hidden {nearest_multiples(hidden, b)}, "
                f"intermediate {nearest_multiples(intermediate, b)}"
            )
    elif w.has_scales:
        if (2 * intermediate) % _UTCCP_BLOCK:
            raise LayoutError(
                f"{where}: UTCCP needs 2*intermediate to be a multiple of 128 (got intermediate={intermediate}; "
                f"nearest valid: {nearest_multiples(intermediate, 64)})"
            )
        if hidden % _UTCCP_BLOCK:
            raise LayoutError(
                f"{where}: UTCCP needs hidden to be a multiple of 128 (got hidden={hidden}; "
                f"nearest valid: {nearest_multiples(hidden, 128)})"
            )
        g = w.scale_group
        if hidden % g or intermediate % g:
            raise LayoutError(
                f"{where}: hidden={hidden} and intermediate={intermediate} must be multiples of the "
                f"scale group {g} of row {row.name}"
            )


def allocate_kernel_tensors(
    row: "Row | str",
    E_l: int | None,
    H: int,
    I: int,
    device: torch.device | str | None = None,
) -> KernelTensors:
    """Zeroed kernel tensors for E_l experts (E_l=None: one 2-D shared expert).

    Allocated once; loaders then `copy_` into them, so storage is never rebound.
    """
    row = get_row(row)
    _check_layout_sizes(row, H, I, f"allocate_kernel_tensors(row={row.name})")
    shapes = kernel_shapes(row, E_l, H, I)
    dt = row.weight.kernel_dtype
    lead = () if E_l is None else (E_l,)
    l1w = torch.zeros(shapes["l1_weight"], dtype=dt, device=device)
    l2w = torch.zeros(shapes["l2_weight"], dtype=dt, device=device)
    l1s = l2s = None
    if row.weight.block_scaled:
        l1s = torch.zeros(shapes["l1_scale"], dtype=torch.float32, device=device)
        l2s = torch.zeros(shapes["l2_scale"], dtype=torch.float32, device=device)
    elif row.has_scales:
        l1s = allocate_scale(lead, 2 * I, shapes["l1_scale"][-1], device)
        l2s = allocate_scale(lead, H, shapes["l2_scale"][-1], device)
    return KernelTensors(l1w, l1s, l2w, l2s)


def physical(sf: torch.Tensor) -> torch.Tensor:
    """The contiguous physical [.., P, MN] base of an MN-major kernel view.

    This is what goes to disk (safetensors stores contiguous tensors only).
    """
    p = sf.transpose(-1, -2)
    if not p.is_contiguous():
        raise LayoutError(
            f"physical: scale view {list(sf.shape)} with strides {list(sf.stride())} is not MN-major "
            f"over a contiguous base"
        )
    return p


def kernel_view_from_physical(phys: torch.Tensor) -> torch.Tensor:
    """MN-major kernel view [.., MN, P] of a contiguous physical [.., P, MN] (no copy)."""
    if not phys.is_contiguous():
        raise LayoutError(
            f"kernel_view_from_physical: physical tensor {list(phys.shape)} must be contiguous "
            f"(strides {list(phys.stride())})"
        )
    return phys.transpose(-1, -2)


def check_kernel_strides(t: torch.Tensor, name: str) -> None:
    """DeepGEMM's check_sf_layout rule for a packed scale kernel view.

    int32; stride(-2) == 1; stride(-1) == align(MN, 4); for 3-D,
    stride(-3) == stride(-1) * size(-1).
    """
    if t.dtype != torch.int32:
        raise LayoutError(f"{name}: scale dtype {t.dtype}, expected torch.int32 (packed bytes)")
    if t.dim() not in (2, 3):
        raise LayoutError(f"{name}: scale must be 2-D or 3-D, got shape {list(t.shape)}")
    mn, p = t.shape[-2], t.shape[-1]
    a = _align4(mn)
    s = t.stride()
    if s[-2] != 1 or s[-1] != a or (t.dim() == 3 and s[-3] != s[-1] * p):
        want = (a * p, 1, a) if t.dim() == 3 else (1, a)
        raise LayoutError(
            f"{name}: shape {list(t.shape)} has strides {list(s)}; DeepGEMM needs MN-major TMA-aligned "
            f"strides {list(want)} (use allocate_scale / kernel_view_from_physical)"
        )


def check_kernel_tensors(
    row: "Row | str", kt: KernelTensors, E_l: int | None, H: int, I: int, where: str = "kernel tensors"
) -> None:
    """Shapes, dtypes and scale strides of `kt` against (row, E_l, H, I)."""
    row = get_row(row)
    shapes = kernel_shapes(row, E_l, H, I)
    for role in KERNEL_ROLES:
        t = getattr(kt, role)
        if role not in shapes:
            if t is not None:
                raise LayoutError(f"{where}.{role}: row {row.name} has no scales, got {list(t.shape)}")
            continue
        if t is None:
            raise LayoutError(f"{where}.{role}: missing (row {row.name} needs {list(shapes[role])})")
        if tuple(t.shape) != shapes[role]:
            raise LayoutError(f"{where}.{role}: shape {list(t.shape)} != expected {list(shapes[role])}")
        if role.endswith("scale") and row.weight.block_scaled:
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise LayoutError(f"{where}.{role}: block scales must be contiguous float32, got {t.dtype} "
                                  f"strides {list(t.stride())}")
        elif role.endswith("scale"):
            check_kernel_strides(t, f"{where}.{role}")
        elif t.dtype != row.weight.kernel_dtype:
            raise LayoutError(f"{where}.{role}: dtype {t.dtype} != {row.weight.kernel_dtype} for row {row.name}")


# --------------------------------------------------------------------------- source coercion

_SCALE_BYTE_DTYPES = tuple(
    d for d in (torch.uint8, torch.int8, torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", None)) if d is not None
)


def _as_kernel_dtype(src: torch.Tensor, kdtype: torch.dtype, where: str) -> torch.Tensor:
    """Reinterpret (never convert) checkpoint bytes as the kernel dtype."""
    if src.dtype == kdtype:
        return src
    if kdtype == torch.int8 and src.dtype == torch.uint8:
        return src.view(torch.int8)
    if kdtype == torch.float8_e4m3fn and src.dtype in (torch.uint8, torch.int8):
        return src.view(kdtype)
    raise LayoutError(f"{where}: source dtype {src.dtype} cannot be stored as kernel dtype {kdtype}")


def _checkpoint_dtype(kdtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if kdtype == torch.int8 else kdtype


def _check_half(half: int, where: str) -> None:
    if half not in (0, 1):
        raise LayoutError(f"{where}: half={half!r}; valid: 0 (gate, w1) or 1 (up, w3)")


def _expect_shape(t: torch.Tensor, shape: tuple[int, ...], where: str, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise LayoutError(f"{where}: {what} shape {list(t.shape)} != expected {list(shape)}")


def _packed_scale(src: torch.Tensor, p: int, where: str) -> torch.Tensor:
    """Per-group scale bytes [.., rows, G] -> int32 [.., rows, P]; int32 passes through."""
    if src.dtype == torch.int32:
        if src.shape[-1] != p:
            raise LayoutError(f"{where}: packed int32 scale has {src.shape[-1]} columns, expected P={p}")
        return src
    if src.dtype not in _SCALE_BYTE_DTYPES:
        raise LayoutError(
            f"{where}: scale source dtype {src.dtype}; expected per-group bytes "
            f"(uint8 / float8_e4m3fn / float8_e8m0fnu) or packed int32"
        )
    g = src.shape[-1]
    if -(-g // 4) != p:
        raise LayoutError(f"{where}: {g} scale groups per row pack to {-(-g // 4)} int32, expected P={p}")
    return _codecs().pack_bytes_int32(src.view(torch.uint8))


def _check_scale_dst(kv: torch.Tensor, where: str) -> None:
    if kv.dtype != torch.int32:
        raise LayoutError(f"{where}: destination scale dtype {kv.dtype}, expected torch.int32 kernel view")
    if kv.dim() < 2:
        raise LayoutError(f"{where}: destination scale must be at least 2-D, got {list(kv.shape)}")


# --------------------------------------------------------------------------- views


def _l1_weight_view(dst: torch.Tensor, half: int) -> torch.Tensor:
    n2 = dst.shape[-2]
    return dst.unflatten(-2, (n2 // 16, 2, 8)).select(-3, half)  # [.., I/8, 8, Dw]


def _l1_scale_view(kv: torch.Tensor, half: int) -> torch.Tensor:
    n2 = kv.shape[-2]
    v = kv.transpose(-1, -2).unflatten(-1, (n2 // 128, 2, 2, 8, 4))  # (.., p, b, q, h, m, j)
    v = v.select(-3, half)  # (.., p, b, q, m, j)
    nd = v.dim()
    lead = list(range(nd - 5))
    return v.permute(*lead, nd - 4, nd - 1, nd - 3, nd - 2, nd - 5)  # (.., b, j, q, m, p)


def _l2_scale_view(kv: torch.Tensor) -> torch.Tensor:
    h = kv.shape[-2]
    v = kv.transpose(-1, -2).unflatten(-1, (h // 128, 32, 4))  # (.., p, b, i, j)
    nd = v.dim()
    lead = list(range(nd - 4))
    return v.permute(*lead, nd - 3, nd - 1, nd - 2, nd - 4)  # (.., b, j, i, p)


def _block_scale_src(src: torch.Tensor, where: str) -> torch.Tensor:
    """fp32 block scales as they are; bf16 / fp16 widen exactly; anything else is refused."""
    if src.dtype == torch.float32:
        return src
    if src.dtype in (torch.bfloat16, torch.float16):
        return src.to(torch.float32)
    raise LayoutError(f"{where}: block scale source dtype {src.dtype}; expected float32 (or bf16 / fp16, widened "
                      "exactly)")


def _block_scale_shaped(src: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``src`` viewed with ``shape`` when it is that grid with its size-1 dims dropped (transformers' saved
    per-expert scales, docs/CHECKPOINTS.md#block-fp8); otherwise as it is, for the shape check to name."""
    if tuple(src.shape) != tuple(shape) and tuple(src.shape) == tuple(d for d in shape if d != 1):
        return src.reshape(shape)
    return src


def _l1_block_half(l1_scale_e: torch.Tensor, half: int, where: str) -> torch.Tensor:
    """The gate (half 0) or up (1) rows of an fp32 L1 block-scale tensor [.., 2I/128, H/128]."""
    nb2 = l1_scale_e.shape[-2]
    if l1_scale_e.dim() < 2 or nb2 % 2:
        raise LayoutError(f"{where}: block scale {list(l1_scale_e.shape)} needs an even number of row blocks")
    return l1_scale_e.narrow(-2, half * (nb2 // 2), nb2 // 2)


# --------------------------------------------------------------------------- write primitives


def write_l1_weight(l1_weight_e: torch.Tensor, src: torch.Tensor, half: int, *, where: str = "l1_weight") -> None:
    """Copy gate (half=0) or up (half=1) rows [.., I, Dw] into kernel rows [.., 2I, Dw], interleaved by 8."""
    _check_half(half, where)
    n2, dw = l1_weight_e.shape[-2:]
    if n2 % 16:
        raise LayoutError(f"{where}: 2I={n2} must be a multiple of 16 (interleave by 8)")
    src = _as_kernel_dtype(src, l1_weight_e.dtype, where)
    _expect_shape(src, (*l1_weight_e.shape[:-2], n2 // 2, dw), where, "source")
    _l1_weight_view(l1_weight_e, half).copy_(src.unflatten(-2, (n2 // 16, 8)))


def write_l1_scale(l1_scale_e: torch.Tensor, src_bytes: torch.Tensor, half: int, *, where: str = "l1_scale") -> None:
    """Copy gate/up scale bytes [.., I, G] (or packed int32 [.., I, P]) into the
    L1 scale kernel view [.., 2I, P]: pack, interleave, UTCCP in one copy_."""
    _check_half(half, where)
    if l1_scale_e.dtype == torch.float32:
        dst = _l1_block_half(l1_scale_e, half, where)
        src = _block_scale_shaped(_block_scale_src(src_bytes, where), tuple(dst.shape))
        _expect_shape(src, tuple(dst.shape), where, "block scale source")
        dst.copy_(src)
        return
    _check_scale_dst(l1_scale_e, where)
    n2, p = l1_scale_e.shape[-2:]
    if n2 % 128:
        raise LayoutError(f"{where}: 2I={n2} must be a multiple of 128 for UTCCP")
    src = _packed_scale(src_bytes, p, where)
    _expect_shape(src, (*l1_scale_e.shape[:-2], n2 // 2, p), where, "packed source")
    _l1_scale_view(l1_scale_e, half).copy_(src.unflatten(-2, (n2 // 128, 4, 2, 8)))


def write_l2_weight(l2_weight_e: torch.Tensor, src: torch.Tensor, *, where: str = "l2_weight") -> None:
    """Copy down weight [.., H, Iw] unchanged (bytes reinterpreted as the kernel dtype)."""
    src = _as_kernel_dtype(src, l2_weight_e.dtype, where)
    _expect_shape(src, tuple(l2_weight_e.shape), where, "source")
    l2_weight_e.copy_(src)


def write_l2_scale(l2_scale_e: torch.Tensor, src_bytes: torch.Tensor, *, where: str = "l2_scale") -> None:
    """Copy down scale bytes [.., H, G] into the L2 scale kernel view [.., H, P]: pack + UTCCP
    (block-FP8: fp32 [.., H/128, I/128] copied unchanged)."""
    if l2_scale_e.dtype == torch.float32:
        src = _block_scale_shaped(_block_scale_src(src_bytes, where), tuple(l2_scale_e.shape))
        _expect_shape(src, tuple(l2_scale_e.shape), where, "block scale source")
        l2_scale_e.copy_(src)
        return
    _check_scale_dst(l2_scale_e, where)
    h, p = l2_scale_e.shape[-2:]
    if h % 128:
        raise LayoutError(f"{where}: H={h} must be a multiple of 128 for UTCCP")
    src = _packed_scale(src_bytes, p, where)
    _expect_shape(src, tuple(l2_scale_e.shape), where, "packed source")
    _l2_scale_view(l2_scale_e).copy_(src.unflatten(-2, (h // 128, 4, 32)))


# --------------------------------------------------------------------------- read primitives


def read_l1_weight(l1_weight_e: torch.Tensor, half: int, *, where: str = "l1_weight") -> torch.Tensor:
    """Gate (0) or up (1) rows [.., I, Dw] in checkpoint encoding (e2m1 as uint8)."""
    _check_half(half, where)
    n2, dw = l1_weight_e.shape[-2:]
    if n2 % 16:
        raise LayoutError(f"{where}: 2I={n2} must be a multiple of 16")
    out = torch.empty((*l1_weight_e.shape[:-2], n2 // 2, dw), dtype=l1_weight_e.dtype, device=l1_weight_e.device)
    out.unflatten(-2, (n2 // 16, 8)).copy_(_l1_weight_view(l1_weight_e, half))
    return out.view(_checkpoint_dtype(l1_weight_e.dtype))


def _read_l1_scale_packed(l1_scale_e: torch.Tensor, half: int, *, where: str = "l1_scale") -> torch.Tensor:
    """Gate/up packed int32 [.., I, P], row-major, in checkpoint row order
    (block-FP8: the fp32 block scales [.., I/128, H/128], a copy)."""
    _check_half(half, where)
    if l1_scale_e.dtype == torch.float32:
        return _l1_block_half(l1_scale_e, half, where).clone(memory_format=torch.contiguous_format)
    _check_scale_dst(l1_scale_e, where)
    n2, p = l1_scale_e.shape[-2:]
    if n2 % 128:
        raise LayoutError(f"{where}: 2I={n2} must be a multiple of 128 for UTCCP")
    out = torch.empty((*l1_scale_e.shape[:-2], n2 // 2, p), dtype=torch.int32, device=l1_scale_e.device)
    out.unflatten(-2, (n2 // 128, 4, 2, 8)).copy_(_l1_scale_view(l1_scale_e, half))
    return out


def read_l1_scale(
    l1_scale_e: torch.Tensor, half: int, num_groups: int | None = None, *, where: str = "l1_scale"
) -> torch.Tensor:
    """Gate/up scale bytes uint8 [.., I, num_groups] (default 4*P)."""
    packed = _read_l1_scale_packed(l1_scale_e, half, where=where)
    if packed.dtype == torch.float32:
        return packed
    return _codecs().unpack_int32_bytes(packed, num_groups or 4 * packed.shape[-1])


def _read_l2_weight(l2_weight_e: torch.Tensor, *, where: str = "l2_weight") -> torch.Tensor:
    """Down weight [.., H, Iw] in checkpoint encoding (a copy)."""
    return l2_weight_e.clone(memory_format=torch.contiguous_format).view(_checkpoint_dtype(l2_weight_e.dtype))


def _read_l2_scale_packed(l2_scale_e: torch.Tensor, *, where: str = "l2_scale") -> torch.Tensor:
    """Down packed int32 [.., H, P], row-major, in checkpoint row order (block-FP8: fp32, a copy)."""
    if l2_scale_e.dtype == torch.float32:
        return l2_scale_e.clone(memory_format=torch.contiguous_format)
    _check_scale_dst(l2_scale_e, where)
    h, p = l2_scale_e.shape[-2:]
    if h % 128:
        raise LayoutError(f"{where}: H={h} must be a multiple of 128 for UTCCP")
    out = torch.empty(tuple(l2_scale_e.shape), dtype=torch.int32, device=l2_scale_e.device)
    out.unflatten(-2, (h // 128, 4, 32)).copy_(_l2_scale_view(l2_scale_e))
    return out


def read_l2_scale(l2_scale_e: torch.Tensor, num_groups: int | None = None, *, where: str = "l2_scale") -> torch.Tensor:
    """Down scale bytes uint8 [.., H, num_groups] (default 4*P)."""
    packed = _read_l2_scale_packed(l2_scale_e, where=where)
    if packed.dtype == torch.float32:
        return packed
    return _codecs().unpack_int32_bytes(packed, num_groups or 4 * packed.shape[-1])


# --------------------------------------------------------------------------- experts


def write_expert(row: "Row | str", kt: KernelTensors, e: int | None, expert: ExpertTensors, *, where: str = "expert") -> None:
    """Write one expert's canonical tensors into slot e of a stack (e=None: 2-D kt)."""
    row = get_row(row)

    def sel(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if (t is None or e is None) else t[e]

    write_l1_weight(sel(kt.l1_weight), expert.gate.weight, 0, where=f"{where}.gate.weight")
    write_l1_weight(sel(kt.l1_weight), expert.up.weight, 1, where=f"{where}.up.weight")
    write_l2_weight(sel(kt.l2_weight), expert.down.weight, where=f"{where}.down.weight")
    write_expert_scales(row, kt, e, expert, where=where)


def write_expert_scales(row: "Row | str", kt: KernelTensors, e: int | None, expert: ExpertTensors, *,
                        where: str = "expert") -> None:
    """The block-scale part of `write_expert` (nothing for rows without scales);
    for callers that put the weight bytes in place themselves."""
    row = get_row(row)
    if not row.has_scales:
        return

    def sel(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if (t is None or e is None) else t[e]

    write_l1_scale(sel(kt.l1_scale), expert.gate.scale, 0, where=f"{where}.gate.scale")
    write_l1_scale(sel(kt.l1_scale), expert.up.scale, 1, where=f"{where}.up.scale")
    write_l2_scale(sel(kt.l2_scale), expert.down.scale, where=f"{where}.down.scale")


def read_expert(row: "Row | str", kt: KernelTensors, e: int | None, *, where: str = "expert") -> ExpertTensors:
    """Canonical tensors of slot e (e=None: 2-D kt); global/input scales are None."""
    row = get_row(row)
    w = row.weight

    def sel(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if (t is None or e is None) else t[e]

    H, I = kt.hidden, kt.intermediate
    gate_w = read_l1_weight(sel(kt.l1_weight), 0, where=f"{where}.gate.weight")
    up_w = read_l1_weight(sel(kt.l1_weight), 1, where=f"{where}.up.weight")
    down_w = _read_l2_weight(sel(kt.l2_weight), where=f"{where}.down.weight")
    gate_s = up_s = down_s = None
    if row.has_scales:
        sdt = w.scale_checkpoint_dtype
        gate_s = read_l1_scale(sel(kt.l1_scale), 0, w.scale_groups(H), where=f"{where}.gate.scale").view(sdt)
        up_s = read_l1_scale(sel(kt.l1_scale), 1, w.scale_groups(H), where=f"{where}.up.scale").view(sdt)
        down_s = read_l2_scale(sel(kt.l2_scale), w.scale_groups(I), where=f"{where}.down.scale").view(sdt)
    return ExpertTensors(
        ProjectionTensors(gate_w, gate_s), ProjectionTensors(up_w, up_s), ProjectionTensors(down_w, down_s)
    )


def pack_expert_stack(
    row: "Row | str",
    experts: Sequence[ExpertTensors],
    *,
    device: torch.device | str | None = None,
    out: KernelTensors | None = None,
) -> KernelTensors:
    """Canonical experts -> kernel tensors [E_l, ...] (into `out` if given).

    Global / input scales are not carried: they are per-expert scalars the
    caller stores separately (l1_alpha, l2_global_scale, manifest scalars).
    """
    row = get_row(row)
    if len(experts) == 0:
        raise LayoutError("pack_expert_stack: no experts given")
    H, I = experts[0].infer_sizes(row)
    for i, ex in enumerate(experts):
        ex.validate(row, H, I, f"expert {i}", error=LayoutError)
    if out is None:
        out = allocate_kernel_tensors(row, len(experts), H, I, device)
    else:
        check_kernel_tensors(row, out, len(experts), H, I, "pack_expert_stack(out)")
    for i, ex in enumerate(experts):
        write_expert(row, out, i, ex, where=f"expert {i}")
    return out


def unpack_expert_stack(row: "Row | str", kt: KernelTensors) -> list[ExpertTensors]:
    """Exact inverse of `pack_expert_stack` (bytes only; global scales None)."""
    row = get_row(row)
    if not kt.is_stack:
        raise LayoutError("unpack_expert_stack: expected 3-D expert stacks; use unpack_shared for 2-D")
    check_kernel_tensors(row, kt, kt.num_experts, kt.hidden, kt.intermediate, "unpack_expert_stack")
    return [read_expert(row, kt, e, where=f"expert {e}") for e in range(kt.num_experts)]


# --------------------------------------------------------------------------- shared experts


def _shared_row(row_or_precision: "Row | str") -> Row:
    # Shared precisions ('mxfp8', 'bf16') are also row names; any row's 2-D
    # layout works the same way, so every row is accepted.
    return get_row(row_or_precision)


def _cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)


def fold_shared(row: "Row | str", experts: "ExpertTensors | Sequence[ExpertTensors]") -> ExpertTensors:
    """S shared experts of width I_s -> one canonical expert of width S*I_s:
    gate and up stacked along N (rows), down stacked along K (columns, scale
    bytes too). A no-op for S=1; otherwise a temporary of shared size only."""
    row = _shared_row(row)
    exs = [experts] if isinstance(experts, ExpertTensors) else list(experts)
    if not exs:
        raise LayoutError("fold_shared: no shared experts given")
    H, I_s = exs[0].infer_sizes(row)
    for i, ex in enumerate(exs):
        ex.validate(row, H, I_s, f"shared expert {i}", error=LayoutError)
    if len(exs) == 1:
        return exs[0]
    has_s = row.has_scales

    def proj(role: str, dim: int) -> ProjectionTensors:
        ps = [getattr(ex, role) for ex in exs]
        return ProjectionTensors(
            _cat([p.weight for p in ps], dim), _cat([p.scale for p in ps], dim) if has_s else None
        )

    return ExpertTensors(proj("gate", 0), proj("up", 0), proj("down", -1))


def _split_shared(row: "Row | str", folded: ExpertTensors, num_shared: int) -> list[ExpertTensors]:
    """Inverse of `fold_shared`."""
    row = _shared_row(row)
    if num_shared == 1:
        return [folded]
    H, I = folded.infer_sizes(row)
    if I % num_shared:
        raise LayoutError(f"split_shared: folded width {I} is not divisible by num_shared={num_shared}")
    I_s = I // num_shared
    w = row.weight
    out = []
    for s in range(num_shared):
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[s * I_s:(s + 1) * I_s].contiguous()

        wc = w.stored_cols(I_s)
        gc = w.scale_groups(I_s)
        dw = folded.down.weight[:, s * wc:(s + 1) * wc].contiguous()
        ds = None if folded.down.scale is None else folded.down.scale[:, s * gc:(s + 1) * gc].contiguous()
        out.append(ExpertTensors(
            ProjectionTensors(rows(folded.gate.weight), rows(folded.gate.scale)),
            ProjectionTensors(rows(folded.up.weight), rows(folded.up.scale)),
            ProjectionTensors(dw, ds),
        ))
    return out


def pack_shared(
    row_or_precision: "Row | str",
    experts: "ExpertTensors | Sequence[ExpertTensors]",
    *,
    device: torch.device | str | None = None,
    out: KernelTensors | None = None,
) -> KernelTensors:
    """S shared experts -> 2-D kernel tensors: l1 [2*S*I_s, Dw], l2 [H, S*I_s(/2)],
    scales 2-D MN-major views [N, P] with strides (1, N)."""
    row = _shared_row(row_or_precision)
    folded = fold_shared(row, experts)
    H, I = folded.infer_sizes(row)
    if out is None:
        out = allocate_kernel_tensors(row, None, H, I, device)
    else:
        check_kernel_tensors(row, out, None, H, I, "pack_shared(out)")
    write_expert(row, out, None, folded, where="shared expert")
    return out


def unpack_shared(row_or_precision: "Row | str", kt: KernelTensors, num_shared: int = 1) -> list[ExpertTensors]:
    """Exact inverse of `pack_shared`."""
    row = _shared_row(row_or_precision)
    if kt.is_stack:
        raise LayoutError("unpack_shared: expected 2-D shared tensors; use unpack_expert_stack for 3-D")
    check_kernel_tensors(row, kt, None, kt.hidden, kt.intermediate, "unpack_shared")
    return _split_shared(row, read_expert(row, kt, None, where="shared expert"), num_shared)


# --------------------------------------------------------------------------- block FP8, whole stacks


def block_fp8_kernel_layout(l1: tuple[torch.Tensor, torch.Tensor], l2: tuple[torch.Tensor, torch.Tensor]
                            ) -> KernelTensors:
    """The SM90 block-FP8 kernel layout of canonical stacks, as a new `KernelTensors`.

    ``l1 = (w13, s13)``: E4M3 ``[.., 2I, H]`` with gate rows then up rows, fp32 block
    scales ``[.., 2I/128, H/128]`` in the same order; ``l2 = (w2, s2)``: ``[.., H, I]``,
    ``[.., H/128, I/128]``. Only the L1 weight changes: gate and up rows interleaved
    in runs of 8 (`interleave_row`); the scales and L2 are copied as they are. This
    is what sgl-deep-gemm's ``transform_weights_for_mega_moe_sm90`` makes from the same
    tensors (docs/LAYOUT.md#sm90-block-fp8), and what the converter writes to disk.
    """
    (w13, s13), (w2, s2) = l1, l2
    n2 = w13.shape[-2]
    if n2 % 16 or s13.shape[-2] % 2:
        raise LayoutError(f"block_fp8_kernel_layout: w13 {list(w13.shape)} / s13 {list(s13.shape)} need gate and up "
                          "halves of whole 8-row runs and whole scale blocks")
    l1w = torch.empty_like(w13, memory_format=torch.contiguous_format)
    write_l1_weight(l1w, w13[..., : n2 // 2, :], 0, where="block_fp8_kernel_layout.w13 gate")
    write_l1_weight(l1w, w13[..., n2 // 2:, :], 1, where="block_fp8_kernel_layout.w13 up")
    return KernelTensors(l1w, s13.contiguous().clone(), w2.contiguous().clone(), s2.contiguous().clone())


def block_fp8_canonical(kt: KernelTensors) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Exact inverse of `block_fp8_kernel_layout`: ``((w13, s13), (w2, s2))`` with gate then up rows."""
    gate = read_l1_weight(kt.l1_weight, 0, where="block_fp8_canonical.l1_weight")
    up = read_l1_weight(kt.l1_weight, 1, where="block_fp8_canonical.l1_weight")
    return (torch.cat((gate, up), dim=-2), kt.l1_scale.clone()), (kt.l2_weight.clone(), kt.l2_scale.clone())
