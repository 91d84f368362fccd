"""Requests that share a forward: one worker thread per model (the embedding model, the
reranker) runs `run(items)` over the items of every request that arrived while the first one
waited. The first waits at most `wait_s` for company, and no longer once the items waiting cost
`budget` (tokens: what one forward takes). The engine thread is never involved.

A request's items are checked and tokenised by its caller before they come here: what `run`
raises (the model failing) is every request's of that call."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T]):
    items: Sequence[T]
    cost: int
    done: threading.Event = field(default_factory=threading.Event)
    result: list = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class BatchFigures:
    """What the worker did: calls of `run`, requests and items they carried."""

    calls: int = 0
    requests: int = 0
    items: int = 0


class Batcher(Generic[T, R]):
    def __init__(self, name: str, run: Callable[[list[T]], Any], *, wait_s: float, budget: int):
        self.name, self.run, self.wait_s, self.budget = name, run, wait_s, budget
        self.figures = BatchFigures()
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, items: Sequence[T], cost: int) -> list[R]:
        """run's results for `items`, in order, once the worker has computed them (blocking)."""
        p: _Pending[T] = _Pending(items, cost)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} batcher is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"edgespec-{self.name}", daemon=True)
                self._thread.start()
            self._queue.put(p)
        p.done.wait()
        if p.error is not None:
            raise p.error
        return p.result

    def _take(self) -> list[_Pending] | None:
        """The next requests to share a call: the first, and those arriving within wait_s of it
        (until their cost reaches the budget). None: closed."""
        first = self._queue.get()
        if first is None:
            return None
        taken, cost = [first], first.cost
        until = time.monotonic() + self.wait_s
        while cost < self.budget:
            try:
                left = until - time.monotonic()
                p = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if p is None:
                self._queue.put(None)  # close after this call
                break
            taken.append(p)
            cost += p.cost
        return taken

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            items = [it for p in taken for it in p.items]
            try:
                out = list(self.run(items))
            except BaseException as exc:
                for p in taken:
                    p.error = exc
                    p.done.set()
                continue
            self.figures.calls += 1
            self.figures.requests += len(taken)
            self.figures.items += len(items)
            i = 0
            for p in taken:
                p.result = out[i:i + len(p.items)]
                i += len(p.items)
                p.done.set()

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

