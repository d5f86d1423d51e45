"""GPU tests of the triton backend (issue 5): staging bit-exactness, forward vs
the reference backend per row x activation x shared fusion, a converted real
producer export end to end, CUDA-graph capture, and negative controls.

Every test is marked ``gpu`` and imports triton lazily, so CPU CI (which may
lack triton) collects this file and skips it. Run on a Hopper GPU with
``pytest -m gpu tests/runtime/backends/test_triton.py``. With
``MEGAMOE_TRITON_REPORT=path`` each forward comparison appends one JSON line
(row, activation, shared, calc_diff, fraction of bitwise-equal outputs) to
``path``; BENCHMARKS.md quotes those numbers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from megamoe_runtime.format import codecs, layout
from megamoe_runtime.format.formats import ActivationSpec, LayerSpec, SharedSpec
from megamoe_runtime.testing import calc_diff, frag_positions, staging_adversarial_rows, staging_random_rows

pytestmark = pytest.mark.gpu

#: The stated tolerance: calc_diff to the reference backend on the same GPU.
TOL = 1e-6
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "real"


def _triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the triton backend needs sm_89+ (E4M3 conversions)")
    from megamoe_runtime.backends.triton import moe, staging, synth

    return staging, moe, synth


def _report(**kw) -> None:
    path = os.environ.get("MEGAMOE_TRITON_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> float:
    """The acceptance check every forward test uses (and the negative controls must fail)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert bool(torch.isfinite(out.float()).all()), f"{what}: non-finite output"
    d = calc_diff(out, ref)
    assert d < TOL, f"{what}: calc_diff {d:.3e} >= {TOL:g}"
    return d


# --------------------------------------------------------------------------- staging


_adversarial_rows = staging_adversarial_rows
_random_rows = staging_random_rows


@pytest.mark.parametrize("hw_cvt", [True, False], ids=["hw_cvt", "int_cvt"])
@pytest.mark.parametrize("H", [128, 7168])
def test_staging_mxfp8_bit_exact(H, hw_cvt):
    staging, _, _ = _triton()
    for x in (_adversarial_rows(H, "cuda"), _random_rows(300, H, "cuda", seed=H)):
        q, sf, x_sf = staging.quantize_mxfp8(x, hw_cvt=hw_cvt)
        rq, rsf = codecs.quantize_mxfp8(x)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), \
            f"{int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())} E4M3 bytes differ"
        assert torch.equal(sf, rsf)
        assert torch.equal(x_sf, codecs.pack_bytes_int32(rsf))
        deq = codecs.dequantize_mx(rq, rsf, "e4m3").to(torch.bfloat16)  # exact in bf16
        for mode in ("natural", "split", "frag", "frag8"):
            *_, xd = staging.quantize_mxfp8(x, hw_cvt=hw_cvt, dequant=mode)
            want = {"natural": deq, "split": torch.cat([deq[:, 0::2], deq[:, 1::2]], dim=1),
                    "frag": _to_frag(deq), "frag8": _to_frag(deq, e4m3=True)}[mode]
            assert torch.equal(xd.view(torch.int16), want.view(torch.int16)), f"dequant {mode} differs"


def _to_frag(x: torch.Tensor, e4m3: bool = False) -> torch.Tensor:
    out = torch.empty_like(x)
    out[:, frag_positions(x.shape[1], e4m3).to(x.device)] = x
    return out


_NV_IMPLS = {"row-fast": dict(impl="row", fast_div=True), "row-div": dict(impl="row", fast_div=False),
             "row-1step": dict(impl="row", fast_div=True, div_steps=1), "row-2step": dict(impl="row", div_steps=2),
             "chunk": dict(impl="chunk"), "default": {}}


@pytest.mark.parametrize("impl", list(_NV_IMPLS))
@pytest.mark.parametrize("hw_cvt", [True, False], ids=["hw_cvt", "int_cvt"])
@pytest.mark.parametrize("H", [128, 6144, 7168])
def test_staging_nvfp4_bit_exact(H, hw_cvt, impl):
    staging, _, _ = _triton()
    kw = _NV_IMPLS[impl]
    for x in (_adversarial_rows(H, "cuda"), _random_rows(300, H, "cuda", seed=H + 1)):
        p, sf, x_sf, ts = staging.quantize_nvfp4_per_token(x, hw_cvt=hw_cvt, **kw)
        rp, rsf, rts = codecs.quantize_nvfp4_per_token(x)
        assert torch.equal(ts, rts), "token scales differ"
        assert torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8)), "E4M3 block scales differ"
        assert torch.equal(p, rp), f"{int((p != rp).sum())} packed E2M1 bytes differ"
        assert torch.equal(x_sf, codecs.pack_bytes_int32(rsf))
        *_, xd = staging.quantize_nvfp4_per_token(x, hw_cvt=hw_cvt, dequant="split", **kw)
        deq = codecs.dequantize_nvfp4(rp, rsf, 1.0).to(torch.bfloat16)  # token scale not applied; exact
        want = torch.cat([deq[:, 0::2], deq[:, 1::2]], dim=1)
        assert torch.equal(xd.view(torch.int16), want.view(torch.int16)), "nvfp4 dequant differs"
        *_, xf = staging.quantize_nvfp4_per_token(x, hw_cvt=hw_cvt, dequant="frag", **kw)
        assert torch.equal(xf.view(torch.int16), _to_frag(deq).view(torch.int16)), "nvfp4 frag dequant differs"


def test_staging_fast_division_proof():
    """The row kernel's fast division equals div_rn on every significand pair it can meet (two
    residual steps always; one step where it is the default), and for the block scale's / 6;
    negative control: the bare product with the reciprocal (no residual step) differs."""
    staging, _, _ = _triton()
    assert staging.division_mismatches(2) == 0
    assert staging.division_mismatches(2, six=True) == 0
    if staging.NV_DIV_STEPS == 1:
        assert staging.division_mismatches(1) == 0
    assert staging.division_mismatches(0) > 0


