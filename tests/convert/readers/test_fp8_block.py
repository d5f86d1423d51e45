"""Block-FP8 sources -> the fp8_block row (docs/FORMATS.md#fp8-block, docs/CHECKPOINTS.md#block-fp8).

1. Converted bytes are the source's bytes rearranged, never re-quantized: every routed
   weight byte and every scale value of the real producer fixtures (transformers
   FineGrainedFP8, llm-compressor FP8_BLOCK) and of the synthetic DeepSeek-V3-style source
   equals, in the written files, what `layout.block_fp8_kernel_layout` makes of the source
   tensors (bf16 scales widened to fp32 exactly).
2. Bad input: one clear error naming layer, expert, tensor and values, and nothing under OUT.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.output.output_dir import temp_dir_for
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source
from megamoe_runtime.format import layout
from megamoe_runtime.format.manifest import read_manifest

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"
REAL_FP8 = ["finegrained-fp8-qwen3moe", "finegrained-fp8-deepseekv3", "llmcompressor-fp8-block-qwen3moe",
            "llmcompressor-fp8-block-deepseekv3"]
SIZES = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def _files(out: Path) -> dict:
    t = {}
    for f in sorted(out.glob("*.safetensors")):
        t.update(load_file(f))
    return t


def _source_stack(src: dict, prefix: str, E: int, scale_suffix: str, H: int, I: int):
    def grid(t, n, k):
        return t.float().reshape(n // 128, k // 128)  # a squeezed producer grid gets its dims back

    def proj(e, p, n, k):
        base = f"{prefix}.experts.{e}.{p}"
        return src[base + ".weight"], grid(src[base + "." + scale_suffix], n, k)

    w13, s13, w2, s2 = [], [], [], []
    for e in range(E):
        (g, gs), (u, us), (d, ds) = proj(e, "gate_proj", I, H), proj(e, "up_proj", I, H), proj(e, "down_proj", H, I)
        w13.append(torch.cat([g, u])), s13.append(torch.cat([gs, us])), w2.append(d), s2.append(ds)
    return (torch.stack(w13), torch.stack(s13)), (torch.stack(w2), torch.stack(s2))


def _assert_bytes_rearranged(src_dir: Path, out: Path) -> int:
    m = read_manifest(out)
    assert m.row == "fp8_block" and m.layout == "sm90-block-fp8/1"
    got, src = _files(out), {}
    for f in sorted(src_dir.glob("*.safetensors")):
        src.update(load_file(f))
    suffix = "weight_scale_inv" if any(k.endswith("weight_scale_inv") for k in src) else "weight_scale"
    checked = 0
    for le in m.layers:
        spec = le.layer_spec()
        want = layout.block_fp8_kernel_layout(*_source_stack(src, le.prefix, spec.num_experts, suffix,
                                                             spec.hidden, spec.intermediate))
        for role in ("l1_weight", "l1_scale", "l2_weight", "l2_scale"):
            a, b = got[f"{le.prefix}.megamoe.{role}"], getattr(want, role)
            assert a.dtype == b.dtype and a.shape == b.shape, role
            bits = torch.uint8 if a.element_size() == 1 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits)), f"{src_dir.name} layer {le.index} {role}"
            checked += a.numel()
    return checked


@pytest.mark.parametrize("name", REAL_FP8)
def test_real_fixture_bytes_are_the_sources_rearranged(tmp_path, name):
    out = tmp_path / "out"
    s = convert(REAL / name, out)
    assert s.row == "fp8_block"
    assert _assert_bytes_rearranged(REAL / name, out) > 0


def test_synthetic_deepseek_v3_style_bytes_and_negative_control(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, shared=1, seed=5)
    out = tmp_path / "out"
    convert(src, out)
    _assert_bytes_rearranged(src, out)
    # negative control: the check sees one changed scale value
    f = next(out.glob("megamoe-experts-*.safetensors"))
    t = load_file(f)
    key = next(k for k in t if k.endswith("megamoe.l2_scale"))
    t[key] = t[key].clone()
    t[key][1, 0, 0] *= 2
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="l2_scale"):
        _assert_bytes_rearranged(src, out)


def test_shared_expert_stays_in_the_passthrough_files(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, shared=1, seed=6)
    out = tmp_path / "out"
    convert(src, out)
    m = read_manifest(out)
    assert all(not le.shared.get("fused_capable") for le in m.layers)
    names = set(_files(out))
    assert "model.layers.0.mlp.shared_experts.gate_proj.weight_scale_inv" in names
    assert not any(k.endswith("megamoe.shared_l1_weight") for k in names)


# --------------------------------------------------------------------------- bad input


def _set(name, value):
    def fn(t):
        t[name] = value(t[name])
    return fn


P = "model.layers.1.mlp.experts.2"


def _nan_byte(w):
    w = w.view(torch.uint8).clone()
    w[3, 5] = 0xFF
    return w.view(torch.float8_e4m3fn)


def _nan_byte_7f(w):
    w = w.view(torch.uint8).clone()
    w[3, 5] = 0x7F
    return w.view(torch.float8_e4m3fn)


def _scale(v):
    def f(s):
        s = s.clone()
        s.view(-1)[0] = v
        return s
    return f


BAD = [
    ("scale wrong shape", _set(f"{P}.down_proj.weight_scale_inv", lambda s: torch.ones(3, 2)),
     ["layer 1 expert 2 down", f"{P}.down_proj.weight_scale_inv", "[3, 2]", "expected [2, 1]", "128x128 block"]),
    ("nan scale", _set(f"{P}.gate_proj.weight_scale_inv", _scale(float("nan"))),
     ["MoE layer 1", "expert 2", "gate", f"{P}.gate_proj.weight_scale_inv", "nan", "[0, 0]"]),
    ("inf scale", _set(f"{P}.up_proj.weight_scale_inv", _scale(float("inf"))),
     ["MoE layer 1", "expert 2", "up", "inf"]),
    ("negative scale", _set(f"{P}.down_proj.weight_scale_inv", _scale(-0.5)),
     ["MoE layer 1", "expert 2", "down", "-0.5", "not finite and > 0"]),
    ("zero scale", _set(f"{P}.down_proj.weight_scale_inv", _scale(0.0)),
     ["MoE layer 1", "expert 2", "down", "0.0", "all-zero block"]),
    ("E4M3 NaN weight byte", _set(f"{P}.up_proj.weight", _nan_byte),
     ["MoE layer 1", "expert 2", "up weight", f"{P}.up_proj.weight in", "NaN", "[3, 5]", "0xFF"]),
    ("E4M3 NaN weight byte 0x7F", _set(f"{P}.down_proj.weight", _nan_byte_7f),
     ["MoE layer 1", "expert 2", "down weight", f"(source tensor {P}.down_proj.weight in model.safetensors)",
      "[3, 5]", "0x7F"]),
    ("scale whose block overflows fp32", _set(f"{P}.gate_proj.weight_scale_inv", _scale(2.0 ** 126)),
     ["MoE layer 1", "expert 2", "gate scale", f"{P}.gate_proj.weight_scale_inv", "[0, 0] = 8.507059173023462e+37 over |E4M3| 448.0",
      "make their block overflow fp32"]),
    ("mixed formats: one expert BF16", _set(f"{P}.up_proj.weight", lambda w: w.float().to(torch.bfloat16)),
     ["layer 1", "1 of 12 routed expert projection(s) stored unquantized", f"{P}.up_proj.weight"]),
    ("mixed formats: UE8M0 scale", _set(f"{P}.gate_proj.weight_scale_inv",
                                        lambda s: torch.full(s.shape, 120, dtype=torch.uint8)),
     ["layer 1 expert 2 gate", f"{P}.gate_proj.weight_scale_inv", "dtype U8", "F32 or BF16"]),
]


@pytest.mark.parametrize("name, edit, needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_refused_nothing_written(tmp_path, edit_source, name, edit, needles):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    edit_source(src, edit)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out)])
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert r.exit_code == 2, r.output
    assert err.startswith("error: ") and "Traceback" not in r.output, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert not out.exists() and not temp_dir_for(out).exists()


@pytest.mark.parametrize("block", [[64, 64], [128, 64], [256, 256]])
def test_other_block_sizes_refused_with_the_values(tmp_path, block):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 2 and f"weight blocks of {block}" in r.output and "[128, 128]" in r.output, r.output
    assert not out.exists()


def test_block_size_that_is_no_list_is_shown_as_json(tmp_path):
    """A string "[128, 128]" was shown bare ("declares weight blocks of [128, 128]; ... takes exactly [128, 128]")."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = "[128, 128]"
    (src / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out")])
    assert r.exit_code == 2 and 'weight blocks of "[128, 128]" (not a list [rows, cols])' in r.output, r.output


def test_ct_block_structure_other_than_128_refused(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "ct-fp8-block", **SIZES, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"weight blocks of \[64, 64\]"):
        detect_reader(open_source(str(src)))


def test_ep2_ranks_hold_their_experts_and_build_layers(tmp_path):
    import megamoe_runtime as mr

    src = REAL / "llmcompressor-fp8-block-deepseekv3"
    convert(src, tmp_path / "ep1")
    convert(src, tmp_path / "ep2", ep_size=2)
    one = _files(tmp_path / "ep1")
    for r in range(2):
        rank = {}
        for f in sorted((tmp_path / "ep2").glob(f"megamoe-experts-rank{r:03d}-*.safetensors")):
            rank.update(load_file(f))
        assert rank
        for k, t in rank.items():
            bits = torch.uint8 if t.element_size() == 1 else torch.int32
            assert torch.equal(t.view(bits), one[k][2 * r:2 * r + 2].view(bits)), (r, k)
    ck = mr.open_checkpoint(tmp_path / "ep2")
    layer = ck.build_layer(1, device="cpu", backend="reference", ep_rank=1, ep_size=2)
    assert layer.spec.row == "fp8_block" and layer.l1_scale.dtype == torch.float32
    assert list(layer.spec.local_experts) == [2, 3]


@pytest.mark.parametrize("name", ["finegrained-fp8-deepseekv3", "llmcompressor-fp8-block-deepseekv3"])
def test_raw_load_of_the_source_equals_the_converted_layer(tmp_path, name):
    """The runtime's raw (vLLM-style) load of the producer's own tensors writes the converter's bytes
    (transformers' squeezed scale grids and CT's bf16 scales included)."""
    import megamoe_runtime as mr
    from megamoe_runtime.layer.experts import DeepGemmMegaMoEExperts
    from megamoe_runtime.load.raw_load import load_raw_checkpoint

    convert(REAL / name, tmp_path / "out")
    ck = mr.open_checkpoint(tmp_path / "out")
    layer = DeepGemmMegaMoEExperts(ck.layer_spec(1), backend="reference", prefix=ck.layer_entry(1).prefix,
                                   layer_index=1)
    rep = load_raw_checkpoint(layer, REAL / name)
    assert len(rep.written) == 4 * 3 * 2 and not rep.skipped
    conv = ck.build_layer(1, device="cpu", backend="reference")
    for role in ("l1_weight", "l1_scale", "l2_weight", "l2_scale"):
        a, b = getattr(layer, role), getattr(conv, role)
        bits = torch.uint8 if a.element_size() == 1 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits)), role


