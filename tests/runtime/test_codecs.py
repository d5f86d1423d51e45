"""Tests for megamoe_runtime.format.codecs and megamoe_runtime.testing.

Golden vectors are derived by hand from the format definitions (docs/FORMATS.md)
and written out literally; the derivation is in the comment beside
each one. The independent-implementation checks use slow pure-Python float64
encoders written here from the math, never the code under test.
"""
from __future__ import annotations

import functools
import math
import struct

import pytest
import torch

from megamoe_runtime.errors import FormatError, LayoutError, MegaMoEError, ScaleError
from megamoe_runtime.format import codecs as C
from megamoe_runtime.testing import calc_diff, rel_l2

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

U8 = torch.uint8
F32 = torch.float32
INF = float("inf")
NAN = float("nan")


def t(values, dtype=F32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def lst(x: torch.Tensor) -> list:
    return x.cpu().tolist()


def nextup(v: float) -> float:
    return torch.nextafter(t([v]), t([INF])).item()


def nextdown(v: float) -> float:
    return torch.nextafter(t([v]), t([-INF])).item()


def e4m3_bytes(q: torch.Tensor) -> list:
    return lst(q.view(U8))


# ---------------------------------------------------------------------------
# Independent pure-Python references (float64 math, fp32 rounding emulated)
# ---------------------------------------------------------------------------

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> float:
    """Round a Python float to fp32 (a float64 op followed by this equals the fp32 op)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def py_e2m1(v: float, ties: str) -> int:
    """Nearest E2M1 magnitude by exhaustive distance; ties by rule; saturate above 6."""
    a = abs(v)
    if a >= 6.0:
        mag = 7
    else:
        dists = [abs(a - g) for g in GRID]
        best = min(dists)
        cands = [i for i, d in enumerate(dists) if d == best]
        if len(cands) == 1:
            mag = cands[0]
        elif ties == "down":
            mag = min(cands)
        else:  # even mantissa = even code
            mag = [i for i in cands if i % 2 == 0][0]
    if ties == "even":
        neg = math.copysign(1.0, v) < 0
    else:
        neg = v < 0 and mag != 0
    return mag | (8 if neg else 0)


def py_e4m3(v: float) -> float:
    """E4M3fn round-to-nearest-even, saturating at 448, from the definition."""
    if v != v:
        return v
    sign = -1.0 if math.copysign(1.0, v) < 0 else 1.0
    a = abs(v)
    if a >= 448.0:
        return sign * 448.0
    if a < 2.0 ** -6:
        ulp = 2.0 ** -9  # subnormal spacing
    else:
        _, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1) -> floor(log2 a) = e - 1
        ulp = 2.0 ** (e - 1 - 3)
    return sign * min(round(a / ulp) * ulp, 448.0)  # round() is half-to-even


def py_ue8m0_byte(amax: float, elem_max: float) -> int:
    q = f32(max(f32(amax), f32(1e-4)) / elem_max)
    if q == 0.0:
        return 1
    m, e = math.frexp(q)
    c = e - 1 if m == 0.5 else e  # ceil(log2 q)
    return max(1, min(254, c + 127))


def py_quantize_mx(row: list, elem: str, ties: str = "even"):
    """Returns (element values or codes, scale bytes) for one row, groups of 32."""
    out, sfs = [], []
    elem_max = 448.0 if elem == "e4m3" else 6.0
    for g0 in range(0, len(row), 32):
        grp = row[g0:g0 + 32]
        s = py_ue8m0_byte(max(abs(v) for v in grp), elem_max)
        sfs.append(s)
        inv = 2.0 ** (127 - s)
        for v in grp:
            scaled = f32(v * inv)
            out.append(py_e4m3(scaled) if elem == "e4m3" else py_e2m1(scaled, ties))
    return out, sfs


def py_quantize_nvfp4(row: list, g: float, ties: str):
    """Newer-DG order in fp32: inv = 1/g; sf = e4m3(max(amax/6*inv, 2^-9)); e2m1(x*inv/sf)."""
    inv = f32(1.0 / f32(g))
    codes, sfs = [], []
    for g0 in range(0, len(row), 16):
        blk = row[g0:g0 + 16]
        s = f32(f32(max(abs(v) for v in blk) / 6.0) * inv)
        sf = py_e4m3(max(s, 2.0 ** -9))
        sfs.append(sf)
        codes += [py_e2m1(f32(f32(v * inv) / sf), ties) for v in blk]
    return codes, sfs


def pack_codes(codes: list) -> list:
    return [(codes[2 * j] & 15) | ((codes[2 * j + 1] & 15) << 4) for j in range(len(codes) // 2)]


def random_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows spanning many binades, with exact grid values and midpoints sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x *= torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen).float())
    specials = t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0, 0.0, -0.0])
    idx = torch.randint(0, k, (rows, 8), generator=gen)
    x.scatter_(1, idx, specials[torch.randint(0, len(specials), (rows, 8), generator=gen)])
    return x


# ---------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------

def test_e2m1_value_table():
    assert lst(C.E2M1_VALUES) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert C.E2M1_VALUES.dtype == F32
    assert torch.signbit(C.E2M1_VALUES[8]) and not torch.signbit(C.E2M1_VALUES[0])


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_decode_all_codes(device):
    codes = torch.arange(16, dtype=U8, device=device)
    v = C.e2m1_decode(codes)
    assert v.dtype == F32
    assert torch.equal(v.cpu(), C.E2M1_VALUES)
    assert torch.equal(torch.signbit(v).cpu(), torch.arange(16) >= 8)  # code 8 is -0.0
    # int8 input and stray high-nibble bits: only the low nibble counts
    assert torch.equal(C.e2m1_decode(codes.view(torch.int8)), v)
    assert torch.equal(C.e2m1_decode(codes | 0xF0), v)


# Midpoints 0.25 .75 1.25 1.75 2.5 3.5 5 between magnitudes 0 .5 1 1.5 2 3 4 6 (codes 0..7).
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
# RNE: tie goes to the even code (even mantissa): 0.25->0(0) .75->1.0(2) 1.25->1.0(2)
# 1.75->2.0(4) 2.5->2.0(4) 3.5->4.0(6) 5->4.0(6).
TIES_EVEN = [0, 2, 2, 4, 4, 6, 6]
# DG Python reference (strict >): tie goes to the smaller magnitude.
TIES_DOWN = [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_every_tie_both_modes(device):
    x = t(MIDPOINTS, device=device)
    assert lst(C.e2m1_encode(x, "even")) == TIES_EVEN
    assert lst(C.e2m1_encode(x, "down")) == TIES_DOWN
    # negatives: even keeps the sign bit (-0.25 -> -0 = code 8); down never makes -0
    assert lst(C.e2m1_encode(-x, "even")) == [8, 10, 10, 12, 12, 14, 14]
    assert lst(C.e2m1_encode(-x, "down")) == [0, 9, 10, 11, 12, 13, 14]
    assert C.e2m1_encode(x).dtype == U8


def test_e2m1_tie_vectors_distinguish_modes():
    """Negative control: the golden tie vectors are not satisfiable by the other mode."""
    x = t(MIDPOINTS)
    even, down = lst(C.e2m1_encode(x, "even")), lst(C.e2m1_encode(x, "down"))
    assert even != TIES_DOWN and down != TIES_EVEN
    differ = [m for m, a, b in zip(MIDPOINTS, even, down) if a != b]
    assert differ == [0.75, 1.75, 3.5]


@pytest.mark.parametrize("ties", ["even", "down"])
def test_e2m1_non_ties_and_saturation(ties):
    # nearest value, unambiguous: 0.1->0 .3->.5 .6->.5 .8->1 1.3->1.5 1.7->1.5 2.4->2 2.6->3
    # 3.4->3 3.6->4 4.9->4 5.1->6; 6 and above (and inf) saturate to 6 (code 7)
    x = t([0.1, 0.3, 0.6, 0.8, 1.3, 1.7, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, 6.0, 6.5, 100.0, INF])
    expect = [0, 1, 1, 2, 3, 3, 4, 5, 5, 6, 6, 7, 7, 7, 7, 7]
    assert lst(C.e2m1_encode(x, ties)) == expect
    assert lst(C.e2m1_encode(-x, ties)) == [c | 8 if c else (8 if ties == "even" else 0) for c in expect]
    # just either side of every midpoint: no tie rule involved
    up = [nextup(m) for m in MIDPOINTS]
    down = [nextdown(m) for m in MIDPOINTS]
    assert lst(C.e2m1_encode(t(up), ties)) == [1, 2, 3, 4, 5, 6, 7]
    assert lst(C.e2m1_encode(t(down), ties)) == [0, 1, 2, 3, 4, 5, 6]


def test_e2m1_negative_zero():
    x = t([-0.0, 0.0, -0.1, -0.25, -0.26, -1e-30])
    # even: sign bit of the input is kept (IEEE-style), so -0.0 and small negatives -> code 8
    assert lst(C.e2m1_encode(x, "even")) == [8, 0, 8, 8, 9, 8]
    # down (DG reference): sign only for x < 0 with a non-zero magnitude, never -0
    assert lst(C.e2m1_encode(x, "down")) == [0, 0, 0, 0, 9, 0]


def test_e2m1_nan_documented():
    assert lst(C.e2m1_encode(t([NAN]), "down")) == [0]
    assert lst(C.e2m1_encode(t([NAN]), "even")) in ([0], [8])


def test_e2m1_half_precision_inputs_match_fp32():
    x = t([0.75, 1.75, 3.5, -2.5, 5.0, 7.0, -0.0])
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        for ties in ("even", "down"):
            assert torch.equal(C.e2m1_encode(x.to(dt), ties), C.e2m1_encode(x, ties))


def test_e2m1_round_trip_grid():
    codes = torch.arange(16, dtype=U8)
    assert torch.equal(C.e2m1_encode(C.e2m1_decode(codes), "even"), codes)
    # down never produces -0: code 8 maps to 0, everything else round-trips
    down = C.e2m1_encode(C.e2m1_decode(codes), "down")
    assert lst(down) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("ties", ["even", "down"])
def test_e2m1_encode_matches_independent_python(ties):
    gen = torch.Generator().manual_seed(1234)
    parts = [
        torch.rand(3000, generator=gen) * 16 - 8,
        torch.randn(1000, generator=gen) * 0.5,
        t(MIDPOINTS + GRID + [7.0, 1e-8, 2.0 ** -126]),
    ]
    mids = t(MIDPOINTS)
    parts += [mids, -mids, torch.nextafter(mids, t(INF)), torch.nextafter(mids, t(-INF))]
    x = torch.cat([p.reshape(-1) for p in parts])
    x = torch.cat([x, -x])
    got = lst(C.e2m1_encode(x, ties))
    want = [py_e2m1(v, ties) for v in lst(x)]
    assert got == want


def test_e2m1_bad_ties_and_dtype():
    with pytest.raises(FormatError, match="ties='up'"):
        C.e2m1_encode(t([1.0]), "up")
    with pytest.raises(FormatError):
        C.e2m1_encode(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(FormatError):
        C.quantize_mxfp4(torch.zeros(1, 32), ties="nearest")


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_e2m1_nibble_order(device):
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0x8]], dtype=U8, device=device)
    packed = C.pack_e2m1(codes)
    # element 2j in the LOW nibble: (1,2)->0x21, (3,4)->0x43, (15,8)->0x8F
    assert lst(packed) == [[0x21, 0x43, 0x8F]]
    assert packed.dtype == U8
    assert torch.equal(C.unpack_e2m1(packed), codes)
    assert torch.equal(C.unpack_e2m1(packed.view(torch.int8)), codes)
    all_bytes = torch.arange(256, dtype=U8, device=device).reshape(4, 64)
    assert torch.equal(C.pack_e2m1(C.unpack_e2m1(all_bytes)), all_bytes)
    with pytest.raises(LayoutError):
        C.pack_e2m1(torch.zeros(3, dtype=U8))


# ---------------------------------------------------------------------------
# E4M3fn
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_encode_golden(device):
    x = t([448.0, 449.0, 464.0, 465.0, 1000.0, INF, -INF, -1000.0,
           1.0625, 1.1875, 17.0, 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -6, -0.0],
          device=device)
    q = C.e4m3_encode(x)
    assert q.dtype == torch.float8_e4m3fn
    # saturation: everything >= 448 (incl. inf) -> 448 = 0x7E; negatives -> 0xFE.
    # RNE: 1.0625 is the tie between 1.0 (0x38, even) and 1.125 -> 1.0;
    # 1.1875 ties 1.125 (odd) / 1.25 (0x3A, even) -> 1.25; 17 ties 16 (0x58) / 18 -> 16;
    # 2^-9 is the min subnormal 0x01; 2^-10 ties 0 / 2^-9 -> 0; 1.5*2^-10 -> 2^-9;
    # 2^-6 is the min normal 0x08; -0.0 keeps its sign, 0x80.
    assert e4m3_bytes(q) == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE,
                             0x38, 0x3A, 0x58, 0x01, 0x00, 0x01, 0x08, 0x80]
    nan = C.e4m3_encode(t([NAN], device=device))
    assert torch.isnan(nan.float()).all()


def test_e4m3_saturation_does_not_depend_on_torch_cast():
    """Older torch casts overflow to NaN (docs/FORMATS.md#e4m3), torch 2.13 on CPU
    saturates; e4m3_encode clamps first, so its result is the same either way."""
    x = t([449.0, 463.9, 464.0, 479.0, 480.0, 1e30, INF])
    assert e4m3_bytes(C.e4m3_encode(x)) == [0x7E] * 7
    assert e4m3_bytes(C.e4m3_encode(-x)) == [0xFE] * 7


def test_e4m3_round_trip_all_bytes_and_decode():
    b = torch.arange(256, dtype=U8)
    finite = (b & 0x7F) != 0x7F  # 0x7F / 0xFF are NaN
    v = C.e4m3_decode(b)
    assert v.dtype == F32
    assert torch.isnan(v[~finite]).all()
    assert torch.equal(C.e4m3_encode(v[finite]).view(U8), b[finite])
    assert torch.equal(C.e4m3_decode(b.view(torch.float8_e4m3fn)).view(torch.int32), v.view(torch.int32))
    assert C.e4m3_decode(t([0x7E], dtype=U8)).item() == 448.0


def test_e4m3_matches_independent_python():
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(4000, generator=gen) * torch.exp2(torch.randint(-12, 10, (4000,), generator=gen).float()),
                   torch.rand(500, generator=gen) * 2.0 ** -6])
    got = lst(C.e4m3_encode(x).float())
    want = [py_e4m3(v) for v in lst(x)]
    assert got == want


# ---------------------------------------------------------------------------
# UE8M0
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_ue8m0_decode_golden(device):
    b = torch.tensor([0, 1, 126, 127, 128, 254], dtype=U8, device=device)
    assert lst(C.ue8m0_decode(b)) == [0.0, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    # the DeepSeek-V4 storage dtype decodes the same bits
    assert torch.equal(C.ue8m0_decode(b.view(torch.float8_e8m0fnu)), C.ue8m0_decode(b))


def test_ue8m0_decode_refuses_ff():
    b = torch.tensor([[1, 2, 255], [255, 127, 0]], dtype=U8)
    with pytest.raises(ScaleError) as info:
        C.ue8m0_decode(b, name="model.layers.3.mlp.experts.7.down_proj.weight_scale")
    msg = str(info.value)
    assert "2 UE8M0" in msg and "(0, 2)" in msg and "0xFF" in msg
    assert "experts.7.down_proj" in msg
    assert isinstance(info.value, MegaMoEError)
    # check=False is the hot-path escape hatch: 0xFF << 23 is the fp32 +inf pattern
    assert C.ue8m0_decode(b, check=False)[0, 2].item() == INF


def test_ceil_to_ue8m0_byte_clamps():
    x = t([0.0, 2.0 ** -130, 2.0 ** -126, nextup(2.0 ** -126), 1.0, nextup(1.0), 0.75,
           2.0 ** 127, 1.5 * 2.0 ** 127, INF, NAN, -3.0])
    # zero / subnormal clamp to byte 1; 2^-126 is exponent 1; anything above needs 2;
    # 1.0 -> 127, next float above -> 128, 0.75 -> 2^0 -> 127; 2^127 -> 254;
    # 1.5*2^127 would be 255 -> clamps to 254; inf/nan -> 254; the sign is ignored (-3 -> 4)
    assert lst(C.ceil_to_ue8m0_byte(x)) == [1, 1, 1, 2, 127, 128, 127, 254, 254, 254, 254, 129]


def test_ue8m0_ceil_exponent_boundaries_e4m3():
    # E4M3 max 448 = 1.75 * 2^8; amax = 1.75 * 2^k is exactly 2^(k-8) -> byte 127 + k - 8.
    amax = t([448.0, 14.0, nextdown(14.0), nextup(14.0), 448.0 * 2.0 ** 20, 384.0,
              0.0, 1e-5, 1e-4, INF, NAN])
    # 14 = 1.75*2^3 -> 2^-5 -> 122; just below -> still 122; just above -> 123;
    # 448*2^20 -> 147; 384 = 1.5*2^8 -> 0.857 -> 127;
    # below the 1e-4 floor: 1e-4/448 = 2.23e-7 -> 2^-22 -> 105; non-finite -> 254.
    assert lst(C.ue8m0_ceil_exponent(amax, 448.0)) == [127, 122, 122, 123, 147, 127,
                                                       105, 105, 105, 254, 254]


def test_ue8m0_ceil_exponent_boundaries_e2m1():
    # E2M1 max 6 = 1.5 * 2^2; amax = 1.5 * 2^k -> byte 127 + k - 2.
    amax = t([6.0, 0.75, nextdown(0.75), nextup(0.75), 7.0, 1.75, 0.0, 5e-5])
    # 0.75 -> 2^-3 -> 124; below -> 124; above -> 125; 7 = 1.75*2^2 -> 7/6 -> 128;
    # 1.75 -> 0.29 -> 2^-1 -> 126; floor 1e-4/6 = 1.67e-5 -> 2^-15 -> 112.
    assert lst(C.ue8m0_ceil_exponent(amax, 6.0)) == [127, 124, 124, 125, 128, 126, 112, 112]
    assert C.ue8m0_ceil_exponent(amax, 6.0).dtype == U8


def test_ue8m0_round_trip():
    s = torch.arange(1, 255, dtype=U8)
    assert torch.equal(C.ceil_to_ue8m0_byte(C.ue8m0_decode(s)), s)
    # byte 0 decodes to 0.0, which is not a power of two: it re-encodes to the clamp, 1
    assert lst(C.ceil_to_ue8m0_byte(C.ue8m0_decode(torch.zeros(1, dtype=U8)))) == [1]


def test_ue8m0_ceil_exponent_matches_independent_python():
    gen = torch.Generator().manual_seed(3)
    amax = (torch.rand(3000, generator=gen) *
            torch.exp2(torch.randint(-40, 40, (3000,), generator=gen).float()))
    for elem_max in (448.0, 6.0):
        got = lst(C.ue8m0_ceil_exponent(amax, elem_max))
        assert got == [py_ue8m0_byte(a, elem_max) for a in lst(amax)]


# ---------------------------------------------------------------------------
# int32 packing
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_pack_bytes_int32_golden(device):
    b = torch.tensor([[0x01, 0x02, 0x03, 0x04, 0x05],
                      [0x7F, 0x80, 0xFF, 0xFE, 0x00]], dtype=U8, device=device)
    p = C.pack_bytes_int32(b)
    assert p.dtype == torch.int32 and tuple(p.shape) == (2, 2)
    # byte j of int p is group 4p+j, missing groups 0:
    # 0x04030201; 0x00000005; 0xFEFF807F as signed int32 = -16809857; 0
    assert lst(p) == [[0x04030201, 0x05], [-16809857, 0]]
    assert lst(C.pack_bytes_int32(torch.tensor([0, 0, 0, 0x80], dtype=U8, device=device))) == [-2 ** 31]
    assert lst(C.pack_bytes_int32(torch.full((4,), 0xFF, dtype=U8, device=device))) == [-1]
    # E4M3 scale bits pack as bytes: 1.0 = 0x38, 448 = 0x7E, 2^-9 = 0x01
    sf = t([1.0, 448.0, 2.0 ** -9, 0.0], device=device).to(torch.float8_e4m3fn)
    assert lst(C.pack_bytes_int32(sf)) == [0x00017E38]
    assert torch.equal(C.unpack_int32_bytes(p, 5), b)


def test_pack_bytes_int32_equals_little_endian_view():
    """The explicit shifts give the same words as a little-endian reinterpretation."""
    import sys
    if sys.byteorder != "little":
        pytest.skip("host is big-endian")
    b = torch.randint(0, 256, (3, 5, 16), dtype=U8)
    assert torch.equal(C.pack_bytes_int32(b), b.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_pack_bytes_int32_fast_path_equals_shifts(device):
    """The little-endian view fast path and the shift path give identical
    words: every G mod 4, empty and 1-D inputs, non-contiguous inputs (shift
    path), unaligned storage offsets, all byte dtypes, edge byte values."""
    import sys
    g = torch.Generator().manual_seed(0)
    cases = []
    for G in (1, 2, 3, 4, 5, 7, 8, 31, 32, 33):
        cases.append(torch.randint(0, 256, (3, 5, G), dtype=U8, generator=g))
    cases.append(torch.randint(0, 256, (9,), dtype=U8, generator=g))
    cases.append(torch.zeros(0, 6, dtype=U8))
    cases.append(torch.tensor([[0xFF, 0x80, 0x7F, 0x00, 0x01]], dtype=U8))
    base = torch.randint(0, 256, (4, 41), dtype=U8, generator=g)
    cases.append(base[:, 1:])          # storage offset 1 (unaligned), non-contiguous rows
    cases.append(base.reshape(-1)[3:43])  # contiguous, storage offset 3
    cases.append(base.t())             # non-contiguous
    for b in cases:
        b = b.to(device)
        want = C._pack_bytes_int32_shifts(b)
        got = C.pack_bytes_int32(b)
        assert got.dtype == torch.int32 and got.shape == want.shape and torch.equal(got, want), b.shape
        if sys.byteorder == "little" and b.is_contiguous():
            assert torch.equal(C._pack_bytes_int32_view(b), want)
        for dt in (torch.int8, torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", torch.int8)):
            assert torch.equal(C.pack_bytes_int32(b.view(dt)), want)
    # a fresh tensor, never a view of the input
    b = torch.randint(0, 256, (2, 8), dtype=U8, device=device)
    p = C.pack_bytes_int32(b)
    before = p.clone()
    b.zero_()
    assert torch.equal(p, before)


def test_unpack_int32_bytes_strided_and_errors():
    b = torch.randint(0, 256, (6, 10), dtype=U8)
    p = C.pack_bytes_int32(b)  # [6, 3]
    mn_major = p.t().contiguous().t()  # same values, strides (1, 6)
    assert mn_major.stride() == (1, 6)
    assert torch.equal(C.unpack_int32_bytes(mn_major, 10), b)
    # pad bytes are dropped whatever they hold (DGv pads with 1.0 = 0x7F bytes)
    padded = p | (0x7F << 16)
    assert torch.equal(C.unpack_int32_bytes(padded, 10)[:, :8], C.unpack_int32_bytes(padded, 12)[:, :8])
    with pytest.raises(LayoutError, match="13 groups"):
        C.unpack_int32_bytes(p, 13)
    with pytest.raises(LayoutError):
        C.unpack_int32_bytes(p, 8)
    with pytest.raises(LayoutError):
        C.unpack_int32_bytes(p.to(torch.int64), 10)
    with pytest.raises(LayoutError):
        C.pack_bytes_int32(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------------
# MXFP8 / MXFP4 quantizers
# ---------------------------------------------------------------------------

def _row(vals, k=32):
    return vals + [0.0] * (k - len(vals))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_mxfp8_golden(device):
    x = t([
        _row([]),                                    # all zero
        _row([14.0, 7.0, -3.5]),                     # amax 1.75*2^3
        _row([nextup(14.0), 1.0]),                   # just above the boundary
        _row([448.0, 1.0625, 1.1875, 17.0, 2.0 ** -10, 3 * 2.0 ** -11, -0.0]),
        _row([5e-5, -1e-5]),                         # below the 1e-4 floor
    ], device=device)
    q, sf = C.quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and sf.dtype == U8
    assert tuple(q.shape) == (5, 32) and tuple(sf.shape) == (5, 1)
    # scale bytes: floor 2^-22 (105); 14/448 = 2^-5 (122); above -> 2^-4 (123); 448 -> 1 (127);
    # 5e-5 < 1e-4 -> floor again (105)
    assert lst(sf) == [[105], [122], [123], [127], [105]]
    qv = lst(q.float())
    assert qv[0] == [0.0] * 32
    assert qv[1][:3] == [448.0, 224.0, -112.0]        # x * 32
    assert qv[2][:2] == [224.0, 16.0]                 # x * 16, 224.0000153 rounds to 224
    # scale 1: RNE ties 1.0625->1, 1.1875->1.25, 17->16, 2^-10->0; 1.5*2^-10->2^-9
    assert qv[3][:6] == [448.0, 1.0, 1.25, 16.0, 0.0, 2.0 ** -9]
    assert e4m3_bytes(q)[3][:7] == [0x7E, 0x38, 0x3A, 0x58, 0x00, 0x01, 0x80]
    # 5e-5 * 2^22 = 209.7 -> 208 (step 16); -1e-5 * 2^22 = -41.9 -> -40 (step 4)
    assert qv[4][:2] == [208.0, -40.0]
    assert e4m3_bytes(q)[4][:2] == [0x75, 0xE2]


def test_quantize_mxfp8_xsf_packed_form_and_batch_dims():
    x = random_rows(6, 256, seed=11)
    q, sf = C.quantize_mxfp8(x)
    assert tuple(sf.shape) == (6, 8)
    xsf = C.pack_bytes_int32(sf)  # DG x_sf: int32 [T, H/128], row-major
    assert tuple(xsf.shape) == (6, 2) and xsf.is_contiguous()
    for r in range(6):
        for w in range(2):
            word = sum(b << (8 * j) for j, b in enumerate(lst(sf[r, 4 * w:4 * w + 4])))
            assert lst(xsf[r, w]) == (word - 2 ** 32 if word >= 2 ** 31 else word)
    q3, sf3 = C.quantize_mxfp8(x.reshape(2, 3, 256))
    assert torch.equal(q3.reshape(6, 256).view(U8), q.view(U8)) and torch.equal(sf3.reshape(6, 8), sf)
    qb, sfb = C.quantize_mxfp8(x.to(torch.bfloat16))
    qf, sff = C.quantize_mxfp8(x.to(torch.bfloat16).float())
    assert torch.equal(qb.view(U8), qf.view(U8)) and torch.equal(sfb, sff)


def test_quantize_mxfp8_matches_independent_python():
    x = random_rows(8, 128, seed=5)
    q, sf = C.quantize_mxfp8(x)
    for r in range(x.shape[0]):
        vals, sfs = py_quantize_mx(lst(x[r]), "e4m3")
        assert lst(sf[r]) == sfs
        assert lst(q[r].float()) == vals


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_mxfp4_golden(device):
    tie_row = [6.0, 0.75, -1.75, 3.5, 0.25, 5.0, -0.25, 2.5]
    x = t([
        _row(tie_row),                    # amax 6 = 1.5*2^2 -> scale 1 (127)
        _row([nextup(6.0), 0.75]),        # just above -> scale 2 (128)
        _row([]),                         # zero -> floor 2^-15 (112)
        _row([1e-5]),                     # below the floor -> 112
    ], device=device)
    pe, sfe = C.quantize_mxfp4(x, "even")
    pd, sfd = C.quantize_mxfp4(x, "down")
    assert lst(sfe) == lst(sfd) == [[127], [128], [112], [112]]
    assert pe.dtype == U8 and tuple(pe.shape) == (4, 16)
    # even codes: 6->7 .75->2 -1.75->12 3.5->6 .25->0 5->6 -.25->8 2.5->4
    # bytes (low nibble first): 0x27 0x6C 0x60 0x48
    assert lst(pe[0]) == [0x27, 0x6C, 0x60, 0x48] + [0] * 12
    # down codes: 7 1 11 5 0 6 0 4 -> 0x17 0x5B 0x60 0x40
    assert lst(pd[0]) == [0x17, 0x5B, 0x60, 0x40] + [0] * 12
    assert lst(pe[0]) != lst(pd[0])  # negative control: the modes are distinguished
    # scale 2: 6.0000005/2 -> 3 (code 5); 0.75/2 = 0.375 -> 0.5 (code 1) -> byte 0x15
    assert lst(pe[1])[0] == 0x15 and lst(pd[1])[0] == 0x15
    assert lst(pe[2]) == [0] * 16
    # 1e-5 * 2^15 = 0.328 -> 0.5 (code 1)
    assert lst(pe[3])[0] == 0x01


@pytest.mark.parametrize("ties", ["even", "down"])
def test_quantize_mxfp4_matches_independent_python(ties):
    x = random_rows(8, 128, seed=9)
    p, sf = C.quantize_mxfp4(x, ties)
    for r in range(x.shape[0]):
        codes, sfs = py_quantize_mx(lst(x[r]), "e2m1", ties)
        assert lst(sf[r]) == sfs
        assert lst(p[r]) == pack_codes(codes)


def test_mx_round_trip_on_grid():
    gen = torch.Generator().manual_seed(2)
    # mxfp4: E2M1 grid values at scale 2^k with one element at 6 (so the scale is exactly 2^k)
    codes = torch.randint(0, 16, (4, 64), generator=gen, dtype=U8)
    codes[:, 0::32] = 7
    scale_bytes = t([[120, 127], [115, 140], [127, 127], [113, 200]], dtype=U8)
    x = C.e2m1_decode(codes) * C.ue8m0_decode(scale_bytes).repeat_interleave(32, dim=-1)
    p, sf = C.quantize_mxfp4(x)
    assert torch.equal(sf, scale_bytes)
    assert torch.equal(C.dequantize_mx(p, sf, "e2m1"), x)
    # mxfp8: E4M3 grid values with the group max at 448 * 2^k
    b = torch.randint(0, 256, (4, 64), generator=gen, dtype=U8)
    b[(b & 0x7F) == 0x7F] = 0x00
    b[:, 0::32] = 0x7E
    x8 = C.e4m3_decode(b) * C.ue8m0_decode(scale_bytes).repeat_interleave(32, dim=-1)
    q, sf8 = C.quantize_mxfp8(x8)
    assert torch.equal(sf8, scale_bytes)
    assert torch.equal(C.dequantize_mx(q, sf8, "e4m3"), x8)


def test_quantizer_shape_and_dtype_errors():
    with pytest.raises(LayoutError, match="multiple of 32"):
        C.quantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(LayoutError, match="multiple of 16"):
        C.quantize_nvfp4(torch.zeros(2, 24), 1.0)
    with pytest.raises(FormatError):
        C.quantize_mxfp4(torch.zeros(2, 32, dtype=torch.int32))


# ---------------------------------------------------------------------------
# NVFP4 quantizers
# ---------------------------------------------------------------------------

def _blk(vals):
    return vals + [0.0] * (16 - len(vals))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_nvfp4_golden(device):
    x = t([
        _blk([3.0, -0.75, 0.1]) + _blk([]),              # global 0.5: inv = 2
        _blk([6.375, 1.0625]) + _blk([5376.0, 448.0]),
    ], device=device)
    p0, sf0 = C.quantize_nvfp4(x[:1], 0.5)
    # block 0: amax 3 -> 3/6*2 = 1.0 (0x38); codes e2m1(x*2): 6->7, -1.5->11, 0.2->0
    # block 1: zero -> max(0, 2^-9) -> 0x01; codes 0
    assert e4m3_bytes(sf0) == [[0x38, 0x01]]
    assert lst(p0) == [[0xB7, 0x00] + [0] * 6 + [0] * 8]
    p1, sf1 = C.quantize_nvfp4(x[1:], 1.0)
    # block 0: 6.375/6 = 1.0625 ties 1.0/1.125 -> 1.0; elements vs the ROUNDED scale:
    #   6.375 -> saturates to 6 (7); 1.0625 -> 1.0 (2) -> byte 0x27
    # block 1: 5376/6 = 896 > 448 -> sf saturates at 448 (0x7E); 5376/448 = 12 -> 6 (7);
    #   448/448 = 1 (2) -> byte 0x27
    assert e4m3_bytes(sf1) == [[0x38, 0x7E]]
    assert lst(p1)[0][0] == 0x27 and lst(p1)[0][8] == 0x27
    assert sf1.dtype == torch.float8_e4m3fn and tuple(p1.shape) == (1, 16)


def test_quantize_nvfp4_global_scale_forms():
    x = random_rows(3, 64, seed=4)
    gs = [0.01, 0.5, 3.0]
    per_row_p, per_row_sf = C.quantize_nvfp4(x, t(gs))
    for r, g in enumerate(gs):
        p, sf = C.quantize_nvfp4(x[r:r + 1], g)
        assert torch.equal(p[0], per_row_p[r]) and torch.equal(sf[0].view(U8), per_row_sf[r].view(U8))
    p, sf = C.quantize_nvfp4(x, torch.tensor(0.5))
    p2, sf2 = C.quantize_nvfp4(x, 0.5)
    assert torch.equal(p, p2) and torch.equal(sf.view(U8), sf2.view(U8))
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ScaleError):
            C.quantize_nvfp4(x, bad)
    with pytest.raises(LayoutError):
        C.quantize_nvfp4(x, t([1.0, 2.0]))


@pytest.mark.parametrize("ties", ["even", "down"])
def test_quantize_nvfp4_matches_independent_python(ties):
    x = random_rows(6, 64, seed=21)
    for g in (1.0, 0.37, 2.0 ** -10, 1e-6):
        p, sf = C.quantize_nvfp4(x, g, ties)
        for r in range(x.shape[0]):
            codes, sfs = py_quantize_nvfp4(lst(x[r]), g, ties)
            assert lst(sf[r].float()) == sfs
            assert lst(p[r]) == pack_codes(codes)


def test_quantize_nvfp4_per_token_golden():
    x = t([
        _blk([2688.0, 1.0]) + _blk([3.0]),
        [0.0] * 32,
    ])
    p, sf, ts = C.quantize_nvfp4_per_token(x)
    assert ts.dtype == F32 and tuple(ts.shape) == (2,)
    # token 0: amax 2688 -> scale 1.0; block 0 sf 448 (0x7E): 2688/448 = 6 (7), 1/448 -> 0;
    # block 1: amax 3 -> sf 0.5 (0x30): 3/0.5 = 6 (7)
    # token 1: all zero -> scale = fp32(1e-12)/2688; block scales 2^-9 (0x01); codes 0
    assert lst(ts)[0] == 1.0
    assert lst(ts)[1] == (t([1e-12]) / 2688.0).item()
    assert e4m3_bytes(sf) == [[0x7E, 0x30], [0x01, 0x01]]
    assert lst(p[0])[0] == 0x07 and lst(p[0])[8] == 0x07 and lst(p[1]) == [0] * 16
    assert torch.equal(C.dequantize_nvfp4(p, sf, ts)[1], torch.zeros(32))


def test_quantize_nvfp4_per_token_matches_dgv_recipe():
    """token_scale = max(amax, 1e-12)/2688, then global-1 NVFP4 of x/token_scale (DGv test)."""
    x = random_rows(5, 64, seed=8) * torch.logspace(-3, 1, 5)[:, None]
    for ties in ("even", "down"):
        p, sf, ts = C.quantize_nvfp4_per_token(x, ties)
        for r in range(x.shape[0]):
            row = lst(x[r])
            scale = f32(f32(max(max(abs(v) for v in row), 1e-12)) / 2688.0)
            assert lst(ts)[r] == scale
            codes, sfs = py_quantize_nvfp4([f32(v / scale) for v in row], 1.0, ties)
            assert lst(sf[r].float()) == sfs and lst(p[r]) == pack_codes(codes)
        err = rel_l2(C.dequantize_nvfp4(p, sf, ts), x)
        assert err < 0.2


def test_quantize_nvfp4_weight_golden():
    w = t([
        _blk([10.5, 0.875, -2.625, 4.375, 1.3125])   # amax 10.5 -> global 10.5/2688 = 2^-8
        + _blk([])                                   # zero block -> scale 1.0
        + _blk([1e-6, -1e-6, -0.0])                  # tiny block -> clamped to 2^-9
        + _blk([3.5, 1.40625, 0.421875]),            # block scale rounds 149.3 -> 144
    ])
    p, sf, g = C.quantize_nvfp4_weight(w)
    assert g == 2.0 ** -8 and isinstance(g, float)
    # block 0: 10.5/(6*2^-8) = 448 (0x7E); element scale 448*2^-8 = 1.75:
    #   6 (7), 0.5 (1), -1.5 (11), 2.5 tie -> 2 (4), 0.75 tie -> 1.0 (2) -> 0x17 0x4B 0x02
    # block 1: 0 -> 1.0 (0x38); block 2: 4.3e-5 -> 2^-9 (0x01); 1e-6*2^17 = 0.13 -> 0,
    #   -0.13 -> -0 (8, ModelOpt's x<0 sign), -0.0 -> +0 (0)  -> 0x80 0x00
    # block 3: 3.5/(6/256) = 149.3 -> RNE 144 (0x71); element scale 144/256 = 0.5625:
    #   3.5/0.5625 = 6.2 -> 6 (7); 1.40625/0.5625 = 2.5 tie -> 2 (4); 0.421875/0.5625 = 0.75 tie -> 1 (2)
    assert e4m3_bytes(sf) == [[0x7E, 0x38, 0x01, 0x71]]
    pb = lst(p[0])
    assert pb[0:3] == [0x17, 0x4B, 0x02]
    assert pb[8:16] == [0] * 8
    assert pb[16:18] == [0x80, 0x00]
    assert pb[24:26] == [0x47, 0x02]


def test_quantize_nvfp4_weight_zero_and_nonfinite():
    p, sf, g = C.quantize_nvfp4_weight(torch.zeros(2, 32))
    assert g == 1.0 and lst(p) == [[0] * 16] * 2 and e4m3_bytes(sf) == [[0x38, 0x38]] * 2
    with pytest.raises(ScaleError, match="inf"):
        C.quantize_nvfp4_weight(t([_blk([INF])]))


def test_quantize_nvfp4_weight_round_trip_error():
    w = random_rows(16, 128, seed=13).to(torch.bfloat16)
    p, sf, g = C.quantize_nvfp4_weight(w)
    assert calc_diff(C.dequantize_nvfp4(p, sf, g), w.float()) < 0.01


# ---------------------------------------------------------------------------
# Dequantizers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_mx_golden(device):
    packed = torch.zeros(2, 16, dtype=U8, device=device)
    packed[:, 0] = 0x27  # codes 7, 2 -> 6.0, 1.0
    packed[:, 1] = 0x9F  # codes 15, 9 -> -6.0, -0.5
    sf = torch.tensor([[128], [0]], dtype=U8, device=device)
    out = C.dequantize_mx(packed, sf, "e2m1")
    assert out.dtype == F32 and tuple(out.shape) == (2, 32)
    assert lst(out[0, :4]) == [12.0, 2.0, -12.0, -1.0]   # * 2^1
    assert lst(out[1]) == [0.0] * 32                     # byte 0 decodes to 0.0
    q = t([_row([448.0, -1.5, 2.0 ** -9])], device=device).to(torch.float8_e4m3fn)
    out8 = C.dequantize_mx(q, torch.tensor([[126]], dtype=U8, device=device), "e4m3")
    assert lst(out8[0, :3]) == [224.0, -0.75, 2.0 ** -10]
    assert torch.equal(C.dequantize_mx(q.view(U8), torch.tensor([[126]], dtype=U8, device=device), "e4m3"), out8)


def test_dequantize_errors():
    packed = torch.zeros(1, 16, dtype=U8)
    with pytest.raises(ScaleError, match="0xFF"):
        C.dequantize_mx(packed, torch.tensor([[255]], dtype=U8), "e2m1")
    with pytest.raises(FormatError, match="fp6"):
        C.dequantize_mx(packed, torch.tensor([[127]], dtype=U8), "fp6")
    with pytest.raises(LayoutError):
        C.dequantize_mx(packed, torch.tensor([[127, 127]], dtype=U8), "e2m1")
    with pytest.raises(LayoutError):
        C.dequantize_nvfp4(packed, torch.ones(1, 3).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(ScaleError):
        C.dequantize_nvfp4(packed, torch.ones(1, 2).to(torch.float8_e4m3fn), 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_nvfp4_golden(device):
    packed = torch.zeros(1, 16, dtype=U8, device=device)
    packed[0, 0] = 0x27  # 6, 1
    packed[0, 8] = 0xA1  # 0.5, -1
    sf = t([[1.0, 448.0]], device=device).to(torch.float8_e4m3fn)
    out = C.dequantize_nvfp4(packed, sf, 0.5)
    assert lst(out[0, :2]) == [3.0, 0.5] and lst(out[0, 16:18]) == [112.0, -224.0]
    # raw E4M3 bytes are accepted too; a per-row global multiplies each row
    out2 = C.dequantize_nvfp4(packed, sf.view(U8), t([0.5], device=device))
    assert torch.equal(out, out2)


# ---------------------------------------------------------------------------
# Byte tables (the CPU fast paths of the converter), bit for bit against the arithmetic codecs
# ---------------------------------------------------------------------------

EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(U8)


def bits(x: torch.Tensor) -> torch.Tensor:
    """Raw bits of a float tensor, so -0.0 vs 0.0 and NaN payloads count."""
    return x.contiguous().view({4: torch.int32, 1: U8}[x.element_size()])


def test_e2m1_decode_packed_every_byte():
    want = C.e2m1_decode(C.unpack_e2m1(EVERY_BYTE.view(16, 16)))  # the arithmetic path
    got = C.e2m1_decode_packed(EVERY_BYTE.view(16, 16))
    assert got.shape == (16, 32) and got.dtype == F32
    assert torch.equal(bits(got), bits(want))
    # int8 bytes, batch dims and a non-contiguous view give the same bits
    assert torch.equal(bits(C.e2m1_decode_packed(EVERY_BYTE.view(torch.int8).view(4, 4, 16))), bits(want.view(4, 4, 32)))
    nc = EVERY_BYTE.view(16, 16).t()
    assert torch.equal(bits(C.e2m1_decode_packed(nc)), bits(C.e2m1_decode(C.unpack_e2m1(nc.contiguous()))))
    # low nibble first: byte 0x71 -> (0.5, 6.0); 0x8F -> (-6.0, -0.0)
    assert lst(C.e2m1_decode_packed(t([[0x71, 0x8F]], dtype=U8))) == [[0.5, 6.0, -6.0, -0.0]]


def test_e2m1_packed_to_e4m3_every_byte():
    want = C.e4m3_encode(C.e2m1_decode(C.unpack_e2m1(EVERY_BYTE.view(8, 32))))
    got = C.e2m1_packed_to_e4m3(EVERY_BYTE.view(8, 32))
    assert got.dtype == torch.float8_e4m3fn and got.shape == (8, 64)
    assert torch.equal(bits(got), bits(want))
    # exact: decoding the E4M3 bytes gives the E2M1 values back
    assert torch.equal(bits(C.e4m3_decode(got)), bits(C.e2m1_decode_packed(EVERY_BYTE.view(8, 32))))


def test_e4m3_decode_table_every_byte():
    """Large inputs take the table (small ones the cast): both give the cast's bits, NaNs included."""
    many = EVERY_BYTE.repeat(64).view(64, 256)  # 16384 bytes: the table path
    want = many.view(torch.float8_e4m3fn).to(F32)
    assert torch.equal(bits(C.e4m3_decode(many)), bits(want))
    assert torch.equal(bits(C.e4m3_decode(many.view(torch.float8_e4m3fn))), bits(want))
    assert torch.equal(bits(C.e4m3_decode(many.t())), bits(want.t()))  # a strided view


def test_byte_tables_negative_control(monkeypatch):
    """A table with the nibbles swapped (the classic packing bug) is caught by the comparisons above."""
    entries, out, width = C._table("e2m1_pair_f32")
    swapped = entries.view(F32).view(256, 2).flip(1).contiguous().view(torch.int64).view(256)
    monkeypatch.setitem(C._TABLES, "e2m1_pair_f32", (swapped, out, width))
    want = C.e2m1_decode(C.unpack_e2m1(EVERY_BYTE.view(16, 16)))
    assert not torch.equal(bits(C.e2m1_decode_packed(EVERY_BYTE.view(16, 16))), bits(want))


def _reencode_reference(packed, sf, g):
    """NVFP4 -> MXFP8 as the converter did before the fused codec: compose the public pieces,
    on the arithmetic decoders (tables off)."""
    x = C.e2m1_decode(C.unpack_e2m1(packed)).unflatten(-1, (sf.shape[-1], 16))
    gs = g if isinstance(g, float) else g.unsqueeze(-1)
    x = (x * (sf.view(torch.float8_e4m3fn).to(F32) * gs).unsqueeze(-1)).flatten(-2)
    q, e = C.quantize_mxfp8(x)
    back = (q.to(F32).unflatten(-1, (e.shape[-1], 32)) * C.ue8m0_decode(e).unsqueeze(-1)).flatten(-2)
    return q, e, (back - x).abs().max() if x.numel() else torch.zeros(())


@functools.lru_cache(maxsize=1)
def _nvfp4_cases():
    gen = torch.Generator().manual_seed(11)
    cases = []
    for rows, k in ((1, 32), (5, 64), (300, 2048), (2048, 96), (3, 4096)):  # chunk edges: rows not a multiple
        w = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=gen).float())
        p, s, g = C.quantize_nvfp4_weight(w)
        cases.append((p, s, g))
    # every byte in every block position, and every E4M3 block scale (NaN excluded: checks refuse it),
    # with a large and a tiny global scale; all-zero blocks; zero scales
    finite = EVERY_BYTE[(EVERY_BYTE & 0x7F) != 0x7F]
    p = EVERY_BYTE.repeat(8).view(16, 128)
    s = finite.repeat(4)[: 16 * 16].view(16, 16).view(torch.float8_e4m3fn)
    for g in (1.0, 3.0e-3, 2.0 ** -20, 1.0e20):
        cases.append((p, s, g))
    cases.append((torch.zeros(4, 64, dtype=U8), torch.zeros(4, 8, dtype=U8).view(torch.float8_e4m3fn), 0.5))
    # a per-row global scale (one value per row)
    cases.append((p, s, torch.linspace(0.01, 4.0, 16)))
    return cases


