"""Tests for megamoe_runtime.format.layout: the only packing code in the project.

Three independent checks of where bytes go:
1. round trips (pack -> unpack is the identity on canonical bytes);
2. an element-lookup oracle written here from docs/LAYOUT.md#kernel-side-lookup
   with plain Python integers, reading scales through the kernel
   view's strides; it must agree with the canonical dequantization for
   every element, and must FAIL for deliberately broken layouts;
3. hand-built examples whose expected ints are written out literally.
"""
from __future__ import annotations

import struct

import pytest
import torch

from megamoe_runtime.errors import CheckpointError, LayoutError
from megamoe_runtime.format import layout
from megamoe_runtime.format.canonical import ExpertTensors, ProjectionTensors
from megamoe_runtime.format.formats import ROWS, get_row

#: the rows with per-row packed scales (UTCCP) or none; the block-FP8 row is tested in test_layout_block_fp8.py
ALL_ROWS = tuple(n for n, r in ROWS.items() if not r.weight.block_scaled)


# --------------------------------------------------------------------------- random canonical experts


def _rand_bytes(shape, gen, lo=0, hi=256, exclude=()):
    b = torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen)
    for x in exclude:
        b[b == x] = (x + 1) % 256 if (x + 1) % 256 not in exclude else (x + 2) % 256
    return b


