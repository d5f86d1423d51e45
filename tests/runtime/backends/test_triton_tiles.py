"""Host-side tile and decode choices of the triton backend (``backends/triton/moe.py``): no GPU.

The kernels themselves are tested on the GPU (test_triton.py); these pin the rules that pick
their compile-time parameters, which the benchmarks in BENCHMARKS.md measured.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

from megamoe_runtime.backends.triton import configs, launch  # noqa: E402
from megamoe_runtime.errors import MegaMoEError  # noqa: E402

KINDS = {"mxfp4": configs.W_E2M1_MX, "nvfp4": configs.W_E2M1_NV, "mxfp8": configs.W_E4M3_MX}
E = 256


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for v in ("MEGAMOE_TRITON_L1GU", "MEGAMOE_TRITON_DECODE", "MEGAMOE_TRITON_SCALES", "MEGAMOE_TRITON_KORDER"):
        monkeypatch.delenv(v, raising=False)


@pytest.mark.parametrize("mean,regime", [(0.03, "decode"), (8, "decode"), (8.5, "mid"), (16, "mid"), (32, "mid"),
                                         (33, "prefill64"), (64, "prefill64"), (64.5, "prefill"),
                                         (128, "prefill")])
def test_frag_regime_boundaries(mean, regime):
    assert configs.frag_regime(mean) == regime
    # "few" is decode with at most FEW_PAIRS pairs in all; the other regimes ignore the count
    few = configs.frag_regime(mean, configs.FEW_PAIRS)
    assert few == ("few" if regime == "decode" else regime)
    assert configs.frag_regime(mean, configs.FEW_PAIRS + 1) == regime


@pytest.mark.parametrize("row", sorted(KINDS))
@pytest.mark.parametrize("tokens", [1, 8, 64, 300, 512, 1024, 2048, 4096])
def test_default_frag_config_follows_the_table(row, tokens):
    """Top-8 over 256 experts: what a forward without a config runs."""
    pairs = tokens * 8
    mean = pairs / E
    cfg = configs.default_config(pairs, E, "frag", w_kind=KINDS[row])
    t = configs.FRAG_TILES[(configs.frag_regime(mean, pairs), KINDS[row])]
    assert (cfg.l1_gu, cfg.l1_bn, cfg.l1_warps, cfg.l1_stages) == (t.l1_gu, t.l1_bn, t.l1_warps, t.l1_stages)
    assert cfg.decode == t.decode and configs.resolve_decode(cfg, KINDS[row])[0] == (t.decode == "fold")
    # each kernel runs the table's decode for it; the config names the L2's only where it differs
    assert configs.resolve_l2_fold(cfg, KINDS[row]) == (t.l2_decode == "fold")
    assert cfg.l2_decode == (None if t.l2_decode == t.decode else t.l2_decode)
    assert (cfg.l2_bn, cfg.l2_warps, cfg.l2_stages) == (t.l2_bn, t.l2_warps, t.l2_stages)
    assert cfg.k_order == "frag" and cfg.l1_bk == cfg.l2_bk == 128
    assert cfg.block_m == (t.block_m if t.block_m is not None else (64 if mean <= 64 else 128))
    # the row block holds the mean pairs of an expert from the mid regime on (decode: 16-row blocks)
    assert cfg.block_m >= min(mean, 128) or configs.frag_regime(mean) == "decode"
    assert (configs.frag_regime(mean, pairs) == "few") == (tokens == 1)
    assert cfg.pick_block_m(pairs, E) == cfg.block_m
    assert cfg.l1_maxnreg == t.l1_maxnreg and cfg.l2_maxnreg == t.l2_maxnreg
    # tails at prefill; at mid sizes only while an expert's pairs mostly fit in one tail
    assert cfg.tail_max == (t.tail_max if configs.frag_regime(mean).startswith("prefill") or mean <= t.tail_max
                            else 0)
    assert cfg.tail is None


def test_frag_tiles_cover_every_regime_and_kind_with_launchable_tiles():
    for regime in ("few", "decode", "mid", "prefill64", "prefill"):
        for kind in KINDS.values():
            bm, gu, l1_bn, l1_w, l1_st, l2_bn, l2_w, l2_st, decode, l2_decode, l1_reg, tail, l2_reg = \
                configs.FRAG_TILES[(regime, kind)]
            assert bm in (None, 16, 32, 64, 128) and decode in configs.DECODES and l2_decode in configs.DECODES
            # 4 CTAs of 4 warps at 128 registers, 3 at 168
            assert l1_reg is None or (l1_w == 4 and l1_reg in (96, 128, 168))
            assert l2_reg is None or (l2_w == 4 and l2_reg == 128)
            assert l1_w in (4, 8) and l2_w in (4, 8) and 2 <= l1_st <= 4 and 2 <= l2_st <= 4
            # a dot's rows are split over warpgroups of 64 rows: 8 warps need >= 128 rows
            l1_rows = 2 * l1_bn if gu else l1_bn
            assert l1_rows >= 64 * (l1_w // 4) and l2_bn >= 64 * (l2_w // 4), (regime, kind)
            # tails only where a row block is larger than the tail launches' (not at decode sizes)
            for b in ((bm,) if bm else (64, 128)):
                assert tail == 0 or (regime != "decode" and 0 < tail < b
                                     and configs.tail_config(kind, b).block_m < b), (regime, kind, tail)


@pytest.mark.parametrize("row", sorted(KINDS))
@pytest.mark.parametrize("bm,below", [(128, "mid"), (64, "mid"), (32, "decode")])
def test_tail_config_is_the_regime_below(row, bm, below):
    t = configs.tail_config(KINDS[row], bm)
    b = configs.TAIL_TILES.get((below, KINDS[row]), configs.FRAG_TILES[(below, KINDS[row])])
    assert (t.block_m, t.l1_bn, t.l1_warps, t.l1_stages, t.l2_bn, t.l2_warps, t.decode, t.l1_maxnreg) == \
        (b.block_m, b.l1_bn, b.l1_warps, b.l1_stages, b.l2_bn, b.l2_warps, b.decode, b.l1_maxnreg)
    assert t.tail_max == 0 and t.block_m < bm  # a tail launch never splits again
    for pairs in (8, 512, 4096, 32768):
        cfg = configs.default_config(pairs * 8, E, "frag", w_kind=KINDS[row])
        assert cfg.tail_max == configs.FRAG_TILES[(configs.frag_regime(pairs * 8 / E, pairs * 8), KINDS[row])].tail_max


def test_l1_gu_override_flips_only_that_field(monkeypatch):
    base = configs.default_config(64 * 8, E, "frag", w_kind=configs.W_E2M1_MX)
    for gu in (True, False):
        cfg = configs.default_config(64 * 8, E, "frag", l1_gu=gu, w_kind=configs.W_E2M1_MX)
        assert cfg == dataclasses.replace(base, l1_gu=gu)
    monkeypatch.setenv("MEGAMOE_TRITON_L1GU", "0")
    assert configs.default_config(64 * 8, E, "frag", w_kind=configs.W_E2M1_MX) == dataclasses.replace(base, l1_gu=False)
    assert configs.default_config(64 * 8, E, "frag", l1_gu=True, w_kind=configs.W_E2M1_MX).l1_gu is True


def test_unknown_weight_kind_gets_the_mxfp4_tiles():
    for pairs in (8, 4096, 32768):
        assert configs.default_config(pairs, E, "frag") == configs.default_config(pairs, E, "frag", w_kind=configs.W_E2M1_MX)


def test_non_frag_defaults_unchanged():
    """The split/natural paths and the shared expert (``default_config(T, 1)``) keep their tiles."""
    assert configs.default_config(8, E).block_m == 16
    assert configs.default_config(300, 1).block_m == 128 and configs.default_config(300, 1).l1_warps == 8


@pytest.mark.parametrize("row,fold", [("mxfp4", False), ("nvfp4", True), ("mxfp8", True)])
def test_default_decode_by_row(row, fold, monkeypatch):
    assert configs.resolve_decode(configs.KernelConfig(), KINDS[row]) == (fold, False)
    assert configs.resolve_decode(configs.KernelConfig(decode="plain"), KINDS[row]) == (False, False)
    monkeypatch.setenv("MEGAMOE_TRITON_DECODE", "fold")
    assert configs.resolve_decode(configs.KernelConfig(), KINDS[row]) == (True, False)
    assert configs.resolve_decode(configs.KernelConfig(decode="plain"), KINDS[row]) == (False, False)
    monkeypatch.setenv("MEGAMOE_TRITON_DECODE", "fast")
    with pytest.raises(MegaMoEError, match="decode 'fast'"):
        configs.resolve_decode(configs.KernelConfig(), KINDS[row])


def test_decode_env_overrides_the_table(monkeypatch):
    """The measured per-kernel decode (mxfp8 decode and mid sizes: plain L1, fold L2) gives way to
    ``MEGAMOE_TRITON_DECODE`` on both kernels; a config's own decode wins over all of it."""
    w = configs.W_E4M3_MX
    mid = configs.default_config(512 * 8, E, "frag", w_kind=w)
    dec = configs.default_config(8 * 8, E, "frag", w_kind=w)
    assert (mid.decode, mid.l2_decode, dec.decode, dec.l2_decode) == ("plain", "fold", "plain", "fold")
    assert (configs.resolve_decode(mid, w)[0], configs.resolve_l2_fold(mid, w)) == (False, True)
    for d in ("plain", "fold"):
        monkeypatch.setenv("MEGAMOE_TRITON_DECODE", d)
        forced = configs.default_config(512 * 8, E, "frag", w_kind=w)
        assert (forced.decode, forced.l2_decode) == (d, None)
        assert configs.resolve_decode(forced, w)[0] is configs.resolve_l2_fold(forced, w) is (d == "fold")
    assert (configs.resolve_decode(mid, w)[0], configs.resolve_l2_fold(mid, w)) == (False, True)  # built earlier: kept
    monkeypatch.setenv("MEGAMOE_TRITON_DECODE", "fast")
    with pytest.raises(MegaMoEError, match="decode 'fast'"):
        configs.resolve_decode(configs.default_config(8 * 8, E, "frag", w_kind=w), w)