@pytest.mark.parametrize("case", range(len(_nvfp4_cases())))
def test_nvfp4_to_mxfp8_bit_exact(case, monkeypatch):
    p, s, g = _nvfp4_cases()[case]
    got_q, got_e, got_change = C.nvfp4_to_mxfp8(p, s, g)
    monkeypatch.setattr(C, "_use_tables", lambda t: False)  # the reference runs on the arithmetic decoders
    want_q, want_e, want_change = _reencode_reference(p, s, g)
    assert torch.equal(got_q.view(U8), want_q.view(U8))
    assert torch.equal(got_e, want_e)
    assert bits(got_change).item() == bits(want_change.to(F32).reshape(())).item()
    # and against the public composition the converter used before (tables on or off: same bits)
    monkeypatch.undo()
    x = C.dequantize_nvfp4(p, s, g)
    q2, e2 = C.quantize_mxfp8(x)
    assert torch.equal(got_q.view(U8), q2.view(U8)) and torch.equal(got_e, e2)
    assert got_change.item() == (C.dequantize_mx(q2, e2, "e4m3") - x).abs().max().item()


def test_nvfp4_to_mxfp8_negative_control(monkeypatch):
    """Break one step (scale the block factor by 2) and the equality with the composition fails."""
    p, s, g = _nvfp4_cases()[2]
    monkeypatch.setattr(C, "e4m3_decode", lambda x: x.view(torch.float8_e4m3fn).to(F32) * 2)
    q, e, _ = C.nvfp4_to_mxfp8(p, s, g)
    monkeypatch.undo()
    q2, e2 = C.quantize_mxfp8(C.dequantize_nvfp4(p, s, g))
    assert not (torch.equal(q.view(U8), q2.view(U8)) and torch.equal(e, e2))


