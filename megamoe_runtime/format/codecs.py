"""Number formats (E2M1, E4M3fn, UE8M0) and the reference quantizers.

Everything here is a small pure torch function that works the same on CPU and
CUDA tensors: no numpy, no Python loops over elements, and no host syncs on the
success path (the only syncs are the explicit validity checks, which callers on
a hot path can switch off with ``check=False``).

Why this module is so exact: the MX rows are specified *bitwise* against
DeepGEMM (``tests/test_mega_moe.py`` in DeepGEMM asserts bitwise equality with
an unfused reference), so every quantizer reproduces the fp32 operation order
of the producer it mirrors, and every encoder is written from the bit-level
definition rather than from ``log2``/``round`` (which round differently on
different devices).  The Triton kernels and the reference backend are tested
against these functions bit for bit.

Sources for each convention are named in the docstrings and in
docs/FORMATS.md and docs/NUMERICS.md.
"""
from __future__ import annotations

import sys
from typing import Union

import torch

from ..errors import FormatError, LayoutError, ScaleError

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "MX_GROUP",
    "NVFP4_GROUP",
    "e2m1_decode",
    "e2m1_decode_packed",
    "e2m1_packed_to_e4m3",
    "e2m1_encode",
    "pack_e2m1",
    "unpack_e2m1",
    "e4m3_encode",
    "e4m3_decode",
    "ue8m0_decode",
    "ue8m0_ceil_exponent",
    "ceil_to_ue8m0_byte",
    "pack_bytes_int32",
    "unpack_int32_bytes",
    "quantize_mxfp8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_nvfp4_per_token",
    "quantize_nvfp4_weight",
    "nvfp4_to_mxfp8",
    "dequantize_mx",
    "dequantize_nvfp4",
    "FP8_BLOCK",
    "FP8_ACT_AMAX_FLOOR",
    "dequantize_fp8_block",
    "quantize_fp8_block",
    "quantize_fp8_act",
]

ScaleLike = Union[float, torch.Tensor]

# --------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------

#: E2M1 value of each 4-bit code. Bit 3 is the sign; code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
_E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
#: DeepGEMM's Python references floor the group amax at 1e-4 before scaling.
_UE8M0_AMAX_FLOOR = 1e-4
MX_GROUP = 32
NVFP4_GROUP = 16
#: DGv ``tests/test_nvfp4_mega_moe.py`` floors the per-token amax at 1e-12.
_NVFP4_TOKEN_AMAX_FLOOR = 1e-12

_TIES = ("even", "down")
# Midpoints between neighbouring E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
# For round-half-to-even a tie goes up exactly when the upper neighbour has an
# even mantissa (1.0, 2.0, 4.0), i.e. at 0.75, 1.75 and 3.5.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_GOES_UP = (False, True, False, True, False, True, False)