def test_staging_nvfp4_impl_selection():
    """The row kernel takes H/16 as at most four powers of two up to H 8192; else the chunk kernel
    (any H, still exact); asking for the row kernel where it cannot hold the row is a clear error."""
    staging, _, _ = _triton()
    from megamoe_runtime.errors import MegaMoEError

    assert staging._nv_pieces(7168) == [256, 128, 64] and staging._nv_pieces(5120) == [256, 64]
    assert staging._nv_pieces(16 * (4 + 8 + 16 + 32 + 64)) is None and staging._nv_pieces(16384) is None
    x = _random_rows(5, 16 * (4 + 8 + 16 + 32 + 64), "cuda", seed=5)
    p, sf, _, ts = staging.quantize_nvfp4_per_token(x)
    rp, rsf, rts = codecs.quantize_nvfp4_per_token(x)
    assert torch.equal(p, rp) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8)) and torch.equal(ts, rts)
    with pytest.raises(MegaMoEError, match="cannot hold H=1984"):
        staging.quantize_nvfp4_per_token(x, impl="row")
    with pytest.raises(MegaMoEError, match="impl="):
        staging.quantize_nvfp4_per_token(x, impl="fast")


@pytest.mark.parametrize("cfg", [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)])
def test_staging_mxfp8_configs_bit_exact(cfg):
    staging, _, _ = _triton()
    x = torch.cat([_adversarial_rows(7168, "cuda"), _random_rows(64, 7168, "cuda", seed=11)])
    q, sf, _ = staging.quantize_mxfp8(x, config=cfg)
    rq, rsf = codecs.quantize_mxfp8(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sf, rsf)


def test_staging_negative_control():
    """A quantizer that rounds ties the other way (DG Python 'down') must be caught."""
    staging, _, _ = _triton()
    x = _adversarial_rows(256, "cuda")
    p, _, _, _ = staging.quantize_nvfp4_per_token(x)
    rp, _, _ = codecs.quantize_nvfp4_per_token(x, ties="down")
    assert not torch.equal(p, rp)
    q, _, _ = staging.quantize_mxfp8(x)
    rq, _ = codecs.quantize_mxfp8(x.float() * 1.0625)  # a different input must give different bytes
    assert not torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,bm", [(1, None), (37, None), (300, 16), (300, None)])
