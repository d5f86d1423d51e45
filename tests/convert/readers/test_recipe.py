"""Activation recipes on REAL producer exports (tests/fixtures/real, issue 10).

Every export either converts or names the one flag that converts it:

* finer or equal kernel activations (ModelOpt W4A8_MXFP4_FP8, Quark mxfp4_fp8
  on the mxfp4 row) convert by default;
* coarser ones (weight-only W4A16 NVFP4 from ModelOpt, llm-compressor and
  Quark; weight-only MXFP4; ModelOpt W4A8_NVFP4_FP8's FP8 activations on the
  nvfp4 row) are refused with a message naming ``--accept-activation-change``
  and convert with it.

The converted kernel bytes are checked against an independent decode of the
source: the raw safetensors tensors read here with ``safetensors`` and decoded
with this file's own tables (no reader, no codecs), and the manifest records
the source recipe, what the kernel does instead and how a2 was derived.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import megamoe_runtime as mr
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.pipeline.inspection import inspect_checkpoint
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.recipe import ACCEPT_FLAG, ActivationRecipe, compare
from megamoe_convert.readers.source import open_source
from megamoe_runtime.errors import FormatError, ScaleError
from megamoe_runtime.format import layout

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"

#: fixture -> (reader format, row, relation of the kernel's activations to the source's)
CASES = {
    "modelopt-w4a8-mxfp4-fp8-qwen3moe": ("modelopt-mxfp4", "mxfp4", "finer"),
    "quark-mxfp4-fp8-qwen3moe": ("quark-mxfp4", "mxfp4", "finer"),
    "modelopt-mxfp4-qwen3moe": ("modelopt-mxfp4", "mxfp4", "finer"),  # W4A4 MXFP4 -> MXFP8: treated alike
    "modelopt-nvfp4-qwen3moe": ("modelopt-nvfp4", "nvfp4", "same"),
    "modelopt-w4a16-nvfp4-qwen3moe": ("modelopt-nvfp4", "nvfp4", "coarser"),
    "modelopt-w4a8-nvfp4-fp8-qwen3moe": ("modelopt-w4a8-nvfp4-fp8", "nvfp4", "coarser"),
    "llmcompressor-nvfp4a16-qwen3moe": ("ct-nvfp4", "nvfp4", "coarser"),
    "llmcompressor-mxfp4a16-qwen3moe": ("ct-mxfp4", "mxfp4", "coarser"),
    "quark-mxfp4-weight-only-qwen3moe": ("quark-mxfp4", "mxfp4", "coarser"),
    "quark-nvfp4-weight-only-qwen3moe": ("quark-nvfp4", "nvfp4", "coarser"),
}
# Every case is a committed real export: a missing one must fail, not skip.
PRESENT = list(CASES)
COARSER = [n for n in PRESENT if CASES[n][2] == "coarser"]


# ---------------------------------------------------------------------------------------- independent decode

_E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _e4m3(b: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes -> float64 by the bit fields (S EEEE MMM, bias 7, subnormals at E=0)."""
    b = b.to(torch.int64)
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    mag = torch.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * torch.pow(2.0, (e - 7).double()))
    return torch.where(s == 1, -mag, mag)


