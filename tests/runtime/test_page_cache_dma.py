"""page_cache_dma.py: GPU loads DMA'd straight from the file's page cache, with the pinned path as fallback."""
import pytest
import torch

import megamoe_runtime.file_io as F
import megamoe_runtime.page_cache_dma as D
from megamoe_runtime.errors import CheckpointError
from megamoe_runtime.tensor_bytes import byte_view


def _blob(tmp_path, n=(1 << 20) + 3 * 4096 + 777):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(byte_view(data)))
    return data, path


@pytest.fixture
def fresh_state(monkeypatch):
    """Each test decides availability afresh, with small pieces and a low size threshold."""
    monkeypatch.setattr(D, "_state", {})
    monkeypatch.setattr(D, "PIECE", 5 * 4096 + 512)  # not a page multiple: pieces start mid-page
    monkeypatch.setattr(F, "_DMA_MIN", 4096)
    monkeypatch.setenv("MEGAMOE_LOAD_THREADS", "3")
    monkeypatch.setenv("MEGAMOE_LOAD_DMA", "1")


def test_off_unless_asked_for_without_touching_cuda(monkeypatch, fresh_state):
    monkeypatch.setenv("MEGAMOE_LOAD_DMA", "0")
    assert "opt-in" in D.available(torch.device("cuda", 0))
    monkeypatch.setattr(D, "_state", {})
    monkeypatch.delenv("MEGAMOE_LOAD_DMA")
    assert "opt-in" in D.available(torch.device("cuda", 0))


@pytest.mark.gpu
def test_dma_lands_every_byte_at_unaligned_offsets(tmp_path, monkeypatch, fresh_state):
    data, path = _blob(tmp_path)
    dev = torch.device("cuda", torch.cuda.current_device())
    taken = []
    real = D.dma_worker
    monkeypatch.setattr(D, "dma_worker", lambda *a: (taken.append(1), real(*a))[1])
    off = 4096 + 123  # not page aligned
    n = data.numel() - off - 5
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    F.read_file_into(path, off, n, dst)
    assert torch.equal(dst.cpu(), data[off:off + n])
    if D.available(dev) is True:  # the H200 supports read-only registration: the DMA path must be the one taken
        assert taken, "page-cache DMA available but not used"
    # negative control: the same comparison sees one wrong byte
    dst[n // 2] ^= 1
    assert not torch.equal(dst.cpu(), data[off:off + n])


@pytest.mark.gpu
def test_refused_registration_falls_back_to_the_pinned_copy(tmp_path, monkeypatch, fresh_state):
    data, path = _blob(tmp_path)
    dev = torch.device("cuda", torch.cuda.current_device())
    if D.available(dev) is not True:
        pytest.skip(f"page-cache DMA unavailable here: {D.available(dev)}")

    def refuse(fd, flat, offset, spans, stream):
        for _ in spans:  # take a piece, write garbage where it goes, then fail like a refused pin
            flat.fill_(7)
            raise OSError(0, "planted refusal")

    monkeypatch.setattr(D, "dma_worker", refuse)
    n = data.numel() - 100
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    F.read_file_into(path, 100, n, dst)
    assert torch.equal(dst.cpu(), data[100:100 + n])  # every byte copied again by the pinned path
    assert "planted refusal" in D.available(dev)


@pytest.mark.gpu
def test_short_file_still_reports_truncation(tmp_path, fresh_state):
    data, path = _blob(tmp_path)
    n = data.numel() - 4096
    with pytest.raises(CheckpointError, match="truncated"):
        F.read_file_into(path, 8192, n, torch.zeros(n, dtype=torch.uint8, device="cuda"))