def test_frag_k_order_bitwise(row, T, bm):
    """The frag K orders (16/32-byte weight runs per thread, shift decode) give the split /
    natural order's output bit for bit and match the reference; with the wrong activation
    order they must not."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", "mxfp8", T=T, mask_frac=0.1,
                                                zero_tokens=min(2, T - 1))
    sc = _NvScalars(lay) if row == "nvfp4" else None
    outs = {k: moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=sc, shared=_Roles(lay, "shared_"),
                               shared_input=x, config=configs.KernelConfig(block_m=bm, k_order=k))
            for k in ("split", "frag")}
    d = calc_diff(outs["frag"], ref)
    _report(test="frag_k_order", row=row, T=T, block_m=bm, calc_diff=d,
            bitwise_frac=float((outs["frag"].view(torch.int16) == ref.view(torch.int16)).float().mean()))
    if row == "mxfp8":  # E4M3 x bf16 products can need more than 24 bits: the fp32 sum order shows
        # (natural and frag orders alike: calc_diff ~1e-11 to the reference at 300 tokens, H200)
        assert calc_diff(outs["frag"], outs["split"]) < 1e-9, "mxfp8 frag and natural orders disagree"
    else:  # E2M1 x bf16 partial sums are exact: the order of the sum cannot show
        assert torch.equal(outs["frag"].view(torch.int16), outs["split"].view(torch.int16)), f"frag != split, {d:.2e}"
    _assert_matches(outs["frag"], ref, f"frag {row}/T={T}")
    # negative control: frag weights against activations in the split order
    from megamoe_runtime.backends.triton import moe as moe_mod

    real = moe_mod.resolve_k_order
    try:
        moe_mod.resolve_k_order = lambda cfg, w_kind, H, I: "split" if cfg.k_order == "bad" else real(cfg, w_kind, H, I)
        orig_l1 = moe_mod.launch_l1

        def bad_l1(cfg, x, weight, rows, *a, **k):
            if not rows.shared:  # the routed launch: frag kernels on split-order activations
                weight = dataclasses.replace(weight, frag=True)
            return orig_l1(cfg, x, weight, rows, *a, **k)

        moe_mod.launch_l1 = bad_l1
        bad = moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=sc, shared=_Roles(lay, "shared_"),
                              shared_input=x, config=configs.KernelConfig(block_m=bm, k_order="bad"))
    finally:
        moe_mod.resolve_k_order = real
        moe_mod.launch_l1 = orig_l1
    assert calc_diff(bad, ref) > 1e-3, "a wrong K order must be caught"


def _nv_scale_plant(device) -> torch.Tensor:
    """64 E4M3 scale bytes the NVFP4 fold operand cannot take: zero and subnormals (the fold makes them
    about 2^-15 of a weight: too small to show after the NVFP4 requant) and negative 0x88 (the fold
    makes it inf: the negative control that shows a skipped redo)."""
    i = torch.arange(64, device=device, dtype=torch.uint8)
    return torch.where(i < 48, i % 8, torch.full_like(i, 0x88))


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,bm", [(1, None), (37, None), (300, 16), (300, None)])
@pytest.mark.parametrize("big", [False, True], ids=["scales_in_range", "scales_outside_fold_range"])
def test_fold_decode_bitwise(row, T, bm, big):
    """The frag decode with the bias multiply folded into the scale operand (and the scales read
    as int32 words), and the one-dot gate/up L1, give the plain decode's two-dot output bit for
    bit and match the reference. With
    scale bytes outside the fold's exact range (big: UE8M0 131 for E2M1, 137 for E4M3, where
    scale * 2^126 or * 2^120 is no finite bf16; E4M3 zero, subnormal and negative bytes for NVFP4,
    which the integer scale operand cannot take) the kernels must detect it and redo those tiles; the
    negative controls: those bytes change the output, and flags that hide them keep the fold's wrong
    output."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs, launch, operands
    from megamoe_runtime.backends.reference import ReferenceBackend
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", None, T=T, mask_frac=0.1,
                                                zero_tokens=min(2, T - 1))
    sc = _NvScalars(lay) if row == "nvfp4" else None
    if big:
        before = ref
        for t in (lay.l1_scale, lay.l2_scale):  # expert 0, the first 4 K groups of 16 physical rows
            sb = launch.scale_bytes(t, t.device)[0, 0, :64]
            if row == "nvfp4":  # E4M3 bytes the integer scale operand cannot take (_nv_scale_plant)
                sb.copy_(_nv_scale_plant(t.device))
            else:
                sb.fill_(131 if row == "mxfp4" else 137)
        ids = ids.clone()
        ids[~(ids == 0).any(1), 0] = 0  # every token through expert 0 (top-k ids stay distinct)
        ref = ReferenceBackend().forward(lay, x, tw, ids)
        assert calc_diff(ref, before) > 1e-3, "the large scales must change the output"
    outs = {(d, w, gu): moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=sc,
                                        config=configs.KernelConfig(block_m=bm, k_order="frag", decode=d, scale_load=w,
                                                                l1_gu=gu))
            for d, w, gu in (("plain", "bytes", False), ("fold", "bytes", False), ("fold", "words", True),
                             ("plain", "bytes", True))}
    for l1d, l2d in (("fold", "plain"), ("plain", "fold")):  # a decode per kernel
        outs[(l1d, l2d, "per-kernel")] = moe.moe_forward(
            spec, _Roles(lay, ""), x, tw, ids, scalars=sc,
            config=configs.KernelConfig(block_m=bm, k_order="frag", decode=l1d, l2_decode=l2d))
    # the per-expert flags a loaded layer passes instead of the per-tile scan (moe.fold_flags)
    ff = moe.fold_flags(spec, _Roles(lay, ""))
    assert ff.tolist() == ([[1] + [0] * (ff.shape[1] - 1)] * 2 if big else [[0] * ff.shape[1]] * 2), ff.tolist()
    for gu in (False, True):
        outs[("fold", "flags", gu)] = moe.moe_forward(
            spec, _Roles(lay, ""), x, tw, ids, scalars=sc, fold_flags=ff,
            config=configs.KernelConfig(block_m=bm, k_order="frag", decode="fold", l1_gu=gu))
    outs[("fold", "flags say scan", True)] = moe.moe_forward(
        spec, _Roles(lay, ""), x, tw, ids, scalars=sc, fold_flags=torch.full_like(ff, operands.FOLD_SCAN),
        config=configs.KernelConfig(block_m=bm, k_order="frag", decode="fold", l1_gu=True))
    plain = outs[("plain", "bytes", False)]
    for k, o in outs.items():
        assert torch.equal(o.view(torch.int16), plain.view(torch.int16)), f"{k} differs from the plain decode"
    if big:  # negative control: flags claiming every expert is fine make the kernels keep the fold's garbage
        lie = moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=sc, fold_flags=torch.zeros_like(ff),
                              config=configs.KernelConfig(block_m=bm, k_order="frag", decode="fold", l1_gu=True))
        assert not torch.equal(lie.view(torch.int16), plain.view(torch.int16)), "the flags are not what the kernels read"
    d = _assert_matches(outs[("fold", "words", True)], ref, f"fold {row}/T={T}/big={big}")
    _report(test="fold_decode", row=row, T=T, block_m=bm, big=big, calc_diff=d,
            bitwise_frac=float((plain.view(torch.int16) == ref.view(torch.int16)).float().mean()))


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
def test_register_cap_same_bits(row):
    """A register cap (``KernelConfig.l1_maxnreg`` / ``l2_maxnreg``, ptxas ``.maxnreg``) changes
    occupancy, never the output: bitwise the uncapped default's, which matches the reference."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", None, T=37)
    sc = _NvScalars(lay) if row == "nvfp4" else None
    base = configs.default_config(37 * spec.top_k, spec.experts_per_rank, "frag", w_kind=configs.ROW_W_KIND[row])
    outs = [moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=sc, config=c)
            for c in (base, dataclasses.replace(base, l1_maxnreg=96, l2_maxnreg=64))]
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16)), "the register cap changed the output"
    _assert_matches(outs[1], ref, f"maxnreg {row}")


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("T", [1, 8, 40, 200, 300])
def test_shape_rule_tiles_same_bits(row, T):
    """The tiles the grid-fill rule picks from the shape (``configs.shape_tiles``: 32-row 4-stage L1,
    64-column L2 with 4 stages, the 32-row one-dot mid-size nvfp4 L1), the short-K rule's two-CTA nvfp4
    prefill L1 (``configs.short_k_tiles``, T=300: 75 pairs per expert) and the 8-warp 256-column L2 that
    nvfp4's prefill64 entry had before (T=200: 50 pairs) give the table's output bit for bit, and the
    shape-aware default (``H``, ``I`` given) matches the reference (issue 28)."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", None, T=T)
    sc = _NvScalars(lay) if row == "nvfp4" else None
    kt = _Roles(lay, "")
    P, E_l = T * spec.top_k, spec.experts_per_rank
    base = configs.default_config(P, E_l, "frag", w_kind=configs.ROW_W_KIND[row])
    want = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=base)
    cfgs = [configs.default_config(P, E_l, "frag", w_kind=configs.ROW_W_KIND[row], H=spec.hidden, I=spec.intermediate),
            dataclasses.replace(base, l1_bn=32, l1_stages=4), dataclasses.replace(base, l2_bn=64, l2_stages=4),
            dataclasses.replace(base, block_m=32, l1_gu=True, l1_bn=32, l1_stages=3, l1_maxnreg=None),
            dataclasses.replace(base, l2_bn=256, l2_warps=8, l2_stages=3)]
    if row == "nvfp4" and T == 300:  # H = 512: the short-K rule's tiles, not the table's, are the default
        assert (cfgs[0].l1_bn, cfgs[0].l1_warps, base.l1_bn, base.l1_warps) == (32, 4, 64, 8), cfgs[0]
    for c in cfgs:
        out = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"{row} T={T} {c} differs"
    _assert_matches(want, ref, f"shape rule {row}/T={T}")


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,shared,ep", [(8, None, (0, 1)), (40, "mxfp8", (1, 2)), (300, None, (0, 1))])
def test_split_k_l2_same_bits(row, T, shared, ep, monkeypatch):
    """The routed L2 in 2 and 4 K slices (``KernelConfig.l2_split``: fp32 partials added in slice order by
    ``_l2_split_reduce``) gives the one-pass output bit for bit on E2M1 weights (their partial sums are
    exact; E4M3 weights: all but a last-bit few, within the reference's bar), with tail launches (T=300),
    a fused shared slot and EP rank 1 of 2 (other ranks' slots left to the combine); a split that does not
    cut I into 128-blocks runs one pass. Negative control: a reduce that drops the last slice is caught."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs, l2
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", shared, T=T, I=512, ep=ep)
    sc = _NvScalars(lay) if row == "nvfp4" else None
    kt, sk = _Roles(lay, ""), (_Roles(lay, "shared_") if shared else None)
    P, E_l = T * spec.top_k, spec.experts_per_rank
    base = configs.default_config(P, E_l, "frag", w_kind=configs.ROW_W_KIND[row])
    want = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=base, shared=sk)
    _assert_matches(want, ref, f"split-K base {row}/T={T}")
    assert l2.l2_split(dataclasses.replace(base, l2_split=3), 512) == 1
    for split in (2, 4):
        c = dataclasses.replace(base, l2_split=split)
        out = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=c, shared=sk)
        same = float((out.view(torch.int16) == want.view(torch.int16)).float().mean())
        if row == "mxfp8":  # E4M3 weights: a partial sum can be inexact, and then the orders differ in its last bit
            assert same > 0.9999, f"{row} T={T} split {split}: {same} bitwise"  # (docs/NUMERICS.md)
            _assert_matches(out, ref, f"split-K {split} {row}/T={T}")
        else:
            assert same == 1.0, f"{row} T={T} split {split}: {same} bitwise"
    real = l2.reduce_l2_split
    monkeypatch.setattr(moe, "reduce_l2_split", lambda part, *a, **k: real(part[:-1], *a, **k))
    bad = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=dataclasses.replace(base, l2_split=2), shared=sk)
    assert not torch.equal(bad.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("wt,T", [(16, 8), (64, 300)])
def test_tiled_weights_same_bits(row, wt, T):
    """Weights in the tiled arrangement (``weight_tiles.tiled_copy``) read with ``w_tile`` give the
    converted layout's output bit for bit (plain and fold decodes, both L1 forms); the converted
    bytes read as if tiled must not."""
    import types

    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.format import weight_tiles

    spec, lay, (x, tw, ids), _, ref = _run_pair(row, "swiglu_clamp_ab", None, T=T)
    sc = _NvScalars(lay) if row == "nvfp4" else None
    kt = _Roles(lay, "")
    tiled = types.SimpleNamespace(**vars(kt))
    tiled.l1_weight = weight_tiles.tiled_copy(kt.l1_weight, wt)
    tiled.l2_weight = weight_tiles.tiled_copy(kt.l2_weight, wt)
    base = configs.default_config(T * spec.top_k, spec.experts_per_rank, "frag", w_kind=configs.ROW_W_KIND[row])
    want = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=base)
    for d, gu in (("plain", True), ("fold", False)):
        cfg = dataclasses.replace(base, decode=d, l1_gu=gu)
        out = moe.moe_forward(spec, tiled, x, tw, ids, scalars=sc, config=cfg, w_tile=wt)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"tiled {wt} {d} gu={gu} differs"
    _assert_matches(want, ref, f"tiled {row}")
    bad = moe.moe_forward(spec, kt, x, tw, ids, scalars=sc, config=base, w_tile=wt)
    assert calc_diff(bad, ref) > 1e-3, "converted bytes read as tiled must be caught"


def test_e2m1_asm_decode_self_check():
    """The PRMT lookup-table E2M1 decode (the fast path) agrees with codecs on this GPU,
    and a forward through it equals the arithmetic decode bit for bit."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import decode_check
    assert decode_check.asm_decode_ok(torch.device("cuda")), "PRMT E2M1 decode disagrees with codecs"
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles

    for row in ("mxfp4", "nvfp4"):
        spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu", None, T=21)
        a = moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=_NvScalars(lay) if row == "nvfp4" else None,
                            asm=True)
        b = moe.moe_forward(spec, _Roles(lay, ""), x, tw, ids, scalars=_NvScalars(lay) if row == "nvfp4" else None,
                            asm=False)
        assert torch.equal(a, b) and torch.equal(a, out)