_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e8m0fnu)


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """Reinterpret a 1-byte tensor as uint8 (a bit view, never a value cast)."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype in _BYTE_DTYPES:
        return t.view(torch.uint8)
    raise LayoutError(
        f"{what}: expected a 1-byte tensor (uint8, int8, float8_e4m3fn or float8_e8m0fnu), "
        f"got dtype {t.dtype} with shape {tuple(t.shape)}"
    )


def _check_ties(ties: str) -> None:
    if ties not in _TIES:
        raise FormatError(f"ties={ties!r} is not a valid E2M1 rounding mode; use 'even' or 'down'")


def _float_input(x: torch.Tensor, what: str) -> torch.Tensor:
    """Rows to quantize, as float32 (bf16/fp16 widen exactly; fp64 rounds once)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise FormatError(
            f"{what}: expected a floating-point tensor, got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    return x.to(torch.float32)


def _grouped(x32: torch.Tensor, group: int, what: str) -> torch.Tensor:
    """View ``[..., K]`` as ``[..., K/group, group]``; K must be a multiple of group."""
    if x32.dim() == 0 or x32.shape[-1] % group != 0:
        raise LayoutError(
            f"{what}: the last dim (K) of shape {tuple(x32.shape)} must be a multiple of {group} "
            f"(one scale per {group} elements along K)"
        )
    return x32.reshape(*x32.shape[:-1], x32.shape[-1] // group, group)


def _scalar_or_rows(scale: ScaleLike, x32: torch.Tensor, what: str) -> torch.Tensor:
    """A global scale as an fp32 tensor: 0-d, or one value per row (shape ``x.shape[:-1]``).

    Python floats are checked here (finite, > 0); tensors are not, since that
    would need a host sync -- callers validate them where they are produced.
    """
    if isinstance(scale, torch.Tensor):
        s = scale.to(device=x32.device, dtype=torch.float32)
        if s.dim() > 0 and tuple(s.shape) != tuple(x32.shape[:-1]):
            raise LayoutError(
                f"{what}: a tensor global scale must be 0-d or have one value per row, "
                f"shape {tuple(x32.shape[:-1])}; got {tuple(s.shape)}"
            )
        return s
    g = float(scale)
    if not (g > 0.0 and g < float("inf")):
        raise ScaleError(f"{what}: global scale must be finite and > 0, got {g!r}")
    return torch.full((), g, dtype=torch.float32, device=x32.device)  # a fill, no H2D copy


def _div_const(a: torch.Tensor, c: float) -> torch.Tensor:
    """IEEE fp32 ``a / c`` on every device.

    PyTorch's CUDA kernel turns ``tensor / python_float`` into a multiply by
    the fp32 reciprocal (CPU divides), which differs in the last bit for about
    a third of all inputs; dividing by a 0-d tensor on the same device keeps
    the true division (and needs no host-to-device copy). Note for kernel
    authors: Triton's ``/`` on fp32 is not IEEE either; use ``div_rn``.
    """
    return a / torch.full((), c, dtype=a.dtype, device=a.device)


def _per_group(s: torch.Tensor) -> torch.Tensor:
    """Broadcast a 0-d or per-row scale against ``[..., G]`` group tensors."""
    return s.unsqueeze(-1) if s.dim() > 0 else s


# --------------------------------------------------------------------------
# E2M1 (FP4)
# --------------------------------------------------------------------------

def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (low nibble of each uint8/int8 element) to float32.

    Built from the fp32 bit pattern, so it is exact by construction and needs
    no lookup table on the device. Code 8 decodes to -0.0. (For packed bytes
    on the CPU, :func:`e2m1_decode_packed` gives the same bits from a table.)
    """
    c = _as_bytes(codes, "e2m1_decode codes").to(torch.int32) & 0xF
    mag = c & 7
    e = mag >> 1
    m = mag & 1
    # e == 0: 0 or 0.5 (= 2^-1, fp32 bits 0x3F000000); e > 0: 2^(e-1) * (1 + m/2).
    bits = torch.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    v = bits.view(torch.float32)
    return torch.where(c >= 8, -v, v)


# --------------------------------------------------------------------------
# Byte lookup tables (CPU)
#
# The converter decodes and re-encodes whole checkpoints on the CPU, where
# the arithmetic decoders above cost about ten int32 passes per element.
# A table indexed by the packed byte touches each byte once: one widening to
# an int32 index and one gather (``index_select``). Every table is built
# from the arithmetic codec itself, so the bits are the same by construction
# (the tests compare all 256 bytes). CUDA tensors keep the arithmetic path:
# it needs no table on the device (no copy, nothing to capture in a graph).
# --------------------------------------------------------------------------

_TABLES: dict[str, tuple[torch.Tensor, torch.dtype, int]] = {}


def _table(name: str) -> tuple[torch.Tensor, torch.dtype, int]:
    """(1-D CPU table of 256 entries, the output dtype, output elements per byte).

    Built once from the arithmetic codecs. An entry holding two output
    elements is stored as one wider integer (two fp32 -> one int64, two E4M3
    bytes -> one int16): the gather then copies whole entries, which is the
    fast path of ``index_select``, and viewing the result back needs no
    assumption about byte order (the bytes are copied as they are)."""
    t = _TABLES.get(name)
    if t is None:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        if name == "e2m1_pair_f32":  # byte -> (low-nibble value, high-nibble value)
            vals, out, wide = e2m1_decode(unpack_e2m1(every.view(256, 1))), torch.float32, torch.int64
        elif name == "e4m3_f32":  # E4M3 byte -> its fp32 value
            vals, out, wide = every.view(torch.float8_e4m3fn).to(torch.float32).view(256, 1), torch.float32, None
        elif name == "e2m1_pair_e4m3":  # byte -> two E4M3 bytes (exact: E2M1 values are E4M3 values)
            vals = e4m3_encode(e2m1_decode(unpack_e2m1(every.view(256, 1)))).view(torch.uint8)
            out, wide = torch.float8_e4m3fn, torch.int16
        else:  # pragma: no cover - internal names only
            raise KeyError(name)
        vals = vals.contiguous()
        entries = vals.view(wide).view(256) if wide is not None else vals.view(256)
        _TABLES[name] = t = (entries, out, vals.shape[1])
    return t


def _lookup(b: torch.Tensor, name: str) -> torch.Tensor:
    """``table[b]`` for uint8 ``b [..., n]`` -> ``[..., n * width]`` of the table's
    output dtype (one widening of the bytes to int32 indices, one gather)."""
    entries, out, width = _table(name)
    got = torch.index_select(entries, 0, b.reshape(-1).to(torch.int32))
    got = got.view(torch.uint8).view(out) if got.dtype != out else got
    return got.view(*b.shape[:-1], b.shape[-1] * width)


def _use_tables(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes ``[..., n]`` -> float32 ``[..., 2n]`` (low nibble first).

    Equals ``e2m1_decode(unpack_e2m1(packed))`` bit for bit; on the CPU it is
    one table lookup per byte instead of an unpack and ten int32 passes.
    """
    b = _as_bytes(packed, "e2m1_decode_packed bytes")
    if b.dim() == 0:
        raise LayoutError("e2m1_decode_packed: expected at least one dim of packed bytes, got a 0-d tensor")
    if not _use_tables(b):
        return e2m1_decode(unpack_e2m1(b))
    return _lookup(b, "e2m1_pair_f32")


def e2m1_packed_to_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes ``[..., n]`` -> float8_e4m3fn ``[..., 2n]``: the same values (exact).

    Every E2M1 value is an E4M3 value, so MXFP4 -> MXFP8 keeps the UE8M0
    scales and changes only the element encoding. Equals
    ``e4m3_encode(e2m1_decode(unpack_e2m1(packed)))``; on the CPU one table
    lookup per byte gives both output bytes.
    """
    b = _as_bytes(packed, "e2m1_packed_to_e4m3 bytes")
    if b.dim() == 0:
        raise LayoutError("e2m1_packed_to_e4m3: expected at least one dim of packed bytes, got a 0-d tensor")
    if not _use_tables(b):
        return e4m3_encode(e2m1_decode(unpack_e2m1(b)))
    return _lookup(b, "e2m1_pair_e4m3").view(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round to the nearest E2M1 value, saturating at +-6; returns uint8 codes 0..15.

    ``ties="even"``: round-half-to-even on the E2M1 grid (DeepGEMM kernels'
    ``cvt.rn.satfinite``, ModelOpt, CT, Quark). The sign bit is the input's sign
    bit, so negative values that round to zero give code 8 (-0), as an IEEE
    conversion does; the input -0.0 also gives code 8 (ModelOpt's ``x < 0``
    gives 0 there; the two decode identically).

    ``ties="down"``: DeepGEMM's Python reference ``_quantize_to_fp4_e2m1`` used by
    ``per_token_cast_to_fp4`` / DGv ``per_token_cast_to_nvfp4``: the magnitude
    code counts the midpoints strictly below |x| (0.25->0, 0.75->0.5,
    1.75->1.5, 3.5->3, 5->4), and the sign is set only for ``x < 0`` with a
    non-zero magnitude, so it never produces -0.

    NaN has no E2M1 code: it encodes as a zero magnitude (code 0, or 8 in
    "even" mode when its sign bit is set). Validate finiteness upstream.
    Comparisons run in the input's precision (fp16/bf16 widened to fp32).
    """
    _check_ties(ties)
    if not x.is_floating_point():
        raise FormatError(f"e2m1_encode: expected a floating-point tensor, got {x.dtype}")
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float32)
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_GOES_UP):
        hit = (a >= mid) if (ties == "even" and up) else (a > mid)
        code += hit.to(torch.uint8)
    if ties == "even":
        sign = torch.signbit(x)
    else:
        sign = (x < 0) & (code != 0)
    return code | (sign.to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., 2n]`` into bytes ``[..., n]``: element 2j in the LOW nibble.

    This is the nibble order of every producer (MO, QK, CT, gpt-oss, DG).
    """
    c = _as_bytes(codes, "pack_e2m1 codes")
    if c.dim() == 0 or c.shape[-1] % 2 != 0:
        raise LayoutError(
            f"pack_e2m1: the last dim of shape {tuple(c.shape)} must be even (two codes per byte)"
        )
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., n]`` into E2M1 codes ``[..., 2n]`` (low nibble first)."""
    b = _as_bytes(packed, "unpack_e2m1 bytes")
    if b.dim() == 0:
        raise LayoutError("unpack_e2m1: expected at least one dim of packed bytes, got a 0-d tensor")
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


