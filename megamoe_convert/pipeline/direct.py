"""Routed weights read from the source straight into the kernel buffers.

Where a reader can say where an expert's weight bytes lie
(``weight_byte_ranges``), one positional read per projection puts them at
their kernel rows, skipping a temporary tensor and a ``copy_``; the gate/up
placement is asked of ``layout.l1_half_row_runs``, not re-derived.
"""
from __future__ import annotations

from typing import Callable

import torch

from megamoe_runtime.files.tensor_bytes import byte_view
from megamoe_runtime.format import layout
from megamoe_runtime.format.formats import Row

from ..readers.base import CheckpointReader


class DirectWeights:
    """Routed weights read from the source straight into one rank's kernel
    buffers, where the reader offers their byte ranges
    (``reader.weight_byte_ranges``): one ``preadv`` per expert and half for
    gate/up, with one iovec per 8-row group at its interleaved place (kernel
    rows ``16g + 8*half .. +8``, contiguous), and one read for down (L2
    weights are stored unchanged). This skips the temporary source buffer and
    the ``copy_`` into the kernel layout; the bytes land exactly where
    ``layout.write_l1_weight`` / ``write_l2_weight`` put them."""

    def __init__(self, reader: CheckpointReader, kt: layout.KernelTensors) -> None:
        self.reader = reader
        self.kt = kt
        E_l, n2, dw = kt.l1_weight.shape
        isz = kt.l1_weight.element_size()
        self.groups = n2 // 16
        self.row_bytes = dw * isz
        self.half_bytes = (n2 // 2) * self.row_bytes  # what one gate/up source tensor holds
        #: per half, (kernel byte offset, nbytes) of each 8-row run in source order (layout's placement)
        self.runs = [[(k * self.row_bytes, n * self.row_bytes) for _, k, n in layout.l1_half_row_runs(n2 // 2, h)]
                     for h in (0, 1)] if n2 % 16 == 0 else None
        self.l1_bytes = n2 * dw * isz  # one expert's l1_weight
        self.l2_bytes = kt.l2_weight[0].numel() * kt.l2_weight.element_size()
        self._l1 = self._l2 = None  # byte views, made on first use
        #: slot -> (gate iovecs, up iovecs, down iovec): the same for every chunk packed into these
        #: buffers (`stream.Run.direct_weights` keeps one instance per chunk buffer set), so the ~200
        #: views per expert are sliced once per slot, not once per expert read
        self._iovecs: dict[int, tuple[list[memoryview], list[memoryview], list[memoryview]]] = {}

    def read(self, layer: int, e: int, slot: int) -> bool:
        """Read expert ``e``'s gate/up/down weights into kernel slot ``slot``;
        False (nothing read) when the reader offers no ranges or their sizes
        do not fit (the read_expert path then reports any problem)."""
        ranges = [self.reader.weight_byte_ranges(layer, e, role) for role in ("gate", "up", "down")]
        if any(r is None for r in ranges) or ranges[0][2] != self.half_bytes or ranges[1][2] != self.half_bytes \
                or ranges[2][2] != self.l2_bytes or self.groups * 16 != self.kt.l1_weight.shape[1]:
            return False
        iov = self._iovecs.get(slot)
        if iov is None:
            if self._l1 is None:
                self._l1, self._l2 = byte_view(self.kt.l1_weight), byte_view(self.kt.l2_weight)
            base = slot * self.l1_bytes
            iov = self._iovecs[slot] = (
                *([self._l1[base + off: base + off + n] for off, n in self.runs[half]] for half in (0, 1)),
                [self._l2[slot * self.l2_bytes:(slot + 1) * self.l2_bytes]])
        src = self.reader.source
        for (path, pos, _), views in zip(ranges, iov):
            src.read_into(path, pos, views)
        return True

    def weights(self, row: Row, slot: int) -> dict[str, Callable[[], torch.Tensor]]:
        """role -> the weight as read_expert would give it, from the kernel
        buffer (for checks that look at weight values: a copy, made only then)."""
        ke = self.kt.expert(slot)
        wdt = row.weight.checkpoint_dtype
        return {"gate": lambda: layout.read_l1_weight(ke.l1_weight, 0).view(wdt),
                "up": lambda: layout.read_l1_weight(ke.l1_weight, 1).view(wdt),
                "down": lambda: ke.l2_weight.view(wdt)}


__all__ = ["DirectWeights"]
