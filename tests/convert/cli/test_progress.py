"""The progress display (issue 31 item 5): bytes, rate, where, 100% at the end, lines off a terminal."""
from __future__ import annotations

import io

from click.testing import CliRunner

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.cli.progress import ProgressDisplay


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_lines_mode_is_periodic_and_says_bytes_rate_where():
    out, clock = io.StringIO(), Clock()
    p = ProgressDisplay("converting", "auto", stream=out, interval=10, clock=clock)
    assert p.mode == "lines"  # a StringIO is not a terminal: CI / k8s logs get plain lines
    p.stage("checking 2 MoE layer(s)")
    p.where("layer 0 (model.layers.0.mlp)")
    for i in range(1, 101):  # 100 updates over 20 s: a line at most every 10 s, not 100
        clock.t = i * 0.2
        p(i * 10_000_000, 1_000_000_000)
    p.close(ok=True)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 2 <= len(lines) <= 4, lines  # at 10 s, 20 s and the last one
    mid = lines[0]
    assert "MB / 1.00 GB" in mid and "MB/s" in mid and "ETA" in mid and "layer 0 (model.layers.0.mlp)" in mid
    assert lines[-1].startswith("converting: 100% 1.00 GB / 1.00 GB, in 0:20")


def test_finishes_at_100_even_if_the_last_bytes_never_came():
    # a run's plan counts a few scalar bytes the byte pass never reports: a successful run ends at 100%
    out, clock = TTY(), Clock()
    p = ProgressDisplay("converting", "auto", stream=out, clock=clock)
    assert p.mode == "tty"
    clock.t = 1.0
    p(999_808, 1_000_000)
    clock.t = 2.0
    p.close(ok=True)
    last = out.getvalue().split("\r")[-1]
    assert "100%" in last and "1.00 MB/1.00 MB" in last
    assert out.getvalue().endswith("\n")


def test_lines_mode_heartbeat_during_a_long_phase():
    # no byte for a while (checking a big model's scales): a line per interval anyway, from the thread
    import time
    out = io.StringIO()
    p = ProgressDisplay("converting", "lines", stream=out, interval=0.05)
    p.stage("checking 48 MoE layer(s)")
    time.sleep(1.3)
    p.close(ok=False)
    assert out.getvalue().startswith("converting: checking 48 MoE layer(s) (0:0")


def test_quick_failure_prints_no_progress_line():
    out = io.StringIO()
    p = ProgressDisplay("converting", "lines", stream=out, interval=10)
    p.stage("opening src")
    p.close(ok=False)
    assert out.getvalue() == ""  # the error stands alone in the log


def test_failed_run_does_not_claim_100():
    out, clock = io.StringIO(), Clock()
    p = ProgressDisplay("converting", "lines", stream=out, interval=0, clock=clock)
    clock.t = 1
    p(500, 1000)
    p.close(ok=False)
    assert "100%" not in out.getvalue()


def test_off_prints_nothing():
    out = io.StringIO()
    p = ProgressDisplay("converting", "off", stream=out)
    p.stage("x")
    p(1, 2)
    p.close()
    assert out.getvalue() == ""


def test_cli_convert_off_a_terminal_prints_progress_lines(tmp_path, monkeypatch):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-mxfp8", num_layers=2, num_experts=4)
    monkeypatch.setenv("MEGAMOE_PROGRESS_INTERVAL", "0")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    err = r.stderr
    # interval 0: every phase and byte update is a line; the first comes before torch is imported
    assert err.splitlines()[0].startswith("converting: loading torch")
    assert "converting: checking 2 MoE layer(s)" in err
    assert "layer 1 (model.layers.1.mlp), writing megamoe-experts-rank000-of-001-00001.safetensors" in err
    assert err.strip().splitlines()[-1].startswith("converting: 100% ")
    import json
    assert json.loads(r.stdout)["row"] == "mxfp8"  # stdout stays JSON only

    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out2"), "--no-progress"])
    assert r.exit_code == 0 and "converting:" not in r.stderr


def test_the_byte_count_reaches_the_total_exactly(tmp_path):
    # shared experts make a layer's bytes per expert fractional: the sum of the shares must still be exact
    from megamoe_convert.pipeline.convert import convert

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", num_layers=2, num_experts=3,
                                           shared=1)
    seen = []
    convert(src, tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))  # never backwards


def test_first_line_comes_before_torch_is_imported(tmp_path):
    # the seconds of `import torch` were a blank screen: the display's first line must come before it
    import subprocess
    import sys

    probe = (
        "import sys, importlib.abc\n"
        "class Hook(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'torch':\n"
        "            sys.stderr.write('TORCH-IMPORTED\\n'); sys.stderr.flush(); sys.meta_path.remove(self)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "from megamoe_convert.cli.main import main\n"
        "main(['convert', sys.argv[1], sys.argv[2]])\n")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "absent"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "MEGAMOE_PROGRESS_INTERVAL": "0"})
    err = r.stderr
    assert "TORCH-IMPORTED" in err and "converting: loading torch" in err, err
    assert err.index("converting: loading torch") < err.index("TORCH-IMPORTED"), err


def test_the_line_names_the_file_being_written(monkeypatch):
    """The line said the layer but not the file being written: it names it now, in both modes, and a new
    phase (which writes its own files, or none) drops it."""
    monkeypatch.setenv("COLUMNS", "200")  # a terminal line is cut at the terminal's width
    for stream in (io.StringIO(), TTY()):
        clock = Clock()
        p = ProgressDisplay("converting", "auto", stream=stream, interval=0, clock=clock)
        p.where("layer 3 (model.layers.3.mlp)")
        p.writing("megamoe-experts-rank001-of-002-00001.safetensors")
        clock.t = 1.0
        p(10_000_000, 1_000_000_000)
        assert "layer 3 (model.layers.3.mlp), writing megamoe-experts-rank001-of-002-00001.safetensors" in p.text(1.0)
        clock.t = 2.0
        p(20_000_000, 1_000_000_000)
        assert "writing megamoe-experts-rank001-of-002-00001.safetensors" in stream.getvalue()
        p.stage("finishing: flushing the shards")
        assert "writing" not in p.text(2.0)
        p.close(ok=True)