# --------------------------------------------------------------------------
# E4M3fn (FP8)
# --------------------------------------------------------------------------

def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn with RNE, saturating to +-448.

    torch's cast rounds to nearest even, but whether it saturates depends on
    the version (older releases turn overflow into NaN; 2.13 on CPU clamps),
    so the input is first rounded to fp32 (as the kernels hold it) and
    clamped to +-448. The result then equals ``cvt.rn.satfinite.e4m3`` on every
    version: +-inf -> +-448, NaN stays NaN (E4M3 S.1111.111).
    """
    if not x.is_floating_point():
        raise FormatError(f"e4m3_encode: expected a floating-point tensor, got {x.dtype}")
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(x: torch.Tensor) -> torch.Tensor:
    """Decode E4M3fn (a float8_e4m3fn tensor, or its raw uint8/int8 bytes) to float32. Exact."""
    if x.dtype != torch.float8_e4m3fn:
        x = _as_bytes(x, "e4m3_decode").view(torch.float8_e4m3fn)
    if _use_tables(x) and x.dim() > 0 and x.numel() >= 4096:  # the CPU cast is ~25x slower than a lookup
        return _lookup(x.view(torch.uint8), "e4m3_f32")
    return x.to(torch.float32)


# --------------------------------------------------------------------------
# UE8M0 (MX scale)
# --------------------------------------------------------------------------

def _raise_if_ff(b: torch.Tensor, name: str) -> None:
    bad = b == 0xFF
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ScaleError(
            f"{name}: {count} UE8M0 scale byte(s) of {b.numel()} are 0xFF (E8M0 NaN), "
            f"first at index {first} of shape {tuple(b.shape)}; valid bytes are 0..254 "
            f"(2^-127 .. 2^127)"
        )


def ue8m0_decode(sf: torch.Tensor, *, check: bool = True, name: str = "scale") -> torch.Tensor:
    """Decode UE8M0 bytes (uint8 or float8_e8m0fnu) to float32 by ``byte << 23``.

    This is DeepGEMM's ``unpack_ue8m0_from_int`` decode: byte s -> 2^(s-127) for
    s >= 1, and s = 0 -> 0.0 (not 2^-127), the value ModelOpt writes for
    all-zero blocks. 0xFF is E8M0 NaN and is refused with a ScaleError naming
    ``name``, the count and the first position (``check=False`` skips the
    check, and its host sync, for hot paths; 0xFF then decodes to +inf).
    """
    b = _as_bytes(sf, f"{name} (UE8M0)")
    if check:
        _raise_if_ff(b, name)
    return (b.to(torch.int32) << 23).view(torch.float32)


def ceil_to_ue8m0_byte(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent of ``2^ceil(log2|x|)`` from the fp32 bits, clamped to [1, 254].

    DeepGEMM's ``ceil_to_ue8m0`` (``deep_gemm/utils/math.py``) returning the
    byte instead of the float: ``e = biased_exp(x) + (mantissa(x) != 0)``.
    Bit arithmetic, not ``log2``, so it is exact on every device. Zero and
    subnormals clamp to byte 1; inf and NaN clamp to 254.
    """
    bits = x.to(torch.float32).abs().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return e.clamp(1, 254).to(torch.uint8)