def test_ct_source_nan_weight_byte_refused_through_direct_reads(tmp_path, edit_source):
    """Readers whose weights the converter reads in place (both block-FP8 readers) still check every byte."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "ct-fp8-block", **SIZES, seed=3)
    edit_source(src, _set(f"{P}.down_proj.weight", _nan_byte))
    with pytest.raises(Exception, match=r"expert 2 down weight .*down_proj\.weight.*E4M3 weight byte\(s\) are NaN"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantize_bf16_source_into_the_row(tmp_path):
    """--quantize fp8_block: each 128x128 block gets scale amax/448 and RNE E4M3 codes of w/scale (the
    DeepSeek-V3 / FineGrainedFP8 convention, written out here); the served layer passes the self-check."""
    from megamoe_convert.testing.selfcheck import compare_with_source

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=7)
    out = tmp_path / "out"
    assert convert(src, out, quantize="fp8_block").row == "fp8_block"
    w = load_file(next(src.glob("*.safetensors")))["model.layers.1.mlp.experts.3.down_proj.weight"].float()
    blocks = w.reshape(2, 128, 1, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(256, 128)
    got = _files(out)
    assert torch.equal(got["model.layers.1.mlp.megamoe.l2_scale"][3], scale)
    assert torch.equal(got["model.layers.1.mlp.megamoe.l2_weight"][3].view(torch.uint8), codes.view(torch.uint8))
    assert all(r.ok for r in compare_with_source(src, out, quantize="fp8_block"))


def test_huge_scale_over_small_or_zero_elements_still_converts(tmp_path, edit_source):
    """The overflow refusal looks at each block's largest element: 2**126 over an all-zero block, or over
    elements of at most 1.75 (1.75 * 2**126 is finite in fp32), converts unchanged."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)

    def fn(t):
        w = t[f"{P}.gate_proj.weight"].view(torch.uint8).clone()
        w[:, :128] = 0
        w[:, 128:] = torch.where((w[:, 128:] & 0x7F) > 0x3E, w[:, 128:] & 0x80 | 0x3E, w[:, 128:])  # |x| <= 1.75
        t[f"{P}.gate_proj.weight"] = w.view(torch.float8_e4m3fn)
        t[f"{P}.gate_proj.weight_scale_inv"] = torch.full_like(t[f"{P}.gate_proj.weight_scale_inv"], 2.0 ** 126)
    edit_source(src, fn)
    assert float(torch.tensor(0x3E, dtype=torch.uint8).view(torch.float8_e4m3fn).float()) == 1.75
    convert(src, tmp_path / "out")
    got = _files(tmp_path / "out")["model.layers.1.mlp.megamoe.l1_scale"][2]
    assert bool((got == 2.0 ** 126).any())


