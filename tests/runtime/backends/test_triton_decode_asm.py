"""The inline-asm weight decodes of the triton backend, checked on the CPU (no triton, no GPU).

``decode_asm`` holds the PTX text the kernels paste into ``tl.inline_asm_elementwise``. A
small interpreter of the few instructions it uses (integer and/or/shifts/multiplies, byte
permutes, ``mul.rn.bf16x2``) runs those exact strings over every nibble / byte value and a
range of scales, and the results must equal ``codecs``' decode times the scale, bf16 bit for
bit. The GPU runs the compiled code through the same comparison (``decode_check.asm_decode_check``)
before using it; this catches an edit of the text in CPU CI. Negative controls: a changed
mask, a dropped multiply and a swapped output order are caught.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

from megamoe_runtime.backends.triton import decode_asm
from megamoe_runtime.format import codecs, weight_tiles

M32 = np.uint64(0xFFFFFFFF)


def _bf16_mul2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``mul.rn.bf16x2``: per 16-bit half, the product rounded to bf16 (ties even). The fp32
    product of two bf16 values is exact here (the decodes multiply exact values), so rounding it
    once more to bf16 is the instruction's single rounding."""
    out = np.zeros_like(a)
    for sh in (0, 16):
        fa = ((a >> np.uint64(sh)) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
        fb = ((b >> np.uint64(sh)) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
        with np.errstate(over="ignore"):
            p = (fa.view(np.float32) * fb.view(np.float32)).view(np.uint32).astype(np.uint64)
        r = ((p + np.uint64(0x7FFF) + ((p >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)) & np.uint64(0xFFFF)
        out |= r << np.uint64(sh)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """``prmt.b32`` default mode: byte i of the result is byte (sel >> 4i) & 7 of {b, a}; with
    bit 3 of that selector nibble set, the selected byte's sign bit replicated."""
    both = (b << np.uint64(32)) | a
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(15)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        rep = np.where((byte >> np.uint64(7)) & np.uint64(1) == 1, np.uint64(0xFF), np.uint64(0))
        out |= np.where(nib & np.uint64(8) != 0, rep, byte) << np.uint64(8 * i)
    return out


def run_ptx(text: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Run decode PTX over uint64 arrays holding 32-bit values; returns the ``n_out`` outputs
    (16-bit outputs of a ``mov.b32 {lo, hi}`` are returned as 16-bit values)."""
    regs: dict[str, np.ndarray] = {f"${n_out + i}": v.astype(np.uint64) for i, v in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full_like(inputs[0], int(tok, 0), dtype=np.uint64)

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        m = re.fullmatch(r"\{(\$\d+),\s*(\$\d+)\},\s*(\S+)", rest)
        if op == "mov.b32" and m:  # unpack a bf16x2 register into two 16-bit outputs
            r = val(m.group(3))
            regs[m.group(1)] = r & np.uint64(0xFFFF)
            regs[m.group(2)] = (r >> np.uint64(16)) & np.uint64(0xFFFF)
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & M32
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "mul.lo.u32":
            r = (a[0] * a[1]) & M32
        elif op == "mul.hi.u32":
            r = (a[0] * a[1]) >> np.uint64(32)
        elif op == "mad.hi.u32":  # (a * b) >> 32, plus c, modulo 2^32
            r = ((a[0] * a[1]) >> np.uint64(32)) + a[2]
        elif op == "shf.r.wrap.b32":  # funnel shift right of b:a by c mod 32 (a = b: a rotation)
            both = (a[1] << np.uint64(32)) | a[0]
            r = both >> (a[2] & np.uint64(31))
        elif op == "prmt.b32":
            r = _prmt(a[0], a[1], a[2])
        elif op == "mul.rn.bf16x2":
            r = _bf16_mul2(a[0], a[1])
        else:
            raise AssertionError(f"the decode PTX uses {op!r}, which this interpreter does not know")
        regs[d] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def _words_and_scales(seed: int = 0):
    """Words covering every nibble pair at every register position, with random other nibbles,
    each paired with a UE8M0 scale byte in 1..128 (the fold decode's range)."""
    g = np.random.default_rng(seed)
    pairs = np.arange(256, dtype=np.uint64)
    words = []
    for j in range(4):  # register j holds nibbles j and j + 4
        w = g.integers(0, 2**32, size=256, dtype=np.uint64)
        keep = ~((np.uint64(0xF) << np.uint64(4 * j)) | (np.uint64(0xF) << np.uint64(4 * j + 16))) & M32
        words.append((w & keep) | ((pairs & np.uint64(15)) << np.uint64(4 * j))
                     | ((pairs >> np.uint64(4)) << np.uint64(4 * j + 16)))
    words = np.concatenate(words + [g.integers(0, 2**32, size=4096, dtype=np.uint64)])
    scales = g.integers(1, 129, size=words.size, dtype=np.uint64)
    return words, scales


def _e2m1_expected(words: np.ndarray, scales: np.ndarray) -> list[np.ndarray]:
    nib = np.stack([(words >> np.uint64(4 * i)) & np.uint64(15) for i in range(8)], 1)
    vals = codecs.e2m1_decode(torch.from_numpy(nib.astype(np.uint8)))
    sc = torch.from_numpy((scales.astype(np.int64) - 127).astype(np.float64)).exp2().float()
    prod = vals.float() * sc[:, None]
    return [_bf16_bits(prod[:, i]) for i in (0, 4, 1, 5, 2, 6, 3, 7)]


def _tiled(words: np.ndarray) -> np.ndarray:
    """Natural words with their bits moved as the tiled arrangement stores them (``weight_tiles``)."""
    t = weight_tiles.permute_e2m1_bits(torch.from_numpy(words.astype(np.uint32).view(np.int32)), to_tiled=True)
    return t.numpy().view(np.uint32).astype(np.uint64)


@pytest.mark.parametrize("tiled", [False, True], ids=["natural", "tiled"])
@pytest.mark.parametrize("fold", [False, True], ids=["plain", "fold"])
def test_e2m1_frag_decode_matches_codecs(fold, tiled):
    """Tiled: the load's bit permutation and the tiled decode, together, decode every nibble pair at every
    register as the natural decode does."""
    words, scales = _words_and_scales()
    # the scale operand: bf16 bits of 2^(s-127) (fold: of 2^(s-1) = scale * 2^126), both halves
    sb = (scales + np.uint64(126) if fold else scales) << np.uint64(7)
    sc2 = sb | (sb << np.uint64(16))
    if tiled:
        text = decode_asm.E2M1_FRAG_TILED_FOLD if fold else decode_asm.E2M1_FRAG_TILED
    else:
        text = decode_asm.E2M1_FRAG_FOLD if fold else decode_asm.E2M1_FRAG
    got = run_ptx(text, [_tiled(words) if tiled else words, sc2], 8)
    want = _e2m1_expected(words, scales)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"output {i}: {int((g != w).sum())} values differ"


@pytest.mark.parametrize("fold", [False, True], ids=["plain", "fold"])
def test_e4m3_frag_decode_matches_codecs(fold):
    g = np.random.default_rng(1)
    b = np.arange(256, dtype=np.uint64)
    b = b[(b & np.uint64(0x7F)) != np.uint64(0x7F)]  # no NaN bytes in weights
    words = np.concatenate([b | (g.choice(b, b.size) << np.uint64(8)) | (g.choice(b, b.size) << np.uint64(16))
                            | (g.choice(b, b.size) << np.uint64(24)) for _ in range(4)])
    words = np.concatenate([words, np.roll(words, 3) << np.uint64(8) & M32 | (words >> np.uint64(24))])
    scales = g.integers(1, 135, size=words.size, dtype=np.uint64)
    sb = (scales + np.uint64(120) if fold else scales) << np.uint64(7)
    got = run_ptx(decode_asm.E4M3_FRAG_FOLD if fold else decode_asm.E4M3_FRAG, [words, sb | (sb << np.uint64(16))], 4)
    byts = np.stack([(words >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)], 1).astype(np.uint8)
    vals = codecs.e4m3_decode(torch.from_numpy(byts).view(torch.float8_e4m3fn)).float()
    sc = torch.from_numpy((scales.astype(np.int64) - 127).astype(np.float64)).exp2().float()
    prod = vals * sc[:, None]
    for i, byte in enumerate((0, 2, 1, 3)):
        want = _bf16_bits(prod[:, byte])
        assert np.array_equal(got[i], want), f"output {i} (byte {byte}): {int((got[i] != want).sum())} differ"


def test_e2m1_prmt_decode_matches_codecs():
    """The split order's lookup-table decode: 4 bytes -> low-nibble and high-nibble bf16 pairs."""
    g = np.random.default_rng(2)
    words = np.concatenate([np.arange(256, dtype=np.uint64) * np.uint64(0x01010101),
                            g.integers(0, 2**32, size=4096, dtype=np.uint64)])
    scales = g.integers(1, 255, size=words.size, dtype=np.uint64)
    sb = scales << np.uint64(7)
    sc2 = sb | (sb << np.uint64(16))
    lo01, lo23, hi01, hi23 = run_ptx(decode_asm.E2M1_PRMT, [words, sc2, sc2], 4)
    byts = np.stack([(words >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)], 1)
    sc = torch.from_numpy((scales.astype(np.int64) - 127).astype(np.float64)).exp2().float()
    for nib_shift, regs in ((0, (lo01, lo23)), (4, (hi01, hi23))):
        codes = torch.from_numpy(((byts >> np.uint64(nib_shift)) & np.uint64(15)).astype(np.uint8))
        want = _bf16_bits(codecs.e2m1_decode(codes).float() * sc[:, None])
        got = np.stack([regs[0] & np.uint64(0xFFFF), regs[0] >> np.uint64(16),
                        regs[1] & np.uint64(0xFFFF), regs[1] >> np.uint64(16)], 1)
        assert np.array_equal(got, want), f"nibble shift {nib_shift}: {int((got != want).sum())} differ"


@pytest.mark.parametrize("break_it", ["mask", "multiply", "order", "tiled_rotation", "tiled_merge",
                                      "natural_words"])
def test_interpreter_catches_a_broken_decode(break_it):
    """Negative controls: the comparison must fail for a wrong mask, a dropped bias multiply,
    outputs in another order, a tiled decode with a wrong rotation or merge shift, or tiled-decoded
    words the load did not permute."""
    words, scales = _words_and_scales(3)
    sb = scales << np.uint64(7)
    text, feed = decode_asm.E2M1_FRAG, words
    if break_it == "mask":
        text = text.replace("0x81C081C0", "0x818081C0", 1)  # drops bit 22 (nibble 4)
    elif break_it == "multiply":
        text = text.replace("mul.rn.bf16x2 t, t, bias;", "", 1)
    elif break_it.startswith("tiled"):
        text, feed = decode_asm.E2M1_FRAG_TILED, _tiled(words)
        text = text.replace("$8, $8, 4;", "$8, $8, 5;") if break_it == "tiled_rotation" else text.replace(
            "0x1000000, t;", "0x800000, t;")  # >> 9 instead of >> 8
    elif break_it == "natural_words":
        text = decode_asm.E2M1_FRAG_TILED
    got = run_ptx(text, [feed, sb | (sb << np.uint64(16))], 8)
    want = _e2m1_expected(words, scales)
    if break_it == "order":
        got = got[1:] + got[:1]
    assert not all(np.array_equal(g, w) for g, w in zip(got, want))


def test_tiled_decode_issues_fewer_integer_instructions():
    """Why the tiled bit order exists: 9 integer instructions per word where the natural order takes 13."""
    def integer_ops(text):
        return sum(1 for ln in text.splitlines() if ln.split(" ")[0] in (
            "and.b32", "mul.lo.u32", "mul.hi.u32", "mad.hi.u32", "shf.r.wrap.b32", "shl.b32", "shr.b32"))

    assert integer_ops(decode_asm.E2M1_FRAG) == 13 and integer_ops(decode_asm.E2M1_FRAG_TILED) == 9


def test_fold_texts_are_the_plain_ones_without_the_bias():
    for plain, fold in ((decode_asm.E2M1_FRAG, decode_asm.E2M1_FRAG_FOLD),
                        (decode_asm.E2M1_FRAG_TILED, decode_asm.E2M1_FRAG_TILED_FOLD),
                        (decode_asm.E4M3_FRAG, decode_asm.E4M3_FRAG_FOLD)):
        assert "bias" in plain and "bias" not in fold
        assert fold.count("mul.rn.bf16x2") * 2 == plain.count("mul.rn.bf16x2")


def _nv_fold_operand(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint64) * np.uint64(decode_asm.NV_FOLD_SCALE_MUL)
            + np.uint64(decode_asm.NV_FOLD_SCALE_ADD)) & M32


def _bf16_bits(v: torch.Tensor) -> np.ndarray:
    return v.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def test_nv_fold_scale_operand_is_the_scale_times_2_118_in_both_halves():
    """The NVFP4 fold decode's scale operand (one integer multiply-add of the E4M3 byte) equals
    bf16(E4M3(b) * 2^118) in both halves for every byte it is used for; the bytes outside
    that range are exactly the ones it gets wrong (so the kernels' range check is needed), and
    a changed constant is caught."""
    b = np.arange(256, dtype=np.uint64)
    want = _bf16_bits(codecs.e4m3_decode(torch.arange(256, dtype=torch.uint8)) * 2.0 ** 118)
    op = _nv_fold_operand(b)
    lo, hi = op & np.uint64(0xFFFF), op >> np.uint64(16)
    ok = (lo == want) & (hi == want)
    used = np.isin(b, list(decode_asm.NV_FOLD_SCALE_BYTES))
    assert ok[used].all(), [hex(int(x)) for x in b[used & ~ok]]
    # zero, subnormal, NaN and negative bytes are outside the range and come out wrong
    assert not ok[~used].any(), [hex(int(x)) for x in b[~used & ok]]
    # negative control: the exponent offset one off changes every used byte
    bad = (b * np.uint64(decode_asm.NV_FOLD_SCALE_MUL) + np.uint64(decode_asm.NV_FOLD_SCALE_ADD - 0x800080)) & M32
    assert not ((bad & np.uint64(0xFFFF)) == want)[used].any()


@pytest.mark.parametrize("key", ["frag", "frag_tiled", "frag_fold", "frag_tiled_fold", "asm_lo"])
def test_self_check_verdict_counts_every_asm_decode(key, monkeypatch):
    """``decode_check.asm_decode_ok`` refuses the inline asm when any asm decode, the tiled ones included,
    disagreed with codecs (here a check result with one mismatch planted), and takes it when none did; the
    arithmetic decode's own counts are diagnostics, not part of the verdict."""
    decode_check = pytest.importorskip("megamoe_runtime.backends.triton.decode_check")
    clean = {"asm_lo": 0, "asm_hi": 0, "arith_lo": 0, "arith_hi": 0, "frag": 0, "frag_tiled": 0, "frag8": 0,
             "frag_fold": 0, "frag_tiled_fold": 0, "frag8_fold": 0}
    monkeypatch.setattr(decode_check, "hw_cvt_default", lambda: True)
    verdicts = {}
    for name, planted in (("clean", {}), ("planted", {key: 1}), ("arith only", {"arith_lo": 3})):
        monkeypatch.setattr(decode_check, "_ASM_OK", {})
        monkeypatch.setattr(decode_check, "asm_decode_check",
                            lambda device, p=planted: {"ue8m0": clean | p, "e4m3": dict(clean)})
        with pytest.warns(UserWarning) if name == "planted" else contextlib.nullcontext():
            verdicts[name] = decode_check.asm_decode_ok(torch.device("cpu"))
    assert verdicts == {"clean": True, "planted": False, "arith only": True}

