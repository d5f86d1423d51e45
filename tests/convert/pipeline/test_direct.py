"""direct.py: routed weights read straight into the kernel buffers, byte-identical to the copy path."""
from pathlib import Path

import pytest

from megamoe_convert.testing import synth
from megamoe_convert.pipeline.convert import convert
from megamoe_convert.readers import detect_reader
from megamoe_convert.readers.source import open_source

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def tree_bytes(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("ep", [1, 2])
def test_direct_weight_reads_taken_and_byte_identical(tmp_path, monkeypatch, ep):
    """ModelOpt NVFP4: routed weights are read straight into the kernel buffers
    (reader.weight_byte_ranges), and the output equals the read_expert path's
    (the capability disabled) byte for byte."""
    from megamoe_convert.readers.modelopt import ModelOptNVFP4Reader
    from megamoe_convert.readers.source import CheckpointSource

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1, seed=3,
                                           max_shard_bytes=200_000)
    calls = []
    real = CheckpointSource.read_into

    def spy(self, path, pos, views):
        calls.append(len(views))
        return real(self, path, pos, views)

    monkeypatch.setattr(CheckpointSource, "read_into", spy)
    with open_source(src) as s:
        reader = detect_reader(s)
        assert isinstance(reader, ModelOptNVFP4Reader)
        assert reader.weight_byte_ranges(0, 0, "gate") is not None
    fast = tmp_path / "fast"
    convert(src, fast, ep_size=ep)
    E, I = SMALL["num_experts"] * SMALL["num_layers"], SMALL["intermediate"]
    # per expert: gate and up (one iovec per 8-row group), then down (one); experts may be read on
    # several threads (stream.read_threads), so the calls of different experts interleave
    assert sorted(calls) == sorted([I // 8, I // 8, 1] * E)

    calls.clear()
    monkeypatch.setattr(ModelOptNVFP4Reader, "weight_byte_ranges", lambda self, *a: None)
    slow = tmp_path / "slow"
    convert(src, slow, ep_size=ep)
    assert calls == []
    assert tree_bytes(fast) == tree_bytes(slow)


def test_direct_weight_reads_keep_weight_value_checks(tmp_path, monkeypatch):
    """A zero block scale over nonzero elements is still refused on the direct
    path (the check reads the weight values back from the kernel buffer)."""
    from megamoe_convert.readers.source import CheckpointSource
    from megamoe_runtime.errors import ScaleError

    calls = []
    real = CheckpointSource.read_into
    monkeypatch.setattr(CheckpointSource, "read_into", lambda self, *a: (calls.append(1), real(self, *a))[1])
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-mxfp8", **SMALL, seed=1,
                                           zero_scale=(1, 0, "down"))
    with pytest.raises(ScaleError, match="zero while their block has nonzero elements"):
        convert(src, tmp_path / "out")
    assert calls  # the direct path ran (layer 0), and layer 1 expert 0's check still saw the weights
