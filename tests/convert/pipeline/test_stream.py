"""The streaming pass packs a layer a few experts at a time (`stream.Run`), on
one or several reader threads.

Real runs put about 24 MiB of experts in a chunk, so the tiny test models fit
one chunk per layer; here the chunk is forced down to 1 or 3 experts (3 does
not divide the 4 experts of a layer, so the last chunk is partial) and the
output must still be the recorded golden bytes, across EP ranks, small shards
(one layer's routed tensors in different files), the requantize repair path
and resume.
"""
from __future__ import annotations

import json

import pytest

from megamoe_convert.pipeline import stream
from megamoe_convert.testing import synth
from megamoe_convert.pipeline.convert import SourceChangedError, convert
from megamoe_convert.output.output_dir import temp_dir_for
from megamoe_runtime.format.formats import get_row

from test_golden_outputs import CASES, _convert_case, _golden

CHUNKED_CASES = [c for c in CASES if c[0] in (
    "modelopt-nvfp4-deepseekv3-ep2-sharedbf16",
    "quark-mxfp4-deepseekv3-ep4-small-shards",
    "llmcompressor-mxfp8-qwen3moe",
    "bf16-plain-qwen3moe",
    "synth-modelopt-nvfp4-mismatch-requantize",
    "bf16-deepseekv3-quantize-nvfp4",  # the quantizing reader, on reader threads
    "synth-deepseek-v4",
)]


class _Stop(Exception):
    pass


def _interrupted(src, out, after: int = 9) -> None:
    """Convert `src` to `out` (60 KB shards) and stop it at its `after`-th tensor: finished files are journaled."""
    seen = [0]

    def on_step(step):
        if step == "tensor":
            seen[0] += 1
            if seen[0] >= after:
                raise _Stop

    with pytest.raises(_Stop):
        convert(src, out, max_shard_size="60KB", on_step=on_step)


@pytest.fixture(params=[(1, 1), (3, 2), (3, 3)], ids=["1-expert-chunks", "3-expert-chunks-2-readers",
                                                      "3-expert-chunks-3-readers"])
def chunk(request, monkeypatch):
    size, readers = request.param
    monkeypatch.setattr(stream.Run, "chunk_experts", lambda self, row, E_l, H, I: min(E_l, size))
    monkeypatch.setattr(stream, "read_threads", lambda: readers)
    return size


@pytest.mark.parametrize("case", CHUNKED_CASES, ids=[c[0] for c in CHUNKED_CASES])
def test_small_chunks_write_the_golden_bytes(case, chunk, tmp_path):
    name, spec, kwargs = case
    got = _convert_case(spec, kwargs, tmp_path)
    want = _golden()["convert"][name]["output"]
    assert got["output"] == want