def _rand_proj(row, out, k, gen):
    w = row.weight
    if w.element == "e2m1":
        weight = _rand_bytes((out, k // 2), gen)
    elif w.element == "e4m3":
        weight = _rand_bytes((out, k), gen, exclude=(0x7F, 0xFF)).view(torch.float8_e4m3fn)
    else:
        weight = torch.randn((out, k), generator=gen).to(torch.bfloat16)
    scale = None
    if w.scale_encoding == "ue8m0":
        scale = _rand_bytes((out, k // 32), gen, 100, 150)
    elif w.scale_encoding == "e4m3":
        scale = _rand_bytes((out, k // 16), gen, 1, 0x7F).view(torch.float8_e4m3fn)  # positive, no NaN
    return ProjectionTensors(weight, scale)


def rand_expert(row, H, I, gen):
    row = get_row(row)
    return ExpertTensors(_rand_proj(row, I, H, gen), _rand_proj(row, I, H, gen), _rand_proj(row, H, I, gen))


def _bits(t):
    """Bit pattern of a tensor, for exact comparisons (NaN/-0 safe)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.int8):
        return t.contiguous().view(torch.uint8)
    return t.contiguous()


def assert_same_expert(a: ExpertTensors, b: ExpertTensors, where=""):
    for role in ("gate", "up", "down"):
        pa, pb = getattr(a, role), getattr(b, role)
        assert pa.weight.dtype == pb.weight.dtype, (where, role)
        assert torch.equal(_bits(pa.weight), _bits(pb.weight)), (where, role, "weight")
        if pa.scale is None:
            assert pb.scale is None
        else:
            assert pa.scale.dtype == pb.scale.dtype, (where, role)
            assert torch.equal(_bits(pa.scale), _bits(pb.scale)), (where, role, "scale")


# --------------------------------------------------------------------------- independent oracle (plain Python)

E2M1_PY = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def py_e2m1(code: int) -> float:
    v = E2M1_PY[code & 7]
    return -v if code & 8 else v


def py_e4m3(b: int) -> float:
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    assert not (e == 15 and m == 7), "NaN byte in test data"
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def py_bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def py_il(n: int, I: int) -> int:
    # docs/LAYOUT.md#interleave8
    if n < I:
        return 16 * (n // 8) + n % 8
    m = n - I
    return 16 * (m // 8) + 8 + m % 8


def py_utccp(r: int) -> int:
    # docs/LAYOUT.md#utccp
    return (r & ~127) + (r % 32) * 4 + (r // 32) % 4


class StridedInt32:
    """Reads an int32 tensor element through its own strides from the raw storage."""

    def __init__(self, t: torch.Tensor):
        assert t.dtype == torch.int32
        n = t.untyped_storage().nbytes() // 4
        self.flat = t.as_strided((n,), (1,), 0).tolist()
        self.off = t.storage_offset()
        self.st = t.stride()

    def __call__(self, *idx: int) -> int:
        return self.flat[self.off + sum(i * s for i, s in zip(idx, self.st))] & 0xFFFFFFFF


def oracle_values(row, w_kernel, sf_kernel, N, K, l1: bool):
    """Dequantized value of logical element (e, n, k) as the kernel reads it.

    w_kernel [E, N, Kw], sf_kernel [E, N, P] kernel views. l1: rows go through
    interleave8 (gate rows n < N/2, up rows after). Returns [E][N][K] floats
    (without nvfp4's global factor, which lives in the alphas).
    """
    row = get_row(row)
    el = row.weight.element
    if el == "bf16":
        wl = w_kernel.view(torch.int16).tolist()
    else:
        wl = w_kernel.view(torch.uint8).tolist()
    sf = StridedInt32(sf_kernel) if sf_kernel is not None else None
    I = N // 2
    enc = row.weight.scale_encoding
    out = []
    for e in range(w_kernel.shape[0]):
        rows = []
        for n in range(N):
            r = py_il(n, I) if l1 else n
            wr = wl[e][r]
            vals = []
            if enc is None:
                for k in range(K):
                    vals.append(py_bf16(wr[k]))
            else:
                sr = py_utccp(r)
                per_int = 128 if enc == "ue8m0" else 64
                group = 32 if enc == "ue8m0" else 16
                scales = []
                for kb in range(0, K, group):
                    word = sf(e, sr, kb // per_int)
                    byte = (word >> (8 * ((kb // group) % 4))) & 0xFF
                    scales.append(2.0 ** (byte - 127) if enc == "ue8m0" else py_e4m3(byte))
                for k in range(K):
                    if el == "e2m1":
                        byte = wr[k // 2]
                        code = byte & 0xF if k % 2 == 0 else byte >> 4
                        v = py_e2m1(code)
                    else:
                        v = py_e4m3(wr[k])
                    vals.append(v * scales[k // group])
            rows.append(vals)
        out.append(rows)
    return out


def canonical_values(row, experts, l1: bool):
    out = []
    for ex in experts:
        g, u, d = ex.dequantize(row)
        out.append(torch.cat([g, u], 0).tolist() if l1 else d.tolist())
    return out


def count_mismatches(a, b) -> int:
    bad = 0
    for ea, eb in zip(a, b):
        for ra, rb in zip(ea, eb):
            bad += sum(1 for x, y in zip(ra, rb) if x != y)
    return bad


def oracle_mismatches(row, kt: layout.KernelTensors, experts) -> tuple[int, int]:
    """(L1 mismatches, L2 mismatches) between the oracle and canonical values."""
    row = get_row(row)
    l1w, l1s, l2w, l2s = kt.l1_weight, kt.l1_scale, kt.l2_weight, kt.l2_scale
    if l1w.dim() == 2:  # 2-D shared: add a unit expert dim (strides of the rest kept)
        l1w, l2w = l1w.unsqueeze(0), l2w.unsqueeze(0)
        l1s = None if l1s is None else l1s.unsqueeze(0)
        l2s = None if l2s is None else l2s.unsqueeze(0)
    H, I = kt.hidden, kt.intermediate
    m1 = count_mismatches(oracle_values(row, l1w, l1s, 2 * I, H, True), canonical_values(row, experts, True))
    m2 = count_mismatches(oracle_values(row, l2w, l2s, H, I, False), canonical_values(row, experts, False))
    return m1, m2


# --------------------------------------------------------------------------- index maps


def test_index_maps_match_reference_and_vllm_scatter():
    for I in (64, 128, 384):
        seen = set()
        for n in range(2 * I):
            r = layout.interleave_row(n, I)
            assert r == py_il(n, I)
            assert layout.deinterleave_row(r, I) == n
            seen.add(r)
        assert seen == set(range(2 * I))
        # vLLM's direct w1/w3 SF scatter: 64b+16j+8q+m -> 128b+64q+32h+4m+j
        for half in (0, 1):
            for n in range(I):
                b, rem = divmod(n, 64)
                j, rem = divmod(rem, 16)
                q, m = divmod(rem, 8)
                assert layout.utccp_row(layout.interleave_row(n + half * I, I)) == 128 * b + 64 * q + 32 * half + 4 * m + j
                assert layout.interleave_row(n + half * I, I) == (n // 8) * 16 + 8 * half + n % 8
    for r in range(512):
        s = layout.utccp_row(r)
        assert s == py_utccp(r)
        base, (c, a) = s & ~127, divmod(s % 128, 4)
        assert base + 32 * a + c == r  # the inverse: logical row stored at position s
        b, rem = divmod(r, 128)
        j, i = divmod(rem, 32)
        assert s == 128 * b + 4 * i + j  # vLLM w2 SF scatter
    assert sorted(layout.utccp_row(r) for r in range(256)) == list(range(256))
    with pytest.raises(LayoutError):
        layout.interleave_row(256, 128)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("row", ALL_ROWS)
def test_round_trip_expert_stack(row):
    gen = torch.Generator().manual_seed(1)
    for I in (64, 128, 256, 384):
        for H in (128, 256):
            for E in (1, 3):
                exs = [rand_expert(row, H, I, gen) for _ in range(E)]
                kt = layout.pack_expert_stack(row, exs)
                layout.check_kernel_tensors(row, kt, E, H, I)
                back = layout.unpack_expert_stack(row, kt)
                assert len(back) == E
                for e, (a, b) in enumerate(zip(exs, back)):
                    assert_same_expert(a, b, f"{row} I={I} H={H} e={e}")


@pytest.mark.parametrize("row", ALL_ROWS)
@pytest.mark.parametrize("S", [1, 2])
def test_round_trip_shared_2d(row, S):
    gen = torch.Generator().manual_seed(2)
    for I_s in (64, 128, 192):
        for H in (128, 256):
            exs = [rand_expert(row, H, I_s, gen) for _ in range(S)]
            kt = layout.pack_shared(row, exs if S > 1 else exs[0])
            assert not kt.is_stack
            assert kt.l1_weight.shape == (2 * S * I_s, get_row(row).weight.stored_cols(H))
            assert kt.l2_weight.shape == (H, get_row(row).weight.stored_cols(S * I_s))
            if kt.l1_scale is not None:
                layout.check_kernel_strides(kt.l1_scale, "shared_l1_scale")
                layout.check_kernel_strides(kt.l2_scale, "shared_l2_scale")
                assert kt.l1_scale.stride() == (1, 2 * S * I_s)
            back = layout.unpack_shared(row, kt, S)
            assert len(back) == S
            for a, b in zip(exs, back):
                assert_same_expert(a, b, f"shared {row} S={S} I_s={I_s} H={H}")


def test_shared_fold_order_is_gate_stack_then_up_stack_and_k_stacked_down():
    gen = torch.Generator().manual_seed(3)
    H, I_s = 128, 64
    exs = [rand_expert("mxfp8", H, I_s, gen) for _ in range(2)]
    f = layout.fold_shared("mxfp8", exs)
    assert torch.equal(_bits(f.gate.weight[I_s:]), _bits(exs[1].gate.weight))
    assert torch.equal(_bits(f.up.weight[:I_s]), _bits(exs[0].up.weight))
    assert torch.equal(_bits(f.down.weight[:, I_s:]), _bits(exs[1].down.weight))
    assert torch.equal(f.down.scale[:, I_s // 32:], exs[1].down.scale)


# --------------------------------------------------------------------------- the lookup oracle


ORACLE_CASES = [(2, 256, 128), (1, 128, 256), (3, 128, 64)]


@pytest.mark.parametrize("row", ALL_ROWS)
def test_oracle_agrees_with_canonical_dequant_3d(row):
    gen = torch.Generator().manual_seed(4)
    for E, H, I in ORACLE_CASES:
        exs = [rand_expert(row, H, I, gen) for _ in range(E)]
        kt = layout.pack_expert_stack(row, exs)
        assert oracle_mismatches(row, kt, exs) == (0, 0), (row, E, H, I)


@pytest.mark.parametrize("row", ALL_ROWS)
def test_oracle_agrees_with_canonical_dequant_2d_shared(row):
    gen = torch.Generator().manual_seed(5)
    H, I_s, S = 128, 64, 2
    exs = [rand_expert(row, H, I_s, gen) for _ in range(S)]
    kt = layout.pack_shared(row, exs)
    folded = layout.fold_shared(row, exs)
    assert oracle_mismatches(row, kt, [folded]) == (0, 0)


def test_oracle_reads_through_strides_not_physical_order():
    # The kernel view and its physical base hold the same ints at different
    # indices; the oracle must use the view's strides.
    gen = torch.Generator().manual_seed(6)
    exs = [rand_expert("mxfp4", 128, 128, gen)]
    kt = layout.pack_expert_stack("mxfp4", exs)
    rd = StridedInt32(kt.l1_scale)
    phys = layout.physical(kt.l1_scale)
    for r in (0, 1, 5, 127, 200):
        assert rd(0, r, 0) == int(phys[0, 0, r]) & 0xFFFFFFFF


# negative controls: a broken layout must be caught by the oracle


def _bad_l1_weight_no_interleave(l1_weight_e, src, half, *, where="l1_weight"):
    n2 = l1_weight_e.shape[-2]
    l1_weight_e[..., half * (n2 // 2):(half + 1) * (n2 // 2), :].copy_(src.view(l1_weight_e.dtype))


def _bad_l1_scale_view_no_utccp(kv, half):
    n2 = kv.shape[-2]
    v = kv.transpose(-1, -2).unflatten(-1, (n2 // 16, 2, 8)).select(-2, half)  # (.., p, I/8, 8)
    nd = v.dim()
    v = v.permute(*range(nd - 3), nd - 2, nd - 1, nd - 3)  # (.., I/8, 8, p)
    return v.unflatten(-3, (n2 // 128, 4, 2))


def _bad_l2_scale_view_no_utccp(kv):
    return kv.unflatten(-2, (kv.shape[-2] // 128, 4, 32))


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4", "bf16"])
def test_negative_control_skipped_interleave(row, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    exs = [rand_expert(row, 128, 64, gen) for _ in range(2)]
    monkeypatch.setattr(layout, "write_l1_weight", _bad_l1_weight_no_interleave)
    kt = layout.pack_expert_stack(row, exs)
    m1, m2 = oracle_mismatches(row, kt, exs)
    assert m1 > 0 and m2 == 0


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4"])
def test_negative_control_skipped_l1_utccp(row, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    exs = [rand_expert(row, 128, 128, gen) for _ in range(2)]
    monkeypatch.setattr(layout, "_l1_scale_view", _bad_l1_scale_view_no_utccp)
    kt = layout.pack_expert_stack(row, exs)
    m1, m2 = oracle_mismatches(row, kt, exs)
    assert m1 > 0 and m2 == 0


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4"])
def test_negative_control_skipped_l2_utccp(row, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    exs = [rand_expert(row, 128, 128, gen)]
    monkeypatch.setattr(layout, "_l2_scale_view", _bad_l2_scale_view_no_utccp)
    kt = layout.pack_expert_stack(row, exs)
    m1, m2 = oracle_mismatches(row, kt, exs)
    assert m1 == 0 and m2 > 0


def test_negative_controls_perturbed_bytes():
    gen = torch.Generator().manual_seed(10)
    exs = [rand_expert("mxfp4", 128, 64, gen)]
    kt = layout.pack_expert_stack("mxfp4", exs)
    assert oracle_mismatches("mxfp4", kt, exs) == (0, 0)
    # swapped nibble order in one row
    saved = kt.l1_weight.clone()
    b = kt.l1_weight.view(torch.uint8)
    b[0, 3] = ((b[0, 3] & 0xF) << 4) | (b[0, 3] >> 4)
    assert oracle_mismatches("mxfp4", kt, exs)[0] > 0
    kt.l1_weight.copy_(saved)
    # two scale rows swapped in the physical base
    phys = layout.physical(kt.l1_scale)
    phys[0, 0, [1, 2]] = phys[0, 0, [2, 1]].clone()
    assert oracle_mismatches("mxfp4", kt, exs)[0] > 0


# --------------------------------------------------------------------------- hand-built literal examples


def _u32_to_i32(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def test_literal_mxfp4_l1_scale_and_weight_i64():
    H, I = 128, 64  # 2I = 128 rows: one UTCCP block; P1 = 1, four groups per row
    gate_s = torch.tensor([[4 * n + g for g in range(4)] for n in range(I)], dtype=torch.uint8)
    up_s = torch.tensor([[(4 * m + g + 128) % 256 for g in range(4)] for m in range(I)], dtype=torch.uint8)
    gate_w = torch.arange(I, dtype=torch.uint8).unsqueeze(1).expand(I, H // 2).contiguous()
    up_w = (64 + torch.arange(I, dtype=torch.uint8)).unsqueeze(1).expand(I, H // 2).contiguous()
    down = ProjectionTensors(torch.zeros(H, I // 2, dtype=torch.uint8), torch.full((H, 2), 127, dtype=torch.uint8))
    ex = ExpertTensors(ProjectionTensors(gate_w, gate_s), ProjectionTensors(up_w, up_s), down)
    kt = layout.pack_expert_stack("mxfp4", [ex])
    phys = layout.physical(kt.l1_scale)
    assert phys.shape == (1, 1, 128) and phys.is_contiguous()
    expect = {
        0: 0x03020100,  # gate row 0, groups 0..3
        1: 0x43424140,  # j=1 -> gate row 16
        4: 0x07060504,  # m=1 -> gate row 1
        32: _u32_to_i32(0x83828180),  # h=1 -> up row 0
        35: 0x43424140,  # h=1, j=3 -> up row 48: (192+128)%256 = 64..67
        64: 0x23222120,  # q=1 -> gate row 8
        127: 0x7F7E7D7C,  # q=1, h=1, m=7, j=3 -> up row 63
    }
    for col, val in expect.items():
        assert int(phys[0, 0, col]) == val, col
    assert int(phys[0, 0, 32]) == -2088599168
    # weights: kernel rows = [g0..7, u0..7, g8..15, u8..15, ...]
    col0 = kt.l1_weight[0, :32, 0].view(torch.uint8).tolist()
    assert col0 == [0, 1, 2, 3, 4, 5, 6, 7, 64, 65, 66, 67, 68, 69, 70, 71,
                    8, 9, 10, 11, 12, 13, 14, 15, 72, 73, 74, 75, 76, 77, 78, 79]
    assert int(kt.l1_weight[0, 127, 5].view(torch.uint8)) == 127
    # L2 weight untouched
    assert kt.l2_weight.view(torch.uint8).eq(0).all()


def test_literal_mxfp4_l2_scale_utccp():
    H, I = 128, 64  # G2 = 2 groups -> P2 = 1, bytes 2, 3 are padding (0)
    down_s = torch.stack([torch.arange(H), torch.full((H,), 0xA5)], 1).to(torch.uint8)
    zero_l1 = ProjectionTensors(torch.zeros(I, H // 2, dtype=torch.uint8), torch.full((I, 4), 127, dtype=torch.uint8))
    ex = ExpertTensors(zero_l1, zero_l1, ProjectionTensors(torch.zeros(H, I // 2, dtype=torch.uint8), down_s))
    kt = layout.pack_expert_stack("mxfp4", [ex])
    phys = layout.physical(kt.l2_scale)
    assert phys.shape == (1, 1, 128)
    expect = {0: 0xA500, 1: 0xA520, 2: 0xA540, 3: 0xA560, 4: 0xA501, 5: 0xA521, 127: 0xA57F, 126: 0xA55F}
    for col, val in expect.items():
        assert int(phys[0, 0, col]) == val, col
    assert kt.l2_scale.stride() == (128, 1, 128)
    # L1 scale of an all-127 source is the same int everywhere
    assert layout.physical(kt.l1_scale).eq(0x7F7F7F7F).all()


def test_literal_nvfp4_scale_words_per_64():
    H, I = 128, 64  # 8 blocks of 16 along H -> P1 = 2 words per row
    gate_s = torch.zeros(I, 8, dtype=torch.uint8)
    gate_s[0] = torch.arange(0x10, 0x18)
    gate_s[1] = torch.arange(0x20, 0x28)
    sc = ProjectionTensors(torch.zeros(I, H // 2, dtype=torch.uint8), gate_s.view(torch.float8_e4m3fn))
    up = ProjectionTensors(torch.zeros(I, H // 2, dtype=torch.uint8), torch.zeros(I, 8, dtype=torch.uint8).view(torch.float8_e4m3fn))
    down = ProjectionTensors(torch.zeros(H, I // 2, dtype=torch.uint8), torch.zeros(H, 4, dtype=torch.uint8).view(torch.float8_e4m3fn))
    kt = layout.pack_expert_stack("nvfp4", [ExpertTensors(sc, up, down)])
    assert kt.l1_scale.shape == (1, 128, 2) and kt.l1_scale.stride() == (256, 1, 128)
    assert kt.l2_scale.shape == (1, 128, 1) and kt.l2_scale.stride() == (128, 1, 128)
    phys = layout.physical(kt.l1_scale)
    assert int(phys[0, 0, 0]) == 0x13121110 and int(phys[0, 1, 0]) == 0x17161514  # gate row 0 at col 0
    assert int(phys[0, 0, 4]) == 0x23222120 and int(phys[0, 1, 4]) == 0x27262524  # gate row 1 at col 4
    assert int(phys.ne(0).sum()) == 4


def test_literal_bf16_interleave_only():
    H, I = 128, 16
    gate = torch.arange(I, dtype=torch.float32).unsqueeze(1).expand(I, H).to(torch.bfloat16)
    up = (100 + torch.arange(I, dtype=torch.float32)).unsqueeze(1).expand(I, H).to(torch.bfloat16)
    down = torch.zeros(H, I, dtype=torch.bfloat16)
    ex = ExpertTensors(ProjectionTensors(gate), ProjectionTensors(up), ProjectionTensors(down))
    kt = layout.pack_expert_stack("bf16", [ex])
    assert kt.l1_scale is None and kt.l2_scale is None
    assert kt.l1_weight[0, :, 7].float().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103, 104, 105, 106, 107,
                                                      8, 9, 10, 11, 12, 13, 14, 15,
                                                      108, 109, 110, 111, 112, 113, 114, 115]


# --------------------------------------------------------------------------- independent vectorised check (index tensors)


def _reference_pack(row, exs, H, I):
    """Kernel tensors built the slow way: explicit index maps + advanced indexing."""
    from megamoe_runtime.format.codecs import pack_bytes_int32

    row = get_row(row)
    il = torch.tensor([py_il(n, I) for n in range(2 * I)])
    w1 = torch.stack([_bits(torch.cat([e.gate.weight, e.up.weight])) for e in exs])
    l1w = torch.empty_like(w1)
    l1w[:, il] = w1
    l2w = torch.stack([_bits(e.down.weight) for e in exs])
    if not row.has_scales:
        return l1w, None, l2w, None
    s1 = pack_bytes_int32(torch.stack([torch.cat([e.gate.scale, e.up.scale]).view(torch.uint8) for e in exs]))
    s1_il = torch.empty_like(s1)
    s1_il[:, il] = s1
    ut1 = torch.tensor([py_utccp(r) for r in range(2 * I)])
    phys1 = torch.empty_like(s1_il)
    phys1[:, ut1] = s1_il
    s2 = pack_bytes_int32(torch.stack([e.down.scale.view(torch.uint8) for e in exs]))
    ut2 = torch.tensor([py_utccp(r) for r in range(H)])
    phys2 = torch.empty_like(s2)
    phys2[:, ut2] = s2
    return l1w, phys1.transpose(1, 2).contiguous(), l2w, phys2.transpose(1, 2).contiguous()


@pytest.mark.parametrize("row", ALL_ROWS)
def test_matches_index_tensor_reference(row):
    gen = torch.Generator().manual_seed(11)
    for I in (64, 128, 256, 384):
        for H in (128, 256):
            exs = [rand_expert(row, H, I, gen) for _ in range(3)]
            kt = layout.pack_expert_stack(row, exs)
            l1w, p1, l2w, p2 = _reference_pack(row, exs, H, I)
            assert torch.equal(_bits(kt.l1_weight), l1w)
            assert torch.equal(_bits(kt.l2_weight), l2w)
            if p1 is not None:
                assert torch.equal(layout.physical(kt.l1_scale), p1)
                assert torch.equal(layout.physical(kt.l2_scale), p2)


# --------------------------------------------------------------------------- primitives


def test_primitives_write_in_place_into_one_expert_slot():
    gen = torch.Generator().manual_seed(12)
    H, I, E = 256, 128, 3
    kt = layout.allocate_kernel_tensors("mxfp4", E, H, I)
    ptrs = {k: v.data_ptr() for k, v in kt.named().items()}
    ex = rand_expert("mxfp4", H, I, gen)
    layout.write_expert("mxfp4", kt, 1, ex)
    assert {k: v.data_ptr() for k, v in kt.named().items()} == ptrs
    for t in kt.named().values():  # other slots untouched
        assert t[0].eq(0).all() and t[2].eq(0).all()
    assert_same_expert(layout.read_expert("mxfp4", kt, 1), ex)
    # primitives on one slot agree with a whole-stack call
    kt2 = layout.allocate_kernel_tensors("mxfp4", E, H, I)
    gates = torch.stack([ex.gate.scale] * E)
    layout.write_l1_scale(kt2.l1_scale, gates, 0)
    for e in range(E):
        assert torch.equal(layout.read_l1_scale(kt2.l1_scale[e], 0, H // 32), ex.gate.scale)
        assert torch.equal(layout.read_l1_scale(kt2.l1_scale[e], 1, H // 32), torch.zeros_like(ex.gate.scale))


def test_write_accepts_packed_int32_and_e8m0_scales():
    from megamoe_runtime.format.codecs import pack_bytes_int32

    gen = torch.Generator().manual_seed(13)
    H, I = 256, 128
    ex = rand_expert("mxfp4", H, I, gen)
    a = layout.allocate_kernel_tensors("mxfp4", 1, H, I)
    b = layout.allocate_kernel_tensors("mxfp4", 1, H, I)
    layout.write_l1_scale(a.l1_scale[0], ex.gate.scale, 0)
    layout.write_l1_scale(b.l1_scale[0], pack_bytes_int32(ex.gate.scale), 0)
    assert torch.equal(layout.physical(a.l1_scale), layout.physical(b.l1_scale))
    if hasattr(torch, "float8_e8m0fnu"):
        layout.write_l2_scale(a.l2_scale[0], ex.down.scale.view(torch.float8_e8m0fnu))
        layout.write_l2_scale(b.l2_scale[0], ex.down.scale)
        assert torch.equal(layout.physical(a.l2_scale), layout.physical(b.l2_scale))


def test_primitive_errors_name_the_tensor():
    H, I = 256, 128
    kt = layout.allocate_kernel_tensors("mxfp4", 2, H, I)
    with pytest.raises(LayoutError, match="half=2"):
        layout.write_l1_weight(kt.l1_weight[0], torch.zeros(I, H // 2, dtype=torch.uint8), 2)
    with pytest.raises(LayoutError, match=r"w13.*\[64, 128\].*\[128, 128\]"):
        layout.write_l1_weight(kt.l1_weight[0], torch.zeros(64, H // 2, dtype=torch.uint8), 0, where="w13")
    with pytest.raises(LayoutError, match="float32"):
        layout.write_l2_weight(kt.l2_weight[0], torch.zeros(H, I // 2))
    with pytest.raises(LayoutError, match="P=2"):
        layout.write_l1_scale(kt.l1_scale[0], torch.zeros(I, 16, dtype=torch.uint8), 0)
    with pytest.raises(LayoutError, match=r"2\*intermediate to be a multiple of 128.*96.*64 or 128"):
        layout.allocate_kernel_tensors("mxfp4", 1, 256, 96)
    with pytest.raises(LayoutError, match=r"hidden.*multiple of 128.*hidden=200.*128 or 256"):
        layout.allocate_kernel_tensors("nvfp4", 1, 200, 128)
    with pytest.raises(LayoutError, match="multiple of 8"):
        layout.allocate_kernel_tensors("bf16", 1, 256, 12)
    bad = ExpertTensors(ProjectionTensors(torch.zeros(I, H // 2, dtype=torch.uint8), torch.zeros(I, 8, dtype=torch.uint8)),
                        ProjectionTensors(torch.zeros(I, H // 2, dtype=torch.uint8), torch.zeros(I, 4, dtype=torch.uint8)),
                        ProjectionTensors(torch.zeros(H, I // 2, dtype=torch.uint8), torch.zeros(H, 4, dtype=torch.uint8)))
    with pytest.raises(LayoutError, match=r"expert 0\.up: scale shape \[128, 4\] != expected \[128, 8\]"):
        layout.pack_expert_stack("mxfp4", [bad])


def test_meta_tensors_dry_run():
    H, I = 256, 128
    kt = layout.allocate_kernel_tensors("nvfp4", 2, H, I, device="meta")
    src_w = torch.empty(I, H // 2, dtype=torch.uint8, device="meta")
    src_s = torch.empty(I, H // 16, dtype=torch.float8_e4m3fn, device="meta")
    layout.write_l1_weight(kt.l1_weight[0], src_w, 1)
    layout.write_l1_scale(kt.l1_scale[0], src_s, 1)
    layout.check_kernel_strides(kt.l1_scale, "l1_scale")


# --------------------------------------------------------------------------- strides


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4"])
def test_allocated_strides_follow_deepgemm_rules(row):
    E, H, I = 3, 256, 384
    r = get_row(row)
    kt = layout.allocate_kernel_tensors(row, E, H, I)
    p1, p2 = r.weight.scale_ints(H), r.weight.scale_ints(I)
    assert kt.l1_scale.shape == (E, 2 * I, p1) and kt.l1_scale.stride() == (p1 * 2 * I, 1, 2 * I)
    assert kt.l2_scale.shape == (E, H, p2) and kt.l2_scale.stride() == (p2 * H, 1, H)
    assert kt.l1_weight.dtype == r.weight.kernel_dtype and kt.l1_weight.is_contiguous()
    assert kt.l1_weight.shape == (E, 2 * I, r.weight.stored_cols(H))
    assert kt.l2_weight.shape == (E, H, r.weight.stored_cols(I))
    for name, t in (("l1_scale", kt.l1_scale), ("l2_scale", kt.l2_scale)):
        layout.check_kernel_strides(t, name)
        phys = layout.physical(t)
        assert phys.is_contiguous() and phys.shape == (E, t.shape[2], t.shape[1])
        back = layout.kernel_view_from_physical(phys)
        assert back.stride() == t.stride() and back.data_ptr() == t.data_ptr()
    if row == "nvfp4":  # newer DG: strides exactly (N*D/64, 1, N)
        assert kt.l1_scale.stride() == (2 * I * H // 64, 1, 2 * I)
    shared = layout.allocate_kernel_tensors(row, None, H, I)
    assert shared.l1_scale.stride() == (1, 2 * I)
    layout.check_kernel_strides(shared.l1_scale, "shared_l1_scale")


def test_check_kernel_strides_rejects():
    good = layout.allocate_scale((2,), 256, 2)
    layout.check_kernel_strides(good, "ok")
    with pytest.raises(LayoutError, match=r"bad_contig.*strides \[512, 2, 1\].*\[512, 1, 256\]"):
        layout.check_kernel_strides(torch.zeros(2, 256, 2, dtype=torch.int32), "bad_contig")
    with pytest.raises(LayoutError, match="int32"):
        layout.check_kernel_strides(good.to(torch.int64), "bad_dtype")
    # expert stride not P*MN (padded experts)
    padded = torch.zeros(2, 3, 256, dtype=torch.int32)[:, :2].transpose(1, 2)
    with pytest.raises(LayoutError, match="bad_expert_stride"):
        layout.check_kernel_strides(padded, "bad_expert_stride")
    with pytest.raises(LayoutError):
        layout.physical(torch.zeros(4, 256, 2, dtype=torch.int32))
    with pytest.raises(LayoutError):
        layout.kernel_view_from_physical(good)  # a strided view is not a physical base
    kt = layout.allocate_kernel_tensors("mxfp4", 2, 256, 128)
    kt.l1_scale = kt.l1_scale.contiguous()
    with pytest.raises(LayoutError, match="l1_scale"):
        layout.check_kernel_tensors("mxfp4", kt, 2, 256, 128)


# --------------------------------------------------------------------------- canonical


def test_canonical_validate_names_where_and_shapes():
    gen = torch.Generator().manual_seed(14)
    ex = rand_expert("nvfp4", 256, 128, gen)
    ex.validate("nvfp4", 256, 128, "layer 3 expert 7")
    with pytest.raises(CheckpointError, match=r"layer 3 expert 7\.gate: weight shape \[128, 128\] != expected \[128, 64\]"):
        ex.validate("nvfp4", 128, 128, "layer 3 expert 7")
    with pytest.raises(CheckpointError, match=r"gate: scale dtype torch.float8_e4m3fn.*uint8"):
        ex.validate("mxfp4", 256, 128, "x")
    ex.gate.global_scale = float("nan")
    from megamoe_runtime.errors import ScaleError

    with pytest.raises(ScaleError, match="global_scale"):
        ex.validate("nvfp4", 256, 128, "x")
    p = ProjectionTensors(torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="has no scales"):
        p.validate("bf16", 4, 4, "gate", "w", error=LayoutError)


def test_canonical_dequantize_applies_global_scale():
    gen = torch.Generator().manual_seed(15)
    ex = rand_expert("nvfp4", 128, 128, gen)
    base = ex.gate.dequantize("nvfp4")
    ex.gate.global_scale = 0.5
    assert torch.equal(ex.gate.dequantize("nvfp4"), base * 0.5)


# --------------------------------------------------------------------------- device


def _to(ex: ExpertTensors, device) -> ExpertTensors:
    def p(t: ProjectionTensors) -> ProjectionTensors:
        return ProjectionTensors(t.weight.to(device), None if t.scale is None else t.scale.to(device))

    return ExpertTensors(p(ex.gate), p(ex.up), p(ex.down))


@pytest.mark.gpu
@pytest.mark.parametrize("row", ALL_ROWS)
def test_cuda_matches_cpu(row):
    gen = torch.Generator().manual_seed(16)
    H, I = 256, 384
    exs = [rand_expert(row, H, I, gen) for _ in range(3)]
    cpu = layout.pack_expert_stack(row, exs)
    from_cpu_src = layout.pack_expert_stack(row, exs, device="cuda")  # CPU sources, CUDA storage
    on_gpu = layout.pack_expert_stack(row, [_to(e, "cuda") for e in exs], device="cuda")
    for kt in (from_cpu_src, on_gpu):
        for role, t in cpu.named().items():
            g = getattr(kt, role)
            assert g.is_cuda and g.stride() == t.stride()
            base = layout.physical(g) if role.endswith("scale") else g
            ref = layout.physical(t) if role.endswith("scale") else t
            assert torch.equal(_bits(base.cpu()), _bits(ref)), role
    for a, b in zip(exs, layout.unpack_expert_stack(row, on_gpu)):
        assert_same_expert(a, _to(b, "cpu"))
    sh = layout.pack_shared(row, [_to(e, "cuda") for e in exs[:2]], device="cuda")
    for a, b in zip(exs[:2], layout.unpack_shared(row, sh, 2)):
        assert_same_expert(a, _to(b, "cpu"))


@pytest.mark.parametrize("I", [8, 24, 128])
def test_l1_half_row_runs_match_write_l1_weight(I):
    """The runs direct readers place bytes with put every gate/up row where write_l1_weight puts it."""
    H = 4
    for half in (0, 1):
        src = torch.arange(I * H, dtype=torch.int32).reshape(I, H) + 1
        want = torch.zeros(2 * I, H, dtype=torch.int32)
        layout.write_l1_weight(want, src, half)
        got = torch.zeros(2 * I, H, dtype=torch.int32)
        runs = layout.l1_half_row_runs(I, half)
        assert [s for s, _, _ in runs] == list(range(0, I, 8))  # source order, contiguous
        for s, k, n in runs:
            got[k:k + n] = src[s:s + n]
        assert torch.equal(got, want)
        # negative control: the other half's runs land the rows elsewhere
        wrong = torch.zeros(2 * I, H, dtype=torch.int32)
        for s, k, n in layout.l1_half_row_runs(I, 1 - half):
            wrong[k:k + n] = src[s:s + n]
        assert not torch.equal(wrong, want)
    with pytest.raises(LayoutError, match="needs % 8"):
        layout.l1_half_row_runs(12, 0)
