"""The simulator's event heaps: heapq's heappush, heappop and heapify on lists of tuples that begin with a time
and a tie-break number unique within the heap (the event loop's heap of (t, seq, fn, arg), an engine's decode
batch (target clock, seq, execution) and its tool calls (return time, seq, execution)).

The functions below are heapq's algorithm (the same sifts, so the same layout) with an entry's order decided
by its (time, tie-break) key. Keys are unique in a heap, so heapq's tuple comparison orders entries exactly as
these do. Run as pure Python, the module hands out heapq's own C functions (bound at the bottom); the hot-path
build (gyre.compiled) compiles these, comparing keys as C doubles instead of tuple by tuple.
"""

from __future__ import annotations


def heappush(heap: list, item: tuple) -> None:
    heap.append(item)
    _sift_down(heap, 0, len(heap) - 1)


def heappop(heap: list) -> tuple:
    last = heap.pop()
    if heap:
        item = heap[0]
        heap[0] = last
        _sift_up(heap, 0)
        return item
    return last


def heapify(heap: list) -> None:
    for i in reversed(range(len(heap) // 2)):
        _sift_up(heap, i)


def _less(a: tuple, b: tuple) -> bool:
    ta, tb = a[0], b[0]
    return ta < tb or (ta == tb and a[1] < b[1])


def _sift_down(heap: list, start: int, pos: int) -> None:
    """heapq._siftdown: the entry at pos moves up towards start while it precedes its parent."""
    item = heap[pos]
    while pos > start:
        up = (pos - 1) >> 1
        parent = heap[up]
        if _less(item, parent):
            heap[pos] = parent
            pos = up
            continue
        break
    heap[pos] = item


def _sift_up(heap: list, pos: int) -> None:
    """heapq._siftup: the smaller child rises into pos down to a leaf, then the entry from pos sifts down."""
    end = len(heap)
    start = pos
    item = heap[pos]
    child = 2 * pos + 1
    while child < end:
        right = child + 1
        if right < end and not _less(heap[child], heap[right]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    heap[pos] = item
    _sift_down(heap, start, pos)


if __file__.endswith(".py"):  # pure Python: heapq's C functions (the same algorithm and order) are faster
    import heapq

    globals().update(heappush=heapq.heappush, heappop=heapq.heappop, heapify=heapq.heapify)
