"""The synthetic-checkpoint builder writes the same bytes across refactors.

``synth.build_synthetic_checkpoint`` is the shared fixture of most tests and of
``megamoe-convert demo``; issue 12 moved each format's encoder and quantization
config into the format's reader. ``tests/fixtures/golden_synth.json`` holds the
sha256 of every file the builder wrote for every synthetic format (and the
defect and naming options that take their own code paths), recorded before the
move. Regenerate deliberately with
``PYTHONPATH=$PWD python tests/convert/testing/test_synth.py`` and say why in the commit.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "fixtures" / "golden_synth.json"
_SMALL = dict(num_layers=2, hidden=128, intermediate=64, num_experts=4, top_k=2, seed=3)


def _cases() -> list[tuple[str, str, dict]]:
    from megamoe_convert.testing.synth import FORMATS, ROW_OF

    # block-FP8 weights come in 128x128 blocks
    cases = [(fmt, fmt, dict(_SMALL, intermediate=128) if ROW_OF[fmt] == "fp8_block" else dict(_SMALL))
             for fmt in FORMATS]
    cases += [
        ("modelopt-nvfp4-shared-mismatch", "modelopt-nvfp4", dict(_SMALL, shared=2, scale_mismatch=[(0, 1)])),
        ("ct-nvfp4-shared-bf16-excluded", "ct-nvfp4", dict(_SMALL, shared=1, shared_format="bf16",
                                                               excluded_layer=1)),
        ("quark-nvfp4-defects", "quark-nvfp4", dict(_SMALL, nan_scale=(0, 0, "gate"), zero_scale=(0, 1, "down"),
                                                     wrong_shape=(1, 2, "up"), missing_expert=(1, 3))),
        ("ct-mxfp4-defects-w123", "ct-mxfp4", dict(_SMALL, naming="w123", ff_scale=(0, 0, "up"),
                                                   nan_scale=(1, 1, "gate"), wrong_shape=(0, 2, "down"))),
        ("deepseek-v4-shared-sharded", "deepseek-v4", dict(_SMALL, shared=1, max_shard_bytes=20_000,
                                                             first_k_dense_replace=1, num_layers=3)),
        ("modelopt-mxfp8-shared-mxfp4", "modelopt-mxfp8", dict(_SMALL, shared=1, shared_format="quark-mxfp4")),
        ("fp32-shared", "fp32", dict(_SMALL, shared=1)),
    ]
    return cases


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _build(fmt: str, kw: dict, path: Path) -> dict[str, str]:
    from megamoe_convert.testing.synth import build_synthetic_checkpoint

    return _tree(build_synthetic_checkpoint(path, fmt, **kw))


@pytest.mark.parametrize("case", _cases(), ids=[c[0] for c in _cases()])
def test_synthetic_checkpoint_bytes_unchanged(case, tmp_path):
    name, fmt, kw = case
    want = json.loads(GOLDEN.read_text())[name]
    assert _build(fmt, kw, tmp_path / "c") == want, f"{name}: synth.py now writes different bytes"


def _record() -> None:
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (name, fmt, kw) in enumerate(_cases()):
            out[name] = _build(fmt, kw, Path(d) / str(i))
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(_record())


def test_every_synthetic_format_is_encoded_by_exactly_one_reader():
    from megamoe_convert.readers import readers_in_order
    from megamoe_convert.testing.synth import ENCODER_OF, FORMATS

    declared = [f for cls in readers_in_order() for f in cls.synthetic_formats]
    assert len(declared) == len(set(declared))
    assert sorted(declared) == sorted(FORMATS) == sorted(ENCODER_OF)


def test_a_format_without_an_encoder_says_so():
    from megamoe_convert.readers import registered_readers

    cls = registered_readers()["modelopt-w4a8-nvfp4-fp8"]
    assert cls.synthetic_formats == ()
    with pytest.raises(NotImplementedError, match="converts on read"):
        cls.encode_expert("x", *[torch.zeros(32, 64)] * 2, torch.zeros(64, 32), input_scales=dict.fromkeys(("gate", "up", "down"), 0.01))


def test_synthetic_tokenizer_loads_in_transformers_and_round_trips(ckpts):
    """The tokenizer files travel into OUT; transformers' AutoTokenizer (what vLLM also uses) loads them from
    the converted folder and round-trips text over the model's vocabulary. The JSON is exactly what the
    tokenizers library writes for that tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from megamoe_convert.testing.synth import tokenizer_json

    _, out = ckpts.converted("modelopt-nvfp4")
    text = (out / "tokenizer.json").read_text().strip()
    assert tokenizers.Tokenizer.from_str(text).to_str() == text == tokenizer_json(64)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("w5 w17 w63")["input_ids"]
    assert ids == [5, 17, 63] and tok.decode(ids) == "w5 w17 w63"
    assert tok.convert_tokens_to_ids(["<s>", "</s>", "<unk>"]) == [0, 1, 2] and len(tok) == 64
