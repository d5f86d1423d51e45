"""What the commands say agrees with itself and with the README (issue 31 items 3, 4 and 8): exit codes,
JSON keys, counts, bytes, estimates, and no internal names; inspect previews the repaired convert run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.cli.progress import format_bytes

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="megamoe-convert")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A 2-layer x 8-expert nvfp4 source converted with 2 EP ranks."""
    d = tmp_path_factory.mktemp("c")
    src = synth.build_synthetic_checkpoint(d / "src", "modelopt-nvfp4", num_layers=2, num_experts=8)
    r = _cli("convert", src, d / "out", "--ep-size", 2, "--no-progress")
    assert r.exit_code == 0, r.output
    return src, d / "out", r.stdout


def test_verify_of_a_folder_that_is_not_a_megamoe_output_is_bad_input(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    r = _cli("verify", tmp_path, "--json")
    assert r.exit_code == 2  # README: 2 = bad input; 1 is for a megamoe folder that fails verification
    d = json.loads(r.stdout)
    assert d["ok"] is False and d["exit_code"] == 2 and "no megamoe.json" in d["error"]


def test_verify_json_path_is_absolute_and_has_exit_code(converted, tmp_path, monkeypatch):
    _, out, _ = converted
    monkeypatch.chdir(out.parent)
    r = _cli("verify", "out", "--json", "--no-progress")
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["ok"] is True and d["exit_code"] == 0
    assert d["path"] == str(out.resolve())


def test_inspect_json_has_ok_and_exit_code():
    ok = json.loads(_cli("inspect", REAL / "modelopt-nvfp4-qwen3moe", "--json").stdout)
    assert (ok["ok"], ok["exit_code"]) == (True, 0)
    r = _cli("inspect", REAL / "modelopt-nvfp4-qwen3moe", "--ep-size", 3, "--json")
    bad = json.loads(r.stdout)
    assert r.exit_code == bad["exit_code"] == 2 and bad["ok"] is False


def test_summary_counts_experts_per_layer(converted):
    _, _, text = converted
    assert "MoE layers: 2   routed experts: 8 per layer (16 in all)   ep_size: 2" in text


def test_reload_dry_run_counts_layers_once(converted):
    _, out, _ = converted
    r = _cli("verify", out, "--reload-dry-run", "--no-progress")
    assert r.exit_code == 0, r.output
    assert "reload dry run of 2 MoE layer(s) on each of 2 EP rank(s) (4 layer loads)" in r.stdout
    d = json.loads(_cli("verify", out, "--reload-dry-run", "--json", "--no-progress").stdout)
    assert (d["reload"]["layers"], d["reload"]["ranks"], d["reload"]["layer_loads"]) == (2, 2, 4)


def test_bytes_in_agree_between_convert_and_inspect(converted):
    src, out, text = converted
    rep = json.loads(_cli("inspect", src, "--ep-size", 2, "--json").stdout)
    summary = json.loads((out / "megamoe.json").read_text())  # noqa: F841 (the folder exists)
    r = _cli("convert", src, out.parent / "out-json", "--json", "--no-progress")
    assert json.loads(r.stdout)["bytes_in"] == rep["tensor_bytes"]
    line = _cli("inspect", src, "--ep-size", 2).stdout
    assert f"bytes in: {format_bytes(rep['tensor_bytes'])}" in line and \
        f"bytes in: {format_bytes(rep['tensor_bytes'])}" in text


def test_inspect_with_an_ep_size_that_does_not_divide_does_not_estimate_zero():
    r = _cli("inspect", REAL / "modelopt-nvfp4-qwen3moe", "--ep-size", 3)
    assert "experts 0 B" not in r.stdout
    assert "estimated output: not estimated: no expert layout at ep_size 3" in r.stdout
    d = json.loads(_cli("inspect", REAL / "modelopt-nvfp4-qwen3moe", "--ep-size", 3, "--json").stdout)
    assert d["estimated_expert_bytes"] is None and d["estimated_output_bytes"] is None


def test_inspect_with_a_nan_scale_does_not_claim_an_agreement_of_0_of_0(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "s", "modelopt-nvfp4", num_layers=1, num_experts=4,
                                           nan_scale=(0, 1, "gate"))
    r = _cli("inspect", src)
    assert r.exit_code == 2
    assert "0 of 0" not in r.stdout
    assert "scale agreement: not checked: layers 0 have a scale that is not finite and > 0" in r.stdout


def test_no_internal_flavour_names_in_notes():
    from megamoe_convert.pipeline.shared import shared_flavour_note
    from megamoe_runtime.format.formats import ROWS

    for row in ROWS.values():
        for p in ("mxfp8", "bf16"):
            note = shared_flavour_note(row, p)
            assert "DGz" not in note and "dgz" not in note.lower(), note


# ----------------------------------------------------------------- item 4: what accepted the recipe
def test_quantize_records_itself_not_a_flag_the_user_never_passed(tmp_path):
    src = REAL / "bf16-plain-qwen3moe"
    r = _cli("convert", src, tmp_path / "o", "--quantize", "mxfp4", "--no-progress")
    assert r.exit_code == 0, r.output
    assert "accept-activation-change" not in r.stdout
    assert "(accepted with --quantize mxfp4)" in r.stdout
    rec = json.loads((tmp_path / "o" / "megamoe.json").read_text())["source"]["recipe"]["activations"]
    assert rec["accepted_with"] == "--quantize mxfp4"
    r = _cli("convert", src, tmp_path / "o2", "--quantize", "mxfp4", "--accept-activation-change", "--no-progress")
    assert "(accepted with --accept-activation-change)" in r.stdout
    assert "accept-activation-change" not in _cli("inspect", src, "--quantize", "mxfp4").stdout


# ----------------------------------------------------------------- item 3: inspect previews the repaired run
def test_inspect_previews_on_scale_mismatch_requantize(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "s", "modelopt-nvfp4", num_layers=1, num_experts=4,
                                           scale_mismatch=[(0, 1)])
    r = _cli("inspect", src)
    assert r.exit_code == 2 and "convert needs --on-scale-mismatch requantize" in r.stdout
    r = _cli("inspect", src, "--on-scale-mismatch", "requantize")
    assert r.exit_code == 0, r.output
    assert "repair: MoE layer 0: 1 expert(s) with w1/w3 weight_scale_2 mismatch (first: expert 1" in r.stdout
    assert "ok: convertible with 1 repair(s) listed above" in r.stdout
    d = json.loads(_cli("inspect", src, "--on-scale-mismatch", "requantize", "--json").stdout)
    assert d["ok"] and len(d["repairs"]) == 1 and d["options"]["on_scale_mismatch"] == "requantize"
    # and convert does what inspect said
    c = _cli("convert", src, tmp_path / "o", "--on-scale-mismatch", "requantize", "--no-progress")
    assert c.exit_code == 0 and "requantized w1/w3 pairs: 1" in c.stdout


def test_inspect_previews_allow_missing_input_scales(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "s", "modelopt-nvfp4", num_layers=1, num_experts=4)
    f = src / "model.safetensors"
    t = load_file(f)
    del t["model.layers.0.mlp.experts.2.down_proj.input_scale"]
    save_file(t, f, metadata={"format": "pt"})
    r = _cli("inspect", src)
    assert r.exit_code == 2 and "convert needs --allow-missing-input-scales" in r.stdout
    r = _cli("inspect", src, "--allow-missing-input-scales")
    assert r.exit_code == 0, r.output
    assert "repair: MoE layer 0: 1 expert(s) without a w2 input scale: a2 = max over the others" in r.stdout
    assert _cli("convert", src, tmp_path / "o", "--allow-missing-input-scales", "--no-progress").exit_code == 0
