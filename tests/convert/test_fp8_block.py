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

from megamoe_convert import synth
from megamoe_convert.cli import main
from megamoe_convert.convert import convert
from megamoe_convert.output_dir import temp_dir_for
from megamoe_convert.readers import detect_reader
from megamoe_convert.source import open_source
from megamoe_runtime.format import layout
from megamoe_runtime.format.manifest import read_manifest

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
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


def _edit(src: Path, fn) -> None:
    f = next(src.glob("*.safetensors"))
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def _set(name, value):
    def fn(t):
        t[name] = value(t[name])
    return fn


P = "model.layers.1.mlp.experts.2"


def _nan_byte(w):
    w = w.view(torch.uint8).clone()
    w[3, 5] = 0xFF
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
    ("mixed formats: one expert BF16", _set(f"{P}.up_proj.weight", lambda w: w.float().to(torch.bfloat16)),
     ["layer 1", "1 of 12 routed expert projection(s) stored unquantized", f"{P}.up_proj.weight"]),
    ("mixed formats: UE8M0 scale", _set(f"{P}.gate_proj.weight_scale_inv",
                                        lambda s: torch.full(s.shape, 120, dtype=torch.uint8)),
     ["layer 1 expert 2 gate", f"{P}.gate_proj.weight_scale_inv", "dtype U8", "F32 or BF16"]),
]


@pytest.mark.parametrize("name, edit, needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_refused_nothing_written(tmp_path, name, edit, needles):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "fp8-block", **SIZES, seed=3)
    _edit(src, edit)
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


def test_ct_block_structure_other_than_128_refused(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "ct-fp8-block", **SIZES, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"weight blocks of \[64, 64\]"):
        detect_reader(open_source(str(src)))
