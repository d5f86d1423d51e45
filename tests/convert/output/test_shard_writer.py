"""shard_writer.py: the streaming safetensors writer, shard planning, sizes."""
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megamoe_convert.output.shard_writer import (
    PlannedTensor,
    ShardWriter,
    parse_size,
    plan_shards,
    safetensors_header,
)
from megamoe_runtime.errors import MegaMoEError
from megamoe_runtime.files.digests import file_digest, safetensors_digests
from megamoe_runtime.format.manifest import dtype_name

TENSORS = {
    "s": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
    "a": torch.tensor([1.5, -2.0], dtype=torch.float32),
    "w": torch.randn(8, 16).to(torch.bfloat16),
    "q": torch.randn(4, 32).to(torch.float8_e4m3fn),
    "p": torch.randint(0, 255, (5, 7), dtype=torch.uint8).view(torch.int8),
    "e": torch.zeros(0, 4, dtype=torch.float32),
    "z": torch.tensor(3.25),
}


def _plan(ts):
    return [PlannedTensor(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in ts.items()]


def _write(path, ts):
    w = ShardWriter(path, _plan(ts))
    shas = {n: w.write(n, t) for n, t in ts.items()}
    return shas, w.close()


def test_stream_writer_output_is_valid_safetensors(tmp_path):
    p = tmp_path / "x.safetensors"
    shas, (size, fsha) = _write(p, TENSORS)
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    # the file digest: sha256 over the header bytes, then each tensor's raw
    # sha256 in data-offset order (ties between empty tensors by name)
    order = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
    want = hashlib.sha256(raw[:8 + n] + b"".join(
        hashlib.sha256(raw[8 + n + b:8 + n + e]).digest() for b, e, _ in order)).hexdigest()
    assert size == len(raw) and fsha == want
    assert safetensors_digests(p, whole=True) == (want, shas, hashlib.sha256(raw).hexdigest())
    assert file_digest(p, "sha256-of-header-and-tensor-digests") == want
    assert file_digest(p, "sha256") == hashlib.sha256(raw).hexdigest()
    with pytest.raises(MegaMoEError, match="unknown digest kind 'md5'"):
        file_digest(p, "md5")
    assert header["__metadata__"] == {"format": "pt"}
    got = load_file(p)
    for name, t in TENSORS.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        b, e = header[name]["data_offsets"]
        assert hashlib.sha256(raw[8 + n + b:8 + n + e]).hexdigest() == shas[name]
    with safe_open(p, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("s")[1].tolist() == TENSORS["s"][1].tolist()


def test_stream_writer_same_bytes_as_save_file_for_same_order(tmp_path):
    # save_file orders by descending alignment then name; give ours that order
    ts = {"b": torch.ones(3, 4, dtype=torch.float32), "c": torch.arange(6, dtype=torch.int32),
          "a": torch.zeros(4, dtype=torch.bfloat16)}
    _write(tmp_path / "ours.safetensors", ts)
    save_file(ts, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert load_file(tmp_path / "ours.safetensors").keys() == load_file(tmp_path / "theirs.safetensors").keys()
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "theirs.safetensors").read_bytes()
    n1, n2 = int.from_bytes(ours[:8], "little"), int.from_bytes(theirs[:8], "little")
    assert ours[8 + n1:] == theirs[8 + n2:]  # identical data section


def test_stream_writer_refuses_off_plan_writes(tmp_path):
    w = ShardWriter(tmp_path / "x.safetensors", _plan({"a": TENSORS["a"], "s": TENSORS["s"]}))
    with pytest.raises(MegaMoEError, match="expected tensor 'a' next, got 's'"):
        w.write("s", TENSORS["s"])
    with pytest.raises(MegaMoEError, match="planned F32 \\[2\\]"):
        w.write("a", TENSORS["a"].double())
    w.write("a", TENSORS["a"])
    with pytest.raises(MegaMoEError, match="1 planned tensor\\(s\\) unwritten, first 's'"):
        w.close()
    w.abort()


def test_mn_major_view_written_as_physical(tmp_path):
    phys = torch.arange(2 * 3 * 8, dtype=torch.int32).reshape(2, 3, 8)
    view = phys.transpose(-1, -2)
    w = ShardWriter(tmp_path / "x.safetensors", [PlannedTensor("s", "I32", (2, 3, 8))])
    w.write("s", view.transpose(-1, -2))
    w.close()
    assert torch.equal(load_file(tmp_path / "x.safetensors")["s"], phys)


def test_header_is_deterministic():
    plan = _plan(TENSORS)
    assert safetensors_header(plan) == safetensors_header(list(plan))
    assert b"format" in safetensors_header(plan)


@pytest.mark.parametrize("text, n", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30),
                                     ("4096", 4096), ("2.5 GB", 2_500_000_000), ("10kb", 10_000), (123, 123)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "5XB", "-1GB", "0", "GB", "five"])
