"""shared.py: --shared-precision, the shared-expert record, the re-encode, end to end."""
import pytest
import torch
from click.testing import CliRunner

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.output.output_dir import temp_dir_for
from megamoe_runtime.format.manifest import read_manifest

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("precision", ["auto", "mxfp8", "bf16"])
def test_shared_precision_nvfp4(tmp_path, precision):
    """--shared-precision on the nvfp4 row (both precisions fusable: mxfp8 for
    vLLM's DeepGEMM fork, bf16 for upstream fp4_fp4_mega_moe): the manifest
    records the choice and why, the stored shared tensors have that precision,
    the served layer fuses them and still matches the source."""
    import megamoe_runtime as mr
    from megamoe_convert.testing.selfcheck import compare_with_source

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    out = tmp_path / "out"
    s = convert(src, out, shared_precision=precision)
    want = "mxfp8" if precision == "auto" else precision
    for le in read_manifest(out).layers:
        sh = le.shared
        assert sh["fused_capable"] and sh["precision"] == want and sh["requested_precision"] == precision
        assert le.spec["shared"]["precision"] == want
        assert sh["precision_reason"].startswith("auto: " if precision == "auto" else f"--shared-precision {want}")
        other = "bf16" if want == "mxfp8" else None
        if other:  # the DeepGEMM flavour that cannot run this choice is named with the precision it needs
            assert "fp4_fp4_mega_moe" in sh["flavour_note"] and f"--shared-precision {other}" in sh["flavour_note"]
        assert sh["conversion"] == f"nvfp4->{want} (dequantize, re-encode)"
    assert [(d["layers"], d["precision"], d["requested"]) for d in s.shared] == [("0-1", want, precision)]
    m = read_manifest(out)
    dtypes = {t.role: t.dtype for t in m.tensors.values() if t.role.startswith("shared_")}
    if want == "bf16":
        assert dtypes == {"shared_l1_weight": "BF16", "shared_l2_weight": "BF16"}
    else:
        assert dtypes["shared_l1_weight"] == "F8_E4M3" and "shared_l1_scale" in dtypes
    layer = mr.open_checkpoint(out).build_layer(0, device="cpu", backend="reference")
    assert layer.shared_fused and layer.spec.shared.precision == want
    assert layer.shared_l1_weight.dtype == (torch.bfloat16 if want == "bf16" else torch.float8_e4m3fn)
    results = compare_with_source(src, out, tokens=8)
    assert results and all(r.ok and r.shared_fused for r in results), results


def test_shared_precision_refused_by_row(tmp_path):
    from megamoe_runtime.errors import FormatError

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL, shared=1)
    with pytest.raises(FormatError, match=r"--shared-precision bf16: row mxfp4 fuses shared experts only as "
                                          r"mxfp8 .*use --shared-precision auto \| mxfp8"):
        convert(src, tmp_path / "out", shared_precision="bf16")
    assert not (tmp_path / "out").exists() and not temp_dir_for(tmp_path / "out").exists()
    with pytest.raises(Exception, match="--shared-precision 'fp4'; valid: auto, mxfp8, bf16"):
        convert(src, tmp_path / "out", shared_precision="fp4")
    # the row's own precision is accepted explicitly
    s = convert(src, tmp_path / "out", shared_precision="mxfp8")
    assert s.shared[0]["precision"] == "mxfp8" and "fp8_fp4_mega_moe" in s.shared[0]["note"]


@pytest.mark.parametrize("fmt, key", [
    ("quark-mxfp4", "model.layers.1.mlp.shared_experts.up_proj.weight_scale"),
    ("deepseek-v4", "layers.1.ffn.shared_experts.w3.scale"),
])
def test_shared_expert_ff_scale_names_source_tensor(tmp_path, fmt, key):
    from safetensors.torch import load_file, save_file

    src = synth.build_synthetic_checkpoint(tmp_path / "src", fmt, **SMALL, shared=1)
    f = next(p for p in sorted(src.glob("*.safetensors")) if key in load_file(p))
    t = load_file(f)
    b = t[key].view(torch.uint8).clone()
    b[0, 0] = 0xFF
    t[key] = b.view(t[key].dtype)
    save_file(t, f, metadata={"format": "pt"})
    out = tmp_path / "out"
    r = run_cli("convert", src, out)
    assert r.exit_code == 2, r.output
    for needle in ("MoE layer 1", "shared expert", "up scale", "0xFF", key, f.name):
        assert needle in r.stderr, (needle, r.stderr)
    assert not out.exists() and not temp_dir_for(out).exists()