def test_register_cap_reaches_the_compile_options(monkeypatch):
    monkeypatch.setattr(launch, "hw_cvt_default", lambda: True)
    assert launch.opts() == {"enable_fp_fusion": False}
    assert launch.opts(96) == {"enable_fp_fusion": False, "maxnreg": 96}
    monkeypatch.setattr(launch, "hw_cvt_default", lambda: False)  # the interpreter takes no compile options
    assert launch.opts(96) == {}


def test_l2_decode_overrides_only_the_l2(monkeypatch):
    cfg = configs.KernelConfig(decode="plain", l2_decode="fold")
    assert configs.resolve_decode(cfg, configs.W_E2M1_NV)[0] is False and configs.resolve_l2_fold(cfg, configs.W_E2M1_NV) is True
    for d in ("fold", "plain"):  # unset: the L1's, wherever that comes from
        monkeypatch.setenv("MEGAMOE_TRITON_DECODE", d)
        assert configs.resolve_l2_fold(configs.KernelConfig(), configs.W_E2M1_MX) is (d == "fold")
    with pytest.raises(MegaMoEError, match="l2_decode 'fast'"):
        configs.resolve_l2_fold(configs.KernelConfig(l2_decode="fast"), configs.W_E2M1_MX)


# --------------------------------------------------------------------------- the grid-fill rule (issue 28)

