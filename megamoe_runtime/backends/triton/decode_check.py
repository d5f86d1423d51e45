"""The inline-asm decodes' self-check: once per device, before the forward uses them.

`asm_decode_check` runs the PRMT E2M1 decode, the frag decodes and the fold decodes over every
byte and the weights' scale range and compares them with the arithmetic decode and `codecs`;
`asm_decode_ok` caches the verdict (a disagreement warns and falls back to the arithmetic decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _jit
from .launch import opts
from .staging import hw_cvt_default


# --------------------------------------------------------------------------- E2M1 decode self-check

_ASM_OK: dict = {}


@triton.jit
def _decode_check_kernel(b_ptr, s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i)
    sc = tl.load(s_ptr + i // 4)
    lo, hi = _jit.e2m1_pair_bf16(b, sc, True)
    lo2, hi2 = _jit.e2m1_pair_bf16(b, sc, False)
    tl.store(out_ptr + i, lo)
    tl.store(out_ptr + N + i, hi)
    tl.store(out_ptr + 2 * N + i, lo2)
    tl.store(out_ptr + 3 * N + i, hi2)


@triton.jit
def _frag_decode_check_kernel(w_ptr, s_ptr, out_ptr, NW: tl.constexpr, FOLD: tl.constexpr = False,
                              TILED: tl.constexpr = False):
    i = tl.arange(0, NW)
    sb = tl.load(s_ptr + i).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    outs = _jit.e2m1_frag_words(tl.load(w_ptr + i), sb | (sb << 16), FOLD, TILED)
    for k in tl.static_range(8):
        tl.store(out_ptr + i * 8 + k, outs[k])


@triton.jit
def _frag8_decode_check_kernel(w_ptr, s_ptr, out_ptr, NW: tl.constexpr, FOLD: tl.constexpr = False):
    i = tl.arange(0, NW)
    sb = tl.load(s_ptr + i).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    outs = _jit.e4m3_frag_words(tl.load(w_ptr + i), sb | (sb << 16), FOLD)
    for k in tl.static_range(4):
        tl.store(out_ptr + i * 4 + k, outs[k])


def _frag_decode_expected(b_all: torch.Tensor, s_rep: torch.Tensor) -> torch.Tensor:
    """int16 bits of what ``_jit.e2m1_frag_words`` must return for bytes ``b_all`` (whole
    little-endian words) and one bf16 scale per word: per word, nibbles (0, 4, 1, 5, 2, 6, 3, 7)
    decoded by ``codecs`` times the scale."""
    from megamoe_runtime.format import codecs

    vals = codecs.e2m1_decode(codecs.unpack_e2m1(b_all)).reshape(-1, 8) * s_rep.float()[:, None]
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=vals.device)
    return vals[:, order].reshape(-1).to(torch.bfloat16).view(torch.int16)


def _tiled_words(b_all: torch.Tensor) -> torch.Tensor:
    """The int32 words of natural bytes ``b_all`` with their bits in the tiled order (what a tiled layer
    holds), so that a tiled decode of them must give what the natural decode gives of ``b_all``."""
    from megamoe_runtime.format import weight_tiles

    return weight_tiles.permute_e2m1_bits(b_all.view(torch.int32), to_tiled=True)


def asm_decode_check(device: torch.device, mx_bytes=None, nv_bytes=None) -> dict:
    """Compare the PRMT E2M1 decode and the arithmetic decode with codecs over all 256
    bytes and the given scales; returns mismatch counts (diagnostics for asm_decode_ok)."""
    from megamoe_runtime.format import codecs

    if mx_bytes is None:
        mx_bytes = list(range(100, 141, 3)) + [0, 127]
    if nv_bytes is None:
        nv_bytes = list(range(0x08, 0x7F, 9)) + [0x38, 0x7E]
    byts = torch.arange(256, dtype=torch.uint8, device=device)
    res = {}
    for name, sc in (("ue8m0", (torch.tensor(mx_bytes, dtype=torch.int32, device=device) << 23).view(
            torch.float32).to(torch.bfloat16)),
                     ("e4m3", torch.tensor(nv_bytes, dtype=torch.uint8, device=device).view(
                         torch.float8_e4m3fn).to(torch.bfloat16))):
        n = sc.numel()
        b_all = byts.repeat(n)
        s_rep = sc.repeat_interleave(64)  # one scale per 4 bytes, 256 bytes per scale
        out = torch.empty(4, b_all.numel(), dtype=torch.bfloat16, device=device)
        _decode_check_kernel[(1,)](b_all, s_rep, out, N=b_all.numel(), **opts())
        want = codecs.e2m1_decode(codecs.unpack_e2m1(b_all)).reshape(-1, 2) * s_rep.float().repeat_interleave(4)[:, None]
        wl, wh = want[:, 0].to(torch.bfloat16).view(torch.int16), want[:, 1].to(torch.bfloat16).view(torch.int16)
        o = out.view(torch.int16)
        res[name] = {"asm_lo": int((o[0] != wl).sum()), "asm_hi": int((o[1] != wh).sum()),
                     "arith_lo": int((o[2] != wl).sum()), "arith_hi": int((o[3] != wh).sum())}
        fw = _frag_decode_expected(b_all, s_rep)
        for key, words, tiled in (("frag", b_all.view(torch.int32), False),
                                  ("frag_tiled", _tiled_words(b_all), True)):
            fr = torch.empty(2 * b_all.numel(), dtype=torch.bfloat16, device=device)
            _frag_decode_check_kernel[(1,)](words, s_rep, fr, NW=b_all.numel() // 4, TILED=tiled, **opts())
            res[name][key] = int((fr.view(torch.int16) != fw).sum())
        if name == "ue8m0":  # E4M3 weights (no NaN bytes) in the E4M3 frag order: bytes (0, 2, 1, 3)
            e8 = b_all.clone()
            e8[(e8 & 0x7F) == 0x7F] = 0
            f8 = torch.empty(b_all.numel(), dtype=torch.bfloat16, device=device)
            _frag8_decode_check_kernel[(1,)](e8.view(torch.int32), s_rep, f8, NW=b_all.numel() // 4, **opts())
            v8 = (e8.view(torch.float8_e4m3fn).float().reshape(-1, 4) * s_rep.float()[:, None])
            w8 = v8[:, torch.tensor([0, 2, 1, 3], device=device)].reshape(-1).to(torch.bfloat16).view(torch.int16)
            res[name]["frag8"] = int((f8.view(torch.int16) != w8).sum())
        res[name].update(_fold_decode_check(name, byts, device))
        bad = ((o[0] != wl) | (o[1] != wh)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            res[name]["first"] = (int(b_all[i]), float(s_rep[i // 4]), int(o[0, i]), int(wl[i]), int(o[1, i]),
                                  int(wh[i]))
    return res


def _fold_decode_check(name: str, byts: torch.Tensor, device: torch.device) -> dict:
    """Mismatches of the FOLD decodes (bias folded into the scale operand) against codecs over
    all 256 bytes: E2M1 x UE8M0 bytes 0..128 (operand 2^(s-1)), E4M3 weights x UE8M0 bytes
    0..134 (operand 2^(s-7)), E2M1 x E4M3 block scales (operand scale * 2^118, result value *
    scale * 2^-8: the kernels restore the 2^8 on the fp32 accumulator). 16 scales per launch."""
    def chunks(t):
        t = torch.cat([t, t[-1:].expand((-t.numel()) % 16)])
        return t.split(16)

    if name == "ue8m0":
        e = torch.arange(0, 129, dtype=torch.int32, device=device)
        sc = (e << 23).view(torch.float32).to(torch.bfloat16)  # the plain decode's scale (byte 0 -> 0)
        opnd = torch.where(e == 0, 0, (e + 126) << 7).to(torch.int16).view(torch.bfloat16)
    else:
        sc = torch.arange(0, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).to(torch.bfloat16)
        opnd = (sc.float() * 2.0 ** 118).to(torch.bfloat16)
        sc = (sc.float() * 2.0 ** -8).to(torch.bfloat16)  # exact
    out = {"frag_fold": 0, "frag_tiled_fold": 0}
    for s16, o16 in zip(chunks(sc), chunks(opnd)):
        b_all = byts.repeat(16)
        s_rep, o_rep = s16.repeat_interleave(64), o16.repeat_interleave(64)
        want = _frag_decode_expected(b_all, s_rep)
        for key, words, tiled in (("frag_fold", b_all.view(torch.int32), False),
                                  ("frag_tiled_fold", _tiled_words(b_all), True)):
            fr = torch.empty(2 * b_all.numel(), dtype=torch.bfloat16, device=device)
            _frag_decode_check_kernel[(1,)](words, o_rep, fr, NW=b_all.numel() // 4, FOLD=True, TILED=tiled,
                                            **opts())
            out[key] += int((fr.view(torch.int16) != want).sum())
    if name == "ue8m0":
        out["frag8_fold"] = 0
        e8 = torch.arange(0, 135, dtype=torch.int32, device=device)
        sc8 = (e8 << 23).view(torch.float32).to(torch.bfloat16)
        op8 = torch.where(e8 == 0, 0, (e8 + 120) << 7).to(torch.int16).view(torch.bfloat16)
        b8 = byts.clone()
        b8[(b8 & 0x7F) == 0x7F] = 0  # no NaN weights
        b8 = b8.repeat(16)
        for s16, o16 in zip(chunks(sc8), chunks(op8)):
            s_rep, o_rep = s16.repeat_interleave(64), o16.repeat_interleave(64)
            f8 = torch.empty(b8.numel(), dtype=torch.bfloat16, device=device)
            _frag8_decode_check_kernel[(1,)](b8.view(torch.int32), o_rep, f8, NW=b8.numel() // 4, FOLD=True,
                                             **opts())
            v8 = b8.view(torch.float8_e4m3fn).float().reshape(-1, 4) * s_rep.float()[:, None]
            w8 = v8[:, torch.tensor([0, 2, 1, 3], device=device)].reshape(-1).to(torch.bfloat16).view(torch.int16)
            out["frag8_fold"] += int((f8.view(torch.int16) != w8).sum())
    return out


def asm_decode_ok(device: torch.device) -> bool:
    """Check once per device that the PRMT-LUT E2M1 decode equals codecs bit for bit over
    all 256 bytes and scales in the weights' range (UE8M0 bytes 100..140 and 0, normal
    E4M3 block scales); else fall back to the arithmetic decode."""
    key = str(device)
    if key in _ASM_OK:
        return _ASM_OK[key]
    if not hw_cvt_default():
        _ASM_OK[key] = False
        return False
    import warnings

    try:
        res = asm_decode_check(device)
        asm_keys = ("asm_lo", "asm_hi", "frag", "frag_tiled", "frag8", "frag_fold", "frag_tiled_fold", "frag8_fold")
        ok = all(v.get(k, 0) == 0 for v in res.values() for k in asm_keys)
    except Exception as exc:  # pragma: no cover - depends on the GPU / PTX support
        res, ok = repr(exc), False
    if not ok:
        warnings.warn(f"triton backend: the PRMT E2M1 decode disagreed with codecs ({res}); "
                      f"using the arithmetic decode")
    _ASM_OK[key] = bool(ok)
    return _ASM_OK[key]
