"""The feature matrix (docs/KERNELS.md#feature-matrix) as data, and layer-spec validation.

Every other module asks this one what a row is (element type, scale group,
kernel dtype, entry point, size rules) instead of hard-coding it, so adding or
correcting a row is a one-place change. Specs are frozen dataclasses validated
at construction: an invalid spec cannot exist, and the error says which rule
failed, with the values and what would be valid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from enum import StrEnum
from typing import Any, Mapping

import torch

from ..errors import FormatError, LayerSpecError
from ..files.limits import check_limit

__all__ = [
    "RowName",
    "Element",
    "Dispatch",
    "DISPATCH_DESCRIPTIONS",
    "WeightSpec",
    "Row",
    "ROWS",
    "QUANTIZE_ROWS",
    "get_row",
    "SHARED_PRECISIONS",
    "MAX_TOPK_SLOTS",
    "LAYOUT_SM100",
    "LAYOUT_SM90_BLOCK_FP8",
    "LAYOUT_SM100_PACKED_FP4",
    "LAYOUT_UNRECORDED_ROWS",
    "ActivationSpec",
    "SharedSpec",
    "LayerSpec",
    "nearest_multiples",
    "SEMANTIC_FIELDS",
    "spec_differences",
]

#: DeepGEMM's combine has at most 32 slots per token: top-k routed + 1 shared.
MAX_TOPK_SLOTS = 32
_ACTIVATION_KINDS = ("swiglu", "situ")
#: Shared-expert precisions the kernels can fuse (2-D tensors, docs/KERNELS.md#feature-matrix).
SHARED_PRECISIONS = ("mxfp8", "bf16")


class RowName(StrEnum):
    """The rows of the feature matrix; members compare and hash equal to their names."""

    MXFP4 = "mxfp4"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    BF16 = "bf16"
    FP8_BLOCK = "fp8_block"


class Element(StrEnum):
    """Weight element encodings."""

    E2M1 = "e2m1"
    E4M3 = "e4m3"
    BF16 = "bf16"


class Dispatch(StrEnum):
    """How a row's kernel quantizes the tokens it feeds the first GEMM (docs/NUMERICS.md)."""

    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    BF16 = "bf16"
    FP8_128 = "fp8_128"


#: what each dispatch feeds the first GEMM, in words (messages, ``inspect``)
DISPATCH_DESCRIPTIONS = {
    Dispatch.MXFP8: "MXFP8 (E4M3, one UE8M0 scale per 32 elements)",
    Dispatch.NVFP4: "NVFP4 (E2M1, one E4M3 scale per 16 elements)",
    Dispatch.BF16: "BF16 (not quantized)",
    Dispatch.FP8_128: "FP8 (E4M3, one fp32 scale per 128 elements: amax / 448)",
}


