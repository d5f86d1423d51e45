"""Converter outputs stay byte-identical across refactors.

The digests in ``tests/fixtures/golden_outputs.json`` were recorded from the
converter on main before the consolidation of issue 12 moved code between
modules. Every case converts a source (a real producer export from
``tests/fixtures/real``, or a synthetic checkpoint in a format the real
fixtures lack) and compares the sha256 of every output file, the manifest
included, with the recorded one. The ``--help`` text of every command is
compared verbatim. A change in any output byte fails here, naming the case and
the file; the CLI's own tests check what the bytes mean.

A deliberate format change regenerates the record:
``PYTHONPATH=$PWD python tests/convert/test_golden_outputs.py`` (from the
repository root), and the commit says why the bytes changed.

"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REAL = "tests/fixtures/real"
#: the checksum kind the golden outputs were recorded with (sha256, the default until blake3 became it);
#: `test_default_checksum_writes_the_golden_shard_bytes` ties the default's output to the same bytes
GOLDEN_CHECKSUM = "sha256"
GOLDEN = ROOT / "tests" / "fixtures" / "golden_outputs.json"

#: (case id, source spec, convert kwargs). A source spec is a real fixture's
#: folder name or ("synth", fmt, build kwargs).
_SYN = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2, seed=7)
CASES: list[tuple[str, object, dict]] = [
    *[(d, d, {}) for d in (
        "bf16-plain-deepseekv3", "bf16-plain-qwen3moe",
        "llmcompressor-mxfp4-qwen3moe", "llmcompressor-mxfp8-qwen3moe",
        "llmcompressor-nvfp4-deepseekv3", "llmcompressor-nvfp4-qwen3moe",
        "modelopt-0.37-nvfp4-qwen3moe-perexpert", "modelopt-mxfp4-qwen3moe", "modelopt-mxfp8-qwen3moe",
        "modelopt-nvfp4-deepseekv3", "modelopt-nvfp4-qwen3moe", "modelopt-nvfp4-qwen3moe-perexpert",
        "quark-mxfp4-deepseekv3", "quark-mxfp4-qwen3moe", "quark-nvfp4-qwen3moe")],
    ("modelopt-nvfp4-deepseekv3-ep2-sharedbf16", "modelopt-nvfp4-deepseekv3",
     dict(ep_size=2, shared_precision="bf16")),
    ("quark-mxfp4-deepseekv3-ep4-small-shards", "quark-mxfp4-deepseekv3",
     dict(ep_size=4, max_shard_size="100KB")),
    ("llmcompressor-nvfp4-deepseekv3-ep2", "llmcompressor-nvfp4-deepseekv3", dict(ep_size=2)),
    ("bf16-qwen3moe-quantize-mxfp4", "bf16-plain-qwen3moe", dict(quantize="mxfp4")),
    ("bf16-qwen3moe-quantize-mxfp8", "bf16-plain-qwen3moe", dict(quantize="mxfp8")),
    ("bf16-deepseekv3-quantize-nvfp4", "bf16-plain-deepseekv3",
     dict(quantize="nvfp4", l2_activation_scale=0.002)),
    # issue 10: activation recipes other than the kernels' own
    ("modelopt-w4a8-mxfp4-fp8-qwen3moe", "modelopt-w4a8-mxfp4-fp8-qwen3moe", {}),
    ("modelopt-w4a8-nvfp4-fp8-qwen3moe-accepted", "modelopt-w4a8-nvfp4-fp8-qwen3moe",
     dict(accept_activation_change=True)),
    ("llmcompressor-nvfp4a16-qwen3moe-accepted", "llmcompressor-nvfp4a16-qwen3moe",
     dict(accept_activation_change=True, l2_activation_scale=0.002)),
    ("synth-deepseek-v4", ("synth", "deepseek-v4", dict(_SYN, shared=1)), {}),
    ("synth-quark-mxfp8", ("synth", "quark-mxfp8", _SYN), {}),
    ("synth-ct-mxfp8-w123", ("synth", "ct-mxfp8", dict(_SYN, naming="w123")), {}),
    ("synth-bf16-fused", ("synth", "bf16-fused", _SYN), {}),
    ("synth-modelopt-nvfp4-mismatch-requantize",
     ("synth", "modelopt-nvfp4", dict(_SYN, scale_mismatch=[(0, 1)])), dict(on_scale_mismatch="requantize")),
]
HELP_COMMANDS = [[], ["convert"], ["inspect"], ["verify"], ["demo"], ["synth"]]
#: CLI runs whose whole output and exit code are recorded, run in a folder where
#: ``real`` links to tests/fixtures/real (so the paths they print are stable).
CLI_CASES: list[list[str]] = [
    ["inspect", "real/modelopt-nvfp4-deepseekv3"],
    ["inspect", "real/llmcompressor-nvfp4-qwen3moe", "--ep-size", "2", "--json"],
    ["inspect", "real/quark-mxfp4-deepseekv3", "--shared-precision", "bf16"],
    ["convert", "absent", "o"],
    ["convert", "real/modelopt-nvfp4-qwen3moe", "o", "--format", "gguf"],
    ["convert", "real/modelopt-nvfp4-qwen3moe", "o", "--ep-size", "3"],
    ["convert", "real/modelopt-nvfp4-qwen3moe", "o", "--quantize", "nvfp4"],
    ["convert", "real/modelopt-mxfp4-qwen3moe", "o", "--shared-precision", "fp4"],
    ["convert", "real/modelopt-w4a16-nvfp4-qwen3moe", "o"],
    ["inspect", "real/modelopt-w4a8-nvfp4-fp8-qwen3moe"],
    ["verify", "absent"],
    ["verify", "real/modelopt-nvfp4-qwen3moe"],
    ["nonsense"],
]
#: (a conversion whose exit code is recorded, then commands on its output recorded in full).
CLI_AFTER_CONVERT: list[tuple[list[str], list[list[str]]]] = [
    (["convert", "real/modelopt-nvfp4-deepseekv3", "o", "--ep-size", "2", "--no-progress"],
     [["verify", "o"], ["verify", "o", "--reload-dry-run"], ["verify", "o", "--reload-dry-run", "--json"]]),
    (["convert", "real/quark-mxfp4-qwen3moe", "o", "--no-progress"], [["verify", "o", "--reload-dry-run"]]),
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): _sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _convert_case(spec, kwargs: dict, base: Path) -> dict:
    """Convert one case into ``base/out``. The manifest records the source id as
    given, so the source is named by a path that does not depend on ``base``:
    relative to the repository root for a real fixture, ``synth`` (built in
    ``base``, the working directory meanwhile) for a synthetic one."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    cwd = os.getcwd()
    try:
        if isinstance(spec, str):
            os.chdir(ROOT)
            src = f"{REAL}/{spec}"
        else:
            os.chdir(base)
            _, fmt, kw = spec
            src = "synth"
            build_synthetic_checkpoint(base / src, fmt, **kw)
        convert(src, base / "out", **{"checksum": GOLDEN_CHECKSUM, **kwargs})
    finally:
        os.chdir(cwd)
    rec = {"output": _tree(base / "out")}
    if not isinstance(spec, str):
        rec["source"] = _tree(base / "synth")
    return rec