def test_small_chunks_resume_and_refuse_a_changed_source(chunk, tmp_path):
    """Interrupted after a few tensors, resumed with chunked re-derivation of the
    finished files: the same bytes as an uninterrupted run; a flipped source byte in
    a finished file's expert is refused (the chunked check hashes every piece)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", num_layers=2, hidden=256,
                                           intermediate=128, num_experts=4, top_k=2, seed=6)
    ref, out = tmp_path / "ref", tmp_path / "out"
    convert(src, ref, max_shard_size="60KB")

    _interrupted(src, out)
    tmp = temp_dir_for(out)
    journal = [json.loads(line) for line in (tmp / "megamoe-journal.jsonl").read_text().splitlines()]
    assert any(j["kind"] == "file" for j in journal)
    s = convert(src, out, resume=True, max_shard_size="60KB")
    assert s.resumed_files > 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in ref.iterdir()}


def test_chunk_size_is_bounded_by_bytes_not_by_the_layer():
    run = stream.Run.__new__(stream.Run)
    run.read_threads = 1
    row = get_row("nvfp4")
    # DeepSeek-V3 size: one expert is ~23 MB packed, so one expert per chunk
    assert run.chunk_experts(row, 256, 7168, 2048) == 1
    # a small expert: as many as fit in CHUNK_BYTES, never more than the rank has
    small = run.chunk_experts(row, 128, 2048, 768)
    assert 1 < small < 128
    assert run.chunk_experts(row, 4, 256, 128) == 4
    run.read_threads = 3  # at least one expert per reader thread
    assert run.chunk_experts(row, 256, 7168, 2048) == 3


def test_source_change_is_caught_in_a_chunked_check(chunk, tmp_path):
    """Negative control for the chunked resume check: a finished expert file whose
    re-derived bytes differ is refused (here: the journaled checksum is wrong)."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "quark-mxfp4", num_layers=2, hidden=256,
                                           intermediate=128, num_experts=4, top_k=2, seed=6)
    out = tmp_path / "out"

    _interrupted(src, out)
    jpath = temp_dir_for(out) / "megamoe-journal.jsonl"
    records = [json.loads(line) for line in jpath.read_text().splitlines()]
    finished_l2 = [t for r in records if r["kind"] == "file" for t in r["tensors"].values()
                   if t["role"] == "l2_weight"]
    assert finished_l2, "the stop point must leave a finished expert file holding an l2_weight"
    kind = next(k for k in ("blake3", "sha256") if k in finished_l2[0])  # the run's checksum kind
    finished_l2[0][kind] = "0" * 64
    jpath.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SourceChangedError, match="l2_weight"):
        convert(src, out, resume=True, max_shard_size="60KB")


def test_reader_threads_report_the_first_failing_expert(tmp_path, monkeypatch):
    """Two defects in one chunk read on three threads: the error names the lower
    expert, as a single-threaded run does (errors do not depend on timing)."""
    from megamoe_runtime.errors import MegaMoEError

    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", num_layers=1, hidden=256,
                                           intermediate=128, num_experts=8, top_k=2, seed=3)
    monkeypatch.setattr(stream, "read_threads", lambda: 3)
    monkeypatch.setattr(stream.Run, "chunk_experts", lambda self, row, E_l, H, I: E_l)
    real = stream._pack_expert
    calls = []

    def failing(reader, row, info, kt, direct, c0, mismatched, where, e):
        calls.append(e)
        if e in (2, 6):
            raise MegaMoEError(f"planted defect in expert {e}")
        return real(reader, row, info, kt, direct, c0, mismatched, where, e)

    monkeypatch.setattr(stream, "_pack_expert", failing)
    with pytest.raises(MegaMoEError, match="planted defect in expert 2"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_small_chunks_blake3_same_folder_as_one_chunk(tmp_path, monkeypatch):
    """The blake3 kind hashes pieces in order too: chunked output (3 experts, 2 readers) equals one chunk per layer."""
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", num_layers=2, hidden=256,
                                           intermediate=128, num_experts=8, top_k=2, seed=4)
    convert(src, tmp_path / "whole", checksum="blake3")
    monkeypatch.setattr(stream.Run, "chunk_experts", lambda self, row, E_l, H, I: min(E_l, 3))
    monkeypatch.setattr(stream, "read_threads", lambda: 2)
    convert(src, tmp_path / "chunked", checksum="blake3")
    files = lambda d: {p.name: p.read_bytes() for p in d.iterdir()}  # noqa: E731
    assert files(tmp_path / "chunked") == files(tmp_path / "whole")


# --------------------------------------------------------------------------- pass-through copy beside the layers

PASSTHROUGH_CASE = next(c for c in CASES if c[0] == "quark-mxfp4-deepseekv3-ep4-small-shards")


def _passthrough_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "megamoe-passthrough" and t.is_alive()]


