"""page_cache_dma.py: GPU loads DMA'd straight from the file's page cache, with the pinned path as fallback."""
import ctypes

import pytest
import torch

import megamoe_runtime.files.file_io as F
import megamoe_runtime.files.page_cache_dma as D
from megamoe_runtime.errors import CheckpointError
from megamoe_runtime.files.tensor_bytes import byte_view


def _blob(tmp_path, n=(1 << 20) + 3 * 4096 + 777, name="blob.bin", seed=1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    path = tmp_path / name
    path.write_bytes(bytes(byte_view(data)))
    return data, path


@pytest.fixture
def fresh_state(monkeypatch):
    """Each test decides availability afresh, with small pieces and a low size threshold."""
    monkeypatch.setattr(D, "_state", {})
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_PIECE_MB", str(5 * 4096 / 2**20))  # 5 pages a piece
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_THREADS", "3")
    monkeypatch.setattr(F, "_DMA_MIN", 4096)
    monkeypatch.setenv("MEGAMOE_LOAD_THREADS", "3")
    monkeypatch.setenv("MEGAMOE_LOAD_DMA", "1")


def test_off_unless_asked_for_without_touching_cuda(monkeypatch, fresh_state):
    monkeypatch.setenv("MEGAMOE_LOAD_DMA", "0")
    assert "opt-in" in D.available(torch.device("cuda", 0))
    monkeypatch.setattr(D, "_state", {})
    monkeypatch.delenv("MEGAMOE_LOAD_DMA")
    assert "opt-in" in D.available(torch.device("cuda", 0))


def test_knobs_round_to_pages(monkeypatch):
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_SHARE", "7")
    assert D.dma_share() == 1.0
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_PIECE_MB", "0.001")
    assert D.piece_bytes() == D._PAGE
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_PIECE_MB", "64")
    assert D.piece_bytes() == 64 << 20
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_THREADS", "0")
    assert D.dma_threads() == 1


def _simulate(reads, piece):
    """Run the plan on the CPU: every planned copy done with memmove from the real mapping."""
    maps = []
    try:
        pieces = D._plan(reads, maps, piece)
        for p in pieces:
            assert p.base % D._PAGE == 0 and 0 < p.length <= piece  # what registration needs
            for dst, src, n in p.copies:
                assert p.base <= src and src + n <= p.base + p.length  # a copy never leaves its piece
                ctypes.memmove(dst, src, n)
        return pieces
    finally:
        for m in maps:
            m.close()


@pytest.mark.parametrize("piece_pages", [1, 3, 64])
def test_plan_covers_every_byte_once_across_files_gaps_and_unaligned_offsets(tmp_path, monkeypatch, piece_pages):
    monkeypatch.setattr(D, "_state", {"libc": D._libc()})
    a, pa = _blob(tmp_path, name="a.bin", seed=1)
    b, pb = _blob(tmp_path, n=70_001, name="b.bin", seed=2)
    wanted = [(pa, a, 123, 10_000), (pa, a, 40_960 + 5, 200_000), (pa, a, 700_000, 1), (pb, b, 0, 70_001),
              (pa, a, 10_123, 100)]  # adjacent to the first; a gap before the second (never pinned)
    import os

    fds = {p: os.open(p, os.O_RDONLY) for p in (pa, pb)}
    try:
        outs = [torch.zeros(n, dtype=torch.uint8) for *_, n in wanted]
        reads = [D.DmaRead(fds[p], off, n, out) for (p, _, off, n), out in zip(wanted, outs)]
        pieces = _simulate(reads, piece_pages * D._PAGE)
        for (p, data, off, n), out in zip(wanted, outs):
            assert torch.equal(out, data[off:off + n]), (p.name, off, n)
        copied = sum(n for pc in pieces for *_, n in pc.copies)
        assert copied == sum(n for *_, n in wanted)  # each byte exactly once
        # negative control: a plan that drops the last copy leaves zeros the comparison sees
        outs2 = [torch.zeros(n, dtype=torch.uint8) for *_, n in wanted]
        reads2 = [D.DmaRead(fds[p], off, n, out) for (p, _, off, n), out in zip(wanted, outs2)]
        maps = []
        try:
            pieces2 = D._plan(reads2, maps, piece_pages * D._PAGE)
            for pc in pieces2:
                for dst, src, n in pc.copies[:-1] if pc is pieces2[-1] else pc.copies:
                    ctypes.memmove(dst, src, n)
        finally:
            for m in maps:
                m.close()
        assert not all(torch.equal(o, d[off:off + n]) for (_, d, off, n), o in zip(wanted, outs2))
    finally:
        for fd in fds.values():
            os.close(fd)


def test_pages_between_reads_are_not_pinned(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_state", {"libc": D._libc()})
    data, path = _blob(tmp_path)
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        page = D._PAGE
        reads = [D.DmaRead(fd, 0, page, torch.zeros(page, dtype=torch.uint8)),
                 D.DmaRead(fd, 100 * page, page, torch.zeros(page, dtype=torch.uint8))]
        pieces = _simulate(reads, page)
        assert len(pieces) == 2  # the 99 pages of the gap (another rank's experts) are left alone
    finally:
        os.close(fd)


def test_deferred_block_reads_cpu_destinations_at_once(tmp_path):
    data, path = _blob(tmp_path)
    dst = torch.zeros(1000, dtype=torch.uint8)
    with F.deferred_gpu_reads():
        F.read_file_into(path, 77, 1000, dst)
        assert torch.equal(dst, data[77:1077])  # CPU reads are never deferred


@pytest.mark.gpu
@pytest.mark.parametrize("share", ["1", "0.5", "0.3"])
def test_deferred_dma_lands_every_byte_at_unaligned_offsets(tmp_path, monkeypatch, fresh_state, share):
    monkeypatch.setenv("MEGAMOE_LOAD_DMA_SHARE", share)
    a, pa = _blob(tmp_path, name="a.bin", seed=1)
    b, pb = _blob(tmp_path, n=3 * 4096 + 5, name="b.bin", seed=2)
    dev = torch.device("cuda", torch.cuda.current_device())
    taken = []
    real = D.dma_reads
    monkeypatch.setattr(D, "dma_reads", lambda reads, submit: (taken.append(len(reads)), real(reads, submit))[1])
    wanted = [(pa, a, 4096 + 123, 300_000), (pa, a, 304_219 + 9, 600_000), (pb, b, 1, 3 * 4096 + 3),
              (pa, a, 7, 100)]  # the last is under the DMA threshold: copied the pinned way
    dsts = [torch.zeros(n, dtype=torch.uint8, device=dev) for *_, n in wanted]
    with F.deferred_gpu_reads():
        for (p, _, off, n), d in zip(wanted, dsts):
            F.read_file_into(p, off, n, d)
        assert not torch.equal(dsts[0].cpu(), a[wanted[0][2]:wanted[0][2] + wanted[0][3]])  # only queued so far
    for (p, data, off, n), d in zip(wanted, dsts):
        assert torch.equal(d.cpu(), data[off:off + n]), (p.name, off, n)
    if D.available(dev) is True:  # the H200 supports read-only registration: the DMA path must be the one taken
        assert taken == [3], "page-cache DMA available but not used"
    # negative control: the same comparison sees one wrong byte
    dsts[1][len(dsts[1]) // 2] ^= 1
    assert not torch.equal(dsts[1].cpu(), a[wanted[1][2]:wanted[1][2] + wanted[1][3]])


@pytest.mark.gpu
def test_a_raising_block_drops_its_queued_reads(tmp_path, fresh_state):
    data, path = _blob(tmp_path)
    dst = torch.zeros(5000, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="planted"):
        with F.deferred_gpu_reads():
            F.read_file_into(path, 0, 5000, dst)
            raise RuntimeError("planted")
    assert int(dst.sum()) == 0
    F.read_file_into(path, 0, 5000, dst)  # and the next read is not deferred
    assert torch.equal(dst.cpu(), data[:5000])


@pytest.mark.gpu
def test_refused_registration_falls_back_to_the_pinned_copy(tmp_path, monkeypatch, fresh_state):
    data, path = _blob(tmp_path)
    dev = torch.device("cuda", torch.cuda.current_device())
    if D.available(dev) is not True:
        pytest.skip(f"page-cache DMA unavailable here: {D.available(dev)}")

    def refuse(reads, submit):
        for r in reads:  # write garbage where it goes, then fail like a refused pin
            r.flat.fill_(7)
        raise OSError(0, "planted refusal")

    monkeypatch.setattr(D, "dma_reads", refuse)
    n = data.numel() - 100
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    with F.deferred_gpu_reads():
        F.read_file_into(path, 100, n, dst)
    assert torch.equal(dst.cpu(), data[100:100 + n])  # every byte copied again by the pinned path
    assert "planted refusal" in D.available(dev)


@pytest.mark.gpu
def test_real_registration_refused_midway_still_loads(tmp_path, monkeypatch, fresh_state):
    """The real worker with cudaHostRegister failing on the third piece: pieces already pinned are
    released, and the pinned path copies every byte."""
    data, path = _blob(tmp_path)
    dev = torch.device("cuda", torch.cuda.current_device())
    if D.available(dev) is not True:
        pytest.skip(f"page-cache DMA unavailable here: {D.available(dev)}")
    rt = D._state["rt"]
    calls = []

    class Flaky:
        def __getattr__(self, k):
            return getattr(rt, k)

        def cudaHostRegister(self, *a):
            calls.append(a)
            return 1 if len(calls) == 3 else rt.cudaHostRegister(*a)

    monkeypatch.setitem(D._state, "rt", Flaky())
    n = data.numel() - 4096
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    with F.deferred_gpu_reads():
        F.read_file_into(path, 4096, n, dst)
    assert torch.equal(dst.cpu(), data[4096:4096 + n])
    assert len(calls) >= 3


@pytest.mark.gpu
def test_short_file_still_reports_truncation(tmp_path, fresh_state):
    data, path = _blob(tmp_path)
    n = data.numel() - 4096
    with pytest.raises(CheckpointError, match="truncated"):
        with F.deferred_gpu_reads():
            F.read_file_into(path, 8192, n, torch.zeros(n, dtype=torch.uint8, device="cuda"))
