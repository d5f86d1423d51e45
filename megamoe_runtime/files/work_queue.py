"""One list of work items dealt to several threads, each item to exactly one.

Why a queue and not fixed spans per thread: a reader that finishes early
takes the next item instead of idling while another still has two to do.
"""
from __future__ import annotations

import threading
from typing import Generic, Sequence, TypeVar

__all__ = ["SharedQueue"]

_T = TypeVar("_T")


class SharedQueue(Generic[_T]):
    """A thread-safe iterator over ``items``, in order; every thread iterates the same object."""

    def __init__(self, items: Sequence[_T]):
        self._items, self._i, self._lock = items, 0, threading.Lock()

    def __iter__(self) -> "SharedQueue[T]":
        return self

    def __next__(self) -> _T:
        with self._lock:
            if self._i >= len(self._items):
                raise StopIteration
            self._i += 1
            return self._items[self._i - 1]
