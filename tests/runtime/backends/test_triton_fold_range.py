"""``fold_range``: when the fold decode's per-tile scale check may be skipped (CPU tests).

The answer must follow the tensor's bytes: a load or reload that writes new bytes (``copy_``,
an indexed write, the page-cache DMA path's explicit version bump) is looked at again; a tensor
whose version cannot be read, and the ``always`` override, keep the check.
"""
from __future__ import annotations

import pytest
import torch

from megamoe_runtime.backends.triton import fold_range
from megamoe_runtime.backends.triton.fold_range import within_fold_limit


def _scales(fill: int = 120) -> torch.Tensor:
    return torch.full((4, 64, 8), fill, dtype=torch.uint8)


def test_fits_and_does_not_fit():
    s = _scales()
    assert within_fold_limit(s, 128)
    s[1, 3, 2] = 129
    assert not within_fold_limit(s, 128)
    assert within_fold_limit(s, 134)  # the E4M3 limit is higher


def test_limit_is_inclusive():
    assert within_fold_limit(_scales(128), 128)
    assert not within_fold_limit(_scales(129), 128)


@pytest.mark.parametrize("write", ["copy_", "setitem", "fill_", "increment_version"])
def test_new_bytes_are_looked_at_again(write, monkeypatch):
    s = _scales()
    assert within_fold_limit(s, 128)
    big = _scales(200)
    if write == "copy_":
        s.copy_(big)
    elif write == "setitem":
        s[0, 0, 0] = 200
    elif write == "fill_":
        s.fill_(200)
    else:  # a raw write torch does not see, announced as file_io's DMA path does
        s.view(-1).numpy()[5] = 200
        torch.autograd.graph.increment_version(s)
    assert not within_fold_limit(s, 128)


def test_view_of_a_reloaded_base_is_looked_at_again():
    base = torch.full((2, 256), 100, dtype=torch.uint8)
    view = base[:, :128]
    assert within_fold_limit(view, 128)
    base[1, 5].fill_(250)  # a write through the base (views share its version counter)
    assert not within_fold_limit(base[:, :128], 128)


def test_answer_is_cached_until_the_version_moves(monkeypatch):
    s = _scales()
    calls = []
    real = fold_range._max_byte
    monkeypatch.setattr(fold_range, "_max_byte", lambda t: calls.append(1) or real(t))
    assert within_fold_limit(s, 128) and within_fold_limit(s, 128) and within_fold_limit(s[:], 128)
    assert len(calls) == 1, "one reduction per tensor contents"
    s.add_(0)
    assert within_fold_limit(s, 128)
    assert len(calls) == 2


def test_raw_write_without_a_version_bump_is_not_seen():
    """Negative control: the cache trusts the version counter, which is why every raw-pointer
    writer must bump it (``file_io`` after the page-cache DMA)."""
    s = _scales()
    assert within_fold_limit(s, 128)
    s.view(-1).numpy()[0] = 200
    assert within_fold_limit(s, 128)  # stale by construction
    torch.autograd.graph.increment_version(s)
    assert not within_fold_limit(s, 128)


def test_inference_tensors_keep_the_check():
    with torch.inference_mode():
        s = _scales()
    assert not within_fold_limit(s, 128)


def test_always_env_keeps_the_check(monkeypatch):
    monkeypatch.setenv(fold_range.FOLD_CHECK_ENV, "always")
    assert not within_fold_limit(_scales(), 128)


def test_none_and_empty_keep_the_check():
    assert not within_fold_limit(None, 128)
    assert not within_fold_limit(torch.empty(0, dtype=torch.uint8), 128)


def test_int32_views_are_read_as_bytes():
    s = _scales().view(torch.int32)  # the kernel views are int32 words of 4 scale bytes
    assert within_fold_limit(s, 128)
    s.view(torch.uint8)[0, 0, 3] = 130
    assert not within_fold_limit(s, 128)