def test_nvfp4_to_mxfp8_shapes_and_errors():
    p = torch.zeros(2, 3, 32, dtype=U8)
    s = torch.ones(2, 3, 4).to(torch.float8_e4m3fn)
    q, e, change = C.nvfp4_to_mxfp8(p, s, 1.0)
    assert q.shape == (2, 3, 64) and e.shape == (2, 3, 2) and change.item() == 0.0
    q, e, change = C.nvfp4_to_mxfp8(torch.zeros(0, 16, dtype=U8), torch.zeros(0, 2, dtype=U8), 1.0)
    assert q.shape == (0, 32) and e.shape == (0, 1) and change.item() == 0.0
    with pytest.raises(LayoutError, match="block scales"):
        C.nvfp4_to_mxfp8(p, torch.ones(2, 3, 3).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(LayoutError, match="multiple of 32"):
        C.nvfp4_to_mxfp8(torch.zeros(1, 8, dtype=U8), torch.ones(1, 1).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(ScaleError):
        C.nvfp4_to_mxfp8(p, s, 0.0)


# ---------------------------------------------------------------------------
# testing.py
# ---------------------------------------------------------------------------

def test_calc_diff_and_rel_l2():
    x = t([1.0, -2.0, 3.0])
    assert calc_diff(x, x) == 0.0
    assert isinstance(calc_diff(x, x), float)
    assert calc_diff(x, 2 * x) == pytest.approx(0.2)   # 1 - 2*2/(1+4)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, torch.zeros(3)) == pytest.approx(1.0)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_l2(t([1.0, 1.0]), t([1.0, 0.0])) == pytest.approx(1.0)
    assert rel_l2(t([3.0, 4.0]), t([3.0, 4.0])) == 0.0
    assert rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_l2(t([1.0]), torch.zeros(1)) == INF
    # computed in float64: bf16 inputs give the same answer as their fp32 values
    xb = torch.randn(100).to(torch.bfloat16)
    assert calc_diff(xb, xb.float() * 1.01) == calc_diff(xb.float(), xb.float() * 1.01)


@pytest.mark.gpu
def test_cuda_matches_cpu_bitwise():
    """Every codec gives the same bytes on CUDA as on CPU (no device-dependent math)."""
    x = random_rows(64, 256, seed=99)
    xc = x.cuda()

    def same(a, b):
        a, b = a.cpu(), b.cpu()
        if a.dtype != U8 and a.element_size() == 1:
            a, b = a.view(U8), b.view(U8)
        elif a.dtype == F32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b)

    for ties in ("even", "down"):
        same(C.e2m1_encode(x, ties), C.e2m1_encode(xc, ties))
        for a, b in zip(C.quantize_mxfp4(x, ties), C.quantize_mxfp4(xc, ties)):
            same(a, b)
        for a, b in zip(C.quantize_nvfp4(x, 0.013, ties), C.quantize_nvfp4(xc, 0.013, ties)):
            same(a, b)
        for a, b in zip(C.quantize_nvfp4_per_token(x, ties), C.quantize_nvfp4_per_token(xc, ties)):
            same(a, b)
    for a, b in zip(C.quantize_mxfp8(x), C.quantize_mxfp8(xc)):
        same(a, b)
    p, sf, g = C.quantize_nvfp4_weight(x)
    pc, sfc, gc = C.quantize_nvfp4_weight(xc)
    same(p, pc), same(sf, sfc)
    assert g == gc
    same(C.e4m3_encode(x * 100), C.e4m3_encode(xc * 100))
    same(C.ue8m0_ceil_exponent(x.abs(), 448.0), C.ue8m0_ceil_exponent(xc.abs(), 448.0))
    b = torch.randint(0, 256, (64, 37), dtype=U8)
    same(C.pack_bytes_int32(b), C.pack_bytes_int32(b.cuda()))
    same(C.unpack_int32_bytes(C.pack_bytes_int32(b).cuda(), 37), b)
    q, s = C.quantize_mxfp8(x)
    same(C.dequantize_mx(q, s, "e4m3"), C.dequantize_mx(q.cuda(), s.cuda(), "e4m3"))
    same(C.dequantize_nvfp4(p, sf, g), C.dequantize_nvfp4(pc, sfc, g))


def test_ue8m0_byte_same_for_division_and_reciprocal_multiply():
    """Exhaustive over one binade (the byte only shifts with the exponent): DG's
    Python reference divides by 448 / 6 on CPU but multiplies by the fp32
    reciprocal on CUDA (and in the DG-main kernel); both give the same byte."""
    a = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(F32)
    for elem_max in (448.0, 6.0):
        inv = torch.full((), 1.0) / torch.full((), elem_max)
        assert torch.equal(C.ceil_to_ue8m0_byte(a * inv), C.ue8m0_ceil_exponent(a, elem_max))


def test_quantizers_accept_zero_rows():
    """A rank with no tokens quantizes an empty [0, K] batch (EP, padding)."""
    x = torch.zeros(0, 64)
    q, sf = C.quantize_mxfp8(x)
    assert q.shape == (0, 64) and sf.shape == (0, 2)
    assert C.dequantize_mx(q, sf, "e4m3").shape == (0, 64)
    p, sf4 = C.quantize_mxfp4(x)
    assert p.shape == (0, 32) and sf4.shape == (0, 2)
    p, sfn, ts = C.quantize_nvfp4_per_token(x)
    assert p.shape == (0, 32) and sfn.shape == (0, 4) and ts.shape == (0,)
    assert C.dequantize_nvfp4(p, sfn, ts).shape == (0, 64)
