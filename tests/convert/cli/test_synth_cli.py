"""`megamoe-convert synth` (issue 31 item 6): a synthetic source of any size, from the command line."""
from __future__ import annotations

import json

from click.testing import CliRunner

from megamoe_convert.cli.main import main


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="megamoe-convert")


def test_synth_builds_a_source_that_converts(tmp_path):
    r = _cli("synth", tmp_path / "src", "--format", "quark-mxfp4", "--layers", 3, "--experts", 4,
             "--hidden", 256, "--intermediate", 128, "--shared", 1, "--max-shard-size", "200KB", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["ok"], d["layers"], d["experts_per_layer"], d["shared"]) == (True, 3, 4, 1)
    assert d["files"] > 1 and (tmp_path / "src" / "model.safetensors.index.json").is_file()
    rep = json.loads(_cli("inspect", tmp_path / "src", "--json").stdout)
    assert rep["ok"] and rep["format"] == "quark-mxfp4" and len(rep["layers"]) == 3
    assert all(l["num_experts"] == 4 and l["hidden"] == 256 and l["intermediate"] == 128 for l in rep["layers"])
    c = _cli("convert", tmp_path / "src", tmp_path / "out", "--no-progress")
    assert c.exit_code == 0, c.output
    assert "routed experts: 4 per layer (12 in all)" in c.stdout


def test_synth_refuses_a_non_empty_out_and_leaves_nothing_on_bad_sizes(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    r = _cli("synth", tmp_path / "full")
    assert r.exit_code == 2 and "not an empty folder" in r.stderr
    assert (tmp_path / "full" / "x").read_text() == "mine"
    r = _cli("synth", tmp_path / "bad", "--hidden", 100)
    assert r.exit_code == 2 and "multiple of 16" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no OUT, no temp folder
    r = _cli("synth", tmp_path / "bad", "--format", "gguf")
    assert r.exit_code == 2 and "valid:" in r.output


def test_synth_refuses_absurd_sizes_up_front(tmp_path, monkeypatch):
    """Sizes beyond megamoe's stated limits, or a source larger than the disk or memory: exit 2 with one
    line naming the option, before anything is allocated or written (``--experts 1000000000`` ended in a
    41-line allocator traceback with exit 1, ``--layers 1000000`` grew memory without end)."""
    import megamoe_convert.testing.synth as synth_mod

    def never(*a, **k):  # the refusal comes before the build
        raise AssertionError("build started")

    monkeypatch.setattr(synth_mod, "build_synthetic_checkpoint", never)
    cases = [(["--experts", 1_000_000_000], "--experts = 1000000000 exceeds"),
             (["--intermediate", 100_000_000], "--intermediate = 100000000 exceeds"),
             (["--hidden", 131072], "--hidden = 131072 exceeds"),
             (["--shared", 100_000], "--shared 100000 x --intermediate 256"),
             (["--layers", 1_000_000], "--layers = 1000000 exceeds"),
             (["--layers", 1024, "--experts", 16384, "--hidden", 65536, "--intermediate", 65536], "more than the")]
    for args, needle in cases:
        r = _cli("synth", tmp_path / "big", *args)
        assert r.exit_code == 2, (args, r.output)
        errors = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: synth:") and needle in errors[0], errors
        assert list(tmp_path.iterdir()) == []


def test_synth_never_removes_a_temp_name_it_did_not_make(tmp_path):
    """``.OUT.synth-tmp`` already there (an interrupted build, or a user's folder): refused, nothing removed
    (the build used to ``rmtree`` it first)."""
    tmp = tmp_path / ".src.synth-tmp"
    tmp.mkdir()
    (tmp / "mine.txt").write_text("keep")
    r = _cli("synth", tmp_path / "src")
    assert r.exit_code == 2 and f"{tmp} exists" in r.stderr, r.output
    assert (tmp / "mine.txt").read_text() == "keep" and not (tmp_path / "src").exists()