def test_e2m1_to_e4m3_exact():
    """The FP8 path's E2M1 -> E4M3 conversion (masks and shifts, no table) gives, for every
    byte, two E4M3 bytes worth exactly 2^-6 times the codecs decode of its nibbles, on both
    the inline-asm and the arithmetic paths; a wrong shift (negative control) is caught."""
    _triton()
    from megamoe_runtime.backends.triton import mma8

    b = torch.arange(256, dtype=torch.uint8, device="cuda")
    want = (codecs.e2m1_decode(codecs.unpack_e2m1(b)) / 64).reshape(-1)  # [lo, hi] per byte
    for asm in (True, False):
        o = mma8.e2m1_e4m3_table(torch.device("cuda"), asm)
        got = o.view(torch.float8_e4m3fn).float()
        assert torch.equal(got, want.float()), f"asm={asm}: {int((got != want).sum())} values differ"
        assert torch.equal(torch.signbit(got), torch.signbit(want.float())), "sign of -0 lost"
    bad = (o.view(torch.uint8).int() << 1).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert not torch.equal(bad, want.float())


#: calc_diff bound of the opt-in FP8 path (mma="fp8"): its k32 e4m3 MMAs do not sum the 32 exact
#: products exactly, and the MXFP8 requant of the intermediate turns those last-bit differences
#: into whole E4M3 steps for some elements. Measured on the H200: 3e-7 .. 4.1e-6 (BENCHMARKS.md).
FP8_TOL = 1e-5


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("mma", ["fp8", "bf16"])
@pytest.mark.parametrize("T,bm", [(1, None), (37, None), (300, 16), (300, None)])
def test_mx_rows_both_gemm_paths(row, mma, T, bm):
    """Both GEMM paths of the MX rows against the reference, with the fused mxfp8 shared
    expert: the default bf16 decode path at the stated 1e-6, the opt-in FP8 tensor-core path at
    FP8_TOL; reports the bitwise fraction. Negative control: one expert's L1 scales set to 1.0
    must be caught on either path."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton import TritonBackend

    cfg = configs.KernelConfig(block_m=bm, mma=mma)
    spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu_clamp_ab", "mxfp8", T=T, config=cfg,
                                                  zero_tokens=1 if T > 1 else 0, mask_frac=0.0 if T == 1 else 0.15)
    d = calc_diff(out, ref)
    bitwise = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())
    _report(test="gemm_paths", row=row, mma=mma, act="swiglu_clamp_ab", shared="mxfp8", T=T, block_m=bm,
            calc_diff=d, bitwise_frac=bitwise)
    tol = FP8_TOL if mma == "fp8" else TOL
    assert bool(torch.isfinite(out.float()).all()) and d < tol, f"{row}/{mma}/T={T}: calc_diff {d:.3e}"
    bad = _clone_layer(lay)
    e = int(ids[ids >= 0][0])
    layout.physical(bad.l1_scale)[e].copy_(torch.full_like(layout.physical(bad.l1_scale)[e], 127 * 0x01010101))
    y = TritonBackend(config=cfg).forward(bad, x, tw, ids, shared_input=x)
    assert calc_diff(y, ref) > tol, "a dropped scale went unnoticed"


def test_bf16_passthrough():
    staging, _, _ = _triton()
    x = _random_rows(17, 384, "cuda", seed=3)
    y = staging.bf16_passthrough(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


# --------------------------------------------------------------------------- forward vs reference

_ACTS = {
    "swiglu": ActivationSpec("swiglu"),
    "swiglu_clamp_ab": ActivationSpec("swiglu", clamp=7.0, alpha=1.702, beta=1.0),
    "swiglu_clamp0": ActivationSpec("swiglu", clamp=0.0),
    "situ": ActivationSpec("situ", situ_beta=3.0, situ_linear_beta=6.0),
}
_CASES = []
for _row, _shared in (("mxfp4", (None, "mxfp8")), ("mxfp8", (None, "mxfp8")), ("nvfp4", (None, "bf16", "mxfp8")),
                      ("bf16", (None, "bf16"))):
    for _act in ("swiglu", "swiglu_clamp_ab", "situ"):
        if _act == "situ" and _row not in ("mxfp4", "mxfp8"):
            continue
        for _sh in _shared:
            _CASES.append((_row, _act, _sh))
_CASES.append(("mxfp4", "swiglu_clamp0", None))


def _run_pair(row, act, shared, *, T=37, H=512, I=256, E=16, K=4, ep=(0, 1), rsf=2.5, seed=0, config=None,
              mask_frac=0.15, zero_tokens=2, a2=4.0 / 2688):
    staging, moe, synth = _triton()
    from megamoe_runtime.backends.reference import ReferenceBackend
    from megamoe_runtime.backends.triton import TritonBackend

    spec = LayerSpec(row, H, I, E, K, _ACTS[act], ep_rank=ep[0], ep_size=ep[1],
                     shared=SharedSpec(shared, 1, 128) if shared else None, routed_scaling_factor=rsf)
    lay = synth.random_layer(spec, device="cuda", seed=seed, a2=a2)
    tw, ids = synth.random_routing(T, E, K, "cuda", seed=seed + 1, mask_frac=mask_frac,
                                   zero_tokens=min(zero_tokens, T))
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    sh_in = x if shared else None
    ref = ReferenceBackend().forward(lay, x, tw, ids, shared_input=sh_in)
    out = TritonBackend(config=config).forward(lay, x, tw, ids, shared_input=sh_in)
    return spec, lay, (x, tw, ids), out, ref


@pytest.mark.parametrize("a2", [4.0 / 2688, 2.0 ** -85], ids=["residuals", "ieee_division"])
def test_nvfp4_block_scale_division_forms(a2):
    """The L1's NVFP4 requantization divides each block's amax by 6 with Markstein residuals while 1 / a2 <=
    ``l1.DIV6_FAST_INV_A2`` and with the IEEE division above it: both forms give the reference's bits."""
    from megamoe_runtime.backends.triton import l1

    assert (1.0 / a2 <= l1.DIV6_FAST_INV_A2.value) == (a2 > 2.0 ** -80)
    _, _, _, out, ref = _run_pair("nvfp4", "swiglu_clamp_ab", None, T=300, a2=a2)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"a2={a2}: calc_diff {calc_diff(out, ref):.2e}"


