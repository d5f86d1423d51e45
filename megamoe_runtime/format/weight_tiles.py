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
Packed E2M1 weights also store the bits of every little-endian 32-bit word in another order
(`E2M1_WORD_BITS`): the triton kernels then unpack a word's eight nibbles for the tensor cores in 9 integer
instructions where the natural order needs 13 (docs/LAYOUT.md).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import LayoutError

__all__ = ["CopyBits", "E2M1_WORD_BITS", "ScratchError", "e2m1_bit_moves", "permute_e2m1_bits", "run_bytes",
           "tiled_copy", "untiled_copy", "tile_in_place", "untile_in_place"]

#: upper bound of the scratch buffer the in-place passes use (whole experts at a time, at least one)
SCRATCH_BYTES = 256 << 20

#: Where the tiled arrangement stores each bit of a little-endian 32-bit word of packed E2M1 weights:
#: natural bit ``n`` (bit ``n % 4`` of nibble ``n // 4``; bit 3 the sign) is stored at ``E2M1_WORD_BITS[n]``.
#: Why these places: the kernels decode nibbles ``j`` and ``j + 4`` into one bf16x2 register whose
#: magnitude bits sit at 6..8 / 22..24 and sign at 15 / 31 (docs/KERNELS.md, "The tiled bit order"). Stored
#: this way, nibbles 0 and 4 hold that register's bits shifted right by 6, nibbles 1 and 5 shifted right by
#: 2, nibbles 3 and 7 rotated left by 4, and nibbles 2 and 6 in place but for the lowest magnitude bit of
#: each, 8 places up: the decode moves them back with one shift, rotation or multiply-add each. No
#: placement puts all four registers one move away (an exhaustive search of the shifts, rotations and
#: funnel shifts of up to four words).
E2M1_WORD_BITS = (0, 1, 2, 9, 4, 5, 6, 13, 14, 7, 8, 15, 10, 11, 12, 19,
                  16, 17, 18, 25, 20, 21, 22, 29, 30, 23, 24, 31, 26, 27, 28, 3)
#: int64 words per slice of the in-place bit permutation (its two buffers are allocated with the scratch)
_BIT_SLICE_WORDS = 1 << 22


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


def e2m1_bit_moves(to_tiled: bool) -> tuple[tuple[int, int], ...]:
    """The bit permutation of `E2M1_WORD_BITS` (``to_tiled``) or its inverse as (shift, mask) pairs, one per
    distance a bit moves: the permuted word is the OR over pairs of ``(word << shift) & mask`` (a negative
    shift moves right). Masks select destination bits of a 32-bit word; five pairs either way."""
    moves: dict[int, int] = {}
    for n, s in enumerate(E2M1_WORD_BITS):
        src, dst = (n, s) if to_tiled else (s, n)
        moves[dst - src] = moves.get(dst - src, 0) | (1 << dst)
    return tuple(sorted(moves.items()))


def permute_e2m1_bits(words: torch.Tensor, to_tiled: bool, out: torch.Tensor | None = None,
                      tmp: torch.Tensor | None = None) -> torch.Tensor:
    """``words`` (int32 or int64 views of packed E2M1 bytes) with the bits of every 32-bit word moved to the
    tiled places (``to_tiled``) or back, into ``out`` (a new tensor if None; ``tmp``: a buffer of the same
    shape, or one is made). int64 words are two 32-bit words: each move's mask is taken for both halves, and
    no bit crosses between them (every move stays inside its 32-bit word)."""
    if words.dtype not in (torch.int32, torch.int64):
        raise LayoutError(f"E2M1 bit order: int32 or int64 words expected, got {words.dtype}")
    bits = words.element_size() * 8
    out = torch.zeros_like(words) if out is None else out.zero_()
    tmp = torch.empty_like(words) if tmp is None else tmp
    for shift, mask in e2m1_bit_moves(to_tiled):
        if bits == 64:
            mask |= mask << 32
        mask -= (1 << bits) if mask >> (bits - 1) else 0  # the same bits as a signed value of the dtype
        if shift >= 0:
            torch.bitwise_left_shift(words, shift, out=tmp)
        else:
            torch.bitwise_right_shift(words, -shift, out=tmp)
        tmp &= mask
        out |= tmp
    return out