#: (H, I, E, K) of bench/kernel.py's shape set
SHAPES = {"dsv3": (7168, 2048, 256, 8), "kimi-k2": (7168, 2048, 384, 8), "qwen3-235b": (4096, 1536, 128, 8),
          "qwen3-30b": (2048, 768, 128, 8), "glm45": (5120, 1536, 160, 8), "mixtral": (4096, 14336, 8, 2),
          "dbrx": (6144, 10752, 16, 4)}


@pytest.fixture
def _h200(monkeypatch):
    monkeypatch.setattr(configs, "_SMS", {"n": 132})


@pytest.mark.parametrize("shape,tokens,l1,l2", [
    # the rule's choice at the points of the issue-28 sweep (nvfp4): (L1 rows, stages), (L2 columns, stages)
    ("dsv3", 1, (32, 4), (64, 3)), ("kimi-k2", 1, (32, 4), (64, 3)), ("qwen3-235b", 1, (32, 4), (64, 3)),
    ("qwen3-30b", 1, (32, 4), (64, 3)), ("glm45", 1, (32, 4), (64, 3)),
    ("mixtral", 1, (64, 3), (64, 4)),  # 2 experts x 224 CTAs: a 32-row grid fills the waves no better
    ("dbrx", 1, (32, 4), (64, 4)),
    ("kimi-k2", 8, (64, 3), (128, 3)), ("qwen3-235b", 8, (64, 3), (128, 3)), ("glm45", 8, (64, 3), (128, 3)),
    ("qwen3-30b", 8, (32, 4), (64, 3)),  # ~50 experts x 12 CTAs: 1.15 waves at 64 rows
    ("mixtral", 8, (64, 3), (64, 4)), ("dbrx", 8, (64, 3), (64, 4)),
    ("qwen3-30b", 64, (64, 3), (128, 3)), ("kimi-k2", 64, (64, 3), (128, 3)),
    ("mixtral", 64, (32, 3), (64, 4)), ("dbrx", 64, (32, 3), (128, 3)),  # mid: 32-row one-dot L1 (table)
    ("qwen3-30b", 512, (32, 3), (128, 3)), ("mixtral", 512, (64, 4), (128, 2)),  # mixtral 512: prefill
])
def test_shape_rule_choices(_h200, shape, tokens, l1, l2):
    H, I, E, K = SHAPES[shape]
    cfg = configs.default_config(tokens * K, E, "frag", w_kind=configs.W_E2M1_NV, H=H, I=I)
    assert (cfg.l1_bn, cfg.l1_stages) == l1 and (cfg.l2_bn, cfg.l2_stages) == l2
    # everything else is the regime's table entry
    table = configs.default_config(tokens * K, E, "frag", w_kind=configs.W_E2M1_NV)
    assert dataclasses.replace(cfg, l1_bn=table.l1_bn, l1_stages=table.l1_stages, l2_bn=table.l2_bn,
                               l2_stages=table.l2_stages, l2_split=1) == table
    # and the split-K rule on top: the few-large-expert L2 at decode / mid sizes (test_split_k_rule)
    assert cfg.l2_split == (4 if (shape, tokens) in {("mixtral", 1), ("mixtral", 8), ("mixtral", 64), ("dbrx", 1)}
                            else 1)