@pytest.mark.parametrize("row,act,shared", _CASES, ids=[f"{r}-{a}-{s or 'noshared'}" for r, a, s in _CASES])
def test_forward_matches_reference(row, act, shared):
    _, _, _, out, ref = _run_pair(row, act, shared)
    bitwise = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())
    d = calc_diff(out, ref)
    _report(test="forward", row=row, act=act, shared=shared or "none", T=37, calc_diff=d, bitwise_frac=bitwise)
    _assert_matches(out, ref, f"{row}/{act}/{shared}")


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4", "bf16"])
@pytest.mark.parametrize("T,bm", [(1, None), (8, None), (300, None), (300, 16)])
def test_forward_sizes_and_ep(row, T, bm):
    """Decode sizes, many pairs per expert (several row blocks), EP rank 1 of 2."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    cfg = configs.KernelConfig(block_m=bm) if bm else None
    _, _, _, out, ref = _run_pair(row, "swiglu_clamp_ab", None, T=T, E=8, K=2, ep=(1, 2), config=cfg,
                                  mask_frac=0.1, zero_tokens=1 if T > 1 else 0)
    d = calc_diff(out, ref)
    bitwise = float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())
    _report(test="sizes_ep", row=row, act="swiglu_clamp_ab", shared="none", T=T, block_m=bm, calc_diff=d,
            bitwise_frac=bitwise)
    _assert_matches(out, ref, f"{row}/T={T}")


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("T,bm,tail_max,ep", [(300, 128, 100, (0, 1)), (600, None, 32, (0, 1)),
                                              (600, None, 32, (1, 2))])
def test_tail_blocks_same_bits(row, T, bm, tail_max, ep, monkeypatch):
    """Prefill with tail launches (``KernelConfig.tail_max``): every pair is computed once, by
    the same per-row math, so the output is the no-tail output bit for bit and matches the
    reference. Negative control: tail launches that compute nothing must be caught."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.backends.triton import staging

    E, K = 8, 2
    base = configs.default_config(T * K, E, "frag", w_kind=configs.ROW_W_KIND[row])
    base = dataclasses.replace(base, block_m=bm or base.block_m, tail_max=0)
    calls = []

    def counting(plan, *a):
        t = staging.split_tails(plan, *a)
        calls.append(int(t.num_blocks))
        return t

    monkeypatch.setattr(moe, "split_tails", counting)
    runs = {}
    for tm in (0, tail_max):
        spec, lay, (x, tw, ids), runs[tm], ref = _run_pair(
            row, "swiglu_clamp_ab", None, T=T, E=E, K=K, ep=ep, mask_frac=0.1, zero_tokens=1,
            config=dataclasses.replace(base, tail_max=tm))
    assert len(calls) == 1 and calls[0] > 0, f"no tail blocks to test: {calls}"
    assert torch.equal(runs[tail_max].view(torch.int16), runs[0].view(torch.int16)), "tails changed the output"
    _assert_matches(runs[tail_max], ref, f"tails {row}/T={T}")

    def wrong_expert(plan, num_local, *a):  # (a tail that computed nothing could show stale slots)
        t = staging.split_tails(plan, num_local, *a)
        t.block_expert.copy_(torch.where(t.block_expert >= 0, (t.block_expert + 1) % num_local, t.block_expert))
        return t

    monkeypatch.setattr(moe, "split_tails", wrong_expert)
    _, _, _, bad, ref = _run_pair(row, "swiglu_clamp_ab", None, T=T, E=E, K=K, ep=ep, mask_frac=0.1,
                                  zero_tokens=1, config=dataclasses.replace(base, tail_max=tail_max))
    assert not calc_diff(bad, ref) < 1e-3, "tail blocks run with another expert's weights must be caught"


