"""The megamoe-convert CLI: help with examples everywhere, exit codes, JSON
outputs, inspect, demo."""
import json

import pytest
from click.testing import CliRunner

from megamoe_convert import synth
from megamoe_convert.cli import main

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("cmd", [[], ["convert"], ["inspect"], ["verify"], ["demo"]])
def test_help_has_examples(cmd):
    r = run_cli(*cmd, "--help")
    assert r.exit_code == 0
    assert "Examples:" in r.output and "megamoe-convert" in r.output
    if not cmd:
        assert "0 ok, 1 verification failed, 2 bad input or usage" in r.output
        for sub in ("convert", "inspect", "verify", "demo"):
            assert sub in r.output


def test_usage_errors_exit_2(tmp_path):
    assert run_cli("convert", tmp_path).exit_code == 2  # missing OUT
    assert run_cli("convert", tmp_path, tmp_path / "o", "--ep-size", "0").exit_code == 2
    assert run_cli("convert", tmp_path, tmp_path / "o", "--on-scale-mismatch", "ignore").exit_code == 2
    assert run_cli("nonsense").exit_code == 2
    r = run_cli("convert", tmp_path / "absent", tmp_path / "o")
    assert r.exit_code == 2 and "neither an existing folder nor a hub repo id" in r.stderr
    r = run_cli("convert", tmp_path, tmp_path / "o")  # empty folder
    assert r.exit_code == 2 and "no *.safetensors" in r.stderr


def test_unknown_format_and_ep_size(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", **SMALL)
    r = run_cli("convert", src, tmp_path / "o", "--format", "gguf")
    assert r.exit_code == 2 and "unknown format 'gguf'" in r.stderr
    r = run_cli("convert", src, tmp_path / "o", "--ep-size", "3")
    assert r.exit_code == 2 and "num_experts=4 is not divisible by ep_size=3" in r.stderr
    r = run_cli("convert", src, tmp_path / "o", "--quantize", "nvfp4")
    assert r.exit_code == 2 and "unquantized" in r.stderr
    assert not (tmp_path / "o").exists()


def test_convert_human_summary(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "bf16", **SMALL)
    r = run_cli("convert", src, tmp_path / "o", "--quantize", "mxfp8")
    assert r.exit_code == 0, r.output
    for needle in ("-> row mxfp8", "layers: 2", "experts: 8", "bytes in:", "bytes out:", "GB/s"):
        assert needle in r.stdout
    r = run_cli("verify", tmp_path / "o")
    assert r.exit_code == 0 and r.stdout.startswith("ok: ") and "row mxfp8" in r.stdout


def test_inspect(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    r = run_cli("inspect", src, "--json", "--ep-size", "2")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["format"] == "modelopt-nvfp4" and rep["row"] == "nvfp4" and rep["problems"] == []
    assert [le["index"] for le in rep["layers"]] == [0, 1]
    assert rep["layer_groups"] == [{"layers": "0-1", "hidden": 256, "intermediate": 128, "num_experts": 4}]
    assert rep["shapes"]["down"] == {"weight": [256, 64], "scale": [256, 8]}
    assert rep["shared"]["fused_capable"] and rep["shared"]["precision"] == "mxfp8"
    assert rep["scales"]["mismatched_pairs"] == 0 and rep["scales"]["pairs"] == 8
    assert rep["layers"][0]["scalars"]["l2_activation_scale"] > 0
    assert rep["estimated_output_bytes"] > rep["estimated_expert_bytes"] > 0
    # the estimate matches what convert writes (within the small headers and JSON files)
    out = tmp_path / "o"
    assert run_cli("convert", src, out, "--ep-size", "2").exit_code == 0
    written = sum(p.stat().st_size for p in out.iterdir())
    assert abs(written - rep["estimated_output_bytes"]) < 64_000

    bad = synth.build_synthetic_checkpoint(tmp_path / "bad", "modelopt-nvfp4", **SMALL, scale_mismatch=(1, 3))
    r = run_cli("inspect", bad)
    assert r.exit_code == 2
    assert "1 of 8 w1/w3 weight_scale_2 pairs differ" in r.stdout
    assert "MoE layer 1: 1 expert(s) with w1/w3 weight_scale_2 mismatch (first: expert 3" in r.stdout
    assert "--on-scale-mismatch requantize" in r.stdout


def test_demo_json(tmp_path):
    r = run_cli("demo", "--keep", tmp_path / "d", "--json", "--format", "quark-nvfp4", "--ep-size", "2")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["verify"]["ok"] and res["convert"]["row"] == "nvfp4" and res["convert"]["ep_size"] == 2
    assert (tmp_path / "d" / "converted" / "megamoe.json").is_file()
    r = run_cli("demo", "--keep", tmp_path / "d")
    assert r.exit_code == 2 and "exists" in r.stderr


def test_demo_default():
    r = run_cli("demo")
    assert r.exit_code == 0, r.output
    assert "demo: verify ok" in r.stdout and "demo: converted to row nvfp4" in r.stdout
    assert "demo: forward through layer 0 on the reference backend: output [4, 256], finite=True" in r.stdout


def test_verify_reload_dry_run(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    out = tmp_path / "o"
    assert run_cli("convert", src, out, "--ep-size", "2").exit_code == 0
    r = run_cli("verify", out, "--reload-dry-run", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["reload"] == {"ok": True, "ranks": 2, "layers": 4, "problems": []}
    r = run_cli("verify", out, "--reload-dry-run")
    assert r.exit_code == 0 and "ok: reload dry run over 4 layer(s) of 2 EP rank(s)" in r.stdout