def test_passthrough_bytes_copied_during_the_first_layer_recorded_after_the_last(tmp_path, monkeypatch):
    """The pass-through copy runs beside the layers (here: all of it is awaited
    inside the first layer, so this does not depend on timing), yet its files
    are journaled only after the last layer and every ``tensor`` step fires on
    the converting thread, in plan order: the output is the golden one."""
    import threading

    import megamoe_convert.pipeline.run as run_mod

    name, spec, kwargs = PASSTHROUGH_CASE
    real = run_mod.convert_layer
    seen = {"layers": 0, "copied_early": 0}

    def layer(reader, row, lp, ep_size, run, journaled, log):
        if seen["layers"] == 0:
            assert run.passthrough is not None and run.passthrough.jobs
            for slot, *_, fut in run.passthrough.jobs:
                fut.result()  # copied and hashed before any layer ran
                assert slot.file not in run.done_files  # ... but not recorded yet
            seen["copied_early"] = len(run.passthrough.jobs)
        seen["layers"] += 1
        return real(reader, row, lp, ep_size, run, journaled, log)

    steps = []
    monkeypatch.setattr(run_mod, "convert_layer", layer)
    got = _convert_case(spec, {**kwargs, "on_step": lambda s: steps.append((s, threading.current_thread()))},
                        tmp_path)
    assert got["output"] == _golden()["convert"][name]["output"]
    assert seen["copied_early"] > 0 and seen["layers"] >= 1
    assert steps and all(t is threading.main_thread() for _, t in steps)
    assert not _passthrough_threads()


def test_passthrough_copy_error_is_raised_and_resume_redoes_the_file(tmp_path, monkeypatch):
    """Negative: a read error on the copy thread is raised by convert (at the
    pass-through file's turn), the thread is gone, the file is not journaled,
    and --resume writes the golden bytes."""
    name, spec, kwargs = PASSTHROUGH_CASE
    real = stream.copy_source_bytes
    calls = [0]

    def failing(path, offset, nbytes, progress=None, buffers=None):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "planted pass-through read error")
        return real(path, offset, nbytes, progress, buffers)

    monkeypatch.setattr(stream, "copy_source_bytes", failing)
    with pytest.raises(OSError, match="planted pass-through read error"):
        _convert_case(spec, kwargs, tmp_path)
    assert not _passthrough_threads()
    journal = [json.loads(line) for line in
               (temp_dir_for(tmp_path / "out") / "megamoe-journal.jsonl").read_text().splitlines()]
    journaled = {j["name"] for j in journal if j["kind"] == "file"}
    assert journaled and not any(all(t["role"] == "passthrough" for t in j["tensors"].values())
                                 for j in journal if j["kind"] == "file")
    monkeypatch.setattr(stream, "copy_source_bytes", real)
    got = _convert_case(spec, {**kwargs, "resume": True}, tmp_path)
    assert got["output"] == _golden()["convert"][name]["output"]


def test_a_layer_error_stops_the_passthrough_copy(tmp_path, monkeypatch):
    """Negative: a failure in a MoE layer while the copy may still run stops and
    joins the copy thread before the writers are aborted (no thread left
    writing into the temp folder), and the error is the layer's."""
    import megamoe_convert.pipeline.run as run_mod

    class Planted(Exception):
        pass

    name, spec, kwargs = PASSTHROUGH_CASE

    def layer(*a, **k):
        raise Planted("layer failed")

    monkeypatch.setattr(run_mod, "convert_layer", layer)
    with pytest.raises(Planted):
        _convert_case(spec, kwargs, tmp_path)
    assert not _passthrough_threads()


def test_passthrough_copy_stop_refuses_the_remaining_tensors(tmp_path):
    """`PassthroughCopy.stop` ends the copy at its next chunk: a tensor not yet
    copied is never reported as copied (its result is the stop error)."""
    from megamoe_convert.pipeline.stream import PassthroughCopy, _Stopped

    copy = PassthroughCopy.__new__(PassthroughCopy)
    import threading

    copy._stop = threading.Event()
    copy._stop.set()
    with pytest.raises(_Stopped):
        list(copy._until_stopped(iter([b"x"])))
