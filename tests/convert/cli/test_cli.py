"""The megamoe-convert CLI: help with examples everywhere, exit codes, JSON
outputs, inspect, demo."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main

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
    (tmp_path / "empty").mkdir()
    r = run_cli("convert", tmp_path / "empty", tmp_path / "o")  # empty folder
    assert r.exit_code == 2 and "no *.safetensors" in r.stderr
    r = run_cli("convert", tmp_path, tmp_path / "o")  # OUT inside the source
    assert r.exit_code == 2 and "may not overlap" in r.stderr


def _usage_cases(name: str, cmd, tmp_path) -> list:
    """(argv, the problem the line must name) for each kind of usage error `cmd` can have: an unknown option,
    a missing argument (commands that take one), a bad value of an option of a checked type."""
    import click

    args = [p for p in cmd.params if isinstance(p, click.Argument)]
    filled = [str(tmp_path / a.name) for a in args]
    cases = [([name, *filled, "--no-such-option"], "no such option --no-such-option")]
    if args:
        cases.append(([name], f"missing argument {args[0].human_readable_name}"))
    opt = next(p for p in cmd.params if isinstance(p, click.Option) and isinstance(p.type, (click.IntRange,
                                                                                            click.Choice)))
    cases.append(([name, *filled, opt.opts[0], "not-a-value"], f"invalid value for '{opt.opts[0]}'"))
    return cases


def test_every_usage_error_of_every_command_is_one_line(tmp_path):
    """Click's usage errors printed four lines (usage, "Try --help", a blank line, the error); the project's
    standard for bad input is one line: it names the command and the problem and points at the command's
    --help, exit 2, nothing on stdout. Every subcommand, each kind of usage error, and the group's own."""
    cases = [(["nonsense"], "", "no such command 'nonsense'"), (["--bogus"], "", "no such option --bogus")]
    for name, cmd in sorted(main.commands.items()):
        cases += [(argv, f" {name}", what) for argv, what in _usage_cases(name, cmd, tmp_path)]
    assert {c[1].strip() for c in cases} >= {"convert", "inspect", "verify", "synth", "demo", "warm"}
    for argv, sub, what in cases:
        r = run_cli(*argv)
        assert r.exit_code == 2 and r.stdout == "", (argv, r.output)
        path = f"megamoe-convert{sub}"
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {path}: {what}"), (argv, r.stderr)
        assert r.stderr.endswith(f" (see {path} --help)\n"), (argv, r.stderr)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_usage_error_line_from_the_real_entry_point(tmp_path):
    """The same line from a real process (``python -m megamoe_convert``), for the option whose missing value
    the parser reports before any command context exists."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    for argv, line in (
            (["convert", str(tmp_path)], "error: megamoe-convert convert: missing argument OUT (see megamoe-convert "
                                         "convert --help)\n"),
            (["convert", str(tmp_path), str(tmp_path / "o"), "--ep-size"],
             "error: megamoe-convert convert: option '--ep-size' requires an argument (see megamoe-convert convert "
             "--help)\n")):
        p = subprocess.run([sys.executable, "-m", "megamoe_convert", *argv], capture_output=True, text=True,
                           env=env, timeout=120)
        assert (p.returncode, p.stdout, p.stderr) == (2, "", line)


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
    for needle in ("-> row mxfp8", "MoE layers: 2", "routed experts: 4 per layer (8 in all)", "bytes in:", "bytes out:", "GB/s"):
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
    assert res["ok"] and res["verify"]["ok"] and res["convert"]["row"] == "nvfp4" and res["convert"]["ep_size"] == 2
    cmp = res["compare"]
    assert cmp["ok"] and cmp["backend"] == "reference" and [le["index"] for le in cmp["layers"]] == [0, 1]
    for le in cmp["layers"]:
        assert le["ok"] and 0 <= le["calc_diff"] < le["threshold"] == 2e-2
    assert (tmp_path / "d" / "converted" / "megamoe.json").is_file()
    gen = res["generate"]  # the last step: from_pretrained on a converted real transformers model + generate
    assert gen["ok"] and len(gen["tokens"]) == 8 and gen["tokens"] == gen["reference_tokens"]
    assert (tmp_path / "d" / "hf-converted" / "megamoe.json").is_file()
    assert "demo: transformers: converted a tiny DeepseekV3ForCausalLM with random weights (a bf16 source, so row " \
           f"bf16) into {tmp_path / 'd' / 'hf-converted'}" not in r.stdout  # (--json: the JSON only)
    assert gen["row"] == "bf16" and gen["source_dtype"] == "bf16" and gen["out"] == str(tmp_path / "d" / "hf-converted")
    mine = tmp_path / "e" / "hf-source"  # a user's folder where the last step would save its model
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    r = run_cli("demo", "--keep", tmp_path / "e")
    assert r.exit_code == 2 and "hf-source (not written by the demo)" in r.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "e" / "source").exists()
    r = run_cli("demo", "--format", "gguf")
    assert r.exit_code == 2 and "unknown synthetic format 'gguf'" in r.output and "deepseek-v4" in r.output


def test_demo_keep_runs_again_in_its_own_folder_only(tmp_path):
    """The README runs `demo --keep` more than once: a second run replaces what the first wrote (its marker
    lists it), and names the folder it wrote; a file changed since, or a folder it did not write, is never
    touched."""
    d = tmp_path / "d"
    for _ in range(2):
        r = run_cli("demo", "--keep", d, "--format", "bf16")
        assert r.exit_code == 0, r.output
    assert (d / "converted" / "megamoe.json").is_file() and (d / ".megamoe-demo.json").is_file()
    assert "demo: transformers: converted a tiny DeepseekV3ForCausalLM with random weights (a bf16 source, so row " \
           f"bf16) into {d / 'hf-converted'}" in r.stdout
    cfg = d / "converted" / "config.json"
    cfg.write_text(cfg.read_text() + " ")  # the user's edit
    before = cfg.read_bytes()
    r = run_cli("demo", "--keep", d, "--format", "bf16")
    assert r.exit_code == 2 and f"{d / 'converted'} (changed since the demo wrote it)" in r.stderr
    assert cfg.read_bytes() == before and (d / "source" / "config.json").is_file()
    r = run_cli("demo", "--format", "gguf")
    assert r.exit_code == 2 and "unknown synthetic format 'gguf'" in r.output and "deepseek-v4" in r.output


def test_demo_default():
    r = run_cli("demo")
    assert r.exit_code == 0, r.output
    assert "demo: verify ok" in r.stdout and "demo: converted to row nvfp4" in r.stdout
    assert "vs fp32 MoE from the source checkpoint" in r.stdout
    for i in (0, 1):
        assert f"demo:   layer {i} (model.layers.{i}.mlp, row nvfp4): calc_diff " in r.stdout
    assert "< threshold 2e-02  OK" in r.stdout and "demo: ok: 2/2 layers match the source" in r.stdout


def test_demo_fails_when_a_layer_misses(monkeypatch):
    """The comparison is not decorative: when the two sides disagree (here the
    source side is fed swapped routing and scaled) every layer is reported
    FAIL and the demo exits 1."""
    from megamoe_convert.testing import selfcheck

    real = selfcheck.source_forward
    monkeypatch.setattr(selfcheck, "source_forward",
                        lambda reader, i, spec, x, w, ids: real(reader, i, spec, x, w, ids.flip(-1)) * 1.5)
    r = run_cli("demo", "--format", "bf16")
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.stdout and "demo: FAILED: 0/2 layers match the source" in r.stdout


def test_every_json_flag_prints_only_json(tmp_path):
    row_fmt = "modelopt-nvfp4"
    """convert/inspect/verify/demo --json: stdout is exactly one JSON document
    (logs and warnings go to stderr)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", row_fmt, **SMALL, shared=1,
                                           scale_mismatch=(1, 3))  # convert logs the requantization
    outs = {}
    r = run_cli("convert", src, tmp_path / "o", "--json", "--on-scale-mismatch", "requantize")
    assert r.exit_code == 0, r.output
    assert "requantized" in r.stderr or "requantize" in r.stderr  # the log went to stderr
    outs["convert"] = json.loads(r.stdout)
    r = run_cli("inspect", src, "--json")
    assert r.exit_code == 2  # the mismatch is a problem for inspect: still JSON only
    outs["inspect"] = json.loads(r.stdout)
    r = run_cli("verify", tmp_path / "o", "--json", "--reload-dry-run")
    assert r.exit_code == 0, r.output
    outs["verify"] = json.loads(r.stdout)
    r = run_cli("demo", "--json", "--format", "bf16")
    assert r.exit_code == 0, r.output
    outs["demo"] = json.loads(r.stdout)
    assert outs["convert"]["repaired_experts"] == 1 and outs["inspect"]["problems"]
    assert outs["verify"]["ok"] and outs["demo"]["ok"]