def _help_text(cmd: list[str]) -> str:
    from click.testing import CliRunner
    from megamoe_convert.cli.main import main

    r = CliRunner().invoke(main, [*cmd, "--help"], prog_name="megamoe-convert")
    return f"exit {r.exit_code}\n{r.output}"


def _cli_text(args: list[str], base: Path, then: list[list[str]] = ()) -> str:
    """Run ``args`` (and ``then``) in ``base``, where ``real`` links to the real
    fixtures. With ``then``, the first run's output (it has timings) is left
    out and only its exit code recorded."""
    from click.testing import CliRunner
    from megamoe_convert.cli.main import main

    if not (base / "real").exists():
        (base / "real").symlink_to(ROOT / REAL)
    cwd = os.getcwd()
    os.chdir(base)
    try:
        r = CliRunner().invoke(main, args, prog_name="megamoe-convert")
        text = f"exit {r.exit_code}\n" if then else f"exit {r.exit_code}\n{r.output}"
        for more in then:
            r = CliRunner().invoke(main, more, prog_name="megamoe-convert")
            text += f"$ {' '.join(more)}\nexit {r.exit_code}\n{r.output}"
    finally:
        os.chdir(cwd)
    return text.replace(str(base.resolve()), "$BASE")  # absolute paths in JSON (verify's, as convert's)


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_output_bytes_unchanged(case, tmp_path):
    name, spec, kwargs = case
    want = _golden()["convert"][name]
    got = _convert_case(spec, kwargs, tmp_path)
    if "source" in want:  # a synthetic source must itself be unchanged, or the comparison means nothing
        assert got["source"] == want["source"], f"{name}: synth.py now builds a different source"
    assert sorted(got["output"]) == sorted(want["output"]), f"{name}: output file names differ"
    changed = [f for f in want["output"] if got["output"][f] != want["output"][f]]
    assert not changed, f"{name}: bytes changed in {changed}"


