"""Tests for megamoe_runtime.format.formats: the feature matrix and spec validation."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from megamoe_runtime.errors import FormatError, LayerSpecError, MegaMoEError
from megamoe_runtime.format.formats import (
    ROWS,
    ActivationSpec,
    LayerSpec,
    SharedSpec,
    get_row,
    nearest_multiples,
)


def spec(**kw) -> LayerSpec:
    base = dict(row="mxfp4", hidden=256, intermediate=256, num_experts=8, top_k=2)
    base.update(kw)
    return LayerSpec(**base)


# --------------------------------------------------------------------------- the matrix


def test_rows_match_feature_matrix():
    assert set(ROWS) == {"mxfp4", "mxfp8", "nvfp4", "bf16", "fp8_block"}
    expect = {
        # name: (mma, entry points, dispatch, fusable shared, activations, stage, element, scale group, encoding)
        "mxfp4": ("fp8xfp4", ("fp8_fp4_mega_moe",), "mxfp8", ("mxfp8",), {"swiglu", "situ"}, "l1", "e2m1", 32, "ue8m0"),
        "mxfp8": ("fp8xfp8", ("fp8_fp4_mega_moe", "fp8_fp8_mega_moe"), "mxfp8", ("mxfp8",), {"swiglu", "situ"}, "l1",
                  "e4m3", 32, "ue8m0"),
        "nvfp4": ("fp4xfp4", ("fp4_fp4_mega_moe", "nvfp4_mega_moe"), "nvfp4", ("mxfp8", "bf16"), {"swiglu"}, "l2",
                  "e2m1", 16, "e4m3"),
        "bf16": ("bf16xbf16", ("bf16_mega_moe",), "bf16", ("bf16",), {"swiglu"}, "l1", "bf16", None, None),
        "fp8_block": ("fp8xfp8", ("fp8_mega_moe",), "fp8_128", (), {"swiglu"}, "l1", "e4m3", 128, "fp32"),
    }
    for name, (mma, eps, disp, shared, acts, stage, el, grp, enc) in expect.items():
        r = ROWS[name]
        assert r.name == name and r.mma_type == mma and r.entry_points == eps
        assert r.dispatch == disp and r.fusable_shared == shared and set(r.activations) == acts
        assert r.topk_weight_stage == stage
        assert r.weight.element == el and r.weight.scale_group == grp and r.weight.scale_encoding == enc
        assert r.hidden_multiple == 128 and r.intermediate_multiple == 128
    assert ROWS["nvfp4"].weight.has_global_scale and not ROWS["mxfp4"].weight.has_global_scale
    assert ROWS["mxfp4"].weight.kernel_dtype == torch.int8
    assert ROWS["nvfp4"].weight.kernel_dtype == torch.int8
    assert ROWS["mxfp8"].weight.kernel_dtype == torch.float8_e4m3fn
    assert ROWS["bf16"].weight.kernel_dtype == torch.bfloat16
    assert [ROWS[n].weight.elements_per_byte for n in ("mxfp4", "mxfp8", "nvfp4", "bf16")] == [2, 1, 2, 0]
    assert ROWS["nvfp4"].entry_point("dgv") == "nvfp4_mega_moe"
    assert ROWS["nvfp4"].entry_point("dg") == "fp4_fp4_mega_moe"
    assert ROWS["mxfp8"].entry_point("dgz") == "fp8_fp8_mega_moe"
    with pytest.raises(FormatError, match="dgz"):
        ROWS["mxfp4"].entry_point("dgz")


def test_row_table_is_the_one_description():
    """Every per-row table elsewhere is derived from ROWS: a row added to the table appears in each."""
    from megamoe_convert.readers import recipe
    from megamoe_convert.testing.selfcheck import THRESHOLDS
    from megamoe_runtime.format.formats import QUANTIZE_ROWS, Dispatch, Element, RowName

    assert set(RowName) == set(ROWS) and all(type(n) is str for n in ROWS)
    assert {r.dispatch for r in ROWS.values()} <= set(Dispatch)
    assert {r.weight.element for r in ROWS.values()} <= set(Element)
    assert set(THRESHOLDS) == set(recipe.KERNEL_ACTIVATIONS) == set(recipe._KEEPS) == set(ROWS)
    assert QUANTIZE_ROWS == tuple(n for n, r in ROWS.items() if r.quantize_target)
    for r in ROWS.values():
        assert set(r.entry_preference) == set(r.entry_points) and r.no_kernel_hint
    with pytest.raises(FormatError, match="entry_preference"):
        dataclasses.replace(ROWS["mxfp4"], entry_preference=("nope",))


def test_weight_spec_size_helpers():
    w = ROWS["mxfp4"].weight
    assert (w.stored_cols(256), w.scale_groups(256), w.scale_ints(256), w.scale_k_per_int32) == (128, 8, 2, 128)
    n = ROWS["nvfp4"].weight
    assert (n.stored_cols(256), n.scale_groups(256), n.scale_ints(256), n.scale_k_per_int32) == (128, 16, 4, 64)
    assert ROWS["mxfp8"].weight.stored_cols(256) == 256
    assert ROWS["bf16"].weight.scale_ints(256) == 0
    b = ROWS["fp8_block"].weight
    assert (b.block_scaled, b.scale_shape(256, 384), b.scale_ints(256), b.scale_k_per_int32) == (True, (2, 3), 0, None)
    assert b.scale_checkpoint_dtype == torch.float32 and not ROWS["mxfp8"].weight.block_scaled
    assert w.scale_ints(64) == 1  # partial word: missing groups are zero


def test_get_row():
    assert get_row("nvfp4") is ROWS["nvfp4"]
    assert get_row(ROWS["bf16"]) is ROWS["bf16"]
    with pytest.raises(FormatError, match="unknown row 'fp4'; valid rows: mxfp4, mxfp8, nvfp4, bf16, fp8_block"):
        get_row("fp4")
    assert issubclass(FormatError, MegaMoEError) and issubclass(FormatError, ValueError)


def test_can_fuse_shared():
    assert ROWS["mxfp4"].can_fuse_shared("mxfp8") == (True, "")
    ok, why = ROWS["mxfp4"].can_fuse_shared("bf16")
    assert not ok and "mxfp4" in why and "mxfp8" in why and "outside" in why
    assert ROWS["nvfp4"].can_fuse_shared("bf16")[0] and ROWS["nvfp4"].can_fuse_shared("mxfp8")[0]
    assert not ROWS["bf16"].can_fuse_shared("mxfp8")[0]
    ok, why = ROWS["bf16"].can_fuse_shared("fp16")
    assert not ok and "unknown" in why


def test_nearest_multiples():
    assert nearest_multiples(300, 128) == "256 or 384"
    assert nearest_multiples(100, 128) == "128"


# --------------------------------------------------------------------------- specs


def test_layer_spec_valid_and_properties():
    s = spec(num_experts=16, ep_size=4, ep_rank=2, shared=SharedSpec("mxfp8", 1, 256))
    assert s.row_spec is ROWS["mxfp4"]
    assert s.experts_per_rank == 4
    assert s.local_experts == range(8, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hidden = 512  # type: ignore[misc]
    assert s.with_rank(3).local_experts == range(12, 16)


def test_to_dict_from_dict_round_trip_json():
    specs = [
        spec(),
        spec(row="nvfp4", activation=ActivationSpec(clamp=10.0, alpha=1.702, beta=1.0),
             shared=SharedSpec("bf16", 2, 128), routed_scaling_factor=2.5, top_k=8),
        spec(row="mxfp8", activation=ActivationSpec("situ", situ_beta=4.0, situ_linear_beta=8.0)),
        spec(row="bf16", num_experts=4, ep_size=2, ep_rank=1),
    ]
    for s in specs:
        d = json.loads(json.dumps(s.to_dict()))
        assert LayerSpec.from_dict(d) == s
    with pytest.raises(LayerSpecError, match=r"unknown keys \['hiden'\]"):
        LayerSpec.from_dict({**spec().to_dict(), "hiden": 1})
    with pytest.raises(LayerSpecError, match="missing keys"):
        LayerSpec.from_dict({"row": "mxfp4"})
    with pytest.raises(LayerSpecError, match="activation: unknown keys"):
        LayerSpec.from_dict({**spec().to_dict(), "activation": {"kind": "swiglu", "gamma": 1}})


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(hidden=300), r"hidden=300 is not a multiple of 128 required by row mxfp4; nearest valid: 256 or 384"),
        (dict(intermediate=200, row="nvfp4"), r"intermediate=200 is not a multiple of 128 required by row nvfp4; "
                                             r"nearest valid: 128 or 256"),
        (dict(row="bf16", hidden=64), r"hidden=64 .* row bf16; nearest valid: 128"),
        (dict(row="fp4"), r"row='fp4' is unknown; valid rows: mxfp4, mxfp8, nvfp4, bf16"),
        (dict(hidden=256.0), r"hidden=256.0 must be a positive int"),
        (dict(num_experts=True), r"num_experts=True must be an int >= 1"),
        (dict(num_experts=10, ep_size=4), r"num_experts=10 is not divisible by ep_size=4; valid ep_size: \[1, 2, 5, 10\]"),
        (dict(ep_size=2, ep_rank=2), r"ep_rank=2 out of range for ep_size=2; valid: 0..1"),
        (dict(ep_rank=-1), r"ep_rank=-1 out of range"),
        (dict(top_k=0), r"top_k=0 must be an int >= 1"),
        (dict(top_k=33, num_experts=64), r"top_k=33 exceeds the kernel limit 32; valid: 1..32"),
        (dict(top_k=9), r"top_k=9 exceeds num_experts=8; valid: 1..8"),
        (dict(top_k=32, num_experts=64, shared=SharedSpec("mxfp8", 1, 128)),
         r"top_k=32 plus 1 fused shared slot exceeds 32.*shared=None"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor=0.0 must be a finite number > 0"),
        (dict(routed_scaling_factor=-1.0), r"routed_scaling_factor=-1.0"),
        (dict(routed_scaling_factor=math.inf), r"routed_scaling_factor=inf"),
        (dict(routed_scaling_factor=math.nan), r"routed_scaling_factor=nan"),
        (dict(row="nvfp4", activation=ActivationSpec("situ", situ_beta=1.0, situ_linear_beta=1.0)),
         r"activation 'situ' is not supported by row nvfp4; valid: swiglu"),
        (dict(row="bf16", activation=ActivationSpec("situ", situ_beta=1.0, situ_linear_beta=1.0)),
         r"'situ' is not supported by row bf16"),
        (dict(shared=SharedSpec("bf16", 1, 128)), r"shared expert cannot be fused: row mxfp4 fuses only mxfp8"),
        (dict(row="bf16", shared=SharedSpec("mxfp8", 1, 128)), r"row bf16 fuses only bf16"),
        (dict(activation={"kind": "swiglu"}), r"activation must be an ActivationSpec"),
    ],
)
def test_layer_spec_rules(kw, pattern):
    with pytest.raises(LayerSpecError, match=pattern):
        spec(**kw)


def test_top_k_31_with_shared_is_fine():
    spec(top_k=31, num_experts=64, shared=SharedSpec("mxfp8", 1, 128))
    spec(top_k=32, num_experts=64)


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(kind="gelu"), r"kind='gelu'; valid: swiglu, situ"),
        (dict(clamp=-1.0), r"clamp=-1.0 must be a finite number >= 0"),
        (dict(clamp=math.inf), r"clamp=inf.*None for no clamp"),
        (dict(clamp=math.nan), r"clamp=nan"),
        (dict(alpha=0.0), r"alpha=0.0 must be > 0"),
        (dict(beta=math.nan), r"beta=nan must be a finite number"),
        (dict(situ_beta=2.0), r"swiglu forbids situ betas"),
        (dict(kind="situ", situ_beta=2.0, situ_linear_beta=2.0, clamp=7.0),
         r"situ takes no clamp \(got clamp=7.0\)"),
        (dict(kind="situ", situ_beta=2.0), r"situ requires situ_linear_beta finite > 0, got None"),
        (dict(kind="situ", situ_beta=0.0, situ_linear_beta=2.0), r"situ_beta finite > 0, got 0.0"),
        (dict(kind="situ", situ_beta=math.inf, situ_linear_beta=2.0), r"situ_beta finite > 0, got inf"),
        (dict(kind="situ", situ_beta=2.0, situ_linear_beta=2.0, alpha=1.702), r"situ has no alpha/beta"),
    ],
)
def test_activation_rules(kw, pattern):
    with pytest.raises(LayerSpecError, match=pattern):
        ActivationSpec(**kw)


def test_activation_valid():
    assert ActivationSpec().is_plain_swiglu
    a = ActivationSpec(clamp=0.0, alpha=1.702, beta=1.0)
    assert not a.is_plain_swiglu
    ActivationSpec("situ", situ_beta=1e3, situ_linear_beta=0.5)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (("fp8", 1, 128), r"shared precision='fp8'; valid: mxfp8, bf16"),
        (("mxfp8", 0, 128), r"num_shared=0 must be an int >= 1"),
        (("mxfp8", 1, 0), r"intermediate=0 must be a positive int"),
        (("mxfp8", 1, 80), r"intermediate=80 is not a multiple of 32"),
        (("bf16", 1, 12), r"intermediate=12 is not a multiple of 8"),
        (("bf16", 3, 40), r"3\*40=120 is not a multiple of 128.*nearest valid: 128"),
    ],
)
def test_shared_spec_rules(args, pattern):
    with pytest.raises(LayerSpecError, match=pattern):
        SharedSpec(*args)


def test_shared_spec_folds():
    s = SharedSpec("mxfp8", 2, 64)
    assert s.folded_intermediate == 128
    assert SharedSpec.from_dict(s.to_dict()) == s


def test_row_properties_are_the_only_row_branches():
    """What the properties answer for each row (the code asks these instead of comparing names)."""
    from megamoe_runtime.format.formats import ROWS

    got = {n: (r.has_scales, r.has_alphas, r.packed_e2m1, r.rsf_in_combine) for n, r in ROWS.items()}
    assert got == {
        "mxfp4": (True, False, True, False),
        "mxfp8": (True, False, False, False),
        "nvfp4": (True, True, True, True),
        "bf16": (False, False, False, False),
        "fp8_block": (True, False, False, False),
    }
    exact = {n: [o for o in ROWS if r.embeds_exactly_in(o)] for n, r in ROWS.items()}
    # E2M1 under UE8M0 groups is exact in MXFP8; NVFP4's E4M3 block scales are not (negative control)
    assert exact == {"mxfp4": ["mxfp4", "mxfp8"], "mxfp8": ["mxfp8"], "nvfp4": ["nvfp4"], "bf16": ["bf16"],
                     "fp8_block": ["fp8_block"]}


def test_shared_by_flavour_covers_exactly_the_fusable_precisions():
    from megamoe_runtime.errors import FormatError
    from megamoe_runtime.format.formats import ROWS, Row
    import dataclasses

    for r in ROWS.values():
        assert {p for _, ps in r.shared_by_flavour for p in ps} == set(r.fusable_shared)
    nv = ROWS["nvfp4"]
    assert dict(nv.shared_by_flavour) == {"dg": ("bf16",), "dgv": ("mxfp8", "bf16")}
    # negative controls: a flavour fusing a precision the row does not list, or an unknown flavour
    with pytest.raises(FormatError, match="shared_by_flavour"):
        dataclasses.replace(nv, shared_by_flavour=(("dg", ("bf16",)),))  # mxfp8 no longer covered
    with pytest.raises(FormatError, match="shared_by_flavour"):
        dataclasses.replace(nv, shared_by_flavour=(("dgq", ("mxfp8", "bf16")),))
    assert isinstance(nv, Row)
