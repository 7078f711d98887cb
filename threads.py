"""A bounded thread pool for the streaming weight writers.

numpy releases the GIL in copies, casts and file reads / writes, so a few threads convert
and write weights in parallel. The bound matters as much as the parallelism: a producer that
hands data to the pool (the random-checkpoint writer) blocks once ``2 * workers`` jobs wait,
so memory holds a fixed number of pieces whatever the model's size.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def default_workers() -> int:
    """Threads for weight conversion: the cores, at most 8 (beyond that the disk is the limit)."""
    return max(1, min(8, os.cpu_count() or 1))


class BoundedPool:
    """Runs jobs on ``workers`` threads; :meth:`submit` blocks while ``2 * workers`` are unfinished.

    Use it as a context manager: leaving the block waits for every job and raises the first
    job's exception; an exception inside the block cancels the jobs that have not started.
    A job that failed stops further submissions (its exception is raised by the next submit).
    ``on_result`` is called (on a worker thread) with the result of each job that succeeds.
    """

    def __init__(self, workers: int | None = None, on_result: Callable | None = None):
        self.workers = workers or default_workers()
        self._on_result = on_result
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="dsv4c-weights")
        self._slots = threading.BoundedSemaphore(2 * self.workers)
        self._futures: list[Future] = []

    def submit(self, job: Callable, *args) -> Future:
        """Run ``job(*args)`` on a worker; blocks while the pool is full."""
        self._raise_failed()
        self._slots.acquire()
        try:
            future = self._executor.submit(job, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._done)
        self._futures.append(future)
        return future

    def _done(self, future: Future) -> None:
        self._slots.release()
        if self._on_result is not None and not future.cancelled() and future.exception() is None:
            self._on_result(future.result())

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()
        self._futures = [f for f in self._futures if not f.done()]

    def __enter__(self) -> BoundedPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._executor.shutdown(wait=True, cancel_futures=exc_type is not None)
        if exc_type is None:
            self._raise_failed()