def test_parse_size_refuses(text):
    with pytest.raises(MegaMoEError, match="size"):
        parse_size(text)


def test_plan_shards():
    ts = [PlannedTensor(f"t{i}", "U8", (n,)) for i, n in enumerate([40, 30, 50, 200, 10, 10])]
    shards = plan_shards(ts, 100)
    assert [[t.name for t in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert plan_shards([], 100) == []


def test_parts_out_of_plan_order_give_the_same_file(tmp_path):
    """`open_parts` claims tensors ahead of plan order and takes their bytes in
    pieces; whole-tensor writes of the rest keep plan order. The file (bytes and
    digest) equals the all-sequential one."""
    ref = tmp_path / "ref.safetensors"
    shas, (size, fsha) = _write(ref, TENSORS)
    p = tmp_path / "x.safetensors"
    w = ShardWriter(p, _plan(TENSORS))
    wv = w.open_parts("w")  # ahead of "s", "a" in the plan
    sv = w.open_parts("s")
    flat_w, flat_s = TENSORS["w"].view(torch.uint8).reshape(-1), TENSORS["s"].view(torch.uint8).reshape(-1)
    for i in range(0, flat_w.numel(), 48):
        wv.put(flat_w[i:i + 48].numpy().data)
    sv.put(flat_s[:40].numpy().data)
    sv.put(flat_s[40:].numpy().data)
    got = {"w": wv.finish(), "s": sv.finish()}
    for n in ("a", "q", "p", "e", "z"):
        got[n] = w.write_async(n, TENSORS[n])
    assert {n: d.result() for n, d in got.items()} == shas
    assert w.close() == (size, fsha)
    assert p.read_bytes() == ref.read_bytes()


def test_parts_refuse_too_many_or_too_few_bytes(tmp_path):
    w = ShardWriter(tmp_path / "x.safetensors", _plan({"s": TENSORS["s"], "a": TENSORS["a"]}))
    s = w.open_parts("s")
    with pytest.raises(MegaMoEError, match="'s' got more than its planned 96 bytes"):
        s.put(bytes(97))
    s.put(bytes(95))
    with pytest.raises(MegaMoEError, match="'s' got 95 bytes, planned 96"):
        s.finish()
    with pytest.raises(MegaMoEError, match="'s' is not planned or was already written"):
        w.open_parts("s")
    w.abort()


# --------------------------------------------------------------------------- O_DIRECT writes and hash lanes

#: tensors that span several pages at odd offsets (the header makes the first one start unaligned)
BIG = {
    "w1": torch.randint(0, 255, (37, 1031), dtype=torch.uint8),  # 38147 B
    "s1": torch.randint(-9, 9, (3, 5), dtype=torch.int32),  # 60 B: one page's head and tail at once
    "w2": torch.randint(0, 255, (5000 * 4 + 3,), dtype=torch.uint8),  # 20003 B
    "e": torch.zeros(0, dtype=torch.float32),
    "z": torch.tensor(3.25),
}


def _write_parts(path, **kw):
    """w1 and w2 streamed side by side in odd pieces (out of plan order), the rest whole,
    the last through `write_chunks`: every path of `ShardWriter`."""
    w = ShardWriter(path, _plan(BIG), **kw)
    f1, f2 = BIG["w1"].reshape(-1).numpy().data, BIG["w2"].numpy().data
    p1, p2 = w.open_parts("w1"), w.open_parts("w2")
    for i, j in zip(range(0, len(f1), 4099), range(0, len(f2), 1777)):
        p1.put(f1[i:i + 4099])
        p2.put(f2[j:j + 1777])
    p1.put(f1[i + 4099:])
    p2.put(f2[j + 1777:])
    got = {"w1": p1.finish(), "w2": p2.finish(), "s1": w.write_async("s1", BIG["s1"]),
           "e": w.write_async("e", BIG["e"])}
    raw = BIG["z"].reshape(1).view(torch.uint8).numpy().data
    got = {n: d.result() for n, d in got.items()}
    got["z"] = w.write_chunks("z", [raw[:1], raw[1:]])
    return got, w.close()


def _count_direct(monkeypatch):
    """Count the device writes `DirectIO` makes (bytes)."""
    from megamoe_convert.output import shard_writer as sw

    seen = []
    real = sw.DirectIO._write

    def spy(self, writer, buf, n, pos):
        seen.append((pos, n))
        return real(self, writer, buf, n, pos)

    monkeypatch.setattr(sw.DirectIO, "_write", spy)
    return seen


def _direct_fds(monkeypatch) -> list:
    """The O_DIRECT descriptors `ShardWriter`s open from now on (None where refused)."""
    from megamoe_convert.output import shard_writer as sw

    opened = []
    real_open = sw._open_direct
    monkeypatch.setattr(sw, "_open_direct", lambda path: opened.append(real_open(path)) or opened[-1])
    return opened


def _fail_direct_writes(monkeypatch, opened: list, err: int, first_only: bool = False) -> list:
    """Make O_DIRECT writes on `opened` descriptors fail with `err` (only the first
    one with `first_only`); the positions of the writes that went through are returned."""
    import os
    import threading

    from megamoe_convert.output import shard_writer as sw

    real, failed, through = os.pwrite, threading.Event(), []

    def pwrite(fd, data, pos):
        if fd in opened:
            if not (first_only and failed.is_set()):
                failed.set()
                raise OSError(err, os.strerror(err))
            through.append(("write", pos))
        return real(fd, data, pos)

    monkeypatch.setattr(sw.os, "pwrite", pwrite)
    return through


def test_direct_writes_give_the_same_file_and_digests(tmp_path, monkeypatch):
    """O_DIRECT for the whole pages inside each tensor, the page cache for the
    unaligned heads and tails (pages shared by two tensors): the same bytes and
    digests as page-cache writes alone, and most bytes went the direct way."""
    from megamoe_convert.output.shard_writer import DIRECT_ALIGN

    ref = tmp_path / "ref.safetensors"
    want = _write_parts(ref)
    seen = _count_direct(monkeypatch)
    p = tmp_path / "direct.safetensors"
    assert _write_parts(p, direct=True) == want
    assert p.read_bytes() == ref.read_bytes()
    if not seen:
        pytest.skip("this file system refuses O_DIRECT (the page-cache path ran; see the fallback tests)")
    assert all(pos % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 for pos, n in seen)
    assert sum(n for _, n in seen) >= 38147 + 20003 - 4 * DIRECT_ALIGN


def test_direct_writes_shared_staging_across_writers(tmp_path):
    """Several files open at once share one `DirectIO` (its few staging buffers)."""
    from megamoe_convert.output.shard_writer import DirectIO

    want = _write_parts(tmp_path / "ref.safetensors")
    io = DirectIO(buffers=2, size=8192)
    try:
        ws = [ShardWriter(tmp_path / f"{k}.safetensors", _plan(BIG), direct_io=io) for k in range(3)]
        for w in ws:
            for n, t in BIG.items():
                w.write_async(n, t)
        got = [w.close() for w in ws]
    finally:
        io.close()
    assert got == [want[1]] * 3
    assert {(tmp_path / f"{k}.safetensors").read_bytes() for k in range(3)} == {
        (tmp_path / "ref.safetensors").read_bytes()}


def test_direct_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens O_DIRECT but refuses the write (EINVAL): that
    buffer and everything after it goes through the page cache, same bytes."""
    import errno

    want = _write_parts(tmp_path / "ref.safetensors")
    opened = _direct_fds(monkeypatch)
    through = _fail_direct_writes(monkeypatch, opened, errno.EINVAL, first_only=True)
    p = tmp_path / "x.safetensors"
    assert _write_parts(p, direct=True) == want
    assert p.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert through == []  # refused once, then the page cache for the rest of the file


def _write_big_expecting(w: ShardWriter, opened: list, match: str) -> None:
    """Queue every BIG tensor on an O_DIRECT writer and expect `close` to raise `match`; then
    abort, as the converter does after a failed close (`Run.abort`). Skips where the file
    system refused O_DIRECT at open (nothing direct to fail)."""
    if opened[0] is None:
        w.abort()
        pytest.skip("this file system refuses O_DIRECT")
    for n, t in BIG.items():
        w.write_async(n, t)
    with pytest.raises(OSError, match=match):
        w.close()
    w.abort()


def test_direct_write_error_surfaces_at_close(tmp_path, monkeypatch):
    """Negative: a device write failing otherwise (here ENOSPC) is not swallowed."""
    import errno

    opened = _direct_fds(monkeypatch)
    _fail_direct_writes(monkeypatch, opened, errno.ENOSPC)
    _write_big_expecting(ShardWriter(tmp_path / "x.safetensors", _plan(BIG), direct=True), opened, "No space left")


def test_direct_on_a_file_system_without_it(tmp_path):
    """tmpfs refuses O_DIRECT at open: the writer uses the page cache alone."""
    import os
    from pathlib import Path

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    want = _write_parts(tmp_path / "ref.safetensors")
    d = shm / f"megamoe-test-{os.getpid()}"
    d.mkdir()
    try:
        assert _write_parts(d / "x.safetensors", direct=True) == want
        assert (d / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_hash_lanes_split_large_tensors_and_keep_digests(tmp_path):
    """Two hash lanes: the two large tensors land on different lanes (fewest
    planned bytes first); digests and file equal the one-lane ones."""
    want = _write_parts(tmp_path / "ref.safetensors")
    p = tmp_path / "x.safetensors"
    assert _write_parts(p, hash_lanes=2) == want
    assert p.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    w = ShardWriter(tmp_path / "y.safetensors", _plan(BIG), hash_lanes=2)
    p1, p2 = w.open_parts("w1"), w.open_parts("w2")
    assert p1._lane is not p2._lane
    assert w._lane_bytes == [38147, 20003]
    w.abort()


def test_direct_large_copies_from_writable_and_read_only_memory(tmp_path):
    """Staging copies of 64 KiB and more go through ctypes.memmove (GIL released)
    from writable memory, a slice assignment from read-only bytes: same file."""
    from megamoe_convert.output.shard_writer import _NOGIL_COPY

    big = torch.randint(0, 255, (3 * _NOGIL_COPY + 5,), dtype=torch.uint8)
    ts = {"a": big, "b": big.flip(0).clone()}
    ref = tmp_path / "ref.safetensors"
    want = _write(ref, ts)
    w = ShardWriter(tmp_path / "x.safetensors", _plan(ts), direct=True)
    got = {"a": w.write("a", ts["a"]),  # writable tensor memory
           "b": w.write_chunks("b", [bytes(ts["b"].numpy())])}  # read-only bytes
    assert (got, w.close()) == want
    assert (tmp_path / "x.safetensors").read_bytes() == ref.read_bytes()


def test_direct_close_waits_for_every_device_write_before_closing(tmp_path, monkeypatch):
    """Negative: with the first device write failing, close raises it, and the
    descriptor is given back (by the abort that follows) only after the later
    writes are over (a reused descriptor number would send them into another
    file)."""
    import errno
    import os

    from megamoe_convert.output import shard_writer as sw

    opened = _direct_fds(monkeypatch)
    order = _fail_direct_writes(monkeypatch, opened, errno.EIO, first_only=True)
    real_close = os.close

    def close(fd):
        if fd in opened:
            order.append(("close", fd))
        return real_close(fd)

    monkeypatch.setattr(sw.os, "close", close)
    io = sw.DirectIO(buffers=2, size=8192)
    _write_big_expecting(ShardWriter(tmp_path / "x.safetensors", _plan(BIG), direct_io=io), opened,
                         "Input/output error")
    io.close()
    assert order and order[-1][0] == "close" and all(k == "write" for k, _ in order[:-1])
    assert len(order) > 2  # the writes after the failed one still ran, before the close