@pytest.mark.parametrize("row", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
def test_shape_rule_leaves_mx_rows_on_the_table(_h200, row, shape, tokens):
    """mxfp4's 32-row / 64-column tiles lost at every point of the sweep; mxfp8's decode tiles are 32 rows.
    Only the split-K rule may change an MX row's config (mxfp4 on Mixtral / DBRX, test_split_k_rule)."""
    H, I, E, K = SHAPES[shape]
    a = configs.default_config(tokens * K, E, "frag", w_kind=KINDS[row], H=H, I=I)
    assert dataclasses.replace(a, l2_split=1) == configs.default_config(tokens * K, E, "frag", w_kind=KINDS[row])
    assert a.l2_split == 1 or (row == "mxfp4" and shape in ("mixtral", "dbrx") and tokens <= 64)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_rule_only_at_streaming_sizes(_h200, shape):
    H, I, E, K = SHAPES[shape]
    for tokens in (4096, 8192):
        regime = configs.frag_regime(tokens * K / E)
        if regime.startswith("prefill"):
            a = configs.default_config(tokens * K, E, "frag", w_kind=configs.W_E2M1_NV)
            assert configs.shape_tiles(a, configs.W_E2M1_NV, regime, tokens * K, E, H, I) == a


@pytest.mark.parametrize("shape,row,tokens,short", [
    # (H, I, E, K): H = 2048 takes the two-CTA L1 at prefill (H100 sweep, 4096 tokens: 1.04-1.05x)
    ((2048, 768, 128, 8), "nvfp4", 4096, True), ((2048, 1408, 64, 6), "nvfp4", 4096, True),
    ((2048, 512, 512, 10), "nvfp4", 4096, True), ((2048, 768, 128, 8), "nvfp4", 2048, True),
    # longer K loops keep the 8-warp 128-row tile (0.98-1.01x there)
    ((5120, 1536, 160, 8), "nvfp4", 4096, False), ((4096, 1536, 128, 8), "nvfp4", 4096, False),
    ((7168, 2048, 256, 8), "nvfp4", 4096, False), ((4096, 14336, 8, 2), "nvfp4", 4096, False),
    # other rows, and the regimes below prefill, keep theirs
    ((2048, 768, 128, 8), "mxfp4", 4096, False), ((2048, 768, 128, 8), "mxfp8", 4096, False),
    ((2048, 1408, 64, 6), "nvfp4", 512, False), ((2048, 768, 128, 8), "nvfp4", 512, False),
])
def test_short_k_rule(_h200, shape, row, tokens, short):
    """``configs.short_k_tiles``: the nvfp4 prefill L1 at two CTAs per SM where H / 128 <= 16; the L2, row
    block, decode and tails stay the regime's."""
    H, I, E_, K = shape
    base = configs.default_config(tokens * K, E_, "frag", w_kind=KINDS[row])  # no shape: the table's tiles
    cfg = configs.default_config(tokens * K, E_, "frag", w_kind=KINDS[row], H=H, I=I)
    l1 = (cfg.l1_bn, cfg.l1_warps, cfg.l1_stages)
    assert l1 == ((32, 4, 3) if short else (base.l1_bn, base.l1_warps, base.l1_stages))
    if short:
        assert base.block_m == 128 and base.l1_bn == 64 and base.l1_warps == 8  # the tile it replaces
        assert dataclasses.replace(cfg, l1_bn=base.l1_bn, l1_warps=base.l1_warps, l1_stages=base.l1_stages) == base


def test_expected_touched_and_wave_efficiency():
    assert configs.expected_touched(0, 256) == 0
    assert abs(configs.expected_touched(8, 256) - 7.88) < 0.01  # one token, top-8 of 256
    assert configs.expected_touched(10 ** 6, 16) == pytest.approx(16)
    assert configs.wave_efficiency(528, 528) == 1.0 and configs.wave_efficiency(529, 528) == pytest.approx(529 / 1056)
    assert configs.wave_efficiency(0, 528) == 0.0


def test_shape_rule_follows_the_sm_count(monkeypatch):
    """Fewer SMs, fewer slots: a grid that underfills 132 SMs can fill 16."""
    H, I, E, K = SHAPES["kimi-k2"]
    monkeypatch.setattr(configs, "_SMS", {"n": 16})
    cfg = configs.default_config(1 * K, E, "frag", w_kind=configs.W_E2M1_NV, H=H, I=I)
    assert (cfg.l1_bn, cfg.l2_bn) == (64, 128)


@pytest.mark.parametrize("shape,tokens,row,split", [
    ((4096, 14336, 8, 2), 1, "mxfp4", 4), ((4096, 14336, 8, 2), 8, "nvfp4", 4), ((4096, 14336, 8, 2), 64, "mxfp4", 4),
    ((4096, 14336, 8, 2), 512, "mxfp4", 1),   # prefill: compute-bound, one pass
    ((4096, 14336, 8, 2), 64, "mxfp8", 1),    # not swept for E4M3 weights
    ((6144, 10752, 16, 4), 1, "mxfp4", 4), ((6144, 10752, 16, 4), 8, "nvfp4", 1),  # 14 experts: grid full
    ((7168, 2048, 256, 8), 1, "mxfp4", 1),    # a 16-step K loop: nothing to split
])
def test_split_k_rule(_h200, shape, tokens, row, split):
    """The split-K rule (``configs.split_k_tiles``) at the points it was measured on (H200, 132 SMs), and the
    launch takes the slices it asks for."""
    from megamoe_runtime.backends.triton import l2

    H, I, E_, K = shape
    cfg = configs.default_config(tokens * K, E_, "frag", w_kind=KINDS[row], H=H, I=I)
    assert cfg.l2_split == split and l2.l2_split(cfg, I) == split


def test_local_pairs():
    assert configs.local_pairs(512, 32, 256) == 64  # EP 8 of DeepSeek-V3: an eighth of the pairs is local
    assert configs.local_pairs(8, 32, 256) == 1  # at least one
    assert configs.local_pairs(512, 256, 256) == 512 and configs.local_pairs(512, 256) == 512  # no EP
    assert configs.local_pairs(0, 32, 256) == 0


@pytest.mark.parametrize("row", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("shape,tokens,ep", [("dsv3", 64, 8), ("kimi-k2", 8, 8), ("qwen3-235b", 64, 4),
                                             ("mixtral", 8, 2), ("dbrx", 64, 4)])
def test_tile_rule_under_ep_works_from_the_local_pairs(_h200, row, shape, tokens, ep):
    """An EP rank sees every token's top-k ids but holds E / ep experts: the rule picks the tiles of the pairs
    expected on the rank, as a single rank with that many pairs would; without ``num_experts`` (the negative
    control) the whole batch's pairs read as ep times the pairs per local expert."""
    H, I, E, K = SHAPES[shape]
    E_l = E // ep
    kw = dict(w_kind=KINDS[row], H=H, I=I)
    ep_cfg = configs.default_config(tokens * K, E_l, "frag", num_experts=E, **kw)
    assert ep_cfg == configs.default_config(configs.local_pairs(tokens * K, E_l, E), E_l, "frag", **kw)
    assert configs.default_config(tokens * K, E, "frag", num_experts=E, **kw) == \
        configs.default_config(tokens * K, E, "frag", **kw)  # one rank: unchanged


@pytest.mark.parametrize("row", ["mxfp4", "fp8_block"])
def test_ep_pair_compute_is_a_one_rank_problem(row):
    """megamoe's own EP path hands a rank only the pairs it owns (``TritonBackend.pairs``, one slot per row):
    as a one-rank problem over its E_l experts (local ids) the tile rule counts all N of them, the tiles one
    rank with N pairs gets; with the EP spec (the negative control) it would expect N / ep_size."""
    import torch

    from megamoe_runtime.backends.triton import block8
    from megamoe_runtime.backends.triton.backend import local_pair_problem
    from megamoe_runtime.format.formats import ActivationSpec, LayerSpec

    spec = LayerSpec(row, 7168, 2048, 256, 8, ActivationSpec(), ep_rank=3, ep_size=8)
    N = 2048
    ids = torch.arange(3 * 32, 4 * 32).repeat(N // 32)
    one, local = local_pair_problem(spec, ids)
    assert (one.num_experts, one.experts_per_rank, one.top_k, one.ep_size, one.shared) == (32, 32, 1, 1, None)
    assert int(local.min()) == 0 and int(local.max()) == 31 and one.ep_rank * one.experts_per_rank == 0
    assert configs.local_pairs(N, one.experts_per_rank, one.num_experts) == N
    assert configs.local_pairs(N, spec.experts_per_rank, spec.num_experts) == N // 8  # the EP spec's reading
    cfg = configs.KernelConfig()
    single = LayerSpec(row, 7168, 2048, 32, 1, ActivationSpec())
    assert block8.tiles_for(one, cfg, N) == block8.tiles_for(single, cfg, N)
    assert block8.tiles_for(one, cfg, N)[0] == block8.TILES["prefill"]  # 64 pairs per expert
    assert block8.tiles_for(dataclasses.replace(spec, top_k=1), cfg, N)[0] == block8.TILES["decode"]


def test_tile_rule_under_ep_changes_the_regime(_h200):
    """DeepSeek-V3 at 64 tokens on EP 8: 2 pairs per local expert (decode), not 16 (mid)."""
    H, I, E, K = SHAPES["dsv3"]
    naive = configs.default_config(64 * K, E // 8, "frag", w_kind=configs.W_E2M1_NV, H=H, I=I)
    ep_cfg = configs.default_config(64 * K, E // 8, "frag", w_kind=configs.W_E2M1_NV, H=H, I=I, num_experts=E)
    assert configs.frag_regime(64 * K / (E // 8)) == "mid" and ep_cfg != naive
    assert ep_cfg == configs.default_config(64, E // 8, "frag", w_kind=configs.W_E2M1_NV, H=H, I=I)
