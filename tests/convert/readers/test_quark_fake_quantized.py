"""Quark MXFP8 fake-quantized exports (issue 31 item 1): amd-quark 0.13 writes MXFP8 only as BF16
quantize-dequantize weights plus float block scales; the converter re-encodes them exactly or refuses
with the true reason. The fixture is a real Quark 0.13 export (tests/fixtures/real/quark-mxfp8-qwen3moe)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import megamoe_runtime as mr
from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source
from megamoe_runtime.errors import FormatError, MegaMoEError, ScaleError
from megamoe_runtime.format import layout

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"
FAKE = REAL / "quark-mxfp8-qwen3moe"
SRC = REAL / "bf16-plain-qwen3moe"
W = "model.layers.0.mlp.experts.1.up_proj.weight"


def _copy(tmp_path: Path, edit=None, cfg_edit=None) -> Path:
    d = tmp_path / "fake"
    shutil.copytree(FAKE, d)
    if edit is not None:
        t = load_file(d / "model.safetensors")
        edit(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    if cfg_edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        cfg_edit(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_converts_exactly_to_the_bytes_quarks_quantizer_gives(tmp_path):
    s = convert(FAKE, tmp_path / "out")
    assert (s.format, s.row) == ("quark-mxfp8", "mxfp8")
    assert "re-encoded exactly" in s.recipe["weights"]
    assert json.loads((tmp_path / "out" / "megamoe.json").read_text())["source"]["recipe"]["weights"] == \
        s.recipe["weights"]
    fake, src = load_file(FAKE / "model.safetensors"), load_file(SRC / "model.safetensors")
    ckpt = mr.open_checkpoint(tmp_path / "out")
    for info in ckpt.layers:
        layer = ckpt.build_layer(info.index, device="cpu", backend="reference")
        for e, ex in enumerate(layout.unpack_expert_stack("mxfp8", layer.kernel_tensors())):
            for role, proj in zip(("gate_proj", "up_proj", "down_proj"), (ex.gate, ex.up, ex.down)):
                name = f"model.layers.{info.index}.mlp.experts.{e}.{role}.weight"
                scale = fake[name + "_scale"].repeat_interleave(32, dim=-1)
                # the kernel-layout bytes decode to the fake-quantized values exactly ...
                deq = proj.weight.float() * torch.exp2(proj.scale.float() - 127).repeat_interleave(32, dim=-1)
                assert torch.equal(deq, fake[name].float()), name
                # ... and are Quark's real quantization of the BF16 source with the recorded scales
                want = (src[name].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert torch.equal(proj.weight.view(torch.uint8), want.view(torch.uint8)), name


def test_cli_summary_says_the_weights_were_re_encoded(tmp_path):
    r = CliRunner().invoke(main, ["convert", str(FAKE), str(tmp_path / "o"), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "weights: Quark fake-quantized MXFP8" in r.stdout
    assert "stored unquantized" not in r.output


def test_weight_that_is_not_e4m3_times_its_scale_is_refused(tmp_path):
    def edit(t):
        w = t[W].float()
        w[3, 5] = 300 * float(t[W + "_scale"][3, 0])  # exact in BF16; E4M3 has 288 and 320 there
        t[W] = w.to(torch.bfloat16)
    src = open_source(_copy(tmp_path, edit))
    with pytest.raises(FormatError, match=r"experts\.1\.up_proj\.weight \(in model\.safetensors\) \[3, 5\].*"
                                          r"not an E4M3 value x scale \(1 of 16384 elements\).*--quantize mxfp8"):
        detect_reader(src).read_expert(0, 1)
    assert not (tmp_path / "o").exists()
    with pytest.raises(FormatError):
        convert(src.root, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_scale_that_is_not_a_power_of_two_is_refused(tmp_path):
    def edit(t):
        t[W + "_scale"][2, 1] *= 1.5
    src = open_source(_copy(tmp_path, edit))
    with pytest.raises(ScaleError, match=r"up_proj\.weight_scale \(in model\.safetensors\) \[2, 1\] = .*power of two"):
        detect_reader(src).read_expert(0, 1)


def test_fake_quantized_mxfp4_is_refused_with_the_export_that_works(tmp_path):
    d = _copy(tmp_path, cfg_edit=lambda qc: qc["global_quant_config"]["weight"].update(dtype="fp4"))
    with pytest.raises(FormatError, match=r'fake-quantized.*only for MXFP8.*weight_format="real_quantized"'):
        detect_reader(open_source(d))


def test_unquantized_reader_on_it_says_to_drop_format_and_quantize(tmp_path):
    r = CliRunner().invoke(main, ["convert", str(FAKE), str(tmp_path / "o"), "--format", "unquantized",
                                  "--quantize", "mxfp8", "--no-progress"])
    assert r.exit_code == 2
    assert "weight_scale stands beside the float weight" in r.stderr
    assert "run without --format and --quantize" in r.stderr


def test_all_bf16_experts_under_a_quantized_config_say_so(tmp_path):
    """The old message said 'N projections stored unquantized while the other experts are Quark MXFP8 ...
    remove them from its ignore/exclude list': wrong when every expert is BF16 and none is excluded."""
    src = synth.build_synthetic_checkpoint(tmp_path / "bf16", "bf16", num_layers=1, num_experts=4)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = json.loads((FAKE / "config.json").read_text())["quantization_config"]
    cfg["quantization_config"]["export"]["weight_format"] = "real_quantized"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError) as ei:
        detect_reader(open_source(src)).moe_layers()
    msg = str(ei.value)
    assert "all 12 routed expert projections are stored unquantized" in msg and "--format unquantized" in msg
    assert "other experts" not in msg and "ignore/exclude" not in msg


def test_real_quantized_config_over_fake_tensors_names_the_fake_form(tmp_path):
    d = _copy(tmp_path, cfg_edit=lambda qc: qc["export"].update(weight_format="real_quantized"))
    with pytest.raises(MegaMoEError, match=r"all 12 routed expert projections are stored as BF16 with float block "
                                           r"scales.*fake-quantized export"):
        detect_reader(open_source(d)).moe_layers()
