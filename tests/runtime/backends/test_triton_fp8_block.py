"""The block-FP8 row on the triton backend (``backends/triton/block8.py``) against the reference backend.

GPU (``-m gpu``): the dispatch quantizer is bitwise the reference's; the forward at 1..300 tokens,
with EP, masked slots and fully masked tokens, and on a DeepSeek-V3-width layer, is within
``FP8_BLOCK_TOL`` of the reference (calc_diff; the fraction of bitwise-equal outputs is reported); the
same kernels with the MMA on bf16 operands (``Block8Config.exact``) are within ``EXACT_MMA_TOL``, which
pins the whole difference on the FP8 MMA's own block sum; it captures in a CUDA graph.
Negative controls that must fail the same check: one 128x128 block scale doubled, the L1 scales
transposed, the L1 gate/up rows not interleaved.

CPU: the same kernels under ``TRITON_INTERPRET=1`` on a tiny layer, where the FP8 MMA becomes an
IEEE fp32 dot of the exactly decoded operands, against the reference, with the same controls.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from megamoe_runtime.format.formats import ActivationSpec, LayerSpec
from megamoe_runtime.testing import calc_diff
from interpreted import interpreted_output

ROW = "fp8_block"

#: calc_diff bound of the triton block-FP8 forward vs the reference on the GPU (docs/NUMERICS.md#fp8-block-triton):
#: the FP8 wgmma's own 128-block sum (13 bits below the largest term, truncated) flips E4M3 roundings; H100 max 1.3e-5.
FP8_BLOCK_TOL = 2.5e-5
#: the same kernels with the MMA on bf16 operands (exact products, fp32 sums in the MMA's order): H100 max 4.8e-8.
EXACT_MMA_TOL = 2e-7
#: a negative control must land at least this far above the bound (H100, calc_diff on the outputs the break can
#: change: 5.1e-3 and up on the H 512 layers; at DeepSeek-V3 width 1.4e-4 one L1 block scale doubled, 6.9e-3 one
#: L2 block scale doubled, 0.995 gate/up not interleaved)
CONTROL_MARGIN = 5.0

_ACTS = {"swiglu": ActivationSpec("swiglu"), "swiglu_clamp": ActivationSpec("swiglu", clamp=7.0)}


def _case(T: int, device: str, *, H: int = 512, I: int = 256, E: int = 16, K: int = 4, ep=(0, 1), act="swiglu",
          rsf: float = 2.5, seed: int = 0, mask_frac: float = 0.15, zero_tokens: int = 2):
    from megamoe_runtime.backends.triton import synth

    spec = LayerSpec(ROW, H, I, E, K, _ACTS[act], ep_rank=ep[0], ep_size=ep[1], routed_scaling_factor=rsf)
    lay = synth.random_layer(spec, device=device, seed=seed)
    tw, ids = synth.random_routing(T, E, K, device, seed=seed + 1, mask_frac=mask_frac,
                                   zero_tokens=min(zero_tokens, max(T - 1, 0)))
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    return spec, lay, x, tw, ids


def _reference(lay, x, tw, ids) -> torch.Tensor:
    from megamoe_runtime.backends.reference import ReferenceBackend

    return ReferenceBackend().forward(lay, x, tw, ids)


def _triton_forward(lay, x, tw, ids, config=None) -> torch.Tensor:
    from megamoe_runtime.backends.triton.backend import _Roles
    from megamoe_runtime.backends.triton.moe import moe_forward

    return moe_forward(lay.spec, _Roles(lay, ""), x, tw, ids, config=config)


def controls(lay, ids) -> list[tuple[str, object]]:
    """Layers broken on purpose, each of which the acceptance check must refuse."""
    from megamoe_runtime.format import layout

    e = int(torch.mode(ids[ids >= 0].flatten() - lay.spec.local_experts.start).values)  # the busiest local expert
    out = []
    bad = copy.copy(lay)
    bad.l1_scale = lay.l1_scale.clone()
    bad.l1_scale[e, 0, 0] *= 2.0
    out.append(("one L1 block scale doubled", bad))
    bad = copy.copy(lay)
    bad.l2_scale = lay.l2_scale.clone()
    bad.l2_scale[e, 0, 0] *= 2.0
    out.append(("one L2 block scale doubled", bad))
    if lay.l1_scale.shape[-1] == lay.l1_scale.shape[-2]:
        bad = copy.copy(lay)
        bad.l1_scale = lay.l1_scale.transpose(-1, -2).contiguous()
        out.append(("L1 scales transposed", bad))
    bad = copy.copy(lay)
    (w13, _), _ = layout.block_fp8_canonical(layout.KernelTensors(lay.l1_weight, lay.l1_scale, lay.l2_weight,
                                                                  lay.l2_scale))
    bad.l1_weight = w13.contiguous()
    out.append(("L1 gate/up rows not interleaved", bad))
    return out


def check(out: torch.Tensor, ref: torch.Tensor, tol: float = FP8_BLOCK_TOL) -> tuple[float, float]:
    """(calc_diff, bitwise fraction); raises AssertionError past ``tol`` or on a non-finite output."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert bool(torch.isfinite(out.float()).all()), "non-finite output"
    d = calc_diff(out, ref)
    assert d < tol, f"calc_diff {d:.3e} >= {tol:g}"
    return d, float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())


