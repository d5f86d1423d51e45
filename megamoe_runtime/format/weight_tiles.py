"""The tiled arrangement of routed expert weights in device memory (docs/LAYOUT.md, "Tiled weights in memory").

Why it exists. In the converted (DeepGEMM) layout a weight row is contiguous, so a GEMM tile that reads one
128-wide K block of many rows touches 64 bytes (E2M1) or 128 bytes (E4M3) per row, one row length apart. On
the H200 the triton kernels read the same bytes 13-15% faster when each group of ``wt`` rows stores its K
blocks one after another (docs/bench-log/kernels.md): a tile's reads become whole runs of memory.
The file format does not change: the layer derives this arrangement in place after a load and restores the
converted layout before the next load writes (`megamoe_runtime.layer.experts`), so loaders, the reload dry run and
the checkpoint only ever see the converted layout.

Per expert, converted ``[N, nblk, run]`` (row-major) and tiled ``[N / wt, nblk, wt, run]`` hold the same
bytes, where ``run`` is the bytes of one row in one 128-wide K block and ``nblk`` the number of K blocks.
"""
from __future__ import annotations

import torch

from ..errors import LayoutError

__all__ = ["ScratchError", "run_bytes", "tiled_copy", "untiled_copy", "tile_in_place",
           "untile_in_place"]

#: upper bound of the scratch buffer the in-place passes use (whole experts at a time, at least one)
SCRATCH_BYTES = 256 << 20


class ScratchError(LayoutError):
    """The scratch buffer of an in-place pass could not be allocated: raised before any byte moved."""


def run_bytes(w: torch.Tensor) -> int:
    """Bytes of one weight row in one 128-wide K block: 64 for packed E2M1 (two weights per byte), 128 for
    E4M3. Other dtypes have no tiled arrangement."""
    if w.dtype == torch.float8_e4m3fn:
        return 128
    if w.dtype in (torch.uint8, torch.int8):
        return 64
    raise LayoutError(f"no tiled arrangement for {w.dtype} weights (E2M1 bytes or E4M3 only)")


def _check_tileable(w: torch.Tensor, wt: int) -> tuple[int, int, int]:
    """(rows N, K blocks, run bytes) of expert stack ``w [E, N, Kbytes]`` for tiles of ``wt`` rows, or a
    LayoutError naming what does not divide."""
    run = run_bytes(w)
    if w.dim() != 3 or not w.is_contiguous():
        raise LayoutError(f"tiled weights need a contiguous [E, N, Kbytes] expert stack, got {tuple(w.shape)} "
                          f"strides {w.stride()}")
    _, n, kb = w.shape
    if wt <= 0 or n % wt or kb % run:
        raise LayoutError(f"weights {tuple(w.shape)} cannot be tiled by {wt} rows of {run}-byte runs "
                          f"(rows % tile and bytes per row % run must be 0)")
    return n, kb // run, run


def _words(w: torch.Tensor) -> torch.Tensor:
    """The same bytes as int64 words (runs are multiples of 8 bytes): a copy moves 8x fewer elements."""
    return w.view(torch.uint8).view(torch.int64)


def tiled_copy(w: torch.Tensor, wt: int) -> torch.Tensor:
    """A new tensor holding ``w`` (converted layout) in the tiled arrangement (tests and benchmarks)."""
    n, nblk, run = _check_tileable(w, wt)
    src = _words(w).reshape(w.shape[0], n // wt, wt, nblk, run // 8)
    return src.transpose(2, 3).contiguous().view(torch.uint8).view(w.dtype).reshape(w.shape)


def untiled_copy(w: torch.Tensor, wt: int) -> torch.Tensor:
    """A new tensor holding tiled ``w`` in the converted layout: the inverse of `tiled_copy`."""
    n, nblk, run = _check_tileable(w, wt)
    src = _words(w).reshape(w.shape[0], n // wt, nblk, wt, run // 8)
    return src.transpose(2, 3).contiguous().view(torch.uint8).view(w.dtype).reshape(w.shape)


def _permute_in_place(w: torch.Tensor, wt: int, to_tiled: bool) -> None:
    n, nblk, run = _check_tileable(w, wt)
    words = _words(w)
    per_expert = words[0].numel() * 8
    chunk = max(1, min(w.shape[0], SCRATCH_BYTES // max(1, per_expert)))
    try:
        scratch = torch.empty((chunk,) + tuple(words.shape[1:]), dtype=torch.int64, device=w.device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise ScratchError(f"cannot allocate the {chunk * per_expert}-byte scratch to rearrange weights "
                           f"{tuple(w.shape)} on {w.device}: {e}") from e
    conv = (n // wt, wt, nblk, run // 8)
    tiled = (n // wt, nblk, wt, run // 8)
    for e0 in range(0, w.shape[0], chunk):
        c = min(chunk, w.shape[0] - e0)
        dst = words[e0:e0 + c]
        s = scratch[:c]
        s.copy_(dst)
        if to_tiled:
            dst.view((c,) + tiled).copy_(s.view((c,) + conv).transpose(2, 3))
        else:
            dst.view((c,) + conv).copy_(s.view((c,) + tiled).transpose(2, 3))


def tile_in_place(w: torch.Tensor, wt: int) -> None:
    """Rearrange ``w`` (converted layout) into the tiled arrangement inside its own storage: same
    ``data_ptr``, one pass through a scratch of at most `SCRATCH_BYTES` (whole experts), never a second
    full-size allocation. The scratch is allocated before the first byte moves."""
    _permute_in_place(w, wt, True)


def untile_in_place(w: torch.Tensor, wt: int) -> None:
    """The inverse of `tile_in_place`: the converted layout again, in the same storage."""
    _permute_in_place(w, wt, False)