def _source_module(sd: dict, mod: str, row: str) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(E2M1 codes [out, in], per-element block scale float64 [out, in], global or None) of one module."""
    w = sd.get(f"{mod}.weight", sd.get(f"{mod}.weight_packed")).view(torch.uint8)
    codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1)
    sc = sd[f"{mod}.weight_scale"].view(torch.uint8)
    per = codes.shape[1] // sc.shape[1]  # 32 (MX, W4A8_NVFP4_FP8) or 16
    if row == "mxfp4":
        block = torch.pow(2.0, sc.double() - 127)
    else:
        block = _e4m3(sc)
    g = None
    if row == "nvfp4":
        if f"{mod}.weight_scale_2" in sd:
            g = float(sd[f"{mod}.weight_scale_2"].float())
        else:  # compressed-tensors stores the divisor
            g = float(torch.tensor(1.0) / sd[f"{mod}.weight_global_scale"].float().reshape(()))
    return codes, block.repeat_interleave(per, 1), g


def _kernel_codes_and_scales(row: str, ex) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for p in (ex.gate, ex.up, ex.down):
        w = p.weight.view(torch.uint8)
        codes = torch.stack([w & 15, w >> 4], -1).reshape(w.shape[0], -1)
        sc = p.scale.view(torch.uint8)
        per = codes.shape[1] // sc.shape[1]
        block = torch.pow(2.0, sc.double() - 127) if row == "mxfp4" else _e4m3(sc)
        out.append((codes, block.repeat_interleave(per, 1)))
    return out


def _convert(name, tmp_path, **extra):
    opts = {"accept_activation_change": CASES[name][2] == "coarser"}
    if name in ("modelopt-w4a16-nvfp4-qwen3moe", "llmcompressor-nvfp4a16-qwen3moe", "quark-nvfp4-weight-only-qwen3moe"):
        opts["l2_activation_scale"] = 0.002
    if name == "quark-nvfp4-weight-only-qwen3moe":
        opts["on_scale_mismatch"] = "requantize"  # Quark's weight-only NVFP4 scales gate and up separately
    opts.update(extra)
    out = tmp_path / "out"
    return convert(REAL / name, out, **opts), out, opts


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", PRESENT)
def test_detected_recipe_and_relation(name):
    fmt, row, rel = CASES[name]
    src = open_source(REAL / name)
    r = detect_reader(src, accept_activation_change=True)
    assert (r.format_name, r.row, r.activation_change.relation) == (fmt, row, rel)
    assert r.activation_change.needs_flag == (rel == "coarser")


@pytest.mark.parametrize("name", COARSER)
def test_coarser_recipe_is_refused_naming_the_flag(name, tmp_path):
    src = open_source(REAL / name)
    with pytest.raises(FormatError) as ei:
        detect_reader(src)
    msg = str(ei.value)
    assert ACCEPT_FLAG in msg and "coarser" in msg and str(REAL / name) in msg
    if CASES[name][1] == "nvfp4":
        assert "--l2-activation-scale" in msg
    res = CliRunner().invoke(main, ["convert", str(REAL / name), str(tmp_path / "o"), "--no-progress"])
    assert res.exit_code == 2 and ACCEPT_FLAG in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists() and not any(tmp_path.iterdir())
    rep = inspect_checkpoint(REAL / name)
    assert any(f"convert needs {ACCEPT_FLAG}" in p for p in rep.problems)
    assert rep.recipe["activations"]["relation"] == "coarser"
    res = CliRunner().invoke(main, ["inspect", str(REAL / name)])
    assert res.exit_code == 2 and f"convert needs {ACCEPT_FLAG}" in res.output


@pytest.mark.parametrize("name", ["modelopt-w4a16-nvfp4-qwen3moe", "llmcompressor-nvfp4a16-qwen3moe"])
def test_weight_only_nvfp4_also_needs_the_l2_activation_scale(name, tmp_path):
    with pytest.raises(ScaleError, match="--l2-activation-scale"):
        convert(REAL / name, tmp_path / "o", accept_activation_change=True)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", PRESENT)
def test_converted_bytes_equal_an_independent_decode_of_the_source(name, tmp_path):
    fmt, row, rel = CASES[name]
    summary, out, opts = _convert(name, tmp_path)
    sd = {}
    for f in sorted((REAL / name).glob("*.safetensors")):
        sd.update(load_file(f))
    ckpt = mr.open_checkpoint(out)
    requantized = 0
    for info in ckpt.layers:
        layer = ckpt.build_layer(info.index, device="cpu", backend="reference")
        experts = layout.unpack_expert_stack(row, layer.kernel_tensors())
        for e, ex in enumerate(experts):
            mods = [f"{info.prefix}.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            src = [_source_module(sd, m, row) for m in mods]
            got = _kernel_codes_and_scales(row, ex)
            for (sc, sb, sg), (kc, kb), m in zip(src, got, mods):
                assert torch.equal(kc, sc), f"{m}: E2M1 codes differ"
                if not (opts.get("on_scale_mismatch") and src[0][2] != src[1][2]):
                    assert torch.equal(kb, sb), f"{m}: block scales differ"
            if row != "nvfp4":
                continue
            gates = (float(layer.l1_alpha[e, 0]), float(layer.l1_alpha[e, 1]))
            assert float(layer.l2_global_scale[e]) == src[2][2]
            if src[0][2] == src[1][2]:
                assert gates == (src[0][2], src[1][2])
                continue
            # requantized onto the larger global: same values up to one E4M3 rounding of the smaller half
            requantized += 1
            assert gates[0] == gates[1] == max(src[0][2], src[1][2])
            for (sc, sb, sg), (kc, kb) in zip(src[:2], got[:2]):
                want = _E2M1[sc.long()] * sb * sg
                have = _E2M1[kc.long()] * kb * gates[0]
                assert torch.allclose(have, want, rtol=2 ** -3, atol=1e-9)
    m = json.loads((out / "megamoe.json").read_text())
    act = m["source"]["recipe"]["activations"]
    assert act["relation"] == rel and act["kernel"]["row"] == row
    assert act["accepted_with"] == (ACCEPT_FLAG if rel == "coarser" else None)
    assert summary.recipe == m["source"]["recipe"]
    if name == "quark-nvfp4-weight-only-qwen3moe":
        assert requantized > 0 and summary.repaired_experts == requantized


def test_w4a8_nvfp4_fp8_a2_from_fp8_input_scales(tmp_path):
    """a2 = max over ALL experts of fl32(fl32(input_scale * 448) / 2688): the FP8 per-tensor
    scale (amax/448) in the NVFP4 global convention (amax/2688), recorded with its rule."""
    name = "modelopt-w4a8-nvfp4-fp8-qwen3moe"
    _, out, _ = _convert(name, tmp_path)
    sd = load_file(next((REAL / name).glob("*.safetensors")))
    m = json.loads((out / "megamoe.json").read_text())
    assert "448" in m["source"]["recipe"]["l2_activation_scale"]
    for le in m["layers"]:
        s = [sd[f"{le['prefix']}.experts.{e}.down_proj.input_scale"].float() for e in range(4)]
        conv = [float((x * torch.tensor(448.0)) / torch.tensor(2688.0)) for x in s]
        assert le["scalars"]["l2_activation_scale"] == max(conv)
        assert le["scalars"]["l2_activation_scale"] != max(float(x) for x in s)  # not the FP8 value itself
        ck = mr.open_checkpoint(out)
        layer = ck.build_layer(le["index"], device="cpu", backend="reference")
        assert float(layer.l2_activation_scale) == max(conv)


def test_given_l2_activation_scale_is_recorded(tmp_path):
    name = "modelopt-w4a16-nvfp4-qwen3moe"
    _, out, _ = _convert(name, tmp_path)
    m = json.loads((out / "megamoe.json").read_text())
    assert "given with --l2-activation-scale" in m["source"]["recipe"]["l2_activation_scale"]
    assert all(le["scalars"]["l2_activation_scale"] == 0.002 for le in m["layers"])


def test_cli_flag_converts_and_the_summary_says_what_changed(tmp_path):
    name = "modelopt-w4a8-nvfp4-fp8-qwen3moe"
    res = CliRunner().invoke(main, ["convert", str(REAL / name), str(tmp_path / "o"), "--no-progress",
                                    ACCEPT_FLAG])
    assert res.exit_code == 0, res.output
    assert f"accepted with {ACCEPT_FLAG}" in res.output and "W4A8_NVFP4_FP8" in res.output
    res = CliRunner().invoke(main, ["convert", str(REAL / "modelopt-w4a8-mxfp4-fp8-qwen3moe"),
                                    str(tmp_path / "o2"), "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)["recipe"]["activations"]
    assert rec["relation"] == "finer" and rec["source"]["kind"] == "fp8" and rec["kernel"]["kind"] == "mxfp8"


def test_policy_table_and_negative_controls():
    fp8 = ActivationRecipe("fp8", True, "fp8")
    bf16 = ActivationRecipe("bf16", False, "bf16")
    assert compare(fp8, "mxfp4").relation == "finer" and not compare(fp8, "mxfp4").needs_flag
    assert compare(fp8, "nvfp4").relation == "coarser" and compare(fp8, "nvfp4").needs_flag
    assert compare(bf16, "bf16").relation == "same"
    for row in ("mxfp4", "mxfp8", "nvfp4"):
        assert compare(bf16, row).needs_flag
    assert compare(ActivationRecipe("mxfp4", False, "x"), "mxfp4").relation == "finer"
    assert compare(ActivationRecipe("nvfp4", True, "x"), "nvfp4").relation == "same"
    assert not compare(ActivationRecipe("undeclared", False, "x"), "nvfp4").needs_flag
    # negative control: a W4A8_MXFP4_FP8 checkpoint declared as weight-only would be refused
    src = open_source(REAL / "modelopt-w4a8-mxfp4-fp8-qwen3moe")
    r = detect_reader(src)
    assert not compare(bf16, r.row).accepted and compare(bf16, r.row).refusal("x", "y").count(ACCEPT_FLAG) == 1


def test_format_aliases_of_the_activation_variants():
    src = open_source(REAL / "modelopt-w4a8-mxfp4-fp8-qwen3moe")
    assert detect_reader(src, format="modelopt-w4a8-mxfp4-fp8").format_name == "modelopt-mxfp4"
    with pytest.raises(FormatError, match=ACCEPT_FLAG):  # forcing the format does not skip the policy
        detect_reader(open_source(REAL / "modelopt-w4a16-nvfp4-qwen3moe"), format="modelopt-w4a16-nvfp4")


def test_bf16_quantize_is_its_own_opt_in(tmp_path):
    """--quantize picks a quantized row for an unquantized model: no second flag."""
    r = detect_reader(open_source(REAL / "bf16-plain-qwen3moe"), quantize="mxfp4")
    assert r.activation_change.relation == "coarser" and r.activation_change.accepted


def test_w4a8_nvfp4_fp8_scale_split_negative_controls(tmp_path):
    """Each 32-element E4M3 scale becomes two equal per-16 scales, in place: the
    kernel's scales equal the source's repeated per element, and a wrong split
    (the 32-scales tiled instead of interleaved, or the halves' order swapped
    within a row) is caught by the same comparison."""
    name = "modelopt-w4a8-nvfp4-fp8-qwen3moe"
    _, out, _ = _convert(name, tmp_path)
    sd = load_file(next((REAL / name).glob("*.safetensors")))
    ckpt = mr.open_checkpoint(out)
    info = ckpt.layers[0]
    layer = ckpt.build_layer(info.index, device="cpu", backend="reference")
    ex = layout.unpack_expert_stack("nvfp4", layer.kernel_tensors())[1]
    src32 = sd[f"{info.prefix}.experts.1.gate_proj.weight_scale"].view(torch.uint8)
    k16 = ex.gate.scale.view(torch.uint8)
    assert k16.shape[1] == 2 * src32.shape[1]
    assert torch.equal(k16[:, 0::2], src32) and torch.equal(k16[:, 1::2], src32)
    assert not torch.equal(k16, src32.repeat(1, 2))  # tiled: wrong
    assert not torch.equal(k16, src32.flip(1).repeat_interleave(2, 1))


# ---------------------------------------------------------------------------------------- review findings


@pytest.mark.parametrize("a2", ["1e300", "1e-300"])
def test_given_l2_activation_scale_must_fit_float32(tmp_path, a2):
    """a2 is stored and used as FP32: a value that becomes inf or 0 there is
    refused up front (it used to convert, verify ok, and fail at build_layer)."""
    name = "modelopt-w4a16-nvfp4-qwen3moe"
    with pytest.raises(ScaleError, match="float32"):
        _convert(name, tmp_path, l2_activation_scale=float(a2))
    res = CliRunner().invoke(main, ["convert", str(REAL / name), str(tmp_path / "o"), "--no-progress",
                                    ACCEPT_FLAG, "--l2-activation-scale", a2])
    assert res.exit_code == 2 and "--l2-activation-scale" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_l2_activation_scale_on_a_row_without_it_is_refused(tmp_path):
    """--l2-activation-scale means nothing to the mx rows (their kernels scale
    activations per block themselves): refused, not silently dropped."""
    name = "llmcompressor-mxfp4a16-qwen3moe"
    with pytest.raises(ScaleError, match="--l2-activation-scale.*nvfp4"):
        _convert(name, tmp_path, l2_activation_scale=0.002)
    assert not (tmp_path / "out").exists()
    _convert(name, tmp_path)  # negative control: without it, it converts


def test_inspect_reports_every_scale_problem_of_a_weight_only_nvfp4_export():
    """Quark's weight-only NVFP4 needs three things: the activation flag, an a2
    and --on-scale-mismatch requantize. inspect lists all three (the missing a2
    used to hide the w1/w3 mismatch and the pair count)."""
    name = "quark-nvfp4-weight-only-qwen3moe"
    rep = inspect_checkpoint(REAL / name)
    probs = "\n".join(rep.problems)
    assert ACCEPT_FLAG in probs and "--l2-activation-scale" in probs
    assert "--on-scale-mismatch requantize" in probs
    assert rep.scales["pairs"] == 8 and rep.scales["mismatched_pairs"] == 8
    rep = inspect_checkpoint(REAL / "modelopt-w4a16-nvfp4-qwen3moe")  # negative control: its pairs agree
    assert rep.scales["pairs"] == 8 and rep.scales["mismatched_pairs"] == 0
    assert "--on-scale-mismatch" not in "\n".join(rep.problems)


@pytest.mark.parametrize("name,fmt,kind", [
    ("quark-mxfp4-weight-only-qwen3moe", "modelopt-mxfp4", "bf16"),
    ("modelopt-w4a8-nvfp4-fp8-qwen3moe", "quark-nvfp4", "fp8"),
    ("llmcompressor-mxfp4a16-qwen3moe", "quark-mxfp4", "bf16"),
])
def test_a_forced_format_keeps_the_sources_own_recipe(name, fmt, kind):
    """The activation recipe is a fact of the source's producer config, not of
    the reader forced with --format: forcing ModelOpt's MXFP4 reader onto a
    Quark weight-only export used to read "undeclared" and convert it silently."""
    src = open_source(REAL / name)
    r = detect_reader(src, format=fmt, accept_activation_change=True)
    assert r.activation_change.source == detect_reader(src, accept_activation_change=True).activation_change.source
    assert r.activation_change.source.kind == kind
    if kind == "bf16":
        with pytest.raises(FormatError, match=ACCEPT_FLAG):
            detect_reader(open_source(REAL / name), format=fmt)


def _with_input_spec(name: str, tmp_path: Path, edit) -> Path:
    """A copy of real export `name` whose quantization config's activation
    spec is rewritten by ``edit(quantization_config)`` (weights copied: a
    source's weight files must lie inside it)."""
    dst = tmp_path / name
    shutil.copytree(REAL / name, dst)
    cfg = json.loads((REAL / name / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _ct_fp8_group64_activations(qc):
    for g in qc["config_groups"].values():
        g["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64,
                                  "dynamic": True, "symmetric": True}


def _quark_fp8_per_token_activations(qc):
    qc["global_quant_config"]["input_tensors"] = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": -1,
                                                  "is_dynamic": True, "group_size": None}


@pytest.mark.parametrize("name,edit", [
    ("llmcompressor-nvfp4a16-qwen3moe", _ct_fp8_group64_activations),
    ("quark-nvfp4-weight-only-qwen3moe", _quark_fp8_per_token_activations),
])
def test_a_declared_recipe_the_converter_does_not_know_needs_the_flag(name, edit, tmp_path):
    """A producer config that states an activation recipe this converter cannot
    classify (FP8 per 64-group or per token on the nvfp4 row: 8 -> 4 bits) is
    not "undeclared": it used to convert without the flag. It is refused naming
    the flag and the producer's words, and inspect lists it."""
    src = _with_input_spec(name, tmp_path, edit)
    with pytest.raises(FormatError, match=ACCEPT_FLAG) as ei:
        detect_reader(open_source(src))
    assert "does not know" in str(ei.value)
    r = detect_reader(open_source(src), accept_activation_change=True)
    assert r.activation_change.relation == "unknown" and r.activation_change.needs_flag
    assert any(f"convert needs {ACCEPT_FLAG}" in p for p in inspect_checkpoint(src).problems)
    # negative control: a checkpoint that states no recipe at all is still never refused
    assert not compare(ActivationRecipe("undeclared", False, "x"), "nvfp4").needs_flag


def test_inspect_takes_the_flags_its_problems_name(tmp_path):
    """inspect tells a weight-only NVFP4 export (or `--quantize nvfp4`) to pass
    --accept-activation-change and --l2-activation-scale; it accepts both, as
    for convert, so the command about to be run can be checked (exit 0), and a
    wrong use of them is still a listed problem."""
    name = "modelopt-w4a16-nvfp4-qwen3moe"
    args = ["inspect", str(REAL / name), ACCEPT_FLAG, "--l2-activation-scale", "0.002"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"accepted with {ACCEPT_FLAG}" in res.output
    res = CliRunner().invoke(main, ["inspect", str(REAL / "bf16-plain-qwen3moe"), "--quantize", "nvfp4",
                                    "--l2-activation-scale", "0.002"])
    assert res.exit_code == 0, res.output
    # negative controls: one flag short, a calibrated checkpoint given an a2, an mx row given one
    assert CliRunner().invoke(main, args[:3]).exit_code == 2
    rep = inspect_checkpoint(REAL / "modelopt-nvfp4-qwen3moe", l2_activation_scale=0.002)
    assert any("drop it" in p for p in rep.problems)
    rep = inspect_checkpoint(REAL / "modelopt-mxfp4-qwen3moe", l2_activation_scale=0.002)
    assert any("only the nvfp4 row" in p for p in rep.problems)


def test_every_issue10_real_export_is_committed():
    missing = [n for n in CASES if not (REAL / n / "config.json").is_file()]
    assert not missing, f"real exports missing from {REAL}: {missing} (tests/fixtures/make_real_fixtures.py makes them)"


def test_every_row_has_its_per_row_converter_facts():
    """The converter's per-row tables a new kernel-layout row must extend (docs/ARCHITECTURE.md, files to touch):
    the recipes it keeps (named in the refusal text), its dispatch description and the demo's threshold."""
    from megamoe_convert.readers import recipe
    from megamoe_convert.testing.selfcheck import THRESHOLDS
    from megamoe_runtime.format.formats import ROWS

    for name, row in ROWS.items():
        assert recipe._KEEPS[name] and recipe.KERNEL_ACTIVATIONS[name][1], name
        assert THRESHOLDS[name] > 0, name


def test_fp8_per_128_activations_are_known_the_fp8_block_kernels_and_coarser_for_nvfp4(tmp_path):
    """FP8 per 1x128 (llm-compressor FP8_BLOCK's activations) is the fp8_block row's own dispatch ("same");
    on the nvfp4 row it is 8 -> 4 bits, refused as coarser (no longer an unknown recipe)."""
    r = detect_reader(open_source(REAL / "llmcompressor-fp8-block-qwen3moe"))
    assert r.row == "fp8_block" and r.activation_change.relation == "same" and not r.activation_change.needs_flag
    src = _with_input_spec("llmcompressor-nvfp4a16-qwen3moe", tmp_path, lambda qc: [
        g.update(input_activations={"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                    "dynamic": True, "symmetric": True}) for g in qc["config_groups"].values()])
    with pytest.raises(FormatError, match="coarser"):
        detect_reader(open_source(src))