def nearest_multiples(value: int, multiple: int) -> str:
    """'256 or 384' for (300, 128): the valid sizes around an invalid one."""
    lo = (value // multiple) * multiple
    hi = lo + multiple
    if lo <= 0:
        return str(hi)
    return f"{lo} or {hi}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class WeightSpec:
    """How one row stores a routed weight and its scale factors.

    elements_per_byte: 2 for packed E2M1, 1 for E4M3, 0 for bf16 (2 bytes per
    element). scale_group: elements along K sharing one scale byte (32 for
    UE8M0, 16 for NVFP4's E4M3, 128 for a 128x128 block), None without
    scales. scale_block_rows: rows (N) sharing one scale: 1 for the per-row
    groups of the MX / NVFP4 rows, 128 for 128x128 block scales, which are
    fp32 multipliers kept unpacked ``[N/128, K/128]`` (docs/LAYOUT.md#sm90-block-fp8).
    """

    element: Element
    elements_per_byte: int
    kernel_dtype: torch.dtype
    scale_group: int | None
    scale_encoding: str | None  # "ue8m0" | "e4m3" | "fp32" | None
    has_global_scale: bool
    scale_block_rows: int = 1

    def __post_init__(self) -> None:
        if self.element not in tuple(Element):
            raise FormatError(f"WeightSpec.element={self.element!r}; valid: {', '.join(Element)}")
        object.__setattr__(self, "element", str.__str__(self.element))
        expected = {Element.E2M1: 2, Element.E4M3: 1, Element.BF16: 0}[self.element]
        if self.elements_per_byte != expected:
            raise FormatError(
                f"WeightSpec({self.element}).elements_per_byte={self.elements_per_byte}; must be {expected}"
            )
        if (self.scale_group is None) != (self.scale_encoding is None):
            raise FormatError("WeightSpec: scale_group and scale_encoding must both be set or both be None")
        if self.scale_encoding not in (None, "ue8m0", "e4m3", "fp32"):
            raise FormatError(f"WeightSpec.scale_encoding={self.scale_encoding!r}; "
                              "valid: 'ue8m0', 'e4m3', 'fp32', None")
        if self.block_scaled != (self.scale_encoding == "fp32"):
            raise FormatError("WeightSpec: fp32 scales are 128x128 block scales (scale_block_rows=128) and only they")

    @property
    def has_scales(self) -> bool:
        return self.scale_group is not None

    @property
    def block_scaled(self) -> bool:
        """One unpacked fp32 scale per block of rows x K (not per-row byte groups)."""
        return self.scale_block_rows > 1

    def scale_shape(self, n: int, k: int) -> tuple[int, int] | None:
        """Canonical scale shape of an ``[n, k]`` weight: ``[n, k/group]`` per-row groups,
        ``[n/128, k/128]`` block scales, None without scales."""
        if self.scale_group is None:
            return None
        return (n // self.scale_block_rows, k // self.scale_group)

    @property
    def scale_k_per_int32(self) -> int | None:
        """Elements of K covered by one packed int32 (4 scale bytes): 128 MX, 64 NVFP4; None unpacked."""
        return None if self.scale_group is None or self.block_scaled else 4 * self.scale_group

    @property
    def checkpoint_dtype(self) -> torch.dtype:
        """dtype of the weight in checkpoint (canonical) encoding."""
        return {Element.E2M1: torch.uint8, Element.E4M3: torch.float8_e4m3fn, Element.BF16: torch.bfloat16}[self.element]

    @property
    def scale_checkpoint_dtype(self) -> torch.dtype | None:
        """dtype of the scale in canonical encoding: uint8 (UE8M0), float8_e4m3fn or float32 (block)."""
        if self.scale_encoding is None:
            return None
        return {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn, "fp32": torch.float32}[self.scale_encoding]

    def stored_cols(self, k: int) -> int:
        """Columns of a weight row holding k elements (k/2 for packed E2M1)."""
        return k // 2 if self.elements_per_byte == 2 else k

    def scale_groups(self, k: int) -> int:
        """Scale bytes per row for a reduction dim of k elements (0 without scales)."""
        return 0 if self.scale_group is None else k // self.scale_group

    def scale_ints(self, k: int) -> int:
        """P: packed int32 columns per row, ceil(k / (4 * group)) (0 without scales or unpacked)."""
        if self.scale_group is None or self.block_scaled:
            return 0
        return -(-k // (4 * self.scale_group))


_E2M1_UE8M0 = WeightSpec(Element.E2M1, 2, torch.int8, 32, "ue8m0", False)
_E4M3_UE8M0 = WeightSpec(Element.E4M3, 1, torch.float8_e4m3fn, 32, "ue8m0", False)
_E2M1_E4M3 = WeightSpec(Element.E2M1, 2, torch.int8, 16, "e4m3", True)
BF16 = WeightSpec(Element.BF16, 0, torch.bfloat16, None, None, False)
#: E4M3 weights, one fp32 multiplier per 128x128 block (DeepSeek-V3's ``weight_scale_inv``)
_E4M3_F32_BLOCK128 = WeightSpec(Element.E4M3, 1, torch.float8_e4m3fn, 128, "fp32", False, scale_block_rows=128)


#: DeepGEMM weight-layout flavours (docs/LAYOUT.md#layout-flavours), named with the version of megamoe's
#: rendering. SM100 mega kernels: gate/up interleaved by 8 rows, block scales UTCCP-permuted MN-major int32
#: (every row megamoe writes for them); SM90 ``fp8_mega_moe``: L1 weight rows interleaved by 8, fp32
#: block scales as the checkpoint has them.
LAYOUT_SM100 = "sm100-interleave8/1"
LAYOUT_SM90_BLOCK_FP8 = "sm90-block-fp8/1"
#: the packed gate/up interleave of sgl-deep-gemm >= 0.1.7's FP4 x FP4 kinds (``mxf4xmxf4``,
#: ``nvfp4xnvfp4``): a flavour megamoe does not write, named so that a refusal can name it
LAYOUT_SM100_PACKED_FP4 = "sm100-packed-fp4"
_LAYOUTS_WRITTEN = (LAYOUT_SM100, LAYOUT_SM90_BLOCK_FP8)
#: rows whose folders were written before megamoe.json named a layout: a manifest without the key holds
#: the row's layout (the only one they were ever written in); every other row's manifest must name it
LAYOUT_UNRECORDED_ROWS = ("mxfp4", "mxfp8", "nvfp4", "bf16")


@dataclass(frozen=True)
class Row:
    """One column of the feature matrix: a routed-weight format and what the
    kernels allow with it.

    entry_points: DeepGEMM function names that run this row, over all API
    flavours; api_flavours maps flavour -> entry point for the backend.
    fusable_shared: shared-expert precisions the kernel can run in the same
    launch; any other shared expert has to run outside the mega kernel.
    topk_weight_stage: 'l1' = the routing weight multiplies the activation
    before requantisation (mx rows, bf16); 'l2' = after the L2 GEMM (nvfp4).
    shared_by_flavour: API flavour -> the shared precisions that flavour's
    entry point fuses (their union is fusable_shared). A row with more than
    one needs the one its server's DeepGEMM takes; the converter cannot know
    which, so it records its choice and the alternative.
    entry_preference: the entry points in the order a backend tries them
    (the first one the installed DeepGEMM has and can run wins);
    no_kernel_hint: what to install when none is there.
    selfcheck_tolerance: the converter's self-check bound on calc_diff
    between the converted layer and the source computed in fp32 (the row's
    quantization noise, with a wrong layout landing far above).
    quantize_target: the converter can quantize a BF16 source into this row.
    source_recipes: producer recipes whose activations this row's kernel
    keeps or refines (named when a coarser recipe is refused).
    """

    name: RowName
    mma_type: str
    entry_points: tuple[str, ...]
    weight: WeightSpec
    dispatch: Dispatch
    fusable_shared: tuple[str, ...]
    activations: frozenset
    hidden_multiple: int
    intermediate_multiple: int
    topk_weight_stage: str  # "l1" | "l2"
    entry_preference: tuple[str, ...]
    no_kernel_hint: str
    selfcheck_tolerance: float
    quantize_target: bool
    source_recipes: str
    api_flavours: tuple[tuple[str, str], ...] = field(default=())
    shared_by_flavour: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    notes: str = ""
    #: the DeepGEMM layout flavour megamoe writes the row in, with its version (docs/LAYOUT.md#layout-flavours):
    #: recorded in megamoe.json (``layout``); a folder of another flavour is refused, and so is a DeepGEMM build
    #: whose kernel for the row reads another one (backends/deepgemm.py)
    layout: str = ""

    def __post_init__(self) -> None:
        if self.layout not in _LAYOUTS_WRITTEN:
            raise FormatError(f"Row {self.name}: layout {self.layout!r} is not one megamoe writes "
                              f"({', '.join(_LAYOUTS_WRITTEN)})")
        if self.mma_type not in ("fp8xfp4", "fp8xfp8", "fp4xfp4", "bf16xbf16"):
            raise FormatError(f"Row {self.name}: unknown mma_type {self.mma_type!r}")
        if self.name not in tuple(RowName):
            raise FormatError(f"Row {self.name!r}: not a RowName; valid: {', '.join(RowName)}")
        if self.dispatch not in tuple(Dispatch):
            raise FormatError(f"Row {self.name}: unknown dispatch {self.dispatch!r}")
        # plain strings from here on: names go into JSON, messages and dict keys unchanged
        object.__setattr__(self, "name", str.__str__(self.name))
        object.__setattr__(self, "dispatch", str.__str__(self.dispatch))
        if set(self.entry_preference) != set(self.entry_points):
            raise FormatError(f"Row {self.name}: entry_preference {self.entry_preference} must order exactly "
                              f"the entry_points {self.entry_points}")
        if not (self.selfcheck_tolerance > 0):
            raise FormatError(f"Row {self.name}: selfcheck_tolerance must be > 0")
        if self.topk_weight_stage not in ("l1", "l2"):
            raise FormatError(f"Row {self.name}: topk_weight_stage must be 'l1' or 'l2'")
        bad = [p for p in self.fusable_shared if p not in SHARED_PRECISIONS]
        if bad:
            raise FormatError(f"Row {self.name}: unknown shared precisions {bad}")
        bad = [a for a in self.activations if a not in _ACTIVATION_KINDS]
        if bad:
            raise FormatError(f"Row {self.name}: unknown activations {bad}")
        for flavour, ep in self.api_flavours:
            if ep not in self.entry_points:
                raise FormatError(f"Row {self.name}: flavour {flavour} names {ep}, not in entry_points")
        flavours = {f for f, _ in self.api_flavours}
        fused = {p for _, ps in self.shared_by_flavour for p in ps}
        if self.shared_by_flavour and (fused != set(self.fusable_shared)
                                       or not {f for f, _ in self.shared_by_flavour} <= flavours):
            raise FormatError(f"Row {self.name}: shared_by_flavour {self.shared_by_flavour} must use the row's "
                              f"api_flavours {sorted(flavours)} and fuse exactly {self.fusable_shared}")

    @property
    def has_scales(self) -> bool:
        """Block scales beside the weights (l1_scale / l2_scale roles)."""
        return self.weight.has_scales

    @property
    def has_alphas(self) -> bool:
        """Per-expert fp32 global scales (``l1_alpha [E_l, 2]``,
        ``l2_global_scale [E_l]``) and the layer's a2 (docs/SCALES.md#alphas):
        the NVFP4 scalar state every loader, check and backend handles."""
        return self.weight.has_global_scale

    @property
    def packed_e2m1(self) -> bool:
        """Weights are two E2M1 codes per byte (``[.., N, D/2]`` int8)."""
        return self.weight.element == Element.E2M1

    @property
    def rsf_in_combine(self) -> bool:
        """``routed_scaling_factor`` multiplies the routed sum in the combine
        (the top-k weight applies after L2), instead of being folded into the
        top-k weights applied in L1 (docs/NUMERICS.md)."""
        return self.topk_weight_stage == "l2"

    def embeds_exactly_in(self, other: "Row | str") -> bool:
        """Weights of this row re-encode into ``other``'s format with no
        rounding and the scale bytes unchanged: the same row, or E2M1 into E4M3
        under the same UE8M0 groups (every E2M1 value is an E4M3 value). NVFP4
        into MXFP8 is not: its E4M3 block scales and global scale would need a
        re-quantization."""
        o = get_row(other)
        if o.name == self.name:
            return True
        w, ow = self.weight, o.weight
        return (w.element == Element.E2M1 and ow.element == Element.E4M3
                and w.scale_encoding == ow.scale_encoding == "ue8m0"
                and w.scale_group == ow.scale_group)

    def entry_point(self, flavour: str) -> str:
        """DeepGEMM function name for an API flavour ('dg', 'dgv', 'dgz', ...)."""
        for f, ep in self.api_flavours:
            if f == flavour:
                return ep
        valid = ", ".join(f for f, _ in self.api_flavours)
        raise FormatError(f"row {self.name} has no entry point for API flavour {flavour!r}; valid: {valid}")

    def can_fuse_shared(self, precision: str) -> tuple[bool, str]:
        """(True, '') if a shared expert of this precision can run inside the
        mega kernel; else (False, why), and the shared expert runs outside."""
        if precision not in SHARED_PRECISIONS:
            return False, (
                f"shared precision {precision!r} is unknown; valid: {', '.join(SHARED_PRECISIONS)}"
            )
        if precision in self.fusable_shared:
            return True, ""
        if not self.fusable_shared:
            return False, f"row {self.name} cannot fuse shared experts; run the shared expert outside"
        return False, (
            f"row {self.name} fuses only {', '.join(self.fusable_shared)} shared experts, not {precision}; "
            f"convert the shared expert to one of those or run it outside (shared=None)"
        )

    def check_sizes(self, hidden: int, intermediate: int, where: str = "") -> None:
        """Raise LayerSpecError unless H and I satisfy this row's size rules."""
        pre = f"{where}: " if where else ""
        for label, v, m in (
            ("hidden", hidden, self.hidden_multiple),
            ("intermediate", intermediate, self.intermediate_multiple),
        ):
            if not _is_int(v) or v <= 0:
                raise LayerSpecError(f"{pre}{label}={v!r} must be a positive int")
            if v % m:
                raise LayerSpecError(
                    f"{pre}{label}={v} is not a multiple of {m} required by row {self.name}; "
                    f"nearest valid: {nearest_multiples(v, m)}"
                )


def _rows(*rows: Row) -> dict[str, Row]:
    return {r.name: r for r in rows}


#: one entry of the table: a Row with what every row has unless its entry says otherwise, H and I multiples
#: of 128 and the top-k weight applied in L1
_row = partial(Row, hidden_multiple=128, intermediate_multiple=128, topk_weight_stage="l1")


ROWS: dict[str, Row] = _rows(
    _row(
        name=RowName.MXFP4,
        mma_type="fp8xfp4",
        entry_points=("fp8_fp4_mega_moe",),
        weight=_E2M1_UE8M0,
        dispatch=Dispatch.MXFP8,
        fusable_shared=("mxfp8",),
        activations=frozenset({"swiglu", "situ"}),
        entry_preference=("fp8_fp4_mega_moe",),
        no_kernel_hint="deep_gemm has no fp8_fp4_mega_moe (the MXFP4-weight mega kernel)",
        selfcheck_tolerance=2e-3,
        quantize_target=True,
        source_recipes="ModelOpt MXFP4 or W4A8_MXFP4_FP8, llm-compressor MXFP4, Quark mxfp4 or mxfp4_fp8",
        api_flavours=(("dg", "fp8_fp4_mega_moe"), ("dgv", "fp8_fp4_mega_moe")),
        shared_by_flavour=(("dg", ("mxfp8",)), ("dgv", ("mxfp8",))),
        notes="every DG version; UTCCP needs 2I % 128, K blocks of 128",
        layout=LAYOUT_SM100,
    ),
    _row(
        name=RowName.MXFP8,
        mma_type="fp8xfp8",
        entry_points=("fp8_fp4_mega_moe", "fp8_fp8_mega_moe"),
        weight=_E4M3_UE8M0,
        dispatch=Dispatch.MXFP8,
        fusable_shared=("mxfp8",),
        activations=frozenset({"swiglu", "situ"}),
        entry_preference=("fp8_fp8_mega_moe", "fp8_fp4_mega_moe"),
        no_kernel_hint=("this DeepGEMM has no MXFP8-weight mega kernel: needs newer deepseek-ai/DeepGEMM "
                        "(fp8_fp4_mega_moe with e4m3 weights) or zyongye/DeepGEMM's fp8_fp8_mega_moe"),
        selfcheck_tolerance=2e-3,
        quantize_target=True,
        source_recipes="ModelOpt MXFP8, llm-compressor MXFP8",
        api_flavours=(("dg", "fp8_fp4_mega_moe"), ("dgz", "fp8_fp8_mega_moe")),
        shared_by_flavour=(("dg", ("mxfp8",)), ("dgz", ())),
        notes="newer DG picks fp8xfp8 from the e4m3 weight dtype; DGz alias fp8_fp8_mega_moe fuses no shared",
        layout=LAYOUT_SM100,
    ),
    _row(
        name=RowName.NVFP4,
        mma_type="fp4xfp4",
        entry_points=("fp4_fp4_mega_moe", "nvfp4_mega_moe"),
        weight=_E2M1_E4M3,
        dispatch=Dispatch.NVFP4,
        fusable_shared=("mxfp8", "bf16"),
        activations=frozenset({"swiglu"}),
        topk_weight_stage="l2",
        # sizes, the table's H, I % 128: DGv's nvfp4_mega_moe needs that. Newer DG's fp4_fp4_mega_moe
        # needs H, I % 512 (its kernel asserts 256) and S*I_s % 128: the
        # deepgemm backend checks that stricter rule for that flavour; the
        # format itself only needs the DGv rule.
        entry_preference=("fp4_fp4_mega_moe", "nvfp4_mega_moe"),
        no_kernel_hint=("this DeepGEMM has no NVFP4 mega kernel: needs newer deepseek-ai/DeepGEMM "
                        "(fp4_fp4_mega_moe) or vllm-project/DeepGEMM (nvfp4_mega_moe)"),
        selfcheck_tolerance=2e-2,
        quantize_target=True,
        source_recipes="NVFP4 W4A4: ModelOpt NVFP4, llm-compressor NVFP4, Quark nvfp4",
        api_flavours=(("dg", "fp4_fp4_mega_moe"), ("dgv", "nvfp4_mega_moe")),
        shared_by_flavour=(("dg", ("bf16",)), ("dgv", ("mxfp8", "bf16"))),
        notes="newer DG: BF16 shared + x_bf16, sizes % 512; DGv: MXFP8 (default) or BF16 shared, sizes % 128",
        layout=LAYOUT_SM100,
    ),
    _row(
        name=RowName.BF16,
        mma_type="bf16xbf16",
        entry_points=("bf16_mega_moe",),
        weight=BF16,
        dispatch=Dispatch.BF16,
        fusable_shared=("bf16",),
        activations=frozenset({"swiglu"}),
        # sizes, the table's H, I % 128: the layout alone needs I % 8 (interleave); 128 is what
        # vLLM's backend factory asks, so a converted bf16 checkpoint is accepted by every consumer.
        entry_preference=("bf16_mega_moe",),
        no_kernel_hint="this DeepGEMM has no bf16_mega_moe (added in deepseek-ai/DeepGEMM main, June 2026)",
        selfcheck_tolerance=1e-4,
        quantize_target=False,
        source_recipes="an unquantized export",
        api_flavours=(("dg", "bf16_mega_moe"), ("dgv", "bf16_mega_moe")),
        shared_by_flavour=(("dg", ("bf16",)), ("dgv", ("bf16",))),
        notes="DG-main on",
        layout=LAYOUT_SM100,
    ),
    _row(
        name=RowName.FP8_BLOCK,
        mma_type="fp8xfp8",
        entry_points=("fp8_mega_moe",),
        weight=_E4M3_F32_BLOCK128,
        dispatch=Dispatch.FP8_128,
        # the SM90 kernel has no shared-expert slot: shared experts stay in the
        # pass-through files and run outside it (docs/FORMATS.md#fp8-block)
        fusable_shared=(),
        activations=frozenset({"swiglu"}),
        entry_preference=("fp8_mega_moe",),
        no_kernel_hint=("deep_gemm has no fp8_mega_moe (the SM90 block-FP8 mega kernel of SGLang's DeepGEMM build): "
                        "pip install sgl-deep-gemm==0.1.5 apache-tvm-ffi==0.1.11, built for torch 2.11"),
        selfcheck_tolerance=2e-3,
        quantize_target=True,
        source_recipes=("dynamic FP8 per 1x128 activations: DeepSeek-V3/R1 native FP8, transformers FineGrainedFP8 "
                        "(Qwen3-FP8, GLM-4.5-FP8), llm-compressor FP8_BLOCK"),
        api_flavours=(("sgl", "fp8_mega_moe"),),
        shared_by_flavour=(("sgl", ()),),
        notes="SGLang's DeepGEMM (sgl-deep-gemm) SM90 fp8_mega_moe, recipe (128, 128, 128); Hopper only",
        layout=LAYOUT_SM90_BLOCK_FP8,
    ),
)

#: rows a BF16 source can be quantized into (``--quantize``)
QUANTIZE_ROWS: tuple[str, ...] = tuple(n for n, r in ROWS.items() if r.quantize_target)


def get_row(name: "str | Row") -> Row:
    """Row by name (a Row passes through). FormatError lists valid names."""
    if isinstance(name, Row):
        return name
    try:
        return ROWS[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown row {name!r}; valid rows: {', '.join(ROWS)}") from None


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class ActivationSpec:
    """The L1 epilogue activation.

    swiglu: g*sigmoid(alpha*g)*(u+beta) with optional clamp (g <= c, |u| <= c);
    situ: sigmoid(g)*sb*tanh(g/sb)*slb*tanh(u/slb), no clamp, betas finite > 0.
    """

    kind: str = "swiglu"
    clamp: float | None = None
    alpha: float = 1.0
    beta: float = 0.0
    situ_beta: float | None = None
    situ_linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _ACTIVATION_KINDS:
            raise LayerSpecError(f"activation kind={self.kind!r}; valid: {', '.join(_ACTIVATION_KINDS)}")
        if self.clamp is not None:
            if not _is_real(self.clamp) or not math.isfinite(self.clamp) or self.clamp < 0:
                raise LayerSpecError(
                    f"activation clamp={self.clamp!r} must be a finite number >= 0, or None for no clamp"
                )
        for label, v in (("alpha", self.alpha), ("beta", self.beta)):
            if not _is_real(v) or not math.isfinite(v):
                raise LayerSpecError(f"activation {label}={v!r} must be a finite number")
        if self.alpha <= 0:
            raise LayerSpecError(f"activation alpha={self.alpha} must be > 0 (1.0 is plain SwiGLU)")
        if self.kind == "swiglu":
            if self.situ_beta is not None or self.situ_linear_beta is not None:
                raise LayerSpecError(
                    f"swiglu forbids situ betas (got situ_beta={self.situ_beta!r}, "
                    f"situ_linear_beta={self.situ_linear_beta!r}); set both to None or use kind='situ'"
                )
        else:
            if self.clamp is not None:
                raise LayerSpecError(
                    f"situ takes no clamp (got clamp={self.clamp!r}); set clamp=None or use kind='swiglu'"
                )
            if self.alpha != 1.0 or self.beta != 0.0:
                raise LayerSpecError(
                    f"situ has no alpha/beta (got alpha={self.alpha}, beta={self.beta}); "
                    "leave them at 1.0/0.0 and set situ_beta, situ_linear_beta"
                )
            for label, v in (("situ_beta", self.situ_beta), ("situ_linear_beta", self.situ_linear_beta)):
                if v is None or not _is_real(v) or not math.isfinite(v) or v <= 0:
                    raise LayerSpecError(f"situ requires {label} finite > 0, got {v!r}")

    @property
    def is_plain_swiglu(self) -> bool:
        return self.kind == "swiglu" and self.alpha == 1.0 and self.beta == 0.0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "clamp": self.clamp,
            "alpha": self.alpha,
            "beta": self.beta,
            "situ_beta": self.situ_beta,
            "situ_linear_beta": self.situ_linear_beta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ActivationSpec":
        _check_keys(d, cls, "activation")
        return cls(**dict(d))


@dataclass(frozen=True)
class SharedSpec:
    """S shared experts of width I_s, folded into one of width S*I_s."""

    precision: str
    num_shared: int
    intermediate: int

    def __post_init__(self) -> None:
        if self.precision not in SHARED_PRECISIONS:
            raise LayerSpecError(
                f"shared precision={self.precision!r}; valid: {', '.join(SHARED_PRECISIONS)}"
                " (any other shared expert runs outside the kernel: shared=None)"
            )
        if not _is_int(self.num_shared) or self.num_shared < 1:
            raise LayerSpecError(f"shared num_shared={self.num_shared!r} must be an int >= 1")
        if not _is_int(self.intermediate) or self.intermediate <= 0:
            raise LayerSpecError(f"shared intermediate={self.intermediate!r} must be a positive int")
        check_limit("num_experts", self.num_shared, "shared expert", LayerSpecError, "num_shared")
        check_limit("intermediate", self.num_shared * self.intermediate, "shared expert (num_shared x intermediate)",
                    LayerSpecError)
        # K-stacking the L2 scale bytes needs whole scale groups per expert,
        # and the folded L1 (2*S*I_s rows) goes through UTCCP in 128-row blocks.
        if self.precision == "mxfp8" and self.intermediate % 32:
            raise LayerSpecError(
                f"shared intermediate={self.intermediate} is not a multiple of 32 (mxfp8 scale group); "
                f"nearest valid: {nearest_multiples(self.intermediate, 32)}"
            )
        if self.intermediate % 8:
            raise LayerSpecError(
                f"shared intermediate={self.intermediate} is not a multiple of 8 (gate/up interleave); "
                f"nearest valid: {nearest_multiples(self.intermediate, 8)}"
            )
        if self.folded_intermediate % 128:
            raise LayerSpecError(
                f"shared num_shared*intermediate={self.num_shared}*{self.intermediate}="
                f"{self.folded_intermediate} is not a multiple of 128 required for the folded shared expert; "
                f"nearest valid: {nearest_multiples(self.folded_intermediate, 128)}"
            )

    @property
    def folded_intermediate(self) -> int:
        return self.num_shared * self.intermediate

    def to_dict(self) -> dict:
        return {"precision": self.precision, "num_shared": self.num_shared, "intermediate": self.intermediate}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SharedSpec":
        _check_keys(d, cls, "shared")
        return cls(**dict(d))


def _check_keys(d: Any, cls: type, what: str) -> None:
    if not isinstance(d, Mapping):
        raise LayerSpecError(f"{what}: expected a mapping, got {type(d).__name__}")
    valid = set(cls.__dataclass_fields__)
    unknown = sorted(set(d) - valid)
    if unknown:
        raise LayerSpecError(f"{what}: unknown keys {unknown}; valid keys: {sorted(valid)}")


@dataclass(frozen=True)
class LayerSpec:
    """Everything that fixes one MoE layer's kernel shapes and numerics."""

    row: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    activation: ActivationSpec = field(default_factory=ActivationSpec)
    ep_rank: int = 0
    ep_size: int = 1
    shared: SharedSpec | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.row not in ROWS:
            raise LayerSpecError(f"row={self.row!r} is unknown; valid rows: {', '.join(ROWS)}")
        row = ROWS[self.row]
        if not isinstance(self.activation, ActivationSpec):
            raise LayerSpecError(
                f"activation must be an ActivationSpec, got {type(self.activation).__name__}"
            )
        if self.shared is not None and not isinstance(self.shared, SharedSpec):
            raise LayerSpecError(f"shared must be a SharedSpec or None, got {type(self.shared).__name__}")
        for label in ("num_experts", "top_k", "ep_size"):
            v = getattr(self, label)
            if not _is_int(v) or v < 1:
                raise LayerSpecError(f"{label}={v!r} must be an int >= 1")
        if not _is_int(self.ep_rank):
            raise LayerSpecError(f"ep_rank={self.ep_rank!r} must be an int")
        # stated limits before any size-dependent work (a divisor list of 10**9 experts would never end)
        for label, limit in (("num_experts", "num_experts"), ("ep_size", "num_experts"), ("top_k", "top_k"),
                             ("hidden", "hidden"), ("intermediate", "intermediate")):
            check_limit(limit, getattr(self, label), "layer spec", LayerSpecError, label)
        row.check_sizes(self.hidden, self.intermediate)
        if self.num_experts % self.ep_size:
            divs = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise LayerSpecError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}; "
                f"valid ep_size: {divs[:16]}{' ...' if len(divs) > 16 else ''}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise LayerSpecError(f"ep_rank={self.ep_rank} out of range for ep_size={self.ep_size}; valid: 0..{self.ep_size - 1}")
        if self.top_k > MAX_TOPK_SLOTS:
            raise LayerSpecError(f"top_k={self.top_k} exceeds the kernel limit {MAX_TOPK_SLOTS}; valid: 1..{MAX_TOPK_SLOTS}")
        if self.top_k > self.num_experts:
            raise LayerSpecError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; valid: 1..{min(self.num_experts, MAX_TOPK_SLOTS)}"
            )
        if self.shared is not None and self.top_k + 1 > MAX_TOPK_SLOTS:
            raise LayerSpecError(
                f"top_k={self.top_k} plus 1 fused shared slot exceeds {MAX_TOPK_SLOTS}; "
                f"valid: top_k <= {MAX_TOPK_SLOTS - 1} with a fused shared expert, or shared=None"
            )
        rsf = self.routed_scaling_factor
        if not _is_real(rsf) or not math.isfinite(rsf) or rsf <= 0:
            raise LayerSpecError(f"routed_scaling_factor={rsf!r} must be a finite number > 0")
        if self.activation.kind not in row.activations:
            raise LayerSpecError(
                f"activation {self.activation.kind!r} is not supported by row {row.name}; "
                f"valid: {', '.join(sorted(row.activations))}"
            )
        if self.shared is not None:
            ok, reason = row.can_fuse_shared(self.shared.precision)
            if not ok:
                raise LayerSpecError(f"shared expert cannot be fused: {reason}")

    @property
    def row_spec(self) -> Row:
        return ROWS[self.row]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_experts(self) -> range:
        n = self.experts_per_rank
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def with_rank(self, ep_rank: int, ep_size: int | None = None) -> "LayerSpec":
        """The same layer as seen by another EP rank (validated again)."""
        d = self.to_dict()
        d["ep_rank"] = ep_rank
        if ep_size is not None:
            d["ep_size"] = ep_size
        return LayerSpec.from_dict(d)

    def to_dict(self) -> dict:
        """JSON-safe dict (ints, floats, strings, None, nested dicts)."""
        return {
            "row": self.row,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "activation": self.activation.to_dict(),
            "ep_rank": self.ep_rank,
            "ep_size": self.ep_size,
            "shared": None if self.shared is None else self.shared.to_dict(),
            "routed_scaling_factor": float(self.routed_scaling_factor),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerSpec":
        _check_keys(d, cls, "layer spec")
        kw = dict(d)
        missing = [k for k in ("row", "hidden", "intermediate", "num_experts", "top_k") if k not in kw]
        if missing:
            raise LayerSpecError(f"layer spec: missing keys {missing}")
        if "activation" in kw and not isinstance(kw["activation"], ActivationSpec):
            kw["activation"] = ActivationSpec.from_dict(kw["activation"])
        if kw.get("shared") is not None and not isinstance(kw["shared"], SharedSpec):
            kw["shared"] = SharedSpec.from_dict(kw["shared"])
        return cls(**kw)


#: spec fields that fix the layer's storage: a checkpoint that differs here cannot be loaded into the layer
_STORAGE_FIELDS = ("row", "hidden", "intermediate", "num_experts", "ep_size", "ep_rank", "shared")
#: spec fields that change only the numerics: refused unless the caller adopts them
SEMANTIC_FIELDS = ("top_k", "activation", "routed_scaling_factor")


def _flat_spec(spec: Any) -> dict[str, Any]:
    d = spec.to_dict()
    out = {k: v for k, v in d.items() if k != "activation"}
    for k, v in (d.get("activation") or {}).items():
        out[f"activation.{k}"] = v
    return out


def spec_differences(layer_spec: Any, ckpt_spec: Any, *, compare_shared: bool = True
                     ) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``(storage, semantic)``: field -> (layer's value, checkpoint's value) for every field that differs.
    ``compare_shared=False`` skips ``shared`` (a layer whose shared expert came from an engine module)."""
    a, b = _flat_spec(layer_spec), _flat_spec(ckpt_spec)
    storage, semantic = {}, {}
    for k in sorted(set(a) | set(b)):
        if a.get(k) == b.get(k):
            continue
        top = k.split(".")[0]
        if top == "shared" and not compare_shared:
            continue
        (semantic if top in SEMANTIC_FIELDS else storage)[k] = (a.get(k), b.get(k))
    return storage, semantic
