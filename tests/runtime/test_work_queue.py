"""work_queue.py: every item to exactly one thread."""
import threading

from megamoe_runtime.files.work_queue import SharedQueue


def test_each_item_taken_once_by_many_threads():
    q = SharedQueue(list(range(5000)))
    got: list[list[int]] = [[] for _ in range(8)]

    def take(i):
        for x in q:
            got[i].append(x)

    ts = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    flat = sorted(x for g in got for x in g)
    assert flat == list(range(5000))
    assert all(g == sorted(g) for g in got)  # in order within a thread
    assert list(q) == []  # exhausted for a late thread too


def test_empty_queue():
    assert list(SharedQueue([])) == []
