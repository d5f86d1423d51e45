"""The examples run as part of the suite, and converted real producer exports
match an independent fp32 computation from their source checkpoints."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import megamoe_runtime as mr

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "tests" / "fixtures" / "real"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def serve_example():
    return _load("convert_and_serve")


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "modelopt-mxfp4"])
def test_convert_and_serve_example(serve_example, capsys, fmt):
    assert serve_example.main(["--format", fmt, "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "2/2 layers match the source" in out and "(shared expert fused)" in out


@pytest.mark.parametrize("tokens", ["0", "-1"])
def test_convert_and_serve_example_refuses_a_token_count_it_cannot_route(serve_example, capsys, tokens):
    """--tokens 0 crashed with IndexError inside the routing, -1 with a torch negative-dimension error."""
    with pytest.raises(SystemExit) as e:
        serve_example.main(["--tokens", tokens])
    assert e.value.code == 2 and f"argument --tokens: {tokens} is not in 1..4096" in capsys.readouterr().err
    from megamoe_convert.testing.selfcheck import compare_with_source

    with pytest.raises(mr.MegaMoEError, match="tokens=0: the comparison needs an int >= 1"):
        compare_with_source("no-source", "no-out", tokens=0)


def test_reload_dry_run_example(capsys):
    assert _load("reload_dry_run").main([]) == 0
    out = capsys.readouterr().out
    assert "never written (experts 3)" in out and "all checks behaved as expected" in out


def _real_exports() -> list[Path]:
    return sorted(p for p in REAL.glob("*") if (p / "config.json").is_file())


@pytest.mark.skipif(not _real_exports(), reason="no real producer exports under tests/fixtures/real")
def test_real_producer_exports_match_their_source(serve_example, tmp_path, real_convert_options):
    """Every committed real export (ModelOpt, Quark, llm-compressor, plain bf16):
    convert -> build_layer(backend="reference") -> forward matches the fp32
    MoE computed from the source's dequantized experts."""
    failures = []
    for src in _real_exports():
        results = serve_example.run(src, tmp_path / src.name, tokens=8, verbose=False,
                                    **real_convert_options.get(src.name, {}))
        assert results, src.name
        failures += [f"{src.name} layer {r['index']}: {r['calc_diff']:.2e} >= {r['threshold']:.0e}"
                     for r in results if not r["ok"]]
    assert not failures, failures


def test_negative_control_wrong_layout_misses_the_threshold(serve_example, tmp_path):
    """The threshold means something: swapping the gate/up interleave of one
    converted layer puts it far above."""
    from megamoe_convert.readers import detect_reader
    from megamoe_convert.readers.source import open_source
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    src = build_synthetic_checkpoint(tmp_path / "src", "modelopt-mxfp4")
    good = serve_example.run(src, tmp_path / "out", tokens=32, verbose=False)
    assert all(r["ok"] for r in good)
    ck = mr.open_checkpoint(tmp_path / "out")
    layer = ck.build_layer(0, backend="reference")
    with torch.no_grad():  # swap the gate and up row groups of every expert's L1 weight
        w = layer.l1_weight.unflatten(1, (-1, 2, 8))
        w.copy_(w.flip(2).clone())
    spec = layer.spec
    x, wt, ids = serve_example.routing(32, spec.num_experts, spec.top_k, spec.hidden, 0)
    source = open_source(str(src))
    try:
        ref = serve_example.source_forward(detect_reader(source), 0, spec, x, wt, ids)
    finally:
        source.close()
    bad = mr.calc_diff(layer(x, wt, ids), ref)
    assert bad > 10 * serve_example.THRESHOLDS["mxfp4"], bad


# The README's own blocks (the transformers and layer snippets included) run in order in tests/test_readme.py.
