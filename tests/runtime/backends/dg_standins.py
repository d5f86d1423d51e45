"""Stand-ins shared by the deepgemm backend's tests (test_deepgemm.py for the SM100 APIs, test_deepgemm_sm90.py
for the SM90 one), imported by name as pytest puts this folder on the path."""
from __future__ import annotations


class OneRankGroup:
    """A process group of one rank in place of ``torch.distributed``'s: what the backend hands a symmetric
    buffer. It counts barriers, so a test can see the backend wait for every rank before a buffer is reused."""

    def __init__(self):
        self.barriers = 0

    def size(self):
        return 1

    def rank(self):
        return 0

    def barrier(self):
        self.barriers += 1