def ue8m0_ceil_exponent(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """UE8M0 byte of the MX scale for a group with absolute max ``amax``.

    Bit-exact with DeepGEMM's Python references: ``sf = amax.clamp(1e-4) /
    elem_max`` in fp32 (a true division, not a multiply by ``1/elem_max``),
    then ``ceil_to_ue8m0(sf)``. ``elem_max`` is 448.0 for E4M3 elements, 6.0 for
    E2M1. (Run on CUDA, DG's ``x_amax / 448.0`` is really ``amax * fl(1/448)``,
    as in the DG-main kernel; for 448 and 6 that gives the same byte for every
    fp32 amax -- checked exhaustively in the tests.) The 1e-4 floor means all-zero groups get 2^-22 (E4M3, byte 105) or
    2^-15 (E2M1, byte 112). Non-finite amax saturates to byte 254.
    """
    a = amax.to(torch.float32).clamp_min(_UE8M0_AMAX_FLOOR)
    return ceil_to_ue8m0_byte(_div_const(a, float(elem_max)))


def _ue8m0_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """Exact ``1 / 2^(e-127)`` in fp32 (2^-127 for e = 254 is a representable subnormal)."""
    return 1.0 / ue8m0_decode(e, check=False)


# --------------------------------------------------------------------------
# int32 packing of per-group bytes
# --------------------------------------------------------------------------

def pack_bytes_int32(b: torch.Tensor) -> torch.Tensor:
    """Pack per-group bytes ``[..., G]`` into int32 ``[..., ceil(G/4)]``, row-major.

    Byte j (bits 8j..8j+7) of int p is group 4p+j; missing groups are 0. This is
    DeepGEMM's packed-UE8M0 (and NVFP4 E4M3) word. Accepts uint8, int8,
    float8_e4m3fn and float8_e8m0fnu (bits, not values, are packed). Returns a
    new tensor (never a view of `b`).

    On a little-endian host (CUDA devices are little-endian too) a contiguous
    input is simply reinterpreted: four bytes in memory order are that word.
    That fast path is one copy instead of an int64 widening and four shifts
    (the converter packs every expert's scales). Otherwise the word is built
    with explicit shifts (`_pack_bytes_int32_shifts`), independent of the
    host's endianness; tests check both paths give identical results.
    """
    u = _as_bytes(b, "pack_bytes_int32 input")
    if u.dim() == 0:
        raise LayoutError("pack_bytes_int32: expected at least one dim of per-group bytes, got 0-d")
    if _LITTLE_ENDIAN and u.is_contiguous():
        return _pack_bytes_int32_view(u)
    return _pack_bytes_int32_shifts(u)


_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_bytes_int32_view(u: torch.Tensor) -> torch.Tensor:
    """Little-endian reinterpretation of contiguous bytes (into a fresh,
    4-byte aligned buffer, zero-padded to a multiple of 4 groups)."""
    lead, g = tuple(u.shape[:-1]), u.shape[-1]
    p = (g + 3) // 4
    out = torch.empty((*lead, p), dtype=torch.int32, device=u.device)
    dst = out.view(torch.uint8)  # [..., 4p]
    if 4 * p != g:
        dst[..., g:].zero_()
        dst = dst[..., :g]
    dst.copy_(u)
    return out


def _pack_bytes_int32_shifts(u: torch.Tensor) -> torch.Tensor:
    """Explicit shifts in int64, wrapped to signed 32 bits: endianness-free."""
    lead, g = tuple(u.shape[:-1]), u.shape[-1]
    p = (g + 3) // 4
    v = u.to(torch.int64)
    if 4 * p != g:
        v = torch.cat((v, v.new_zeros(*lead, 4 * p - g)), dim=-1)
    v = v.reshape(*lead, p, 4)
    w = v[..., 0] | (v[..., 1] << 8) | (v[..., 2] << 16) | (v[..., 3] << 24)
    w = w - ((w >> 31) << 32)  # two's-complement wrap into [-2^31, 2^31)
    return w.to(torch.int32)


def unpack_int32_bytes(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_bytes_int32`: int32 ``[..., P]`` -> uint8 ``[..., num_groups]``.

    Works on strided views (e.g. an MN-major kernel scale view). Pad bytes
    beyond ``num_groups`` are dropped whatever they hold (DGv pads with 1.0).
    """
    if x.dtype != torch.int32:
        raise LayoutError(f"unpack_int32_bytes: expected int32 words, got {x.dtype} shape {tuple(x.shape)}")
    if x.dim() == 0:
        raise LayoutError("unpack_int32_bytes: expected at least one dim of packed words, got 0-d")
    p = x.shape[-1]
    if num_groups < 0 or (num_groups + 3) // 4 != p:
        raise LayoutError(
            f"unpack_int32_bytes: {num_groups} groups need ceil({num_groups}/4) words, "
            f"but the last dim of shape {tuple(x.shape)} holds {p}"
        )
    v = x.to(torch.int64) & 0xFFFFFFFF
    out = torch.stack([(v >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1)
    return out.reshape(*x.shape[:-1], 4 * p)[..., :num_groups].to(torch.uint8)


# --------------------------------------------------------------------------
# Quantizers (rows along the last dim = K)
# --------------------------------------------------------------------------

def _mx_scale(g: torch.Tensor, elem_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group UE8M0 byte and the exact power-of-two reciprocal to multiply by."""
    e = ue8m0_ceil_exponent(g.abs().amax(dim=-1), elem_max)
    return e, _ue8m0_reciprocal(e)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8: E4M3 elements with one UE8M0 scale per 32 along the last dim.

    Bit-exact with DeepGEMM ``per_token_cast_to_fp8(x, use_ue8m0=True,
    gran_k=32)`` and the MegaMoE requant: ``e = ceil_to_ue8m0(max(amax, 1e-4) /
    448)``, ``q = e4m3_RNE_sat(x * 2^-e)`` (multiply by the exact reciprocal;
    never overflows since the scale rounds up). Returns ``(q float8_e4m3fn
    [..., K], sf uint8 [..., K/32])``; the activation ``x_sf`` word form is
    ``pack_bytes_int32(sf)``.
    """
    g = _grouped(_float_input(x, "quantize_mxfp8"), MX_GROUP, "quantize_mxfp8")
    e, inv = _mx_scale(g, E4M3_MAX)
    q = e4m3_encode(g * inv.unsqueeze(-1))
    return q.flatten(-2), e


def quantize_mxfp4(x: torch.Tensor, ties: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: E2M1 elements with one UE8M0 scale per 32, ``e = ceil_to_ue8m0(max(amax,1e-4)/6)``.

    ``ties="down"`` is bit-exact with DeepGEMM ``per_token_cast_to_fp4(x,
    use_ue8m0=True, gran_k=32)``; ``"even"`` is what an RNE hardware conversion
    gives. Returns ``(packed uint8 [..., K/2], sf uint8 [..., K/32])``.
    """
    _check_ties(ties)
    g = _grouped(_float_input(x, "quantize_mxfp4"), MX_GROUP, "quantize_mxfp4")
    e, inv = _mx_scale(g, _E2M1_MAX)
    codes = e2m1_encode(g * inv.unsqueeze(-1), ties)
    return pack_e2m1(codes.flatten(-2)), e


def quantize_nvfp4(
    x: torch.Tensor, global_scale: ScaleLike, ties: str = "even"
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 elements, one E4M3 scale per 16, and a global dequant scale.

    The newer-DG kernel's L2 requant, in fp32 and in this order:
    ``inv = 1/global``; ``sf = e4m3_sat(max(amax/6 * inv, 2^-9))``;
    ``q = e2m1(x * inv / float(sf))`` (a true division; the kernel's fast-math
    path uses a fast reciprocal instead). ``global_scale`` is a positive float,
    a 0-d tensor, or one value per row (shape ``x.shape[:-1]``). With
    ``global_scale=1.0`` and ``ties="down"`` this equals DGv
    ``deep_gemm/utils/nvfp4.py`` ``per_token_cast_to_nvfp4(x, 1.0)`` (as run on
    CPU). All divisions are IEEE on every device (see ``_div_const``).
    Returns ``(packed uint8 [..., K/2], sf float8_e4m3fn [..., K/16])``.
    """
    _check_ties(ties)
    x32 = _float_input(x, "quantize_nvfp4")
    g = _grouped(x32, NVFP4_GROUP, "quantize_nvfp4")
    gs = _scalar_or_rows(global_scale, x32, "quantize_nvfp4")
    inv = _per_group(1.0 / gs)
    amax = g.abs().amax(dim=-1)
    sf = e4m3_encode((_div_const(amax, _E2M1_MAX) * inv).clamp_min(E4M3_MIN_SUBNORMAL))
    scaled = g * inv.unsqueeze(-1) / sf.to(torch.float32).unsqueeze(-1)
    codes = e2m1_encode(scaled, ties)
    return pack_e2m1(codes.flatten(-2)), sf


def quantize_nvfp4_per_token(
    x: torch.Tensor, ties: str = "even"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 dispatch quantization with one FP32 dequant scale per token (DGv ``use_x_scales``).

    Follows DGv ``tests/test_nvfp4_mega_moe.py``: ``token_scale = max(amax_t,
    1e-12) / 2688`` (2688 = 6*448, so each token's largest block scale lands
    at the top of the E4M3 range), then the token is divided by its scale and
    quantized with global scale 1.0 (:func:`quantize_nvfp4`). An all-zero token
    gets scale 1e-12/2688, block scales 2^-9 and zero codes.
    ``ties="down"`` reproduces DGv's Python reference bit for bit when that runs
    on CPU (on CUDA its ``/ 2688`` multiplies by the fp32 reciprocal instead,
    which can move the token scale by one ulp; here it is a true division).
    Returns ``(packed uint8 [..., K/2], sf float8_e4m3fn [..., K/16],
    token_scale float32 [...])``; dequantize with
    ``dequantize_nvfp4(packed, sf, token_scale)``.
    """
    _check_ties(ties)
    x32 = _float_input(x, "quantize_nvfp4_per_token")
    _grouped(x32, NVFP4_GROUP, "quantize_nvfp4_per_token")
    amax = x32.abs().amax(dim=-1).clamp_min(_NVFP4_TOKEN_AMAX_FLOOR)
    token_scale = _div_const(amax, _E2M1_MAX * E4M3_MAX)
    packed, sf = quantize_nvfp4(x32 / token_scale.unsqueeze(-1), 1.0, ties)
    return packed, sf, token_scale


def quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Quantize a weight the way ModelOpt's NVFP4 export does (used by ``--quantize``).

    ModelOpt ``NVFP4QTensor`` (dynamic path), in fp32: ``global = amax(W) /
    2688``; ``block = block_amax / (6 * global)``, zero blocks -> 1.0, clamped to
    [2^-9, 448], RNE to E4M3; elements ``e2m1_RNE(w / (float(block) *
    global))`` against the *rounded* block scale. ModelOpt's sign rule is
    ``w < 0``, so -0.0 is canonicalised to +0.0 before encoding to match its
    bytes. Deviation: an all-zero W (where ModelOpt divides 0 by 0) gets
    global 1.0 and zero codes. Returns ``(packed uint8 [..., K/2], sf
    float8_e4m3fn [..., K/16], global_scale float)``; one host sync (offline).
    """
    w32 = _float_input(w, "quantize_nvfp4_weight")
    g = _grouped(w32, NVFP4_GROUP, "quantize_nvfp4_weight")
    amax = w32.abs().amax() if w32.numel() else torch.zeros((), device=w32.device)
    gs = _div_const(amax, _E2M1_MAX * E4M3_MAX)
    gs_host = float(gs)
    amax_host = float(amax)
    if not (amax_host < float("inf")):
        raise ScaleError(f"quantize_nvfp4_weight: weight amax is {amax_host!r}; it must be finite")
    if gs_host == 0.0:
        if amax_host != 0.0:
            raise ScaleError(
                f"quantize_nvfp4_weight: weight amax {amax_host!r} is too small for an fp32 "
                f"global scale (amax/2688 underflows to 0)"
            )
        gs = torch.ones((), dtype=torch.float32, device=w32.device)
        gs_host = 1.0
    block = g.abs().amax(dim=-1) / (_E2M1_MAX * gs)
    block = torch.where(block == 0, torch.ones_like(block), block)
    sf = e4m3_encode(block.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
    scaled = g / (sf.to(torch.float32) * gs).unsqueeze(-1) + 0.0  # + 0.0 maps -0.0 to +0.0
    codes = e2m1_encode(scaled, "even")
    return pack_e2m1(codes.flatten(-2)), sf, gs_host


# --------------------------------------------------------------------------
# Dequantizers
# --------------------------------------------------------------------------

def _element_values(elems: torch.Tensor, element: str) -> torch.Tensor:
    if element == "e2m1":
        return e2m1_decode_packed(elems)
    if element == "e4m3":
        return e4m3_decode(elems)
    raise FormatError(f"element={element!r} is not a known element format; use 'e2m1' or 'e4m3'")


def _check_group_shape(vals: torch.Tensor, sf: torch.Tensor, group: int, what: str) -> None:
    if (vals.dim() == 0 or tuple(sf.shape[:-1]) != tuple(vals.shape[:-1])
            or sf.shape[-1] * group != vals.shape[-1]):
        raise LayoutError(
            f"{what}: {vals.shape[-1] if vals.dim() else 0} elements per row (element shape "
            f"{tuple(vals.shape)}) need scales of shape {tuple(vals.shape[:-1])} + "
            f"({vals.shape[-1] // group if vals.dim() else 0},) at one per {group}; "
            f"got {tuple(sf.shape)}"
        )


def dequantize_mx(
    elems: torch.Tensor, sf_bytes: torch.Tensor, element: str, *, check: bool = True
) -> torch.Tensor:
    """Dequantize an MX tensor to float32: ``value * 2^(s-127)`` per group of 32 along K.

    ``elems``: packed E2M1 bytes ``[..., K/2]`` (uint8/int8) for ``element="e2m1"``,
    or E4M3 ``[..., K]`` (float8_e4m3fn or its bytes) for ``"e4m3"``.
    ``sf_bytes``: UE8M0 ``[..., K/32]`` (uint8 or float8_e8m0fnu); byte 0 decodes
    to 0.0 and 0xFF raises ScaleError (unless ``check=False``).
    """
    vals = _element_values(elems, element)
    _check_group_shape(vals, sf_bytes, MX_GROUP, f"dequantize_mx({element})")
    scale = ue8m0_decode(sf_bytes, check=check, name=f"dequantize_mx({element}) scale")
    out = vals.unflatten(-1, (scale.shape[-1], MX_GROUP)) * scale.unsqueeze(-1)
    return out.reshape(vals.shape)


def dequantize_nvfp4(packed: torch.Tensor, sf: torch.Tensor, global_scale: ScaleLike) -> torch.Tensor:
    """Dequantize NVFP4 to float32: ``e2m1 * (float(sf) * global)`` per block of 16.

    ``packed`` uint8/int8 ``[..., K/2]``; ``sf`` float8_e4m3fn (or its bytes)
    ``[..., K/16]``; ``global_scale`` a positive float, a 0-d tensor, or one
    value per row (a per-token scale). The block factor is formed first, as
    ModelOpt and DGv do.
    """
    vals = e2m1_decode_packed(packed)
    _check_group_shape(vals, sf, NVFP4_GROUP, "dequantize_nvfp4")
    gs = _per_group(_scalar_or_rows(global_scale, vals, "dequantize_nvfp4"))
    block = e4m3_decode(sf) * gs
    out = vals.unflatten(-1, (block.shape[-1], NVFP4_GROUP)) * block.unsqueeze(-1)
    return out.reshape(vals.shape)


#: elements per chunk of `nvfp4_to_mxfp8` (its fp32 temporaries stay in the L2 cache)
_REENCODE_CHUNK = 1 << 18


def nvfp4_to_mxfp8(
    packed: torch.Tensor, sf: torch.Tensor, global_scale: ScaleLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-encode NVFP4 as MXFP8: ``(q float8_e4m3fn [..., K], sf uint8 [..., K/32], max_abs_change)``.

    What the converter does to NVFP4 shared experts for a row that fuses them
    as MXFP8, bit for bit equal to::

        x = dequantize_nvfp4(packed, sf, global_scale)
        q, e = quantize_mxfp8(x)
        max_abs_change = (dequantize_mx(q, e, "e4m3") - x).abs().max()   # 0-d fp32; 0 if empty

    but done in chunks of rows, so that the fp32 temporaries stay in cache,
    with table decodes and in-place ops: each source byte is read once and
    each output byte written once (the composition above makes about twenty
    full-size fp32 passes).
    """
    b = _as_bytes(packed, "nvfp4_to_mxfp8 packed")
    if b.dim() == 0 or tuple(sf.shape[:-1]) != tuple(b.shape[:-1]) or b.shape[-1] * 2 != sf.shape[-1] * NVFP4_GROUP:
        raise LayoutError(
            f"nvfp4_to_mxfp8: packed {tuple(b.shape)} (K/2 bytes per row) needs block scales "
            f"{tuple(b.shape[:-1])} + (K/16,); got {tuple(sf.shape)}")
    K = 2 * b.shape[-1]
    if K % MX_GROUP != 0:
        raise LayoutError(f"nvfp4_to_mxfp8: K = {K} must be a multiple of {MX_GROUP} (one MXFP8 scale per 32)")
    lead = tuple(b.shape[:-1])
    rows = b.reshape(-1, K // 2)
    sfb = _as_bytes(sf, "nvfp4_to_mxfp8 scale").reshape(-1, K // NVFP4_GROUP)
    gs = _scalar_or_rows(global_scale, torch.empty(lead + (0,), device=b.device), "nvfp4_to_mxfp8")
    gs = gs.reshape(-1, 1) if gs.dim() > 0 else gs
    R = rows.shape[0]
    q = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=b.device)
    e = torch.empty(R, K // MX_GROUP, dtype=torch.uint8, device=b.device)
    worst = torch.zeros((), dtype=torch.float32, device=b.device)
    step = max(1, _REENCODE_CHUNK // max(K, 1)) if K else R + 1
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        n = r1 - r0
        g_rows = gs[r0:r1] if gs.dim() > 0 else gs
        block = e4m3_decode(sfb[r0:r1]) * g_rows  # [n, K/16], the block factor first (as dequantize_nvfp4)
        x = e2m1_decode_packed(rows[r0:r1]).view(n, K // NVFP4_GROUP, NVFP4_GROUP)
        x.mul_(block.unsqueeze(-1))
        g = x.view(n, K // MX_GROUP, MX_GROUP)
        ec, inv = _mx_scale(g, E4M3_MAX)
        e[r0:r1] = ec
        y = g * inv.unsqueeze(-1)
        qc = e4m3_encode(y)
        q[r0:r1] = qc.view(n, K)
        back = e4m3_decode(qc).view(n, K // MX_GROUP, MX_GROUP)
        back.mul_(ue8m0_decode(ec, check=False).unsqueeze(-1))
        worst = torch.maximum(worst, back.sub_(g).abs_().amax())
    return q.view(*lead, K), e.view(*lead, K // MX_GROUP), worst


# --------------------------------------------------------------------------
# Block FP8 (E4M3 with fp32 scales per 128x128 weight block / per 128 or 64 activations)
# --------------------------------------------------------------------------

#: rows and columns of one weight scale block of the block-FP8 row
FP8_BLOCK = 128
#: the SM90 kernel floors an activation group's amax here before dividing (docs/NUMERICS.md#fp8-block)
FP8_ACT_AMAX_FLOOR = 1e-10


def dequantize_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float32 ``e4m3 * scale`` of a block-FP8 weight: ``w`` E4M3 ``[..., N, K]``
    (float8_e4m3fn or its bytes), ``scale`` fp32 ``[..., N/block, K/block]`` (the
    multiplier: DeepSeek's ``weight_scale_inv``, compressed-tensors' ``weight_scale``)."""
    vals = e4m3_decode(w)
    n, k = vals.shape[-2:]
    want = (*vals.shape[:-2], -(-n // block), -(-k // block))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise LayoutError(f"dequantize_fp8_block: weight {tuple(vals.shape)} needs fp32 scales {want} at one per "
                          f"{block}x{block} block; got {scale.dtype} {tuple(scale.shape)}")
    s = scale.repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]
    return vals * s


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 encoding of a float weight ``[N, K]`` (N, K multiples of ``block``):
    ``(e4m3 [N, K], fp32 scale [N/block, K/block])`` with ``scale = amax / 448`` per
    block (1.0 for an all-zero block) and ``e4m3 = RNE-satfinite(w / scale)``, the
    DeepSeek-V3 / transformers FineGrainedFP8 convention (docs/FORMATS.md#fp8-block)."""
    x = _float_input(w, "quantize_fp8_block")
    n, k = x.shape[-2:]
    if n % block or k % block:
        raise FormatError(f"quantize_fp8_block: shape {tuple(x.shape)} is not a multiple of {block}x{block}")
    blocks = x.unflatten(-1, (k // block, block)).unflatten(-3, (n // block, block))  # [.., nb, b, kb, b]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = e4m3_encode(blocks / scale[..., :, None, :, None])
    return q.reshape(x.shape), scale


def quantize_fp8_act(x: torch.Tensor, group: int, *, reciprocal_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 activation quantization of the SM90 block-FP8 kernel, ``(e4m3 [.., K],
    fp32 scale [.., K/group])``: ``amax`` per group floored at 1e-10, then
    ``scale = amax / 448`` (``reciprocal_scale=False``: the dispatch, a division) or
    ``scale = amax * fp32(1/448)`` (``True``: the intermediate after SwiGLU, a multiply by
    the rounded constant); ``e4m3 = RNE-satfinite(x * (1 / scale))`` (docs/NUMERICS.md#fp8-block)."""
    x32 = _float_input(x, "quantize_fp8_act")
    g = _grouped(x32, group, "quantize_fp8_act")
    amax = g.abs().amax(dim=-1).clamp_min(FP8_ACT_AMAX_FLOOR)
    if reciprocal_scale:
        scale = amax * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32, device=x32.device)
    else:
        # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal
        scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=x32.device)
    inv = 1.0 / scale
    q = e4m3_encode(g * inv.unsqueeze(-1))
    return q.reshape(x32.shape), scale