def check_controls(lay, x, tw, ids, ref, run, tol: float = FP8_BLOCK_TOL) -> dict:
    """Each control must fail ``check`` by ``CONTROL_MARGIN``; returns their calc_diffs."""
    seen = {}
    for name, bad in controls(lay, ids):
        d = calc_diff(run(bad, x, tw, ids), ref)
        seen[name] = d
        assert d > CONTROL_MARGIN * tol, f"negative control {name!r} passed: calc_diff {d:.3e}"
    return seen


def _report(**kw) -> None:
    path = os.environ.get("MEGAMOE_TRITON_REPORT")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


# --------------------------------------------------------------------------- CPU: the interpreter


def check_row_scales() -> None:
    """``block8.row_scales``: row r of the plan gets its token's dispatch scales (K-block major), a padding row
    zeros; a plan built for other routing must not match."""
    from megamoe_runtime.backends.triton import block8, synth
    from megamoe_runtime.backends.triton.staging import route

    T, E, K, H = 9, 4, 2, 384
    xs = torch.rand(T, H // 128, generator=torch.Generator().manual_seed(5)) + 0.5
    tw, ids = synth.random_routing(T, E, K, "cpu", seed=6, mask_frac=0.2, zero_tokens=1)
    plan = route(ids, E, 0, 16)
    got = block8.row_scales(xs, plan, K, False)
    pairs = plan.sorted_pairs.long()
    want = torch.where((pairs >= 0)[:, None], xs[pairs.clamp_min(0) // K], torch.zeros(()))
    assert got.shape == (H // 128, pairs.shape[0]) and torch.equal(got, want.t()), "row_scales"
    assert bool((pairs >= 0).any()) and bool((pairs < 0).any()), "the case needs padding and real rows"
    other = route(synth.random_routing(T, E, K, "cpu", seed=7, mask_frac=0.2)[1], E, 0, 16)
    bad = block8.row_scales(xs, other, K, False)
    assert bad.shape != got.shape or not torch.equal(bad, got), "row_scales ignores the plan"


def run_interpreted() -> str:
    """The tiny-layer check the CPU test runs under ``TRITON_INTERPRET=1`` (a subprocess)."""
    import dataclasses

    from megamoe_runtime.backends.triton import block8, configs

    check_row_scales()
    res = []
    for T, ep, act in ((6, (0, 1), "swiglu_clamp"), (9, (1, 2), "swiglu")):
        spec, lay, x, tw, ids = _case(T, "cpu", H=256, I=128, E=4, K=2, ep=ep, act=act, zero_tokens=1)
        ref = _reference(lay, x, tw, ids)
        d, bw = check(_triton_forward(lay, x, tw, ids), ref, 1e-7)
        ctl = check_controls(lay, x, tw, ids, ref, _triton_forward, 1e-7)
        res.append(f"T={T} ep={ep} calc_diff={d:.2e} bitwise={bw:.4f} controls={len(ctl)}")
        # the prefill tiles, and the L1 promoting its gate dot before issuing its up dot
        for fc in (block8.TILES["prefill"], dataclasses.replace(block8.TILES["prefill"], paired=False)):
            check(_triton_forward(lay, x, tw, ids, configs.KernelConfig(fp8=fc)), ref, 1e-7)
    return "; ".join(res)


def test_block8_kernels_under_the_interpreter():
    out = interpreted_output(__file__, "'OK ' + str(m.run_interpreted())", timeout=600)
    assert out.startswith("OK"), out[-2000:]


def test_controls_change_what_they_claim():
    """The controls are real breakages of this layout: each differs from the layer in the tensor it names."""
    from megamoe_runtime.backends.triton import synth  # noqa: F401  (pure torch)

    spec, lay, x, tw, ids = _case(4, "cpu", H=256, I=128, E=4, K=2)
    for name, bad in controls(lay, ids):
        changed = [t for t in ("l1_weight", "l1_scale", "l2_weight", "l2_scale")
                   if not torch.equal(getattr(bad, t).view(torch.uint8), getattr(lay, t).view(torch.uint8))]
        assert len(changed) == 1, (name, changed)


# --------------------------------------------------------------------------- GPU


def _gpu():
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the triton backend needs sm_89+ (E4M3 conversions)")


@pytest.mark.gpu
def test_dispatch_quantizer_bitwise():
    """``block8.quantize_b128`` = the reference's per-1x128 activation quantizer, bytes and scales, on random
    rows, rows with a zero block, huge and tiny blocks; a changed input must change the bytes."""
    _gpu()
    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.testing import staging_adversarial_rows, staging_random_rows

    for H in (128, 512, 7168):
        for x in (staging_random_rows(33, H, "cuda", seed=H), staging_adversarial_rows(H, "cuda")):
            q, s = block8.quantize_b128(x)
            rq, rs = _ref_act_quant(x)
            assert torch.equal(q, rq.view(torch.uint8)), f"H={H}: E4M3 bytes differ"
            assert torch.equal(s, rs), f"H={H}: scales differ"
    q2, _ = block8.quantize_b128(x * 1.0625)
    assert not torch.equal(q2, q)


def _ref_act_quant(x):
    """The reference's dispatch quantizer, computed on the CPU: on a CUDA tensor torch turns ``amax / 448``
    (a division by a Python scalar) into a multiply by fp32(1/448), which is the intermediate's rule, not
    the dispatch's true division (docs/NUMERICS.md#fp8-block)."""
    from megamoe_runtime.format import codecs

    q, s = codecs.quantize_fp8_act(x.cpu(), 128, reciprocal_scale=False)
    return q.to(x.device), s.to(x.device)


@pytest.mark.gpu
@pytest.mark.parametrize("T,bm,ep,act", [(1, None, (0, 1), "swiglu"), (8, None, (0, 1), "swiglu_clamp"),
                                         (37, None, (1, 2), "swiglu_clamp"), (300, None, (0, 1), "swiglu"),
                                         (300, 16, (0, 1), "swiglu_clamp"), (300, 128, (1, 2), "swiglu")])
def test_forward_matches_reference(T, bm, ep, act):
    _gpu()
    from megamoe_runtime.backends.triton import TritonBackend, configs

    spec, lay, x, tw, ids = _case(T, "cuda", ep=ep, act=act, mask_frac=0.0 if T == 1 else 0.15)
    ref = _reference(lay, x, tw, ids)
    be = TritonBackend(config=configs.KernelConfig(block_m=bm))
    out = be.forward(lay, x, tw, ids)
    d = calc_diff(out, ref)
    ctl = {name: calc_diff(be.forward(bad, x, tw, ids), ref) for name, bad in controls(lay, ids)} \
        if T in (37, 300) else {}
    _report(test="fp8_block_forward", row=ROW, T=T, block_m=bm, ep=list(ep), act=act, calc_diff=d,
            bitwise_frac=_bitwise(out, ref), max_abs_err=(out.float() - ref.float()).abs().max().item(),
            ref_absmax=ref.float().abs().max().item(), controls=ctl)
    check(out, ref)
    for name, dc in ctl.items():
        assert dc > CONTROL_MARGIN * FP8_BLOCK_TOL, f"negative control {name!r} passed: calc_diff {dc:.3e}"


def _bitwise(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.view(torch.int16) == ref.view(torch.int16)).float().mean())


def _dsv3_case():
    """DeepSeek-V3's H and I on a few experts (the K loops and the scale strides at full length)."""
    return _case(64, "cuda", H=7168, I=2048, E=8, K=8, rsf=2.5)


@pytest.mark.gpu
def test_dsv3_width_layer():
    """At DeepSeek-V3's width, within ``FP8_BLOCK_TOL``; negative controls measured on the outputs they
    can change (one expert's tokens; the planted block's 128 output columns) must land above it."""
    _gpu()
    from megamoe_runtime.backends.triton import TritonBackend

    spec, lay, x, tw, ids = _dsv3_case()
    ref = _reference(lay, x, tw, ids)
    be = TritonBackend()
    out = be.forward(lay, x, tw, ids)
    d = calc_diff(out, ref)
    e = int(torch.mode(ids[ids >= 0].flatten()).values)
    rows = (ids == e).any(1)
    ctl = {}
    for name, bad in controls(lay, ids):
        y = be.forward(bad, x, tw, ids)
        if name == "one L2 block scale doubled":  # output columns 0..127 of expert e's tokens
            ctl[name] = calc_diff(y[rows, :128], ref[rows, :128])
        else:
            ctl[name] = calc_diff(y[rows], ref[rows])
    _report(test="fp8_block_dsv3_width", row=ROW, T=64, calc_diff=d, bitwise_frac=_bitwise(out, ref),
            max_abs_err=(out.float() - ref.float()).abs().max().item(), controls=ctl)
    check(out, ref)
    for name, dc in ctl.items():
        assert dc > CONTROL_MARGIN * FP8_BLOCK_TOL, f"negative control {name!r} passed: calc_diff {dc:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dsv3", "300"])
def test_exact_mma_isolates_the_fp8_sum(case):
    """The same kernels and tiles with the MMA on bf16 operands (``Block8Config.exact``: the exact E4M3
    products summed to fp32) land on the reference to ``EXACT_MMA_TOL``: everything but the FP8 MMA's own
    block sum (promotions, scale indexing, masks, epilogue, combine) is the reference's at these tiles."""
    _gpu()
    import dataclasses

    from megamoe_runtime.backends.triton import TritonBackend, block8, configs

    spec, lay, x, tw, ids = _dsv3_case() if case == "dsv3" else _case(300, "cuda")
    ref = _reference(lay, x, tw, ids)
    fc = block8.default_config(x.shape[0] * spec.top_k, spec.experts_per_rank)
    be = TritonBackend(config=configs.KernelConfig(fp8=dataclasses.replace(fc, exact=True)))
    out = be.forward(lay, x, tw, ids)
    d = calc_diff(out, ref)
    bad = controls(lay, ids)[1][1]  # one L2 block scale doubled: the exact path is no less sensitive
    dc = calc_diff(be.forward(bad, x, tw, ids), ref)
    _report(test="fp8_block_exact_mma", row=ROW, case=case, calc_diff=d, bitwise_frac=_bitwise(out, ref),
            control=dc)
    check(out, ref, EXACT_MMA_TOL)
    assert dc > CONTROL_MARGIN * EXACT_MMA_TOL, f"negative control passed: calc_diff {dc:.3e}"


@pytest.mark.gpu
def test_cuda_graph_capture_and_zero_tokens():
    """No host sync: the forward captures, and a replay on new inputs equals eager; zero tokens and
    fully masked tokens give zeros."""
    _gpu()
    from megamoe_runtime.backends.triton import TritonBackend, synth

    spec, lay, x, tw, ids = _case(8, "cuda")
    be = TritonBackend()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        be.forward(lay, x, tw, ids)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = be.forward(lay, x, tw, ids)
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    tw2, ids2 = synth.random_routing(8, spec.num_experts, spec.top_k, "cuda", seed=99)
    tw.copy_(tw2)
    ids.copy_(ids2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, be.forward(lay, x, tw, ids))
    assert be.forward(lay, x[:0], tw[:0], ids[:0]).shape == (0, spec.hidden)
    ids.fill_(-1)
    assert torch.equal(be.forward(lay, x, tw, ids), torch.zeros_like(y))


@pytest.mark.parametrize("T", [1, 64, 512, 1024, 4096])
def test_tiles_under_ep_follow_the_local_pairs(T):
    """An EP rank picks the tiles and row block one rank holding every expert picks at the same T (the pairs
    per local expert are the same); counting the batch's pairs over the rank's experts instead (the negative
    control) would take the prefill tile at 512 tokens on 8 ranks of DeepSeek-V3's 256 experts."""
    from megamoe_runtime.backends.triton import block8, configs

    one = LayerSpec(ROW, 7168, 2048, 256, 8, _ACTS["swiglu"])
    cfg = configs.KernelConfig()
    for ep in (2, 8, 32):
        spec = LayerSpec(ROW, 7168, 2048, 256, 8, _ACTS["swiglu"], ep_rank=ep - 1, ep_size=ep)
        assert block8.tiles_for(spec, cfg, T) == block8.tiles_for(one, cfg, T), (T, ep)
    ep8 = LayerSpec(ROW, 7168, 2048, 256, 8, _ACTS["swiglu"], ep_rank=0, ep_size=8)
    batch_count = block8.default_config(T * 8, ep8.experts_per_rank)
    if T == 512:
        assert block8.tiles_for(ep8, cfg, T)[0] == block8.TILES["decode"] and batch_count == block8.TILES["prefill"]


def test_gluon_l2_applies_only_where_proven(monkeypatch):
    """The Gluon L2 is taken only when asked for (the prefill tile asks; ``MEGAMOE_BLOCK8_L2`` overrides any
    tile either way), on the GPU path, in the tile it was proven equal in: the prefill tile and CUDA tensors.
    Flag off, the CPU path, another tile or a non-contiguous weight keep block8's L2
    (``block8.gluon_l2_applies``)."""
    import dataclasses

    from megamoe_runtime.backends.triton import block8

    monkeypatch.delenv("MEGAMOE_BLOCK8_L2", raising=False)
    on = block8.TILES["prefill"]
    assert on.l2_gluon and not block8.TILES["decode"].l2_gluon
    off = dataclasses.replace(on, l2_gluon=False)
    act, w = torch.zeros(64, 256, dtype=torch.uint8), torch.zeros(2, 128, 256, dtype=torch.uint8)
    assert not block8.gluon_l2_applies(off, act, w, 256, 32, True)  # not asked for
    assert not block8.gluon_l2_applies(on, act, w, 256, 32, True)  # CPU tensors
    monkeypatch.setenv("MEGAMOE_BLOCK8_L2", "gluon")
    assert not block8.gluon_l2_applies(off, act, w, 256, 32, True)  # asked for by env, still CPU tensors
    if torch.cuda.is_available():
        a, b = act.cuda(), w.cuda()
        gl_ok = __import__("megamoe_runtime.backends.triton.block8_gluon", fromlist=["x"]).GLUON_ERROR is None
        assert block8.gluon_l2_applies(off, a, b, 256, 32, True) == gl_ok  # the env asks over the tile
        assert not block8.gluon_l2_applies(on, a, b, 256, 32, False)  # interpreter-style path
        assert not block8.gluon_l2_applies(block8.TILES["decode"], a, b, 256, 16, True)
        assert not block8.gluon_l2_applies(on, a, b.transpose(1, 2), 256, 32, True)
        assert not block8.gluon_l2_applies(on, a, b, 192, 32, True)  # I not a multiple of 128
        monkeypatch.setenv("MEGAMOE_BLOCK8_L2", "triton")
        assert not block8.gluon_l2_applies(on, a, b, 256, 32, True)  # refused by env over the tile
        monkeypatch.delenv("MEGAMOE_BLOCK8_L2")
        assert block8.gluon_l2_applies(on, a, b, 256, 32, True) == gl_ok  # the tile's own choice


def test_gluon_l2_failure_falls_back_to_block8_l2(monkeypatch):
    """A Gluon L2 that fails to build or launch (Gluon is experimental: another Triton may import it and still
    refuse the kernel) warns once and leaves block8's L2 (the same bytes) for the rest of the process, instead
    of failing the forward; without the failure the Gluon launch is taken (the control)."""
    from megamoe_runtime.backends.triton import block8, block8_gluon

    tries, block8_runs = [], []

    class _Kernel:  # stands in for block8's jit L2: records its launches
        def __getitem__(self, grid):
            return lambda *a, **k: block8_runs.append(grid)

    def gluon_launch(*a, **k):
        tries.append(1)
        if fail:
            raise RuntimeError("planted: PTX assembly failed")

    monkeypatch.setattr(block8, "_GLUON_LAUNCH_ERROR", None)
    monkeypatch.setattr(block8, "gluon_l2_applies", lambda *a: block8._GLUON_LAUNCH_ERROR is None)
    monkeypatch.setattr(block8_gluon, "launch_l2", gluon_launch)
    monkeypatch.setattr(block8, "_l2_kernel", _Kernel())
    from megamoe_runtime.backends.triton.staging import RoutingPlan

    plan = RoutingPlan(torch.zeros(64, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), 32, 2, 2)
    ws = torch.ones(2, 2, 1)
    args = (block8.TILES["prefill"], torch.zeros(64, 128, dtype=torch.uint8), torch.ones(2, 64),
            torch.zeros(2, 256, 128, dtype=torch.uint8), ws, plan,
            torch.zeros(4, 2, 256, dtype=torch.bfloat16), 256, 128, 2, 2, 32, True)
    fail = False
    block8.launch_l2(*args)
    assert (len(tries), len(block8_runs)) == (1, 0)
    fail = True
    with pytest.warns(RuntimeWarning, match="Gluon L2 unavailable in this process .*planted: PTX assembly failed"):
        block8.launch_l2(*args)
    assert (len(tries), len(block8_runs)) == (2, 1)
    block8.launch_l2(*args)  # no second try, no second warning
    assert (len(tries), len(block8_runs)) == (2, 2)


@pytest.mark.gpu
def test_gluon_l2_bytes_equal_block8_l2(monkeypatch):
    """The layer with the Gluon L2 gives block8's output bytes exactly (DeepSeek-V3's I, prefill tile), the
    Gluon kernel was really launched, and a doubled L2 block scale through it changes the output (the
    comparison can fail)."""
    _gpu()
    import dataclasses

    from megamoe_runtime.backends.triton import TritonBackend, block8, block8_gluon, configs

    if block8_gluon.GLUON_ERROR is not None:
        pytest.skip(f"no Gluon: {block8_gluon.GLUON_ERROR}")
    spec, lay, x, tw, ids = _case(512, "cuda", H=1024, I=2048, E=8, K=8, mask_frac=0.1)
    monkeypatch.delenv("MEGAMOE_BLOCK8_L2", raising=False)
    pre = block8.TILES["prefill"]
    base = TritonBackend(config=configs.KernelConfig(fp8=dataclasses.replace(pre, l2_gluon=False)))
    glu = TritonBackend(config=configs.KernelConfig(fp8=pre))
    launched = []
    real = block8_gluon.launch_l2
    monkeypatch.setattr(block8_gluon, "launch_l2", lambda *a, **k: (launched.append(1), real(*a, **k))[1])
    want = base.forward(lay, x, tw, ids)
    assert not launched
    got = glu.forward(lay, x, tw, ids)
    assert launched, "the Gluon L2 was not launched"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{int((got.view(torch.int16) != want.view(torch.int16)).sum())} of {got.numel()} outputs differ"
    bad = copy.copy(lay)
    bad.l2_scale = lay.l2_scale.clone()
    bad.l2_scale.view(-1)[0] *= 2.0
    assert not torch.equal(glu.forward(bad, x, tw, ids).view(torch.int16), want.view(torch.int16))