@pytest.mark.parametrize("quantize", ["fp8_block", "mxfp8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_quantize_refuses_a_non_finite_source_weight(tmp_path, edit_source, refused_convert, quantize, value):
    """--quantize of a BF16 source holding NaN / inf: refused naming layer, expert, tensor, index and value.
    Before: fp8_block blamed 'E4M3 weight byte(s) are NaN' (its own quantizer's output) and mxfp8 converted
    (the layer served NaN)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=7)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"

    def put(w):
        w = w.clone()
        w[5, 7] = value
        return w
    edit_source(src, _set(name, put))
    err = refused_convert(src, tmp_path / "out", "--quantize", quantize)
    for n in ("layer 1 expert 2 up", name, "1 non-finite value", f"first at [5, 7] = {value!r}", f"--quantize {quantize}"):
        assert n in err, f"{n!r} not in {err!r}"


def test_quantize_non_finite_in_fused_experts_names_the_expert(tmp_path, edit_source):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SIZES, seed=7, naming="fused")
    name = "model.layers.0.mlp.experts.down_proj"

    def put(w):
        w = w.clone()
        w[3].view(-1)[0] = float("-inf")
        return w
    edit_source(src, _set(name, put))
    with pytest.raises(Exception, match=rf"layer 0 expert 3 down: {name}\[3\] .*first at \[0, 0\] = -inf"):
        convert(src, tmp_path / "out", quantize="fp8_block")
    assert not (tmp_path / "out").exists()


def test_a_layer_modules_to_not_convert_excludes_is_refused_for_that_reason(tmp_path):
    """A FineGrainedFP8 export whose ``modules_to_not_convert`` keeps layer 1's experts in BF16: the synthetic
    writer now writes that list as the producer does (it wrote DeepSeek-V3's config, no list at all), and the
    refusal says the config excludes them, naming the entry (it said "the config does not describe these
    tensors" and sent the user to --format unquantized)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3, excluded_layer=1)
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    real = json.loads((REAL / "finegrained-fp8-qwen3moe" / "config.json").read_text())["quantization_config"]
    assert sorted(qc) == sorted(real) and {k: qc[k] for k in real if k != "modules_to_not_convert"} == \
        {k: v for k, v in real.items() if k != "modules_to_not_convert"}
    assert "model.layers.1.mlp.experts" in qc["modules_to_not_convert"]
    assert not any("layers.0.mlp.experts" in m or "*" in m for m in qc["modules_to_not_convert"])
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 2, r.output
    assert ("layer 1 has 12 of 12 routed expert projection(s) stored unquantized (e.g. "
            "model.layers.1.mlp.experts.0.gate_proj.weight, BF16) - the quantization config excludes them (its list "
            "of unquantized modules names 'model.layers.1.mlp.experts')") in r.stderr, r.stderr
    assert "does not describe" not in r.stderr and not out.exists()
    # MiniMax's name for the list; and without a list naming them, the tensors are still what the config
    # does not describe
    for qc2, said in ((dict(qc, modules_to_not_convert=None, ignored_layers=["model.layers.1.mlp.experts"]),
                       "excludes them"), (dict(qc, modules_to_not_convert=["model.layers.10.mlp.experts"]),
                                          "the config does not describe these tensors")):
        (src / "config.json").write_text(json.dumps(
            dict(json.loads((src / "config.json").read_text()), quantization_config=qc2)))
        r = CliRunner().invoke(main, ["convert", str(src), str(out)])
        assert r.exit_code == 2 and said in r.stderr, r.stderr


@pytest.mark.parametrize("entry, named", [
    ("model.layers.1.mlp.experts", True), ("model.layers.1", True), ("model.layers.1.mlp.experts.0.gate_proj", True),
    ("gate_proj", True), (r"model\.layers\.\d+\.mlp\.experts", True), ("model.layers.10", False),
    ("model.layers.1.mlp.experts.0.gate", False), ("experts.0.gate", False), ("model.layers.1.mlp.exp[", False),
])
def test_modules_to_not_convert_names_modules_as_transformers_does(entry, named):
    """An entry is the module's name, a module above it, or its trailing names (a regex from the start), and it
    ends at a dot: ``model.layers.1`` does not name ``model.layers.10``, ``...gate`` not ``...gate_proj``."""
    from megamoe_convert.readers.fp8_block import FP8BlockReader

    assert FP8BlockReader._ignore_names(entry, "model.layers.1.mlp.experts.0.gate_proj") is named