def test_zero_tokens_and_fully_masked():
    _, moe, _ = _triton()
    for row in ("mxfp4", "nvfp4"):
        spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu", None, T=5, mask_frac=0.0, zero_tokens=5)
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, out)
        from megamoe_runtime.backends.triton import TritonBackend

        y = TritonBackend().forward(lay, x[:0], tw[:0], ids[:0])
        assert y.shape == (0, spec.hidden)


def _captured(be, lay, x, tw, ids, shared_input):
    """(graph, output) of ``be.forward`` captured in a CUDA graph after one warm-up call on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(lay, x, tw, ids, shared_input=shared_input)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = be.forward(lay, x, tw, ids, shared_input=shared_input)
    return g, y


def test_cuda_graph_capture():
    """No host sync in staging + forward: it captures, and replays equal eager on new inputs."""
    _, moe, synth = _triton()
    from megamoe_runtime.backends.triton import TritonBackend

    spec, lay, (x, tw, ids), out, ref = _run_pair("nvfp4", "swiglu_clamp_ab", "bf16", T=8)
    be = TritonBackend()
    g, y = _captured(be, lay, x, tw, ids, x)
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    tw2, ids2 = synth.random_routing(8, spec.num_experts, spec.top_k, "cuda", seed=99)
    tw.copy_(tw2)
    ids.copy_(ids2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, be.forward(lay, x, tw, ids, shared_input=x))


@pytest.mark.parametrize("row,shared,T", [("mxfp4", None, 8), ("nvfp4", "bf16", 8), ("mxfp8", None, 300),
                                           ("nvfp4", None, 300), ("mxfp4", "mxfp8", 300)])
def test_programmatic_dependent_launch_keeps_the_bits(row, shared, T, monkeypatch):
    """The forward launched with programmatic dependent launch (``staging.pdl``, the default on Hopper) gives
    the plainly launched forward's bits, eagerly and replayed from a CUDA graph on new inputs: each kernel
    waits for the previous grid before it touches memory, so only the launches overlap. Not vacuous: on this
    GPU the launches with the knob on do carry the attribute, and ``MEGAMOE_TRITON_PDL=0`` takes it away."""
    staging, moe, synth = _triton()
    from megamoe_runtime.backends.triton import TritonBackend

    def bits(t):
        return t.view(torch.int16)

    monkeypatch.setenv("MEGAMOE_TRITON_PDL", "1")
    spec, lay, (x, tw, ids), out_pdl, _ = _run_pair(row, "swiglu_clamp_ab", shared, T=T)
    sh = x if shared else None
    assert staging.pdl(x.device) == {"PDL": True, "launch_pdl": True}
    be = TritonBackend()
    g, y = _captured(be, lay, x, tw, ids, sh)
    monkeypatch.setenv("MEGAMOE_TRITON_PDL", "0")
    assert staging.pdl(x.device) == {"PDL": False}
    plain = be.forward(lay, x, tw, ids, shared_input=sh)
    assert torch.equal(bits(out_pdl), bits(plain)), f"eager: calc_diff {calc_diff(out_pdl, plain):.2e}"
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    tw2, ids2 = synth.random_routing(T, spec.num_experts, spec.top_k, "cuda", seed=99)
    tw.copy_(tw2)
    ids.copy_(ids2)
    g.replay()
    torch.cuda.synchronize()
    plain = be.forward(lay, x, tw, ids, shared_input=sh)
    assert not torch.equal(bits(plain), bits(out_pdl)), "the new inputs must change the output"
    assert torch.equal(bits(y), bits(plain)), f"graph: calc_diff {calc_diff(y, plain):.2e}"


def test_auto_selects_triton_without_deepgemm():
    _triton()
    from megamoe_runtime.backends import get_backend

    try:
        import deep_gemm  # noqa: F401
        pytest.skip("DeepGEMM is installed; auto may pick it")
    except ImportError:
        pass
    assert get_backend("auto", "cuda").name == "triton"


# --------------------------------------------------------------------------- real export end to end


@pytest.mark.parametrize("fixture", ["modelopt-nvfp4-deepseekv3", "quark-mxfp4-deepseekv3",
                                     "modelopt-mxfp8-qwen3moe", "llmcompressor-nvfp4-qwen3moe",
                                     "bf16-plain-deepseekv3"])
def test_real_export_end_to_end(fixture, tmp_path):
    """A real producer export, converted by megamoe-convert, loaded by the runtime on
    the GPU, run through the triton backend and the reference backend."""
    _triton()
    assert (FIXTURES / fixture).exists(), f"committed real export {fixture} is missing"
    from megamoe_convert.pipeline.convert import convert
    from megamoe_runtime.load.checkpoint import open_checkpoint

    out_dir = tmp_path / "converted"
    convert(FIXTURES / fixture, out_dir)
    ck = open_checkpoint(out_dir)
    for info in ck.layers:
        idx = info.index
        lt = ck.build_layer(idx, device="cuda", backend="triton")
        lr = ck.build_layer(idx, device="cuda", backend="reference")
        assert lt.backend.name == "triton"
        spec = lt.spec
        T = 19
        g = torch.Generator(device="cpu").manual_seed(idx)
        x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16).cuda()
        ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :spec.top_k].cuda()
        ids[3, 0] = -1
        tw = torch.softmax(torch.randn(T, spec.top_k, generator=g), 1).float().cuda()
        yt, yr = lt(x, tw, ids), lr(x, tw, ids)
        d = _assert_matches(yt, yr, f"{fixture} layer {idx}")
        _report(test="real_export", fixture=fixture, layer=idx, row=spec.row,
                shared=spec.shared.precision if spec.shared else "none", fused=bool(lt.shared_fused),
                calc_diff=d, bitwise_frac=float((yt.view(torch.int16) == yr.view(torch.int16)).float().mean()))


@pytest.mark.parametrize("fmt", ["modelopt-mxfp4", "modelopt-nvfp4", "modelopt-mxfp8"])
def test_layer_derives_tiled_weights_on_load(fmt, ckpts, monkeypatch):
    """A triton layer on the GPU holds its routed weights tiled after every load (same storage),
    computes bit for bit what the converted layout computes, survives a reload under a captured
    CUDA graph, and refuses a path that cannot read tiles."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs
    from megamoe_runtime.errors import MegaMoEError
    from megamoe_runtime.format import weight_tiles
    from megamoe_runtime.load.checkpoint import open_checkpoint

    _, out = ckpts.converted(fmt)
    ck = open_checkpoint(out)
    lt = ck.build_layer(0, device="cuda", backend="triton")
    lr = ck.build_layer(0, device="cuda", backend="reference")
    monkeypatch.setenv("MEGAMOE_TRITON_WTILE", "0")
    l0 = ck.build_layer(0, device="cuda", backend="triton")
    monkeypatch.delenv("MEGAMOE_TRITON_WTILE")
    assert lt.weight_tiles == configs.DEFAULT_W_TILE and l0.weight_tiles == 0
    for name in ("l1_weight", "l2_weight"):
        want = weight_tiles.tiled_copy(getattr(lr, name).detach(), lt.weight_tiles)
        assert torch.equal(getattr(lt, name).view(torch.uint8), want.view(torch.uint8)), name
    spec = lt.spec
    T = 21
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16).cuda()
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :spec.top_k].cuda()
    tw = torch.softmax(torch.randn(T, spec.top_k, generator=g), 1).float().cuda()
    y = lt(x, tw, ids)
    assert torch.equal(y.view(torch.int16), l0(x, tw, ids).view(torch.int16)), "tiled != converted layout"
    _assert_matches(y, lr(x, tw, ids), f"tiled layer {fmt}")
    # a reload under a captured graph: same storage, tiles derived again, same output on replay
    snap = lt.storage_snapshot
    lt(x, tw, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = lt(x, tw, ids)
    ck.load_layer(lt)
    assert lt.storage_snapshot == snap and lt.weight_tiles == configs.DEFAULT_W_TILE
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg.view(torch.int16), y.view(torch.int16))
    # negative control: the converted bytes read as tiles
    lt.weight_tiles, l0.weight_tiles = 0, configs.DEFAULT_W_TILE
    assert calc_diff(l0(x, tw, ids), y) > 1e-3
    lt.weight_tiles = configs.DEFAULT_W_TILE
    # the split order cannot read tiles: a clear error, not wrong numbers
    lt.backend.config = configs.KernelConfig(k_order="split")
    with pytest.raises(MegaMoEError, match="tiled by"):
        lt(x, tw, ids)


