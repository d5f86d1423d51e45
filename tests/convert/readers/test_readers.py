"""Readers: detection, structure, canonical tensors, scale conventions, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megamoe_convert.readers import available_formats, detect_reader, readers_in_order
from megamoe_convert.readers.base import CheckpointReader, MoELayerInfo
from megamoe_convert.readers.source import open_source
from megamoe_runtime.errors import CheckpointError, FormatError, ScaleError
from megamoe_runtime.format import codecs
from megamoe_runtime.format.canonical import ExpertTensors
from megamoe_convert.testing.synth import (
    FORMATS,
    ROW_OF,
    synthetic_expert_weights,
    synthetic_input_scale,
    synthetic_shared_weights,
)

H, I, E = 256, 128, 8
EXPECTED_READER = {
    "bf16": "unquantized",
    "fp16": "unquantized",
    "fp32": "unquantized",
    "bf16-fused": "unquantized",
}
#: relative Frobenius error of dequantized vs the float weights, per row
TOL = {"nvfp4": 0.15, "mxfp4": 0.2, "mxfp8": 0.05, "bf16": 0.01, "fp8_block": 0.05}


def _reader(path, **kw) -> CheckpointReader:
    return detect_reader(open_source(path), **kw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------ every format


@pytest.mark.parametrize("fmt", FORMATS)
def test_reads_every_format(synth_ckpt, fmt):
    shared = 0 if fmt == "bf16-fused" else 2
    p = synth_ckpt(fmt, shared=shared, first_k_dense_replace=1 if fmt == "modelopt-nvfp4" else 0, num_layers=3)
    r = _reader(p)
    assert r.format_name == EXPECTED_READER.get(fmt, fmt)
    assert r.row == ROW_OF[fmt]
    layers = r.moe_layers()
    first = 1 if fmt == "modelopt-nvfp4" else 0
    assert [l.index for l in layers] == list(range(first, 3))
    for info in layers:
        assert isinstance(info, MoELayerInfo)
        assert (info.num_experts, info.hidden, info.intermediate) == (E, H, I)
        if shared:
            assert info.shared is not None
            assert (info.shared.num_shared, info.shared.intermediate) == (2, I)
            assert info.shared.unsupported_reason is None
        else:
            assert info.shared is None
    facts = r.model_facts()
    assert facts.top_k == 2 and facts.num_experts == E
    assert facts.activation.kind == "swiglu"
    assert facts.num_shared == shared

    info = layers[-1]
    L = info.index
    for e in (0, 5):
        et = r.read_expert(L, e)
        assert isinstance(et, ExpertTensors)
        et.validate(r.row, H, I, "test")
        ref = synthetic_expert_weights(0, L, e, H, I)
        for got, want in zip(et.dequantize(r.row), ref):
            assert torch.isfinite(got).all()
            assert _rel(got, want) < TOL[r.row], fmt
    # shared experts decode to the synthetic shared weights, in their own encoding
    if shared:
        (sh,) = r.read_shared(L)
        ref = synthetic_shared_weights(0, L, H, 2 * I)
        for got, want in zip(sh.dequantize(info.shared.encoding), ref):
            assert got.shape == want.shape
            assert _rel(got, want) < TOL[info.shared.encoding]
    else:
        assert r.read_shared(L) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_consumed_names_cover_experts_only(synth_ckpt, fmt):
    p = synth_ckpt(fmt, shared=0 if fmt == "bf16-fused" else 1)
    src = open_source(p)
    r = detect_reader(src)
    consumed = r.consumed_tensor_names()
    names = set(src.tensor_names())
    assert consumed <= names
    rest = names - consumed
    assert not any(".experts." in n for n in rest), sorted(n for n in rest if ".experts." in n)[:3]
    assert not any("shared_experts" in n for n in rest)
    # routers, norms, attention, embeddings are passed through
    assert any(n.endswith(".gate.weight") for n in rest)
    assert any("embed" in n for n in rest)


def test_reads_are_lazy(synth_ckpt):
    src = open_source(synth_ckpt("modelopt-nvfp4"))
    r = detect_reader(src)
    r.moe_layers()  # header-only structure
    seen: list[str] = []
    orig, orig_value = src.get_tensor, src.first_value

    def spy(name):
        seen.append(name)
        return orig(name)

    def spy_value(name):  # scalar scales: one small read each, no tensor
        seen.append(name)
        return orig_value(name)

    src.get_tensor = spy  # type: ignore[method-assign]
    src.first_value = spy_value  # type: ignore[method-assign]
    r.read_expert(1, 6)
    assert seen and all(".experts.6." in n and n.startswith("model.layers.1.") for n in seen)
    assert len(seen) == 12  # 3 projections x (weight, scale, scale_2, input_scale)


def test_moe_layers_reads_headers_only(synth_ckpt):
    src = open_source(synth_ckpt("ct-nvfp4", shared=1))
    src.get_tensor = lambda name: pytest.fail(f"read {name}")  # type: ignore[assignment]
    r = detect_reader(src)
    assert len(r.moe_layers()) == 2
    r.model_facts()
    r.consumed_tensor_names()


def test_registry():
    fmts = available_formats()
    for f in ("modelopt-nvfp4", "modelopt-mxfp4", "modelopt-mxfp8", "quark-mxfp4", "quark-nvfp4",
              "ct-nvfp4", "ct-mxfp4", "ct-mxfp8", "deepseek-v4", "unquantized"):
        assert f in fmts
    assert fmts[-1] == "unquantized"
    assert all(cls.description for cls in readers_in_order())


# ------------------------------------------------------------------ NVFP4 scale semantics


def test_modelopt_nvfp4_semantics(synth_ckpt):
    """dequant = e2m1 * weight_scale * weight_scale_2, with the stored tensors."""
    p = synth_ckpt("modelopt-nvfp4")
    src = open_source(p)
    r = detect_reader(src)
    et = r.read_expert(1, 2)
    m = "model.layers.1.mlp.experts.2.down_proj"
    w, s = src.get_tensor(f"{m}.weight"), src.get_tensor(f"{m}.weight_scale")
    s2 = float(src.get_tensor(f"{m}.weight_scale_2"))
    assert torch.equal(et.down.weight, w) and torch.equal(et.down.scale.view(torch.uint8), s.view(torch.uint8))
    assert et.down.global_scale == s2
    block = s.float() * torch.tensor(s2, dtype=torch.float32)  # block factor first, as ModelOpt/DGv
    manual = codecs.e2m1_decode(codecs.unpack_e2m1(w)).reshape(H, -1, 16) * block.unsqueeze(-1)
    assert torch.equal(et.down.dequantize("nvfp4"), manual.reshape(H, I))
    # gate and up share weight_scale_2 and input_scale (ModelOpt >= 0.47 fused-input unification)
    assert et.gate.global_scale == et.up.global_scale
    assert et.gate.input_scale == et.up.input_scale == synthetic_input_scale(0, 1, 2, "gate")
    assert et.down.input_scale == synthetic_input_scale(0, 1, 2, "down")


def test_ct_nvfp4_divisors_are_inverted(synth_ckpt):
    mo = _reader(synth_ckpt("modelopt-nvfp4"))
    ct_src = open_source(synth_ckpt("ct-nvfp4"))
    ct = detect_reader(ct_src)
    for e in range(E):
        a, b = mo.read_expert(0, e), ct.read_expert(0, e)
        for (role, pa), (_, pb) in zip(a.projections(), b.projections()):
            assert torch.equal(pa.weight, pb.weight) and torch.equal(pa.scale.view(torch.uint8), pb.scale.view(torch.uint8))
            # 1/(1/x) in fp32 is within an ulp or two of x
            assert pb.global_scale == pytest.approx(pa.global_scale, rel=2.5e-7)
            assert pb.input_scale == pytest.approx(pa.input_scale, rel=2.5e-7)
            stored = float(ct_src.get_tensor(f"model.layers.0.mlp.experts.{e}.{role}_proj.weight_global_scale"))
            assert pb.global_scale == pytest.approx(1.0 / stored, rel=1e-7)
    # scalars-only path agrees with the full read
    s = ct.read_expert_scalars(0, 3)
    full = ct.read_expert(0, 3)
    assert s.down_input == full.down.input_scale and s.gate_global == full.gate.global_scale


def test_quark_nvfp4_uses_input_scale_2(synth_ckpt):
    src = open_source(synth_ckpt("quark-nvfp4"))
    assert any(n.endswith("input_scale_2") for n in src.tensor_names())
    assert not any(n.endswith(".input_scale") for n in src.tensor_names())
    r = detect_reader(src)
    et = r.read_expert(1, 4)
    assert et.down.input_scale == synthetic_input_scale(0, 1, 4, "down")
    mo = _reader(synth_ckpt("modelopt-nvfp4")).read_expert(1, 4)
    assert torch.equal(et.gate.dequantize("nvfp4"), mo.gate.dequantize("nvfp4"))


def test_nvfp4_without_input_scale_is_optional(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    t = {k: v for k, v in t.items() if not k.endswith("input_scale")}
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    et = _reader(p).read_expert(0, 0)
    assert et.gate.input_scale is None and et.down.input_scale is None
    assert et.gate.global_scale is not None


# ------------------------------------------------------------------ naming variants


def test_mixtral_w123_block_sparse_moe(synth_ckpt):
    p = synth_ckpt("ct-nvfp4", naming="w123")
    src = open_source(p)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight_packed" in src.tensor_names()
    r = detect_reader(src)
    info = r.moe_layers()[0]
    assert info.prefix == "model.layers.0.block_sparse_moe"
    assert r.model_facts().num_experts == E
    et = r.read_expert(0, 3)
    g, u, d = synthetic_expert_weights(0, 0, 3, H, I)
    assert _rel(et.gate.dequantize("nvfp4"), g) < 0.15  # w1 = gate
    assert _rel(et.up.dequantize("nvfp4"), u) < 0.15  # w3 = up
    assert _rel(et.down.dequantize("nvfp4"), d) < 0.15  # w2 = down


def test_fused_gate_up_gate_half_first(synth_ckpt):
    p = synth_ckpt("bf16-fused")
    src = open_source(p)
    gu = src.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
    assert tuple(gu.shape) == (E, 2 * I, H)
    r = detect_reader(src)
    et = r.read_expert(1, 5)
    assert torch.equal(et.gate.weight, gu[5, :I]) and torch.equal(et.up.weight, gu[5, I:])
    g, u, d = synthetic_expert_weights(0, 1, 5, H, I)
    assert torch.equal(et.gate.weight, g.to(torch.bfloat16))
    assert torch.equal(et.down.weight, d.to(torch.bfloat16))
    assert r.consumed_tensor_names() >= {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}


def test_fused_transposed_refused(make_ckpt):
    p = make_ckpt("bf16-fused", num_layers=1, intermediate=64)  # 2I != H, so the shapes are unambiguous
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    t["model.layers.0.mlp.experts.gate_up_proj"] = t["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2).contiguous()
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="transposed"):
        _reader(p).moe_layers()


def test_fp32_cast_and_quantize_from_fp32(synth_ckpt):
    p = synth_ckpt("fp32")
    et = _reader(p).read_expert(0, 1)
    g, _, _ = synthetic_expert_weights(0, 0, 1, H, I)
    assert et.gate.weight.dtype == torch.bfloat16 and torch.equal(et.gate.weight, g.to(torch.bfloat16))
    q = _reader(p, quantize="mxfp8").read_expert(0, 1)
    assert torch.equal(q.gate.weight, codecs.quantize_mxfp8(g)[0])  # from fp32, not via bf16


@pytest.mark.parametrize("q", ["mxfp4", "mxfp8", "nvfp4"])
def test_quantize_unquantized(synth_ckpt, q):
    r = _reader(synth_ckpt("bf16", shared=1), quantize=q)
    assert r.row == q and r.format_name == "unquantized"
    et = r.read_expert(1, 7)
    et.validate(q, H, I, "t")
    ref = synthetic_expert_weights(0, 1, 7, H, I)
    for got, want in zip(et.dequantize(q), ref):
        assert _rel(got, want) < TOL[q]
    if q == "nvfp4":
        assert et.gate.global_scale == et.up.global_scale  # quantized together
        assert et.down.input_scale is None  # no calibration data
        s = r.read_expert_scalars(1, 7)
        assert s.gate_global == et.gate.global_scale
    assert r.moe_layers()[0].shared.encoding == "bf16"


def test_quantize_on_quantized_refused(synth_ckpt):
    with pytest.raises(FormatError, match="unquantized .* only.*modelopt-nvfp4"):
        _reader(synth_ckpt("modelopt-nvfp4"), quantize="mxfp4")
    with pytest.raises(FormatError, match="quantize='int4'"):
        _reader(synth_ckpt("bf16"), quantize="int4")


def test_deepseek_v4_native(synth_ckpt):
    src = open_source(synth_ckpt("deepseek-v4", shared=1))
    r = detect_reader(src)
    assert r.format_name == "deepseek-v4" and r.row == "mxfp4"
    info = r.moe_layers()[0]
    assert info.prefix == "layers.0.ffn"
    et = r.read_expert(0, 2)
    raw_w = src.get_tensor("layers.0.ffn.experts.2.w3.weight")
    raw_s = src.get_tensor("layers.0.ffn.experts.2.w3.scale")
    assert raw_w.dtype == torch.int8 and raw_s.dtype == torch.float8_e8m0fnu
    # bit views, not value casts
    assert et.up.weight.dtype == torch.uint8 and torch.equal(et.up.weight, raw_w.view(torch.uint8))
    assert torch.equal(et.up.scale, raw_s.view(torch.uint8))
    # FP8 shared experts with 128x128 E8M0 blocks -> exact per-32 mxfp8 encoding
    assert info.shared.encoding == "mxfp8"
    (sh,) = r.read_shared(0)
    w = src.get_tensor("layers.0.ffn.shared_experts.w2.weight").float()
    s = src.get_tensor("layers.0.ffn.shared_experts.w2.scale").view(torch.uint8)
    block = codecs.ue8m0_decode(s).repeat_interleave(128, 0)[:H].repeat_interleave(128, 1)[:, :I]
    assert torch.equal(sh.down.dequantize("mxfp8"), w * block)
    assert r.model_facts().activation.clamp == 10.0  # swiglu_limit


def test_shared_excluded_is_bf16(synth_ckpt):
    r = _reader(synth_ckpt("modelopt-nvfp4", shared=1, shared_format="bf16"))
    info = r.moe_layers()[0]
    assert info.shared.encoding == "bf16"
    (sh,) = r.read_shared(0)
    assert sh.gate.weight.dtype == torch.bfloat16 and sh.gate.scale is None


def test_qwen2_style_gated_shared_expert_not_fusable(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    for r, shape in (("gate_proj", (64, H)), ("up_proj", (64, H)), ("down_proj", (H, 64))):
        t[f"model.layers.0.mlp.shared_expert.{r}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    t["model.layers.0.mlp.shared_expert_gate.weight"] = torch.zeros(1, H, dtype=torch.bfloat16)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    _edit_config(p, lambda c: c.update(shared_expert_intermediate_size=64))
    r = _reader(p)
    sh = r.moe_layers()[0].shared
    assert sh is not None and "sigmoid gate" in sh.unsupported_reason
    assert (sh.num_shared, sh.intermediate) == (1, 64)
    assert not any("shared_expert" in n for n in r.consumed_tensor_names())


def test_sharded_checkpoint_reads_across_files(synth_ckpt):
    p = synth_ckpt("quark-mxfp4", max_shard_bytes=100_000, shared=1)
    src = open_source(p)
    r = detect_reader(src)
    files = {src.file_of(n) for n in r.moe_layers()[1].expert_tensor_names}
    assert len(files) > 1
    a = r.read_expert(1, 7)
    b = _reader(synth_ckpt("quark-mxfp4", shared=1)).read_expert(1, 7)
    assert torch.equal(a.down.weight, b.down.weight) and torch.equal(a.down.scale, b.down.scale)


# ------------------------------------------------------------------ config facts


def test_model_facts_from_config(make_ckpt):
    p = make_ckpt("bf16", shared=1, routed_scaling_factor=2.5)
    r = _reader(p)
    f = r.model_facts()
    assert f.routed_scaling_factor == 2.5 and f.model_type == "deepseek_v3" and f.norm_topk_prob is True
    assert f.num_shared == 1 and f.shared_intermediate == I


def test_situ_activation(make_ckpt):
    p = make_ckpt("bf16")
    _edit_config(p, lambda c: c.update(hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0))
    a = _reader(p).model_facts().activation
    assert (a.kind, a.situ_beta, a.situ_linear_beta) == ("situ", 4.0, 25.0)


def test_unsupported_activation(make_ckpt):
    p = make_ckpt("bf16")
    _edit_config(p, lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(FormatError, match="hidden_act='gelu'"):
        _reader(p).model_facts()


def test_missing_top_k(make_ckpt):
    p = make_ckpt("bf16")
    _edit_config(p, lambda c: c.pop("num_experts_per_tok"))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        _reader(p).model_facts()


def test_dense_layers_and_expected_layers(make_ckpt):
    p = make_ckpt("ct-mxfp4", num_layers=3, first_k_dense_replace=1, shared=1)
    r = _reader(p)
    assert [l.index for l in r.moe_layers()] == [1, 2]
    # config claims layer 0 is MoE too -> its experts are missing
    _edit_config(p, lambda c: c.update(first_k_dense_replace=0))
    with pytest.raises(CheckpointError, match=r"layers \[0\] are MoE"):
        _reader(p).moe_layers()


def test_config_sizes_missing_are_inferred(make_ckpt):
    p = make_ckpt("modelopt-mxfp4", num_layers=1)
    _edit_config(p, lambda c: (c.pop("moe_intermediate_size"), c.pop("num_experts")))
    info = _reader(p).moe_layers()[0]
    assert (info.num_experts, info.hidden, info.intermediate) == (E, H, I)


# ------------------------------------------------------------------ defects


def test_missing_expert(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", missing_expert=(1, 5))
    with pytest.raises(CheckpointError, match=r"layer 1 is missing expert\(s\) \[5\] of 8.*experts\.5"):
        _reader(p).moe_layers()


def test_missing_projection_tensor(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    del t["model.layers.0.mlp.experts.4.up_proj.weight_scale_2"]
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 0 expert 4 up: missing tensor .*up_proj.weight_scale_2"):
        _reader(p).moe_layers()


def test_more_experts_than_config(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    _edit_config(p, lambda c: c.update(num_experts=6))
    with pytest.raises(CheckpointError, match=r"expert\(s\) \[6, 7\].*num_experts=6"):
        _reader(p).moe_layers()


def test_fewer_experts_than_config(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    _edit_config(p, lambda c: c.update(num_experts=10))
    with pytest.raises(CheckpointError, match=r"missing expert\(s\) \[8, 9\] of 10"):
        _reader(p).moe_layers()


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "ct-mxfp4", "deepseek-v4", "bf16"])
def test_wrong_shape(make_ckpt, fmt):
    p = make_ckpt(fmt, wrong_shape=(1, 2, "down"))
    with pytest.raises(CheckpointError) as ei:
        _reader(p).moe_layers()
    msg = str(ei.value)
    assert "layer 1 expert 2 down" in msg and "model.safetensors" in msg
    cols = {"modelopt-nvfp4": I // 2, "ct-mxfp4": I // 2, "deepseek-v4": I // 2, "bf16": I}[fmt]
    assert f"[{H - 1}, {cols}]" in msg and f"expected [{H}, {cols}]" in msg


def test_hidden_size_mismatch(make_ckpt):
    p = make_ckpt("modelopt-mxfp8", num_layers=1)
    _edit_config(p, lambda c: c.update(hidden_size=512))
    with pytest.raises(CheckpointError, match="expected \\[128, 512\\]"):
        _reader(p).moe_layers()


def test_wrong_dtype(make_ckpt):
    p = make_ckpt("modelopt-mxfp4", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    n = "model.layers.0.mlp.experts.1.gate_proj.weight_scale"
    t[n] = t[n].to(torch.float32)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{n}.*F32.*U8"):
        _reader(p).moe_layers()


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "quark-nvfp4", "ct-nvfp4"])
@pytest.mark.parametrize("defect", ["nan_scale", "zero_scale"])
def test_bad_global_scale_raises_scale_error(make_ckpt, fmt, defect):
    p = make_ckpt(fmt, num_layers=1, **{defect: (0, 3, "up")})
    r = _reader(p)
    r.moe_layers()  # structure is fine
    r.read_expert(0, 2)
    with pytest.raises(ScaleError, match="layer 0 expert 3 up: .*experts.3.up_proj.* \\(in model.safetensors\\)") as ei:
        r.read_expert(0, 3)
    assert ("nan" if defect == "nan_scale" else "0.0") in str(ei.value)


@pytest.mark.parametrize("fmt", ["modelopt-mxfp4", "quark-mxfp8", "deepseek-v4"])
def test_ff_block_scale_bytes_preserved(make_ckpt, fmt):
    """0xFF / zero E8M0 bytes are value defects for checks.py; the reader hands
    the bytes over unchanged so checks can name them."""
    p = make_ckpt(fmt, num_layers=1, ff_scale=(0, 1, "gate"), zero_scale=(0, 2, "down"))
    r = _reader(p)
    assert int(r.read_expert(0, 1).gate.scale.view(-1)[0]) == 0xFF
    assert int(r.read_expert(0, 2).down.scale.view(-1)[0]) == 0


def test_scale_mismatch_visible(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", num_layers=1, scale_mismatch=(0, 6), mismatch_factor=3.0)
    r = _reader(p)
    s = r.read_expert_scalars(0, 6)
    assert abs(s.up_global / s.gate_global - 1) > 0.05  # w1/w3 weight_scale_2 disagree
    ok = r.read_expert_scalars(0, 5)
    assert ok.up_global == ok.gate_global


def test_excluded_experts_refused(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", excluded_layer=1)
    with pytest.raises(FormatError, match="layer 1 .* unquantized .*quantization config excludes them"):
        _reader(p).moe_layers()


# ------------------------------------------------------------------ detection / refusals


def _set_quant(p: Path, qc: dict | None, hf: dict | None = None) -> None:
    _edit_config(p, lambda c: c.update(quantization_config=qc) if qc is not None else c.pop("quantization_config", None))
    hq = p / "hf_quant_config.json"
    if hf is None:
        hq.unlink(missing_ok=True)
    else:
        hq.write_text(json.dumps(hf))


@pytest.mark.parametrize(
    "algo, match",
    [
        ("W4A8_AWQ", "W4A8_AWQ"),
        ("FP8", "per-tensor FP8"),
        ("NVFP4_AWQ", "pre_quant_scale"),
    ],
)
def test_modelopt_refusals(make_ckpt, algo, match):
    p = make_ckpt("modelopt-nvfp4", num_layers=1)
    hf = json.loads((p / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = algo
    (p / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(FormatError, match=match) as ei:
        _reader(p)
    assert "Supported ModelOpt algorithms: NVFP4, MXFP4, MXFP8" in str(ei.value)
    assert "To convert this model: re-export" in str(ei.value) and "--quantize" in str(ei.value)


@pytest.mark.parametrize("base, algo, fmt, needs_flag", [
    ("modelopt-mxfp4", "W4A8_MXFP4_FP8", "modelopt-mxfp4", False),
    ("modelopt-nvfp4", "W4A16_NVFP4", "modelopt-nvfp4", True),
    ("modelopt-nvfp4", "W4A8_NVFP4_FP8", "modelopt-w4a8-nvfp4-fp8", True),
])
def test_modelopt_activation_recipes(make_ckpt, base, algo, fmt, needs_flag):
    """The activation variants of the formats the rows read: W4A8_MXFP4_FP8 converts
    (MXFP8 per 32 is finer than per-tensor FP8); the others name the flag."""
    from megamoe_convert.readers import detect_reader
    from megamoe_convert.readers.source import open_source

    p = make_ckpt(base, num_layers=1)
    hf = json.loads((p / "hf_quant_config.json").read_text())
    hf["quantization"]["quant_algo"] = algo
    (p / "hf_quant_config.json").write_text(json.dumps(hf))
    if needs_flag:
        with pytest.raises(FormatError, match="--accept-activation-change"):
            _reader(p)
    r = detect_reader(open_source(p), accept_activation_change=True)
    assert r.format_name == fmt and r.activation_change.needs_flag == needs_flag
    if algo == "W4A8_NVFP4_FP8":  # its block scales are per 32: a per-16 export is not one
        with pytest.raises(CheckpointError, match="one scale per 32"):
            r.moe_layers()


def test_modelopt_config_only_detection(make_ckpt):
    p = make_ckpt("modelopt-mxfp8", num_layers=1)
    (p / "hf_quant_config.json").unlink()
    assert _reader(p).format_name == "modelopt-mxfp8"


def test_modelopt_mixed_precision(make_ckpt):
    p = make_ckpt("modelopt-nvfp4", num_layers=2)
    hf = json.loads((p / "hf_quant_config.json").read_text())
    layers = {f"model.layers.{L}.mlp.experts.{e}.{r}_proj": {"quant_algo": "NVFP4", "group_size": 16}
              for L in range(2) for e in range(E) for r in ("gate", "up", "down")}
    layers["model.layers.0.self_attn.q_proj"] = {"quant_algo": "FP8"}
    hf["quantization"] = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    (p / "hf_quant_config.json").write_text(json.dumps(hf))
    assert _reader(p).format_name == "modelopt-nvfp4"
    layers["model.layers.1.mlp.experts.3.down_proj"] = {"quant_algo": "FP8"}
    (p / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(FormatError, match="MIXED_PRECISION .*different algorithms.*FP8: 1 modules"):
        _reader(p)


@pytest.mark.parametrize(
    "fmt, match",
    [("float-quantized", "FP8"), ("pack-quantized", "INT4"), ("dense", "uncompressed")],
)
def test_ct_refusals(make_ckpt, fmt, match):
    p = make_ckpt("ct-nvfp4", num_layers=1)
    _edit_config(p, lambda c: c["quantization_config"].update(format=fmt, config_groups={}))
    with pytest.raises(FormatError, match=f"'{fmt}' is not supported: .*{match}.*nvfp4-pack-quantized"):
        _reader(p)


def test_ct_mixed_precision_single_supported_group(make_ckpt):
    p = make_ckpt("ct-mxfp8", num_layers=1)

    def edit(c):
        q = c["quantization_config"]
        q["format"] = "mixed-precision"
        q["config_groups"]["group_1"] = {"targets": ["re:.*self_attn.*"], "format": "float-quantized"}

    _edit_config(p, edit)
    assert _reader(p).format_name == "ct-mxfp8"


def test_quark_refusal_and_legacy_mx(make_ckpt):
    p = make_ckpt("quark-mxfp4", num_layers=1)
    _edit_config(p, lambda c: c["quantization_config"]["global_quant_config"].update(
        weight={"dtype": "int4", "qscheme": "per_group", "group_size": 128}))
    with pytest.raises(FormatError, match="Quark export with .*int4.* not supported"):
        _reader(p)
    _edit_config(p, lambda c: c["quantization_config"]["global_quant_config"].update(
        weight={"dtype": "mx", "mx_element_dtype": "fp4", "group_size": 32}))
    assert _reader(p).format_name == "quark-mxfp4"


def test_block_fp8_other_than_128_and_per_tensor_fp8_refused(make_ckpt):
    p = make_ckpt("fp8-block", num_layers=1)
    _set_quant(p, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [64, 128]})
    with pytest.raises(FormatError, match=r"weight blocks of \[64, 128\]; the fp8_block row .* takes exactly "
                                          r"\[128, 128\]"):
        _reader(p)
    _set_quant(p, {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})
    with pytest.raises(FormatError, match="fmt 'e5m2'; the fp8_block row holds E4M3 weights only"):
        _reader(p)
    _set_quant(p, {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(FormatError, match="without weight_block_size .*per-tensor or per-channel FP8.*"
                                          r"--quantize mxfp4\|mxfp8\|nvfp4\|fp8_block"):  # the row it re-exports to
        _reader(p)


def test_gpt_oss_refused(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    t["model.layers.0.mlp.experts.gate_up_proj_bias"] = torch.zeros(E, 2 * I)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="gpt-oss"):
        _reader(p).moe_layers()
    _set_quant(p, {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    with pytest.raises(FormatError, match="cannot tell the checkpoint format .*quant_method='mxfp4'"):
        _reader(p)


def test_expert_bias_refused(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    t["model.layers.0.mlp.experts.0.down_proj.bias"] = torch.zeros(H, dtype=torch.bfloat16)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FormatError, match="expert bias .*experts.0.down_proj.bias"):
        _reader(p).moe_layers()


def test_unexpected_expert_tensor(make_ckpt):
    p = make_ckpt("ct-mxfp4", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    t["model.layers.0.mlp.experts.0.up_proj.weight_zero_point"] = torch.zeros(I, dtype=torch.int8)
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor.*weight_zero_point"):
        _reader(p).moe_layers()


def test_format_override(synth_ckpt):
    p = synth_ckpt("ct-mxfp4")
    # forced reader that does not match the tensors: a clear structural error
    with pytest.raises(CheckpointError, match="missing tensor .*weight_packed|weight"):
        _reader(p, format="modelopt-mxfp4").moe_layers()
    assert _reader(p, format="compressed-tensors-mxfp4").format_name == "ct-mxfp4"
    with pytest.raises(FormatError, match="unknown format 'nope'; valid: modelopt-nvfp4"):
        _reader(p, format="nope")


def test_no_moe_tensors(make_ckpt):
    p = make_ckpt("bf16", num_layers=1, first_k_dense_replace=1)
    with pytest.raises(CheckpointError, match="no routed-expert tensors"):
        _reader(p).moe_layers()


def test_not_an_moe_layer(synth_ckpt):
    r = _reader(synth_ckpt("bf16"))
    with pytest.raises(CheckpointError, match="layer 7 is not an MoE layer"):
        r.read_expert(7, 0)
    with pytest.raises(CheckpointError, match="experts 0..7, not 8"):
        r.read_expert(0, 8)


def test_modelopt_kv_cache_only_is_unquantized(make_ckpt):
    p = make_ckpt("bf16", num_layers=1)
    _set_quant(p, None, {"producer": {"name": "modelopt", "version": "0.47.0"},
                         "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}})
    r = _reader(p)
    assert r.format_name == "unquantized" and r.row == "bf16"


def test_quark_mxfp8_row_blocked_scales_expand(make_ckpt):
    """vLLM reports Quark MXFP8 scales stored per block of R rows ([out/R, in/32]);
    each byte covers R rows, so expanding it is exact."""
    p = make_ckpt("quark-mxfp8", num_layers=1)
    from safetensors.torch import load_file, save_file

    t = load_file(p / "model.safetensors")
    n = "model.layers.0.mlp.experts.2.down_proj.weight_scale"
    blocked = t[n][::32].contiguous()  # [H/32, I/32]
    t[n] = blocked
    save_file(t, p / "model.safetensors", metadata={"format": "pt"})
    et = _reader(p).read_expert(0, 2)
    assert et.down.scale.shape == (H, I // 32)
    assert torch.equal(et.down.scale, blocked.repeat_interleave(32, 0))
    # not allowed for formats that do not store blocks
    p2 = make_ckpt("modelopt-mxfp8", num_layers=1)
    t = load_file(p2 / "model.safetensors")
    t[n] = t[n][::32].contiguous()
    save_file(t, p2 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{n}.*shape \\[8, 4\\], expected \\[256, 4\\]"):
        _reader(p2).moe_layers()


@pytest.mark.parametrize("key, value", [("routed_scaling_factor", "2.5x"), ("swiglu_limit", "none"),
                                        ("swiglu_alpha", [1.0])])
def test_non_numeric_config_value_is_a_format_error(make_ckpt, key, value):
    """A config value that is not a number is bad input (FormatError naming the
    key and value, CLI exit 2), not a ValueError/TypeError traceback (exit 1)."""
    p = make_ckpt("bf16")
    _edit_config(p, lambda c: c.update({key: value}))
    with pytest.raises(FormatError, match=key):
        _reader(p).model_facts()


def test_detection_order_is_explicit_and_followed(tmp_path, monkeypatch):
    """DETECTION_ORDER lists every registered reader once, and detect_reader tries them in that order
    (not import order): with two readers both claiming a checkpoint, the earlier one wins."""
    from megamoe_convert import readers
    from megamoe_convert.readers.base import registered_readers
    from megamoe_convert.readers.source import open_source
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    assert sorted(readers.DETECTION_ORDER) == sorted(registered_readers())
    assert readers.available_formats() == list(readers.DETECTION_ORDER)
    src = open_source(build_synthetic_checkpoint(tmp_path / "s", "quark-mxfp4", num_layers=1, hidden=128,
                                                 intermediate=128, num_experts=2, top_k=1))
    assert detect_reader(src).format_name == "quark-mxfp4"
    regs = registered_readers()
    monkeypatch.setattr(regs["ct-mxfp4"], "detect", classmethod(lambda cls, s: True))
    assert detect_reader(src).format_name == "quark-mxfp4"  # quark comes first
    order = list(readers.DETECTION_ORDER)
    order.remove("ct-mxfp4")
    monkeypatch.setattr(readers, "DETECTION_ORDER", ("ct-mxfp4", *order))
    assert detect_reader(src).format_name == "ct-mxfp4"  # negative control: the order decides


def test_param_reads_suffix_meanings_from_the_runtime_table():
    """A reader's Param takes divisor-or-multiplier from megamoe_runtime.format.source_formats (the raw loader's
    table) and refuses a suffix used as another kind than the runtime gives it."""
    from megamoe_convert.readers.common import Param

    assert Param("global", ("weight_global_scale",), ("F32",)).invert
    assert not Param("global", ("weight_scale_2",), ("F32",)).invert
    assert not Param("scale", ("weight_scale_inv",), ("F8_E8M0",)).invert  # unknown to the raw loader: as stored
    with pytest.raises(TypeError, match="global_scale"):
        Param("input", ("weight_scale_2",), ("F32",))
    with pytest.raises(TypeError, match="mix divisors"):
        Param("input", ("input_scale", "input_global_scale"), ("F32",))


def test_every_reader_hook_is_declared_on_the_base_class():
    """What a reader class adds beyond CheckpointReader is its own machinery (the scheme and what
    reading it needs), never a hook the converter calls: those are all declared on the base (issue 12)."""
    from megamoe_convert.readers import CheckpointReader, readers_in_order

    internal = {"scheme", "shared_schemes", "reads_fused", "direct_weight_bytes", "excluded_by_config",
                "algos", "ct_format", "quark_row"}
    for cls in readers_in_order():
        extra = {n for n in dir(cls) if not n.startswith("_")} - set(dir(CheckpointReader))
        assert extra <= internal, f"{cls.format_name}: {sorted(extra - internal)} not declared on CheckpointReader"
    root = Path(__file__).resolve().parents[3] / "megamoe_convert"
    paths = [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "readers"]
    assert len(paths) > 20, "the converter's modules moved: find them again, or this check reads nothing"
    for path in paths:  # outside readers/: nothing reaches into the internals
        text = path.read_text()
        used = sorted(n for n in internal if f".{n}" in text)
        assert not used, f"{path.name} uses reader internals {used}"