def _permute_bits_in_place(words: torch.Tensor, to_tiled: bool, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`permute_e2m1_bits` into ``words`` itself, a slice at a time through the two slice buffers ``bufs``
    (allocated with the scratch, before any byte moves)."""
    flat = words.view(-1)
    step = bufs[0].numel()
    for i in range(0, flat.numel(), step):
        part = flat[i:i + step]
        n = part.numel()
        part.copy_(permute_e2m1_bits(part, to_tiled, bufs[0][:n], bufs[1][:n]))


def _is_e2m1(w: torch.Tensor) -> bool:
    return w.dtype in (torch.uint8, torch.int8)


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
    out = src.transpose(2, 3).contiguous()
    if _is_e2m1(w):
        out = permute_e2m1_bits(out, True)
    return out.view(torch.uint8).view(w.dtype).reshape(w.shape)


def untiled_copy(w: torch.Tensor, wt: int) -> torch.Tensor:
    """A new tensor holding tiled ``w`` in the converted layout: the inverse of `tiled_copy`."""
    n, nblk, run = _check_tileable(w, wt)
    src = _words(w).reshape(w.shape[0], n // wt, nblk, wt, run // 8)
    out = src.transpose(2, 3).contiguous()
    if _is_e2m1(w):
        out = permute_e2m1_bits(out, False)
    return out.view(torch.uint8).view(w.dtype).reshape(w.shape)


#: ``copy_bits(src, dst, to_tiled)``: writes contiguous words ``src`` into ``dst`` with the E2M1 bits moved
#: as `permute_e2m1_bits` moves them (a backend's one-pass form; the triton backend's runs on the GPU)
CopyBits = Callable[[torch.Tensor, torch.Tensor, bool], None]


def _permute_in_place(w: torch.Tensor, wt: int, to_tiled: bool, copy_bits: Optional[CopyBits]) -> None:
    n, nblk, run = _check_tileable(w, wt)
    e2m1 = _is_e2m1(w)
    words = _words(w)
    per_expert = words[0].numel() * 8
    chunk = max(1, min(w.shape[0], SCRATCH_BYTES // max(1, per_expert)))
    try:
        scratch = torch.empty((chunk,) + tuple(words.shape[1:]), dtype=torch.int64, device=w.device)
        slice_words = min(_BIT_SLICE_WORDS, scratch.numel())
        bufs = tuple(torch.empty(slice_words, dtype=torch.int64, device=w.device)
                     for _ in range(2 if e2m1 and copy_bits is None else 0))
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise ScratchError(f"cannot allocate the {chunk * per_expert}-byte scratch to rearrange weights "
                           f"{tuple(w.shape)} on {w.device}: {e}") from e
    conv = (n // wt, wt, nblk, run // 8)
    tiled = (n // wt, nblk, wt, run // 8)
    for e0 in range(0, w.shape[0], chunk):
        c = min(chunk, w.shape[0] - e0)
        dst = words[e0:e0 + c]
        s = scratch[:c]
        # bits move inside 32-bit words, the transpose below whole 8-byte words: either order gives the same
        if e2m1 and copy_bits is not None:
            copy_bits(dst, s, to_tiled)
        else:
            s.copy_(dst)
            if e2m1:
                _permute_bits_in_place(s, to_tiled, bufs)
        if to_tiled:
            dst.view((c,) + tiled).copy_(s.view((c,) + conv).transpose(2, 3))
        else:
            dst.view((c,) + conv).copy_(s.view((c,) + tiled).transpose(2, 3))


def tile_in_place(w: torch.Tensor, wt: int, copy_bits: Optional[CopyBits] = None) -> None:
    """Rearrange ``w`` (converted layout) into the tiled arrangement inside its own storage: same
    ``data_ptr``, one pass through a scratch of at most `SCRATCH_BYTES` (whole experts), never a second
    full-size allocation. The scratch is allocated before the first byte moves. ``copy_bits``: a one-pass
    form of the E2M1 bit permutation for the copy into the scratch (`CopyBits`); without it the bits move in
    torch steps through two slice buffers allocated with the scratch (the same bytes, slower)."""
    _permute_in_place(w, wt, True, copy_bits)


def untile_in_place(w: torch.Tensor, wt: int, copy_bits: Optional[CopyBits] = None) -> None:
    """The inverse of `tile_in_place`: the converted layout again, in the same storage."""
    _permute_in_place(w, wt, False, copy_bits)
