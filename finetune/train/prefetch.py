"""`Prefetcher`: items of an ordered stream built on a background thread a bounded number ahead of their use
(the step loop's global batches, built and sent to the devices while the device runs the step before)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class _Failure:
    """A producer's exception, queued in place of the item it was building."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """`(position, produce(position))` for positions `start, start + 1, ... stop - 1`, in order, built on a
    background thread up to `depth` items ahead of the consumer (in the consumer's thread when `depth` is 0).

    An exception in `produce` is raised by the `next()` that would have returned its item. Use as a context
    manager: leaving it (at the end, on an error, or early) stops the thread and waits for it."""

    THREAD_NAME = "finetune-prefetch"

    def __init__(self, produce: Callable[[int], Any], start: int, stop: int, depth: int):
        self._produce, self._next, self._stop, self._depth = produce, start, stop, depth
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Prefetcher":
        if self._depth > 0 and self._next < self._stop:
            self._thread = threading.Thread(target=self._run, args=(self._next,), name=self.THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._next >= self._stop:
            raise StopIteration
        position = self._next
        if self._thread is None:
            item = self._produce(position)
        else:
            item = self._get()
            if isinstance(item, _Failure):
                self.close()
                raise item.error
            got, item = item
            assert got == position, (got, position)
        self._next += 1
        return position, item

    def close(self) -> None:
        """Stop the producer thread and wait for it to end; items it built and nobody took are dropped."""
        self._stopping.set()
        self._stop = self._next  # nothing more to take
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while not self._queue.empty():  # drop references to device buffers at once
            self._queue.get_nowait()

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch prefetching thread ended without its next batch") from None

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room; False if told to stop meanwhile."""
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _run(self, start: int) -> None:
        try:
            for position in range(start, self._stop):
                if self._stopping.is_set() or not self._put((position, self._produce(position))):
                    return
        except BaseException as e:  # noqa: BLE001 - raised in the consumer's thread, where it would have been
            self._put(_Failure(e))