@pytest.mark.parametrize("fmt", ["modelopt-mxfp4", "modelopt-nvfp4", "modelopt-mxfp8"])
def test_layer_fold_flags_follow_reloads(fmt, ckpts):
    """A triton layer computes its per-expert fold flags after every load, into the same storage:
    all FOLD_OK for a real export (output bitwise the per-tile scan's), FOLD_SCAN while a load
    writes, and after a reload that brings scale bytes the fold cannot take the flags mark that
    expert, so a CUDA graph captured before the reload replays the plain decode's output."""
    _, moe, _ = _triton()
    from megamoe_runtime.backends.triton import configs, launch, operands
    from megamoe_runtime.backends.triton.backend import _NvScalars, _Roles
    from megamoe_runtime.load.checkpoint import open_checkpoint

    _, out = ckpts.converted(fmt)
    lt = open_checkpoint(out).build_layer(0, device="cuda", backend="triton")
    spec = lt.spec
    flags = lt.triton_fold_flags
    keep = flags.data_ptr()
    assert flags.tolist() == [[operands.FOLD_OK] * spec.experts_per_rank] * 2
    T = 19
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16).cuda()
    rest = torch.argsort(torch.rand(T, spec.num_experts - 1, generator=g), 1)[:, :spec.top_k - 1] + 1
    ids = torch.cat([torch.zeros(T, 1, dtype=rest.dtype), rest], 1).cuda()  # every token through expert 0
    tw = torch.softmax(torch.randn(T, spec.top_k, generator=g), 1).float().cuda()
    sc = _NvScalars(lt) if spec.row == "nvfp4" else None

    def direct(decode, ff=None):
        cfg = configs.KernelConfig(k_order="frag", decode=decode, l1_gu=True)
        return moe.moe_forward(spec, _Roles(lt, ""), x, tw, ids, scalars=sc, config=cfg, fold_flags=ff,
                               w_tile=lt.weight_tiles)

    y = lt(x, tw, ids)
    assert torch.equal(direct("fold", flags).view(torch.int16), direct("fold").view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    lt.backend.config = configs.KernelConfig(k_order="frag", decode="fold", l1_gu=True)  # the fold where flags act
    lt(x, tw, ids)
    with torch.cuda.graph(graph):
        yg = lt(x, tw, ids)
    # a load writes: flags go to FOLD_SCAN before the first byte, in place
    lt.begin_load()
    assert flags.tolist() == [[operands.FOLD_SCAN] * spec.experts_per_rank] * 2
    lt.abort_load()
    # reload with scale bytes of expert 0 the fold cannot take
    sd = {k: v.clone() for k, v in lt.state_dict().items()}
    for name in ("l1_scale", "l2_scale"):
        sb = launch.scale_bytes(sd[name], sd[name].device)[0, 0, :64]
        sb.copy_(_nv_scale_plant("cuda") if spec.row == "nvfp4" else
                 torch.full_like(sb, 131 if spec.row == "mxfp4" else 137))
    lt.load_state_dict(sd)
    assert lt.triton_fold_flags.data_ptr() == keep
    assert flags[:, 0].tolist() == [operands.FOLD_REDO] * 2 and int(flags[:, 1:].sum()) == 0, flags.tolist()
    plain = direct("plain")
    assert not torch.equal(plain.view(torch.int16), y.view(torch.int16)), "the reloaded scales must change the output"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg.view(torch.int16), plain.view(torch.int16)), "the captured graph did not read the new flags"
    # negative control: stale flags (all FOLD_OK) on the new bytes keep the fold's garbage
    assert not torch.equal(direct("fold", torch.zeros_like(flags)).view(torch.int16), plain.view(torch.int16))


# --------------------------------------------------------------------------- negative controls