_NO_NUMPY = textwrap.dedent("""
    import importlib.abc, sys
    class NoNumpy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
    sys.meta_path.insert(0, NoNumpy())
    for m in [m for m in sys.modules if m == "numpy" or m.startswith("numpy.")]:
        del sys.modules[m]
""")


def test_no_numpy_warning_from_the_cli():
    """On a machine without numpy torch warns 'Failed to initialize NumPy' at
    import; the CLI entry point silences exactly that warning."""
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    root = str(Path(__file__).resolve().parents[3])
    control = subprocess.run([sys.executable, "-c", _NO_NUMPY + "import torch\n"], capture_output=True,
                             text=True, env=env, cwd=root, timeout=120)
    if "Failed to initialize NumPy" not in control.stderr:
        pytest.skip("this torch does not warn without numpy")
    code = _NO_NUMPY + "from megamoe_convert.cli.main import main\nmain(['verify', '--help'])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Failed to initialize NumPy" not in r.stderr and "Examples:" in r.stdout


def test_shared_precision_cli(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    r = run_cli("convert", src, tmp_path / "auto")
    assert r.exit_code == 0, r.output
    assert "shared experts (layers 0-1): fused as mxfp8 (auto: the shared experts are nvfp4" in r.stdout
    assert "--shared-precision bf16 for it" in r.stdout  # the other DeepGEMM flavour's precision
    r = run_cli("convert", src, tmp_path / "bf16", "--shared-precision", "bf16", "--json")
    assert r.exit_code == 0, r.output
    (d,) = json.loads(r.stdout)["shared"]
    assert d["precision"] == "bf16" and d["requested"] == "bf16" and d["layers"] == "0-1"
    assert "fp4_fp4_mega_moe" in d["note"]
    r = run_cli("inspect", src, "--shared-precision", "bf16")
    assert r.exit_code == 0 and "fused as bf16 (--shared-precision bf16)" in r.stdout

    mx = synth.build_synthetic_checkpoint(tmp_path / "mx", "quark-mxfp4", **SMALL, shared=1)
    r = run_cli("convert", mx, tmp_path / "o", "--shared-precision", "bf16")
    assert r.exit_code == 2
    assert "--shared-precision bf16: row mxfp4 fuses shared experts only as mxfp8" in r.stderr
    assert not (tmp_path / "o").exists()
    r = run_cli("convert", mx, tmp_path / "o", "--shared-precision", "fp4")
    assert r.exit_code == 2 and "auto" in r.stderr and "mxfp8" in r.stderr


def test_verify_reload_dry_run(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    out = tmp_path / "o"
    assert run_cli("convert", src, out, "--ep-size", "2").exit_code == 0
    r = run_cli("verify", out, "--reload-dry-run", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["reload"] == {"ok": True, "ranks": 2, "layers": 2, "layer_loads": 4, "problems": []}
    r = run_cli("verify", out, "--reload-dry-run")
    assert r.exit_code == 0 and "ok: reload dry run of 2 MoE layer(s) on each of 2 EP rank(s) (4 layer loads)" in r.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"], ["verify", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    """Start-up: answering --help / --version must not pay the torch import (seconds)."""
    code = textwrap.dedent(f"""
        import sys
        from megamoe_convert.cli.main import main
        try:
            main({args!r})
        except SystemExit as e:
            assert e.code in (0, None), e.code
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_blake3_folder_without_blake3(tmp_path, monkeypatch):
    """A machine without the blake3 package: convert --checksum blake3 and verify of a blake3
    folder exit 2 naming the package; a sha256 folder verifies; a blake3 folder still loads."""
    pytest.importorskip("blake3")
    import megamoe_runtime as mr

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    assert run_cli("convert", src, tmp_path / "b3", "--checksum", "blake3").exit_code == 0
    assert run_cli("convert", src, tmp_path / "sha", "--checksum", "sha256").exit_code == 0
    monkeypatch.setitem(sys.modules, "blake3", None)
    r = run_cli("convert", src, tmp_path / "again", "--checksum", "blake3")
    assert r.exit_code == 2 and "'blake3' is not installed" in r.stderr
    assert not (tmp_path / "again").exists()
    r = run_cli("verify", tmp_path / "b3")
    assert r.exit_code == 2 and "'blake3' is not installed" in r.stderr and "--checksum sha256" in r.stderr
    assert run_cli("verify", tmp_path / "sha").exit_code == 0
    layer = mr.open_checkpoint(tmp_path / "b3").build_layer(0, device="cpu", backend="reference")
    assert layer.l1_weight.numel() > 0


# --------------------------------------------------------------------------- signals and JSON errors


@pytest.mark.parametrize("sig, code, as_json", [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)])
def test_signal_exit_code_temp_folder_and_resume_command(tmp_path, synth_ckpt, crashing_run, sig, code, as_json):
    """A real conversion process gets SIGINT (Ctrl-C) / SIGTERM mid-run: exit
    130 / 143 (not 1, which means verification failed), the message names the
    temp folder and the exact --resume command, nothing is under OUT; the
    printed command completes the conversion."""
    from megamoe_convert.output.output_dir import lock_path_for, temp_dir_for
    from megamoe_runtime.load.verify import verify_output

    src = synth_ckpt("quark-mxfp4", **SMALL)
    src_bytes = {f.name: f.read_bytes() for f in Path(src).iterdir()}
    out = tmp_path / "out dir"  # a space: the printed command must quote it
    args = ["convert", src, out, "--max-shard-size", "60KB", "--no-progress"] + (["--json"] if as_json else [])
    p = crashing_run("tensor", "5:60", *args, wait=False)  # mid-layers: pass-through thread and O_DIRECT writes live
    err = ""
    try:
        deadline = time.time() + 120
        while "pausing" not in err and time.time() < deadline:
            err += p.stderr.readline()
        p.send_signal(sig)
        stdout, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    err += rest
    assert p.returncode == code, err
    tmp = temp_dir_for(out)
    assert not out.exists() and tmp.is_dir() and not lock_path_for(out).exists()
    assert f"nothing was written under {out}" in err and f"The unfinished conversion is in {tmp}" in err
    cmd = err.split("continue it with:\n  ", 1)[1].splitlines()[0]
    assert cmd == shlex.join(["megamoe-convert", "convert", str(src), str(out), "--max-shard-size", "60KB",
                              *(["--json"] if as_json else []), "--no-progress", "--resume"])
    if as_json:
        rep = json.loads(stdout)
        assert rep["ok"] is False and rep["exit_code"] == 143 and rep["resume_command"] == cmd
        assert rep["temp_folder"] == str(tmp)
    r = run_cli(*shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output
    assert verify_output(out).ok and not tmp.exists()
    assert {f.name: f.read_bytes() for f in Path(src).iterdir()} == src_bytes  # the source never written


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_second_signal_during_slow_writes_ends_the_run_at_once(tmp_path, synth_ckpt, crashing_run, sig, code):
    """Two SIGINTs (SIGTERMs) 0.2 s apart while the writer threads are stuck on a slow disk (each write sleeps 3 s, so
    a layer's queued pieces take far longer than the bound): the process ends within seconds with 130 (143) (it
    used to drain the whole queue, or hang in the interpreter's exit joining a writer thread that waited
    for a staging buffer nobody would free), and the temp folder it leaves resumes to a verified output."""
    from megamoe_convert.output.output_dir import lock_path_for, temp_dir_for
    from megamoe_runtime.load.verify import verify_output

    src = synth_ckpt("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    args = ["convert", src, out, "--max-shard-size", "60KB", "--no-progress"]
    p = crashing_run("tensor", "1:0.01", *args, wait=False, env={"CRASHING_CLI_WRITE_DELAY": "3"})
    err = ""
    try:
        deadline = time.time() + 120
        while "pausing" not in err and time.time() < deadline:
            err += p.stderr.readline()
        time.sleep(1.5)  # the writer threads now have a queue of slowed writes
        p.send_signal(sig)
        time.sleep(0.2)
        if p.poll() is None:
            p.send_signal(sig)
        t0 = time.time()
        _, rest = p.communicate(timeout=30)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    err += rest
    assert p.returncode == code, err
    assert took < 2.5, f"the run took {took:.1f} s to end after the second signal"
    tmp = temp_dir_for(out)
    assert not out.exists() and tmp.is_dir()
    cmd = err.split("continue it with:\n  ", 1)[1].splitlines()[0]
    r = run_cli(*shlex.split(cmd)[1:])
    assert r.exit_code == 0, r.output
    assert verify_output(out).ok and not tmp.exists() and not lock_path_for(out).exists()


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_starting_exits_130_in_one_line(tmp_path, monkeypatch, as_json):
    """Ctrl-C before the command's own handling starts (here: while the converter is imported to read
    --max-shard-size) exits 130 with one line, not click's "Aborted!" with 1."""
    import megamoe_convert.cli.main as cli

    def interrupted(text):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "parse_size", interrupted)
    r = run_cli("convert", tmp_path, tmp_path / "out", *(["--json"] if as_json else []))
    assert r.exit_code == 130, r.output
    assert "Aborted!" not in r.output and "interrupted by SIGINT (Ctrl-C) while starting" in r.stderr
    assert not (tmp_path / "out").exists()
    if as_json:
        assert json.loads(r.stdout)["exit_code"] == 130


def test_json_errors_for_every_command(tmp_path):
    cases = [
        (["convert", tmp_path / "absent", tmp_path / "o", "--json"], "neither an existing folder"),
        (["inspect", tmp_path / "absent", "--json"], "neither an existing folder"),
        (["verify", tmp_path / "absent", "--json"], "is not a folder"),
        (["demo", "--format", "nope", "--json"], "unknown synthetic format"),
        (["convert", tmp_path, tmp_path / "o", "--max-shard-size", "lots", "--json"], "--max-shard-size"),
        (["convert", tmp_path, "--json"], "megamoe-convert convert: missing argument OUT (see megamoe-convert "
                                          "convert --help)"),
        (["verify", tmp_path, "--bogus", "--json"], "megamoe-convert verify: no such option --bogus"),
    ]
    for args, needle in cases:
        r = run_cli(*args)
        assert r.exit_code == 2, (args, r.output)
        rep = json.loads(r.stdout)  # only JSON on stdout
        assert rep["ok"] is False and rep["exit_code"] == 2 and needle in rep["error"], (args, rep)


def test_convert_verify_demo_count_files_alike_and_a_deleted_shard_is_one_problem(tmp_path, synth_ckpt):
    src = synth_ckpt("quark-mxfp4", **SMALL)
    out = tmp_path / "out"
    s = json.loads(run_cli("convert", src, out, "--max-shard-size", "60KB", "--json").stdout)
    v = json.loads(run_cli("verify", out, "--json").stdout)
    assert s["files"] == v["files_checked"] == len(list(out.iterdir()))  # the manifest counted by both
    d = json.loads(run_cli("demo", "--format", "quark-mxfp4", "--json").stdout)
    assert d["convert"]["files"] == d["verify"]["files_checked"]
    shard = sorted(out.glob("megamoe-experts-*.safetensors"))[0]
    shard.unlink()
    r = run_cli("verify", out, "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 1 and len(rep["problems"]) == 1, rep["problems"]
    assert rep["problems"][0].startswith(f"{shard}: missing (manifest lists it with ")
    assert "does not list" not in rep["problems"][0]


def test_inspect_size_estimate_says_about(tmp_path, synth_ckpt):
    src = synth_ckpt("quark-mxfp4", **SMALL)
    r = run_cli("inspect", src)
    assert "estimated output: about " in r.stdout


def test_quantize_choices_are_the_readers_quantize_rows():
    """cli.py lists the --quantize choices by hand (it imports no torch before a command runs); they must be
    what the unquantized reader can produce, so a kernel-layout row added there fails here until listed."""
    from megamoe_convert.readers.unquantized import QUANTIZE_ROWS

    for name in ("convert", "inspect"):
        opt = next(p for p in main.commands[name].params if p.name == "quantize")
        assert tuple(opt.type.choices) == QUANTIZE_ROWS, name


def test_shared_precision_choices_are_the_row_tables():
    """--shared-precision is listed by hand for the same reason; it must be `SHARED_PRECISION_CHOICES`."""
    from megamoe_convert.pipeline.shared import SHARED_PRECISION_CHOICES

    for name in ("convert", "inspect"):
        opt = next(p for p in main.commands[name].params if p.name == "shared_precision")
        assert tuple(opt.type.choices) == SHARED_PRECISION_CHOICES, name


@pytest.mark.parametrize("cmd", ["convert", "inspect"])
def test_an_already_converted_folder_is_named_as_such(ckpts, tmp_path, cmd):
    _, out = ckpts.converted("modelopt-nvfp4")
    args = [cmd, out] + ([tmp_path / "again"] if cmd == "convert" else [])
    r = run_cli(*args)
    assert r.exit_code == 2
    assert f"{out}: already a megamoe output (megamoe.json is there)" in r.stderr
    assert not (tmp_path / "again").exists()


def test_inspect_names_the_source_formats_own_global_scale_tensor():
    """compressed-tensors keeps the NVFP4 global scale in weight_global_scale, ModelOpt in weight_scale_2."""
    real = Path(__file__).resolve().parents[2] / "fixtures" / "real"
    for fixture, name in (("llmcompressor-nvfp4-qwen3moe", "weight_global_scale"),
                          ("modelopt-nvfp4-qwen3moe", "weight_scale_2")):
        r = run_cli("inspect", real / fixture)
        assert r.exit_code == 0, r.output
        assert f"of 8 w1/w3 {name} pairs differ" in r.stdout, fixture


def test_convert_summary_says_what_its_time_measures_and_what_comes_next(synth_ckpt, tmp_path):
    r = run_cli("convert", synth_ckpt("bf16"), tmp_path / "out")
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("time:"))
    m = re.search(r"time: ([\d.]+) s converting \(checks, reads, writes, rename\), ([\d.]+) s since the command "
                  r"started \(imports included\)   throughput: ", line)
    assert m and float(m[2]) >= float(m[1]), line
    out, src = tmp_path / "out", synth_ckpt("bf16")
    assert f"next: megamoe-convert verify {out} --against {src}" in r.stdout
    assert f"transformers: AutoModelForCausalLM.from_pretrained('{out}')   (the installed package registers" \
        in r.stdout and f"vllm serve {out} --load-format megamoe" in r.stdout


def test_verify_against_its_source_prints_the_layer_table_and_passes(ckpts):
    src, out = ckpts.converted("modelopt-nvfp4")
    r = run_cli("verify", out, "--against", src)
    assert r.exit_code == 0, r.output
    assert "layer  module" in r.stdout and "calc_diff  threshold  result" in r.stdout
    for i in (0, 1):
        assert f"    {i}  model.layers.{i}.mlp  nvfp4" in r.stdout
    assert f"ok: all 2 MoE layers match {src} within their row's threshold" in r.stdout
    d = json.loads(run_cli("verify", out, "--against", src, "--json", "--tokens", "8").stdout)
    a = d["against"]
    assert d["ok"] and d["exit_code"] == 0 and a["ok"] and a["tokens"] == 8 and a["format"] == "modelopt-nvfp4"
    assert [le["index"] for le in a["layers"]] == [0, 1]
    assert all(le["ok"] and 0 <= le["calc_diff"] < le["threshold"] == 2e-2 for le in a["layers"])


def test_verify_against_quantized_from_bf16_reads_the_source_as_the_conversion_did(ckpts):
    """--quantize mxfp4: the manifest says so, and the comparison quantizes the source the same way."""
    src = ckpts.source("bf16")
    out = ckpts.base / "bf16-to-mxfp4"
    if not out.exists():
        from megamoe_convert.pipeline.convert import convert
        convert(src, out, quantize="mxfp4")
    d = json.loads(run_cli("verify", out, "--against", src, "--json").stdout)
    assert d["ok"] and d["against"]["quantize"] == "mxfp4" and d["against"]["row"] == "mxfp4"


def test_verify_against_another_source_fails(ckpts, make_ckpt):
    """Negative control: a source of the same shapes but other weights misses every threshold (exit 1); one of
    other shapes is named as not the source (exit 2)."""
    _, out = ckpts.converted("modelopt-nvfp4")
    other = make_ckpt("modelopt-nvfp4", seed=7)
    r = run_cli("verify", out, "--against", other)
    assert r.exit_code == 1, r.output
    assert r.stdout.count("FAIL") >= 2 and f"against {other} >= threshold 2e-02" in r.stdout
    d = json.loads(run_cli("verify", out, "--against", other, "--json").stdout)
    assert d["exit_code"] == 1 and not d["ok"] and not d["against"]["ok"]
    wider = make_ckpt("modelopt-nvfp4", intermediate=384)
    r = run_cli("verify", out, "--against", wider)
    assert r.exit_code == 2 and f"{wider} is not the source of {out}: MoE layer 0" in r.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_an_internal_error_exits_3_naming_its_traceback_file(ckpts, tmp_path, monkeypatch, as_json):
    """An exception no command expects (a bug; here planted in verify) used to end in a bare traceback and exit 1,
    which for `verify` also means "verification failed": a script took a crash for a verdict. Now exit 3, one
    line naming the exception and the file its traceback went to (with the command line, a --token hidden)."""
    import tempfile

    import megamoe_runtime.load.verify as verify_mod

    _, out = ckpts.converted("quark-mxfp4")

    def planted(*a, **k):
        raise KeyError("planted bug")

    monkeypatch.setattr(verify_mod, "verify_output", planted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_cli("verify", out, "--no-progress", *(["--json"] if as_json else []))
    assert r.exit_code == 3, (r.output, r.exception)
    [crash] = tmp_path.glob("megamoe-convert-crash-*.txt")
    line = ("error: internal error (a bug in megamoe, not a verdict on the input): KeyError: 'planted bug'; the "
            f"traceback is in {crash}: please report it with that file")
    assert r.stderr.strip().splitlines() == [line] and "Traceback" not in r.output
    text = crash.read_text()
    assert "Traceback (most recent call last)" in text and "raise KeyError(\"planted bug\")" in text
    if as_json:
        assert json.loads(r.stdout) == {"ok": False, "exit_code": 3, "error": line[len("error: "):],
                                        "traceback": str(crash)}