@pytest.mark.parametrize("cmd", HELP_COMMANDS, ids=[" ".join(c) or "main" for c in HELP_COMMANDS])
def test_help_text_unchanged(cmd):
    assert _help_text(cmd) == _golden()["help"][" ".join(cmd) or "main"]


@pytest.mark.parametrize("args", CLI_CASES, ids=[" ".join(a) for a in CLI_CASES])
def test_cli_text_and_exit_code_unchanged(args, tmp_path):
    assert _cli_text(args, tmp_path) == _golden()["cli"][" ".join(args)]


@pytest.mark.parametrize("case", CLI_AFTER_CONVERT, ids=[" ".join(c[0]) for c in CLI_AFTER_CONVERT])
def test_cli_text_on_a_converted_folder_unchanged(case, tmp_path):
    assert _cli_text(case[0], tmp_path, case[1]) == _golden()["cli"][" ".join(case[0])]


def test_golden_record_detects_a_changed_byte(tmp_path):
    """Negative control: one flipped byte in an output file changes its recorded digest."""
    name, spec, kwargs = CASES[0]
    got = _convert_case(spec, kwargs, tmp_path)
    want = _golden()["convert"][name]["output"]
    shard = next(f for f in got["output"] if f.startswith("megamoe-experts-"))
    assert got["output"][shard] == want[shard]
    p = tmp_path / "out" / shard
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 1
    p.write_bytes(bytes(data))
    assert _tree(tmp_path / "out")[shard] != want[shard]


def _record() -> None:
    import tempfile

    rec: dict = {"convert": {}, "help": {}, "cli": {}}
    for name, spec, kwargs in CASES:
        with tempfile.TemporaryDirectory() as d:
            rec["convert"][name] = _convert_case(spec, kwargs, Path(d))
        print(name, len(rec["convert"][name]["output"]), "files")
    for cmd in HELP_COMMANDS:
        rec["help"][" ".join(cmd) or "main"] = _help_text(cmd)
    for args in CLI_CASES:
        with tempfile.TemporaryDirectory() as d:
            rec["cli"][" ".join(args)] = _cli_text(args, Path(d))
    for args, then in CLI_AFTER_CONVERT:
        with tempfile.TemporaryDirectory() as d:
            rec["cli"][" ".join(args)] = _cli_text(args, Path(d), then)
    GOLDEN.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    print("wrote", GOLDEN)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _record()


def test_default_checksum_writes_the_golden_shard_bytes(tmp_path):
    """The default checksum kind (blake3 where installed) changes only megamoe.json: every other
    output file is byte for byte the golden (sha256-kind) output; and the
    manifest says which kind it is."""
    from megamoe_convert.pipeline.convert import convert
    from megamoe_convert.testing.synth import build_synthetic_checkpoint
    from megamoe_runtime.files.digests import DEFAULT_CHECKSUM
    from megamoe_runtime.format.manifest import read_manifest

    for name, spec, kwargs in [c for c in CASES if not isinstance(c[1], str)][:3]:
        _, fmt, kw = spec
        src = tmp_path / name / "synth"
        build_synthetic_checkpoint(src, fmt, **kw)
        convert(src, tmp_path / name / "out", **kwargs)
        got = _tree(tmp_path / name / "out")
        want = _golden()["convert"][name]["output"]
        assert set(got) == set(want)
        assert {k: v for k, v in got.items() if k != "megamoe.json"} == \
            {k: v for k, v in want.items() if k != "megamoe.json"}, name
        assert read_manifest(tmp_path / name / "out").checksum == DEFAULT_CHECKSUM
