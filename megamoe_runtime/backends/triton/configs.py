"""Tile configs and regimes of the triton forward: what each launch is compiled with.

`KernelConfig` (block sizes, warps, stages, K order, decodes, tails), the regime of a batch
(`frag_regime`: few / decode / mid / prefill64 / prefill by pairs per expert), the measured
tile table per regime and weight kind (`FRAG_TILES`, `TAIL_TILES`, BENCHMARKS.md), the grid-fill
rule (`shape_tiles`), and the environment overrides (`resolve_*`). Host side only: no kernel
here, no import of the other modules of this package.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from megamoe_runtime.format.formats import ROWS

# weight kinds
W_E2M1_MX = 0
W_E4M3_MX = 1
W_E2M1_NV = 2
W_BF16 = 3
W_E4M3_B128 = 4  # E4M3 with fp32 128x128 block scales (the block-FP8 row, ``block8``)
# requant kinds of the L1 epilogue
REQ_MX8 = 0
REQ_NV4 = 1
REQ_BF16 = 2


# --------------------------------------------------------------------------- host side


@dataclass
class KernelConfig:
    """Tile choices. ``block_m`` None picks by the mean pairs per expert."""

    block_m: Optional[int] = None
    l1_bn: int = 64
    l1_bk: int = 128
    l1_warps: int = 4
    l1_stages: int = 3
    l2_bn: int = 64
    l2_bk: int = 128
    l2_warps: int = 4
    l2_stages: int = 3
    #: frag path: the routed L2 in this many K slices (fp32 partials, added in order by one reduce launch;
    #: docs/KERNELS.md "Split-K L2"); 1 = one pass over K. Taken only where it cuts I into whole 128-blocks.
    l2_split: int = 1
    #: frag path: K blocks (128 wide) per trip of the one-dot L1's and the L2's K loop, 1 or 2; 2 only where
    #: the loop's K is a multiple of 256 (else 1). The same dots in the same order (bitwise the same output)
    #: with the loop's fixed cost per trip (stage counters, predicates, fences) paid once per two blocks;
    #: the mxfp8 L1 also issues both blocks' scale loads before the first block's wgmmas. Off: compiled
    #: for sm_90 (fewer instructions per weight byte), not timed (docs/bench-log/kernels.md, "CPU: SASS audit
    #: of the decode-size frag kernels").
    k_unroll: int = 1
    combine_bh: int = 1024
    #: GEMM path of the MX rows: "fp8" (E4M3 wgmma, ``mma8``), "bf16" (decode to bf16) or
    #: None = env ``MEGAMOE_TRITON_MMA`` (default "auto" = bf16, the exact path). Other rows: bf16.
    mma: Optional[str] = None
    #: tiles of the fp8 path (None: ``mma8.default_fp8_config``)
    fp8: Any = None
    #: K order of the E2M1 and E4M3 rows' bf16 GEMMs: "frag" (16/32-byte weight runs per
    #: thread, the operand built in registers by shifts and masks, docs/KERNELS.md "The frag
    #: K order"), "split" (E2M1: even/odd nibble halves; E4M3: natural order; the issue-5
    #: paths) or None = env ``MEGAMOE_TRITON_KORDER`` (default ``DEFAULT_K_ORDER``).
    #: frag needs H and I multiples of 128 (else the old order is used).
    k_order: Optional[str] = None
    #: weight decode of the frag paths: "fold" (the decode's bias multiply folded into the scale
    #: operand: one bf16x2 multiply per operand register instead of two, bitwise the same
    #: output; docs/KERNELS.md "The frag K order"), "plain", or None = env
    #: ``MEGAMOE_TRITON_DECODE``, else by row (``resolve_decode``); ``default_config`` sets it
    #: per regime and row from ``FRAG_TILES``. Needs the inline-asm decode.
    decode: Optional[str] = None
    #: the L2 kernel's decode where it differs from ``decode`` (the two kernels are separate
    #: launches, so each can take the one measured faster for it); None: ``decode``
    l2_decode: Optional[str] = None
    #: how the frag paths read the weight scales: "words" (one int32 per row and 128-wide K
    #: block, a 4-byte load that is software-pipelined), "bytes" (per-group byte loads), "ahead"
    #: (the byte loads of the next K step issued one step early, mxfp8's one-dot L1 and L2;
    #: docs/KERNELS.md "Scale bytes one K step ahead"), or None = env ``MEGAMOE_TRITON_SCALES``
    #: (default ``DEFAULT_SCALE_LOAD``).
    scale_load: Optional[str] = None
    #: frag L1 as one dot over the tile's 2*BN gate/up kernel rows (``_l1_kernel`` GU) instead
    #: of a gate dot and an up dot; None = env ``MEGAMOE_TRITON_L1GU`` ("1"/"0"), else off
    #: (``default_config`` sets it where it was measured faster, with its tiles).
    l1_gu: Optional[bool] = None
    #: register cap per thread of the L1 / L2 kernel (ptxas ``.maxnreg``; None: the compiler's
    #: choice). Occupancy is set by registers: 8-warp tiles at 132 registers fit one CTA per
    #: SM, at 128 two.
    l1_maxnreg: Optional[int] = None
    l2_maxnreg: Optional[int] = None
    #: frag path: an expert whose last row block holds 1..``tail_max`` pairs has that block
    #: computed by a second L1/L2 launch of small row blocks (``staging.split_tails``;
    #: docs/KERNELS.md "Tail blocks"); 0: off. ``default_config`` sets it at prefill.
    tail_max: int = 0
    #: the tiles of those launches (their ``block_m`` is the tail row block); None: the frag
    #: tiles of the regime below (``tail_config``)
    tail: Optional["KernelConfig"] = None

    def pick_block_m(self, n_pairs: int, num_local: int) -> int:
        if self.block_m is not None:
            return self.block_m
        mean = n_pairs / max(1, num_local)
        for bm in (16, 32, 64):
            if mean <= bm:
                return bm
        return 128


def k_unroll(cfg: "KernelConfig", K: int) -> int:
    """K blocks per trip of a frag K loop over ``K``: ``cfg.k_unroll`` where it divides K into whole
    128-blocks per trip, else 1 (a loop with a remainder block would need a second, unrolled-once copy)."""
    ku = cfg.k_unroll
    if ku not in (1, 2):
        raise ValueError(f"KernelConfig.k_unroll must be 1 or 2, got {ku}")
    return ku if K % (128 * ku) == 0 else 1


def resolve_l1_gu(cfg: Optional["KernelConfig"] = None) -> bool:
    """Whether the frag L1 runs as one gate/up dot: ``KernelConfig.l1_gu`` (``default_config``
    sets it per regime and row), else env ``MEGAMOE_TRITON_L1GU`` ("1"/"0"), else off."""
    from megamoe_runtime import knobs

    if cfg is not None and cfg.l1_gu is not None:
        return bool(cfg.l1_gu)
    v = knobs.get("MEGAMOE_TRITON_L1GU")
    return False if v is None else v not in ("0", "false", "no", "")


#: at most this many (token, expert) pairs is the "few" regime: a token or two, so at most this
#: many experts and too few L1 tiles to give every SM its CTAs with the decode tiles
FEW_PAIRS = 16


def frag_regime(mean_pairs: float, n_pairs: Optional[int] = None) -> str:
    """Regime of the frag tiles by mean (token, expert) pairs per local expert: "decode"
    (<= 8: weight streaming, row blocks mostly padding; "few" when there are at most
    ``FEW_PAIRS`` pairs in all), "mid" (<= 32), "prefill64" (<= 64: an expert's mean fits one
    64-pair row block), "prefill" (128-pair blocks)."""
    if mean_pairs <= 32:
        if mean_pairs > 8:
            return "mid"
        return "few" if n_pairs is not None and n_pairs <= FEW_PAIRS else "decode"
    return "prefill64" if mean_pairs <= 64 else "prefill"


class FragTiles(NamedTuple):
    """One ``FRAG_TILES`` entry: the L1 and L2 tiles of the frag path for a regime and weight kind."""

    #: pairs per row block (None: 64 up to 64 pairs per expert, else 128)
    block_m: Optional[int]
    #: the L1 as one gate/up dot (``KernelConfig.l1_gu``)
    l1_gu: bool
    l1_bn: int
    l1_warps: int
    l1_stages: int
    l2_bn: int
    l2_warps: int
    l2_stages: int
    #: weight decode of the L1 and of the L2 ("plain" / "fold"; each kernel takes its faster one)
    decode: str
    l2_decode: str
    #: L1 register cap (None: the compiler's; 128 lets four 4-warp L1 CTAs share an SM)
    l1_maxnreg: Optional[int]
    #: ``KernelConfig.tail_max`` (0: no tail launches)
    tail_max: int = 0
    #: L2 register cap (None: the compiler's)
    l2_maxnreg: Optional[int] = None


#: Frag-path tiles per (regime, weight kind): the fastest L1 and the fastest L2 of
#: ``bench/sweep.py`` on the H200, which times the two kernels apart (docs/bench-log/kernels.md),
#: each with its faster weight decode (plain / fold: fold issues fewer instructions but is slower
#: where the tile is latency bound). On tiled
#: weights: the 128-register cap made the decode-size L1 3-8% faster, and fold overtook plain
#: for mxfp4 there: less waiting on memory left the instruction count to matter. nvfp4 prefill:
#: 64-pair row blocks (two CTAs per SM; 128-pair blocks fit one). With fold flags
#: (no scan after the loop): fold for the mxfp4 mid-size L1/L2 (6% whole layer at 512 tokens)
#: and the nvfp4 prefill L1 (5% L1); mxfp8 prefill in 4-warp, 2-stage tiles (two CTAs per SM:
#: L1 8.67 -> 7.66 ms, L2 3.97 -> 3.77 ms at 4096 tokens) and a one-dot plain L1 at mid sizes.
#: Tail launches (the last field, ``KernelConfig.tail_max``): whole layer at 4096
#: tokens mxfp4 8533 -> 7530 us, nvfp4 9701 -> 9331, mxfp8 11617 -> 10235; 512 tokens (16 per
#: expert) mxfp4 2695 -> 2571, nvfp4 2892 -> 2765. With tails the 128-pair nvfp4 prefill tiles
#: (8 warps, one CTA per SM) overtake the 64-pair ones: 9196 -> 8380 us at 4096 tokens; with 33-64
#: pairs per expert ("prefill64") the 64-pair tiles stay (2048 tokens: 5428 us against 6208).
#: "few" (one or two tokens): 32 kernel rows per L1 tile for nvfp4 and mxfp8, twice the CTAs for
#: the few experts touched (1 token: nvfp4 112.9 -> 103.6 us, mxfp8 169.6 -> 158.8; mxfp4 keeps 64).
#: mxfp8 decode: 32-row, 3-stage L1 tiles (8 tokens 818.8 -> 762.0 us, 64 tokens 3134.5 -> 3024.5;
#: the fp4 rows' 64-row tiles stay fastest there).
#: Decode sizes, 8 and 64 tokens of DeepSeek-V3 and Qwen3-30B on the H200 (BENCHMARKS.md "Decode at the
#: bandwidth limit"): a 4-stage mxfp4 L1 (42.5 KB of shared memory, still four CTAs per SM) was as fast or
#: faster at every point (302.9 / 52.6 / 1105.9 / 99.8 -> 302.7 / 48.8 / 1095.6 / 95.8 us; 2 stages lost
#: 5-17%), and the fold decode for the mxfp8 L2 1.0-1.2% faster at every point (251.3 / 37.6 / 960.5 / 78.3
#: -> 248.7 / 37.2 / 948.7 / 77.4 us).
#: Register caps that keep CTAs per SM where the tiled bit order's decode (docs/KERNELS.md, "The tiled bit
#: order") moved a kernel across an allocation step: the fp4 decode-size L2 at 128 (130 uncapped: three CTAs
#: instead of four) and the mid-size mxfp4 L1 at 168 (170, allocated as 176: two instead of three).
#: nvfp4 prefill64 L2: 4-warp 128-column tiles over the 8-warp 256-column ones (an H100 sweep in
#: docs/bench-log/kernels.md: L2 101.1 -> 84.2 us on DeepSeek-V2-Lite at 512 tokens; whole layer 1.04x there,
#: 1.03x on DeepSeek-V3 at 2048 tokens, 1.07x on Qwen3-235B at 1024).
FRAG_TILES = {
    ("few", W_E4M3_MX): FragTiles(16, True, 32, 4, 4, 64, 4, 3, "plain", "plain", 128),
    ("decode", W_E2M1_MX): FragTiles(16, True, 64, 4, 4, 128, 4, 3, "fold", "fold", 128, l2_maxnreg=128),
    ("decode", W_E2M1_NV): FragTiles(16, True, 64, 4, 3, 128, 4, 3, "fold", "fold", 128, l2_maxnreg=128),
    ("decode", W_E4M3_MX): FragTiles(16, True, 32, 4, 3, 64, 4, 3, "plain", "fold", 128),
    ("mid", W_E2M1_MX): FragTiles(32, True, 64, 4, 3, 128, 4, 3, "fold", "fold", 168, 16),
    ("mid", W_E2M1_NV): FragTiles(32, True, 32, 4, 3, 128, 4, 3, "fold", "fold", None, 16),
    ("mid", W_E4M3_MX): FragTiles(32, True, 64, 4, 3, 128, 4, 3, "plain", "fold", None, 16),
    ("prefill64", W_E2M1_MX): FragTiles(64, True, 64, 4, 3, 128, 4, 3, "plain", "plain", None, 32),
    ("prefill64", W_E2M1_NV): FragTiles(64, True, 64, 4, 4, 128, 4, 3, "fold", "plain", None, 32),
    ("prefill64", W_E4M3_MX): FragTiles(64, True, 64, 4, 2, 128, 4, 2, "plain", "fold", None, 32),
    ("prefill", W_E2M1_MX): FragTiles(128, True, 64, 4, 3, 128, 4, 3, "plain", "plain", None, 32),
    ("prefill", W_E2M1_NV): FragTiles(128, True, 64, 8, 4, 128, 4, 2, "fold", "fold", None, 32),
    ("prefill", W_E4M3_MX): FragTiles(128, True, 64, 4, 2, 128, 4, 2, "plain", "fold", None, 32),
}
#: mxfp4 keeps its decode tiles for one or two tokens (the 32-row tiles lose there; the 3-stage L1 the
#: decode entry had when the few regime was measured: 4 stages were not timed at one or two tokens); nvfp4 starts from
#: its decode tiles there too, and the grid-fill rule (``shape_tiles``) picks 32-row L1 / 64-column L2
#: tiles from the shape (the "few" entry it replaces was the rule's choice at one token of
#: DeepSeek-V3, and lost 5-13% on the few large experts of Mixtral / DBRX)
FRAG_TILES[("few", W_E2M1_MX)] = FRAG_TILES[("decode", W_E2M1_MX)]._replace(l1_stages=3)
FRAG_TILES[("few", W_E2M1_NV)] = FRAG_TILES[("decode", W_E2M1_NV)]
#: the tail launches' tiles (``tail_config``) where they differ from the regime-below entry: the
#: nvfp4 mid-size L1 went to 32-row one-dot tiles (a sweep, docs/bench-log/kernels.md); its tails keep the tiles they
#: were measured with (two 128-row dots)
TAIL_TILES = {("mid", W_E2M1_NV): FragTiles(32, False, 128, 4, 3, 128, 4, 3, "fold", "fold", None, 16)}

#: CTAs per SM that the grid-fill rule counts as resident (the decode-size tiles are 4 warps; the
#: L1 under a 128-register cap fits four per SM)
FILL_CTAS_PER_SM = 4
#: SMs when no CUDA device can be asked (an H200 / H100 SXM has 132)
_DEFAULT_SMS = 132
_SMS: dict = {}


def sm_count() -> int:
    """SMs of the current CUDA device (cached), else ``_DEFAULT_SMS``."""
    if "n" not in _SMS:
        n = _DEFAULT_SMS
        try:
            if torch.cuda.is_available():
                n = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
        except Exception:
            pass
        _SMS["n"] = n
    return _SMS["n"]


def expected_touched(n_pairs: int, num_local: int) -> float:
    """Experts expected to get at least one of ``n_pairs`` pairs spread uniformly over ``num_local``
    (Poisson: E (1 - exp(-pairs / E))). The host never sees the routing (no sync), so the tile rule
    sizes the grid from this; skewed routing touches fewer experts, which only makes small tiles
    more worth it."""
    import math

    E = max(1, num_local)
    return E * (1.0 - math.exp(-n_pairs / E))


def local_pairs(n_pairs: int, num_local: int, num_experts: Optional[int] = None) -> int:
    """The (token, expert) pairs expected to land on this rank's ``num_local`` experts when ``n_pairs`` are
    routed over all ``num_experts`` (expert parallelism: each rank sees every token's top-k ids, and the
    other ranks' pairs contribute nothing here). Uniform routing, as `expected_touched` assumes:
    ``n_pairs * num_local / num_experts``, at least 1; ``n_pairs`` itself when the rank holds every expert
    (``num_experts`` None or not above ``num_local``). The tile rule sizes tiles and grids from this:
    the whole batch's pair count would read as ``num_experts / num_local`` times the pairs per local expert
    and pick prefill tiles for a decode batch."""
    if not num_experts or num_experts <= num_local or n_pairs <= 0:
        return n_pairs
    return max(1, round(n_pairs * num_local / num_experts))


def wave_efficiency(ctas: float, slots: int) -> float:
    """Fraction of the resident-CTA slots that ``ctas`` CTAs keep busy over their waves."""
    import math

    if ctas <= 0:
        return 0.0
    return ctas / (math.ceil(ctas / slots) * slots)


def _expected_blocks(n_pairs: int, num_local: int, block_m: int) -> float:
    """Row blocks a batch is expected to route into: at least one per expert touched, at least the pairs
    over the row block (the grid rules size the launches from this; the host never sees the routing)."""
    import math

    return max(expected_touched(n_pairs, num_local), math.ceil(n_pairs / block_m))


def shape_tiles(cfg: "KernelConfig", kind: int, regime: str, n_pairs: int, num_local: int, H: int, I: int,
                sms: Optional[int] = None) -> "KernelConfig":
    """The grid-fill part of the tile rule (docs/KERNELS.md "Tile rule"): at decode and mid sizes the
    kernels stream weights, and a grid of too few CTAs leaves SMs without loads in flight. From the
    shape and the pairs per expert: row blocks ~ max(experts touched, pairs / block_m); with
    ``slots = FILL_CTAS_PER_SM * SMs``:

    * L1 (decode sizes): 64-row tiles give ``blocks * I / 64`` CTAs. Under two waves, and when halving
      the tile raises the wave efficiency by more than 5%, take 32-row tiles (4 stages).
    * L2: 128-column tiles give ``blocks * H / 128`` CTAs. While that is under two waves of 16-row
      blocks' worth of rows (``ctas * block_m < 32 * slots``), take 64-column tiles, with 4 stages when
      the K loop is long (I / 128 >= 64: a few large experts).

    Measured for nvfp4 weights (docs/bench-log/kernels.md); mxfp4's 32-row / 64-column tiles lost at every point
    of the set (18-44% L1, 8-39% L2), and mxfp8's decode tiles are 32 rows already, so both keep the
    table's."""
    if kind != W_E2M1_NV or regime not in ("few", "decode", "mid") or not H or not I:
        return cfg
    sms = sms or sm_count()
    slots = FILL_CTAS_PER_SM * sms
    bm = cfg.block_m or 16
    blocks = _expected_blocks(n_pairs, num_local, bm)
    if regime in ("few", "decode") and cfg.l1_bn == 64:
        n64 = blocks * (I // 64)
        if n64 < 2 * slots and wave_efficiency(2 * n64, slots) > 1.05 * wave_efficiency(n64, slots):
            cfg = dataclasses.replace(cfg, l1_bn=32, l1_stages=4)
    if cfg.l2_bn == 128 and blocks * (H // 128) * bm < 32 * slots:
        cfg = dataclasses.replace(cfg, l2_bn=64, l2_stages=4 if I // 128 >= 64 else cfg.l2_stages)
    return cfg


#: the split-K rule's slices, and the K loop (128-blocks of I) it needs before it splits
_SPLIT_K_SLICES = 4
_SPLIT_K_MIN_STEPS = 64


def split_k_tiles(cfg: "KernelConfig", kind: int, regime: str, n_pairs: int, num_local: int, H: int, I: int,
                  sms: Optional[int] = None) -> "KernelConfig":
    """The split-K part of the tile rule (docs/KERNELS.md "Split-K L2"): a few large experts (I / 128 >=
    64: Mixtral, DBRX) at decode and mid sizes give the L2 too few tiles, each with a long K loop. When
    the L2 would run under two CTAs per SM with 128-column tiles (``blocks * H / 128 < 2 * SMs``, row
    blocks as in ``shape_tiles``), split its K into ``_SPLIT_K_SLICES`` slices. Measured on the H200 for
    the E2M1 rows (docs/bench-log/kernels.md: Mixtral 1 / 8 / 64 tokens 1.35 / 1.04 / 1.18x mxfp4, 1.11 / 1.04 /
    1.09x nvfp4; DBRX one token 1.14x mxfp4); mxfp8 was not swept and keeps one pass."""
    steps = I // 128 if I else 0
    if kind not in (W_E2M1_MX, W_E2M1_NV) or regime not in ("few", "decode", "mid") or not H \
            or steps < _SPLIT_K_MIN_STEPS or steps % _SPLIT_K_SLICES:
        return cfg
    if _expected_blocks(n_pairs, num_local, cfg.block_m or 16) * (H // 128) < 2 * (sms or sm_count()):
        cfg = dataclasses.replace(cfg, l2_split=_SPLIT_K_SLICES)
    return cfg


#: K steps (128-blocks of H) up to which the nvfp4 prefill L1 takes two-CTA tiles (``short_k_tiles``)
_SHORT_K_STEPS = 16


def short_k_tiles(cfg: "KernelConfig", kind: int, regime: str, H: Optional[int]) -> "KernelConfig":
    """The short-K part of the tile rule (docs/KERNELS.md "Tile rule"): the nvfp4 prefill L1's 8-warp
    128-row tile holds one CTA per SM (158.7 KB of shared memory), so nothing runs on the SM while a tile
    requantizes its output after the K loop. With a short K loop (``H / 128 <= 16``) that epilogue is a large
    share of each tile, and 64-row 4-warp tiles, two CTAs per SM (107.5 KB each), let one CTA's epilogue run
    beside the other's loop. Measured at 4096 tokens on the H100 (docs/bench-log/kernels.md): whole layer
    1.04-1.05x at H = 2048 (Qwen3-30B, Qwen3-Next, DeepSeek-V2-Lite), 0.98-1.01x from H = 4096 on."""
    if kind != W_E2M1_NV or regime != "prefill" or not H or H // 128 > _SHORT_K_STEPS:
        return cfg
    return dataclasses.replace(cfg, l1_bn=32, l1_warps=4, l1_stages=3)


def default_config(n_pairs: int, num_local: int, k_order: Optional[str] = None,
                   l1_gu: Optional[bool] = None, w_kind: Optional[int] = None,
                   H: Optional[int] = None, I: Optional[int] = None,
                   num_experts: Optional[int] = None) -> KernelConfig:
    """Tiles by regime: decode (few pairs per expert) streams weights with small
    row blocks; prefill uses 128-pair blocks so each weight tile feeds a full MMA.

    ``k_order`` "frag" (the MX/NV rows' default): ``FRAG_TILES`` by regime and weight kind
    ``w_kind`` (None: the mxfp4 tiles), then, given the shape (``H``, ``I``), the grid-fill rule
    ``shape_tiles``, the split-K rule ``split_k_tiles`` and the short-K rule ``short_k_tiles``
    (docs/KERNELS.md "Tile rule"). ``l1_gu`` None: env ``MEGAMOE_TRITON_L1GU``, else the
    table's; True / False flips only that field (benchmarks compare the two L1 forms). The
    decode is the table's unless env ``MEGAMOE_TRITON_DECODE`` names one. ``num_experts``: the layer's
    experts over all EP ranks when ``n_pairs`` counts the whole batch's pairs and this rank holds
    ``num_local`` of them; the rule then works from the pairs expected on this rank (`local_pairs`)."""
    from megamoe_runtime import knobs

    n_pairs = local_pairs(n_pairs, num_local, num_experts)
    mean = n_pairs / max(1, num_local)
    if k_order == "frag":
        kind = w_kind if w_kind in (W_E4M3_MX, W_E2M1_NV) else W_E2M1_MX
        regime = frag_regime(mean, n_pairs)
        t = FRAG_TILES[(regime, kind)]
        env = knobs.get("MEGAMOE_TRITON_L1GU")
        if l1_gu is None and env is not None:
            l1_gu = env not in ("0", "false", "no", "")
        bm = t.block_m if t.block_m is not None else (64 if mean <= 64 else 128)
        cfg = _frag_config(t, bm, l1_gu)
        cfg = shape_tiles(cfg, kind, regime, n_pairs, num_local, H, I)
        cfg = split_k_tiles(cfg, kind, regime, n_pairs, num_local, H, I)
        cfg = short_k_tiles(cfg, kind, regime, H)
        # at prefill a tail is the short remainder of a compute-bound expert: always worth its own
        # launch; at mid sizes only while most experts fit in one (mean <= tail_max): there the
        # kernels are bound by the weight bytes, and a remainder in a second launch reads its
        # expert's weights again (docs/bench-log/kernels.md: 512 tokens 1.06 -> 1.11x,
        # 1024 tokens 0.98x either way, nvfp4 0.92 -> 0.87x)
        if t.tail_max and frag_regime(mean) in ("decode", "mid") and mean > t.tail_max:
            cfg = dataclasses.replace(cfg, tail_max=0)
        return cfg
    if mean <= 8:
        return KernelConfig(block_m=16, l1_bn=64, l1_bk=128, l1_warps=4, l1_stages=4,
                            l2_bn=64, l2_bk=128, l2_warps=4, l2_stages=4)
    if mean <= 32:
        return KernelConfig(block_m=16 if mean <= 16 else 32, l1_bn=128, l1_bk=128, l1_warps=4, l1_stages=3,
                            l2_bn=128, l2_bk=128, l2_warps=4, l2_stages=3)
    return KernelConfig(block_m=64 if mean <= 64 else 128, l1_bn=64, l1_bk=128, l1_warps=8, l1_stages=3,
                        l2_bn=128, l2_bk=128, l2_warps=8, l2_stages=3)


def _frag_config(t: FragTiles, bm: int, l1_gu: Optional[bool] = None) -> KernelConfig:
    from megamoe_runtime import knobs

    # the environment's decode, when set, is forced on both kernels
    env_decode = knobs.get("MEGAMOE_TRITON_DECODE")
    decode = env_decode or t.decode
    l2_decode = None if env_decode or t.l2_decode == decode else t.l2_decode
    return KernelConfig(block_m=bm, l1_bn=t.l1_bn, l1_bk=128, l1_warps=t.l1_warps, l1_stages=t.l1_stages,
                        l2_bn=t.l2_bn, l2_bk=128, l2_warps=t.l2_warps, l2_stages=t.l2_stages, k_order="frag",
                        l1_gu=t.l1_gu if l1_gu is None else bool(l1_gu),
                        decode=decode, l2_decode=l2_decode, l1_maxnreg=t.l1_maxnreg, l2_maxnreg=t.l2_maxnreg,
                        tail_max=t.tail_max)


def tail_config(w_kind: Optional[int], block_m: int) -> KernelConfig:
    """Tiles of the tail launches (``KernelConfig.tail``) when a config names none: the frag
    tiles of the regime below the one whose row blocks are ``block_m`` pairs (mid-size tiles,
    32-pair blocks, under 64- and 128-pair blocks; decode tiles, 16-pair blocks, under 32), sized
    for the few pairs a tail holds. Their ``tail_max`` is 0: a tail launch never splits again."""
    kind = w_kind if w_kind in (W_E4M3_MX, W_E2M1_NV) else W_E2M1_MX
    reg = "mid" if block_m > 32 else "decode"
    t = TAIL_TILES.get((reg, kind), FRAG_TILES[(reg, kind)])
    return dataclasses.replace(_frag_config(t, t.block_m), tail_max=0)


def candidate_configs(n_pairs: int, num_local: int, k_order: Optional[str] = None) -> list[KernelConfig]:
    """What ``bench/kernel.py --tune`` tries around the default."""
    d = default_config(n_pairs, num_local, k_order)
    bm = d.block_m
    if d.l1_gu:  # one-dot L1: (l1 bn, l1 warps, l2 bn, l2 warps)
        r = [(64, 4, 64, 4), (128, 8, 128, 4), (64, 8, 64, 4)] if bm <= 32 else \
            [(64, 8, 64, 4), (64, 4, 64, 4), (32, 4, 128, 8)]
        return [d] + [dataclasses.replace(d, l1_bn=a, l1_warps=b, l2_bn=c, l2_warps=w) for a, b, c, w in r]
    if bm <= 32:
        raw = [(64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3), (32, 128, 4, 4),
               (64, 128, 4, 2), (128, 128, 4, 3)]
    else:
        raw = [(64, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (64, 128, 8, 4)]
    out = [d]
    for bn, bk, w, st in raw:
        out.append(KernelConfig(block_m=bm, l1_bn=bn, l1_bk=bk, l1_warps=w, l1_stages=st,
                                l2_bn=max(bn, 64), l2_bk=bk, l2_warps=w, l2_stages=st, k_order=k_order))
    return out


#: K order of the E2M1/E4M3 bf16 GEMMs when neither the config nor the environment names one
#: (frag: 1.2-1.9x faster than split/natural on the H200, docs/bench-log/kernels.md)
DEFAULT_K_ORDER = "frag"
K_ORDERS = ("frag", "split")


def resolve_k_order(cfg: "KernelConfig", w_kind: int, H: int, I: int) -> str:
    """K order of the bf16 GEMMs (``KernelConfig.k_order``, env ``MEGAMOE_TRITON_KORDER``,
    ``DEFAULT_K_ORDER``): "frag" (E2M1 and E4M3 weights, H and I multiples of 128), "split"
    (E2M1 only) or "natural" (E4M3 without frag, bf16 weights)."""
    from megamoe_runtime import knobs

    if w_kind not in (W_E2M1_MX, W_E2M1_NV, W_E4M3_MX):
        return "natural"
    k = cfg.k_order or knobs.get("MEGAMOE_TRITON_KORDER") or DEFAULT_K_ORDER
    if k not in K_ORDERS:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton k_order {k!r}; valid: {', '.join(K_ORDERS)}")
    old = "split" if w_kind != W_E4M3_MX else "natural"
    if k == "frag" and (H % 128 or I % 128):
        return old
    return "frag" if k == "frag" else old


#: rows per tile of the weight arrangement the layer derives after a load for this backend
#: (`megamoe_runtime.format.weight_tiles`; 16 and 64 measured the same on the H200,
#: docs/bench-log/kernels.md); env ``MEGAMOE_TRITON_WTILE`` ("0": keep the converted layout)
DEFAULT_W_TILE = 16


def fp8_selected(row: str, hw: bool, choice: Optional[str]) -> bool:
    """Whether a forward of ``row`` takes the FP8 path: only the MX rows on a GPU, and only
    when asked for. ``choice`` (KernelConfig.mma, else env ``MEGAMOE_TRITON_MMA``) is "fp8",
    "bf16" or "auto" (the default: bf16, the exact path; the FP8 path misses the 1e-6 calc_diff
    bar, see BENCHMARKS.md)."""
    from megamoe_runtime import knobs

    c = choice or knobs.value("MEGAMOE_TRITON_MMA")
    if c not in ("auto", "fp8", "bf16"):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"MEGAMOE_TRITON_MMA / KernelConfig.mma = {c!r}; valid: auto, fp8, bf16")
    from megamoe_runtime.format.formats import get_row

    return c == "fp8" and get_row(row).weight.scale_encoding == "ue8m0" and hw  # the MX rows


def resolve_w_tile(spec: Any, device: Any, cfg: Optional["KernelConfig"] = None) -> int:
    """Rows per tile for a layer of ``spec`` on ``device`` (0: the converted layout): CUDA, a row with
    E2M1 or E4M3 weights, and the frag bf16 GEMMs (not the fp8 path, not the split order) per the
    config and environment at load time."""
    from megamoe_runtime import knobs

    dev = torch.device(device) if device is not None else torch.device("cpu")
    w_kind = ROW_W_KIND.get(spec.row)
    if dev.type != "cuda" or w_kind not in (W_E2M1_MX, W_E2M1_NV, W_E4M3_MX):
        return 0
    cfg = cfg or KernelConfig()
    if fp8_selected(spec.row, True, cfg.mma) or \
            resolve_k_order(cfg, w_kind, spec.hidden, spec.intermediate) != "frag":
        return 0
    v = knobs.get("MEGAMOE_TRITON_WTILE")
    try:
        wt = DEFAULT_W_TILE if v is None or v == "" else int(v)
    except ValueError:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"MEGAMOE_TRITON_WTILE={v!r}; expected rows per tile (16, 32, 64, ...) or 0") from None
    if wt < 0 or (wt and ((2 * spec.intermediate) % wt or spec.hidden % wt)):
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"MEGAMOE_TRITON_WTILE={wt}: must be 0 or divide both 2*intermediate "
                           f"({2 * spec.intermediate}) and hidden ({spec.hidden})")
    return wt


#: frag-path decode and scale loads when neither the config nor the environment names one
DECODES = ("fold", "plain")
DEFAULT_SCALE_LOAD = "bytes"  # "words" routed the E2M1 operand through shared memory with triton 3.6
SCALE_LOADS = ("words", "bytes", "ahead")


def _pick(value: Optional[str], env: str, default: str, valid: tuple, what: str) -> str:
    from megamoe_runtime import knobs

    v = value or knobs.get(env) or default
    if v not in valid:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton {what} {v!r}; valid: {', '.join(valid)}")
    return v


def resolve_decode(cfg: "KernelConfig", w_kind: Optional[int] = None) -> tuple[bool, bool]:
    """(fold, scale words) of the frag paths from ``KernelConfig.decode`` / ``scale_load``, the
    env ``MEGAMOE_TRITON_DECODE`` / ``MEGAMOE_TRITON_SCALES``, else a row default for configs
    built by hand (``default_config`` fills ``decode`` per regime from ``FRAG_TILES``): fold
    for the NVFP4 and E4M3 rows, plain for mxfp4; scale bytes (``DEFAULT_SCALE_LOAD``)."""
    from megamoe_runtime import knobs

    dflt = "fold" if w_kind in (W_E2M1_NV, W_E4M3_MX) else "plain"
    d = cfg.decode or knobs.get("MEGAMOE_TRITON_DECODE") or dflt
    if d not in DECODES:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton decode {d!r}; valid: {', '.join(DECODES)}")
    return (d == "fold",
            _pick(cfg.scale_load, "MEGAMOE_TRITON_SCALES", DEFAULT_SCALE_LOAD, SCALE_LOADS, "scale_load") == "words")


def resolve_scale_ahead(cfg: "KernelConfig") -> bool:
    """Whether the frag kernels load each K step's scale bytes one step ahead (``scale_load`` "ahead",
    ``KernelConfig.scale_load`` else env ``MEGAMOE_TRITON_SCALES``; ``launch.WeightOperand`` takes it for
    the mxfp8 row only)."""
    return _pick(cfg.scale_load, "MEGAMOE_TRITON_SCALES", DEFAULT_SCALE_LOAD, SCALE_LOADS, "scale_load") == "ahead"


def resolve_l2_fold(cfg: "KernelConfig", w_kind: Optional[int] = None) -> bool:
    """Whether the L2 kernel runs the fold decode: ``KernelConfig.l2_decode`` if set, else the
    L1's (``resolve_decode``)."""
    if cfg.l2_decode is None:
        return resolve_decode(cfg, w_kind)[0]
    if cfg.l2_decode not in DECODES:
        from megamoe_runtime.errors import MegaMoEError

        raise MegaMoEError(f"triton l2_decode {cfg.l2_decode!r}; valid: {', '.join(DECODES)}")
    return cfg.l2_decode == "fold"


#: the weight kind the kernels decode, per (element, scale encoding, scale group) of a row's WeightSpec
_W_KIND_OF_WEIGHT = {("e2m1", "ue8m0", 32): W_E2M1_MX, ("e4m3", "ue8m0", 32): W_E4M3_MX,
                     ("e2m1", "e4m3", 16): W_E2M1_NV, ("bf16", None, None): W_BF16,
                     ("e4m3", "fp32", 128): W_E4M3_B128}


#: row -> weight kind, for the rows whose weights these kernels decode (the rows the backend runs)
ROW_W_KIND = {name: _W_KIND_OF_WEIGHT[k] for name, k in
              ((n, (r.weight.element, r.weight.scale_encoding, r.weight.scale_group)) for n, r in ROWS.items())
              if k in _W_KIND_OF_WEIGHT}
