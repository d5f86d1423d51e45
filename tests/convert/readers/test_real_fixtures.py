"""Every reader on REAL producer exports (tests/fixtures/real, made by
tests/fixtures/make_real_fixtures.py with nvidia-modelopt, llmcompressor,
amd-quark and transformers on tiny random MoE models).

All fixtures of a model family were quantized from the same BF16 weights
(the ``source`` fixture), so the readers' dequantized experts can be compared
with the exact weights the producer saw: a wrong scale convention (a divisor
read as a multiplier, a swapped nibble order, gate/up swapped) shows up as a
large error, not a subtle one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source
from megamoe_runtime.format import codecs

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "real"
MANIFEST = REAL / "manifest.json"
FIXTURES = json.loads(MANIFEST.read_text())["fixtures"]  # committed: missing means a broken checkout
PRODUCER_PREFIX = {"modelopt": "modelopt", "llmcompressor": "ct", "quark": "quark"}
#: max relative Frobenius error of a dequantized expert vs its BF16 source
#: (fp8_block: transformers 5.17's on-load quantizer measures 0.044, llm-compressor's 0.027)
TOL = {"nvfp4": 0.12, "mxfp4": 0.14, "mxfp8": 0.035, "bf16": 0.0, "fp8_block": 0.05}

def _ids(fx):
    return fx["dir"]


def test_every_recorded_fixture_is_committed():
    missing = [f["dir"] for f in FIXTURES if not (REAL / f["dir"] / "config.json").is_file()]
    assert not missing, f"fixtures listed in {MANIFEST} but missing: {missing}"


#: fixtures read by a reader named other than producer-scheme
EXPECTED_FORMAT = {"modelopt-w4a8-nvfp4-fp8-qwen3moe": "modelopt-w4a8-nvfp4-fp8",
                   "finegrained-fp8-qwen3moe": "fp8-block", "finegrained-fp8-deepseekv3": "fp8-block",
                   "llmcompressor-fp8-block-qwen3moe": "ct-fp8-block",
                   "llmcompressor-fp8-block-deepseekv3": "ct-fp8-block"}


def _expected_format(fx) -> str:
    if fx["scheme"] == "bf16":
        return "unquantized"
    if fx["dir"] in EXPECTED_FORMAT:
        return EXPECTED_FORMAT[fx["dir"]]
    return f"{PRODUCER_PREFIX[fx['producer']]}-{fx['scheme']}"


def _reader(src):
    """The reader, with a coarser activation recipe accepted: these tests are about
    reading the weights (tests/convert/readers/test_recipe.py tests the refusal)."""
    return detect_reader(src, accept_activation_change=True)


def _has_input_scales(fx) -> bool:
    return any(k in fx.get("checks", {}) for k in ("input_scale", "input_scale_2", "input_global_scale"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _source_weights(fx, prefix: str, e: int):
    src = open_source(REAL / fx["source"])
    return tuple(src.get_tensor(f"{prefix}.experts.{e}.{p}.weight").float() for p in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize("fx", FIXTURES, ids=_ids)
def test_reader_reads_real_export(fx):
    src = open_source(REAL / fx["dir"])
    r = _reader(src)
    assert r.format_name == _expected_format(fx)
    row = r.row
    layers = r.moe_layers()
    assert layers and all(l.num_experts == fx["num_experts"] for l in layers)
    assert fx["expert_prefix"] in {f"{l.prefix}.experts" for l in layers}
    facts = r.model_facts()
    assert facts.num_experts == fx["num_experts"] and facts.activation.kind == "swiglu"
    consumed = r.consumed_tensor_names()
    rest = set(src.tensor_names()) - consumed
    assert not any(".experts." in n for n in rest)
    assert any(n.endswith("mlp.gate.weight") for n in rest)  # the router is passed through

    for info in layers:
        for e in range(info.num_experts):
            et = r.read_expert(info.index, e)
            et.validate(row, info.hidden, info.intermediate, f"{fx['dir']} L{info.index} e{e}")
            deq = et.dequantize(row)
            for t, shape in zip(deq, [(info.intermediate, info.hidden)] * 2 + [(info.hidden, info.intermediate)]):
                assert tuple(t.shape) == shape and torch.isfinite(t).all()
            if fx["source"]:
                for role, got, want in zip(("gate", "up", "down"), deq, _source_weights(fx, info.prefix, e)):
                    err = _rel(got, want)
                    assert err < TOL[row], (fx["dir"], info.index, e, role, err)
            else:  # BF16: bit-exact copy
                raw = src.get_tensor(f"{info.prefix}.experts.{e}.gate_proj.weight")
                assert torch.equal(et.gate.weight, raw)


@pytest.mark.parametrize("fx", [f for f in FIXTURES if f.get("source")
                                and f.get("checks", {}).get("dequant_rel_rms_err_vs_bf16_source_expert0")],
                         ids=_ids)
def test_expert0_error_matches_producer_report(fx):
    """Our decoding of expert 0 agrees with the fixture script's own decoder."""
    want = fx["checks"]["dequant_rel_rms_err_vs_bf16_source_expert0"]
    r = _reader(open_source(REAL / fx["dir"]))
    info = r.moe_layers()[0]
    assert f"{info.prefix}.experts" == fx["expert_prefix"]
    deq = r.read_expert(info.index, 0).dequantize(r.row)
    for got, ref, p in zip(deq, _source_weights(fx, info.prefix, 0), ("gate_proj", "up_proj", "down_proj")):
        assert _rel(got, ref) == pytest.approx(want[p], abs=6e-4)