def _clone_layer(lay):
    import copy

    new = copy.copy(lay)
    for k, v in vars(lay).items():
        if isinstance(v, torch.Tensor):
            setattr(new, k, v.clone() if v.dim() < 2 or k.endswith("weight")
                    else layout.kernel_view_from_physical(layout.physical(v).clone()) if k.endswith("scale")
                    else v.clone())
    return new


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4"])
def test_negative_wrong_layout(row):
    """L1 rows de-interleaved ([gate | up]) or scales without the UTCCP permutation must fail."""
    from megamoe_runtime.backends.triton import TritonBackend

    spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu", None)
    _assert_matches(out, ref)
    I = spec.intermediate
    bad = _clone_layer(lay)
    for e in range(spec.experts_per_rank):
        gate = layout.read_l1_weight(lay.l1_weight[e], 0)
        up = layout.read_l1_weight(lay.l1_weight[e], 1)
        bad.l1_weight[e].copy_(torch.cat([gate, up]).view(bad.l1_weight.dtype))
    with pytest.raises(AssertionError):
        _assert_matches(TritonBackend().forward(bad, x, tw, ids), ref, "de-interleaved L1")
    bad = _clone_layer(lay)
    phys = layout.physical(bad.l2_scale)  # [E, P, H]: undo UTCCP of the L2 scale rows
    n = torch.arange(spec.hidden, device=phys.device)
    perm = (n // 128) * 128 + (n % 32) * 4 + (n // 32) % 4
    phys.copy_(layout.physical(lay.l2_scale)[..., perm.argsort()].clone())
    with pytest.raises(AssertionError):
        _assert_matches(TritonBackend().forward(bad, x, tw, ids), ref, "scales without UTCCP")


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8", "nvfp4"])
def test_negative_dropped_scale(row):
    """One expert's L1 scales replaced by 1.0 (UE8M0 127 / E4M3 0x38), or nvfp4's alpha dropped, must fail."""
    from megamoe_runtime.backends.triton import TritonBackend

    spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu", None, mask_frac=0.0, zero_tokens=0)
    _assert_matches(out, ref)
    e = int(ids[0, 0])
    bad = _clone_layer(lay)
    one = 127 if row != "nvfp4" else 0x38
    layout.physical(bad.l1_scale)[e].copy_(torch.full_like(layout.physical(bad.l1_scale)[e], one * 0x01010101))
    with pytest.raises(AssertionError):
        _assert_matches(TritonBackend().forward(bad, x, tw, ids), ref, "dropped scale")
    if row == "nvfp4":
        bad = _clone_layer(lay)
        bad.l1_alpha = torch.ones_like(lay.l1_alpha)
        with pytest.raises(AssertionError):
            _assert_matches(TritonBackend().forward(bad, x, tw, ids), ref, "dropped alpha")


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("nvfp4", "bf16")])
def test_negative_dropped_shared_input(row, shared):
    """Leaving out the shared expert's input (so slot K is not computed) must fail."""
    from megamoe_runtime.backends.triton import TritonBackend

    spec, lay, (x, tw, ids), out, ref = _run_pair(row, "swiglu", shared)
    _assert_matches(out, ref)
    with pytest.raises(AssertionError):
        _assert_matches(TritonBackend().forward(lay, x, tw, ids, shared_input=None), ref, "no shared input")
    other = torch.roll(x, 1, 0)
    with pytest.raises(AssertionError):
        _assert_matches(TritonBackend().forward(lay, x, tw, ids, shared_input=other), ref, "wrong shared input")


# --------------------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize("row,shared", [("mxfp4", "mxfp8"), ("mxfp8", None), ("nvfp4", "bf16"), ("bf16", "bf16")])
def test_ep_pieces_recombine_to_the_forward(row, shared, tmp_path):
    """The EP path of the triton backend on one GPU: each rank's `pairs` plus the
    source rank's `shared_slot`, combined with the row's rule, equal the
    single-rank triton forward (the transport itself is tested with gloo
    processes on CPU; several GPUs were not available to this project)."""
    _triton()
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint
    from megamoe_runtime.backends.reference import combine_slots
    from megamoe_runtime.load.checkpoint import open_checkpoint

    fmt = {"mxfp4": "modelopt-mxfp4", "mxfp8": "modelopt-mxfp8", "nvfp4": "modelopt-nvfp4", "bf16": "bf16"}[row]
    src = build_synthetic_checkpoint(tmp_path / "src", fmt, num_layers=1, hidden=256, intermediate=128,
                                     num_experts=8, top_k=3, shared=1 if shared else 0, seed=5,
                                     routed_scaling_factor=1.5)
    convert(src, tmp_path / "ep1")
    convert(src, tmp_path / "ep2", ep_size=2)
    single = open_checkpoint(tmp_path / "ep1").build_layer(0, device="cuda", backend="triton")
    ck2 = open_checkpoint(tmp_path / "ep2")
    ranks = [ck2.build_layer(0, device="cuda", backend="triton", ep_rank=r, ep_size=2) for r in range(2)]
    spec = single.spec
    T, K = 29, spec.top_k
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16).cuda()
    ids = torch.argsort(torch.rand(T, spec.num_experts, generator=g), 1)[:, :K]
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    ids = ids.cuda()
    tw = torch.rand(T, K, generator=g).cuda()
    y = single(x, tw, ids)

    slots = torch.zeros(T, K, spec.hidden, dtype=torch.bfloat16, device="cuda")
    valid = ids >= 0
    for lay in ranks:
        mine = (ids >= lay.spec.local_experts.start) & (ids < lay.spec.local_experts.stop)
        t, k = mine.nonzero(as_tuple=True)
        slots[t, k] = lay.backend.pairs(lay, x[t], tw[t, k], ids[t, k])
    if single.shared_fused:
        slots = torch.cat([slots, ranks[0].backend.shared_slot(ranks[0], x).unsqueeze(1)], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    y_ep = combine_slots(spec, slots, valid)
    d = _assert_matches(y_ep, y, f"EP2 pieces {row}")
    _report(test="ep_pieces", row=row, shared=shared or "none", calc_diff=d,
            bitwise_frac=float((y_ep.view(torch.int16) == y.view(torch.int16)).float().mean()))
    # negative control: losing one routed pair is caught by the same check
    t0, k0 = valid[:, :K].nonzero()[0].tolist()
    slots[t0, k0] = 0
    with pytest.raises(AssertionError):
        _assert_matches(combine_slots(spec, slots, valid), y, "dropped pair")