NVFP4 = [f for f in FIXTURES if f["scheme"] == "nvfp4"]


@pytest.mark.parametrize("fx", NVFP4, ids=_ids)
def test_nvfp4_scale_semantics(fx):
    """ModelOpt/Quark weight_scale_2 = amax/(6*448) (a multiplier; gate/up share
    the max of both amaxes); compressed-tensors stores 6*448/amax (a divisor),
    which the reader inverts. Dequant = e2m1 * (block scale * global)."""
    src = open_source(REAL / fx["dir"])
    r = _reader(src)
    # W4A8_NVFP4_FP8: weight_scale_2 = amax/448 (its E4M3 block scales span per 32 below it)
    div = 448.0 if fx["format"] == "W4A8_NVFP4_FP8" else 2688.0
    shared_global = "weight-only" not in fx["dir"]  # Quark's weight-only NVFP4 does not merge gate/up
    for info in r.moe_layers():
        for e in range(info.num_experts):
            et = r.read_expert(info.index, e)
            g, u, d = _source_weights(fx, info.prefix, e)
            a13 = max(float(g.abs().max()), float(u.abs().max())) / div
            a2 = float(d.abs().max()) / div
            rel = 1e-2 if fx["producer"] == "llmcompressor" else 1e-5
            if not shared_global:
                assert et.gate.global_scale == pytest.approx(float(g.abs().max()) / div, rel=rel)
                assert et.up.global_scale == pytest.approx(float(u.abs().max()) / div, rel=rel)
                continue
            assert et.gate.global_scale == et.up.global_scale
            assert et.gate.global_scale == pytest.approx(a13, rel=rel)
            assert et.down.global_scale == pytest.approx(a2, rel=rel)
            for p in (et.gate, et.up, et.down):
                if not _has_input_scales(fx):  # weight-only
                    assert p.input_scale is None
                    continue
                assert p.input_scale is not None and 0 < p.input_scale < 1
                manual = codecs.e2m1_decode(codecs.unpack_e2m1(p.weight))
                block = p.scale.float() * torch.tensor(p.global_scale, dtype=torch.float32)
                manual = (manual.reshape(manual.shape[0], -1, 16) * block.unsqueeze(-1)).reshape(manual.shape)
                assert torch.equal(p.dequantize("nvfp4"), manual)
            assert et.gate.input_scale == et.up.input_scale


def test_nvfp4_producers_agree():
    """The same BF16 weights through ModelOpt, Quark and llm-compressor give
    the same dequantized experts (CT within its reciprocal-global rounding)."""
    w4a4 = ("modelopt-nvfp4-qwen3moe", "quark-nvfp4-qwen3moe", "llmcompressor-nvfp4-qwen3moe")
    dirs = {f["producer"]: f["dir"] for f in NVFP4 if f["dir"] in w4a4}
    assert len(dirs) == len(w4a4), f"committed W4A4 NVFP4 exports missing: {sorted(set(w4a4) - set(dirs.values()))}"
    readers = {p: _reader(open_source(REAL / d)) for p, d in dirs.items()}
    base = readers.pop("modelopt", None) or readers.pop(next(iter(readers)))
    for p, r in readers.items():
        for e in range(4):
            a, b = base.read_expert(0, e), r.read_expert(0, e)
            for x, y in zip(a.dequantize("nvfp4"), b.dequantize("nvfp4")):
                assert _rel(y, x) < (0.08 if p == "llmcompressor" else 1e-6), p  # CT: other global, other roundings


@pytest.mark.parametrize(
    "fx", [f for f in FIXTURES if f["model"] == "deepseekv3"], ids=_ids
)
def test_real_shared_experts(fx):
    src = open_source(REAL / fx["dir"])
    r = _reader(src)
    (info,) = r.moe_layers()
    assert info.index == 1 and info.shared is not None
    assert (info.shared.num_shared, info.shared.intermediate) == (1, 128)
    assert r.model_facts().routed_scaling_factor == 2.5
    (sh,) = r.read_shared(1)
    deq = sh.dequantize(info.shared.encoding)
    ref_src = open_source(REAL / (fx["source"] or fx["dir"]))
    for got, p in zip(deq, ("gate_proj", "up_proj", "down_proj")):
        want = ref_src.get_tensor(f"model.layers.1.mlp.shared_experts.{p}.weight").float()
        assert _rel(got, want) <= TOL[info.shared.encoding]
    assert set(info.shared.tensor_names) <= r.consumed_tensor_names()
    # the dense layer 0 MLP is not an MoE layer and is passed through
    assert "model.layers.0.mlp.gate_proj.weight" not in r.consumed_tensor_names()
