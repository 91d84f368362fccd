"""The daemon's chat models at run time: each its own engine and engine thread (an EngineLoop)
while loaded, and the one memory budget they share (chat_plan.py).

A request for a model holds it (`ChatModels.use`) from before its prompt is tokenised until its
answer ends: a model in use is never unloaded. A model that is not loaded is loaded on the
request's behalf; when it would not fit beside the loaded ones, the idle ones whose keep_alive
has passed since their last request are unloaded first (least recently used first), as Ollama
does, and when none may be yet, the request waits for one. Every wait is bounded by the
request's own deadline (DeadlineExceeded naming `model`) or else [models] load_wait_seconds.

An on_demand model also unloads once it has been idle for its keep_alive, memory needed or not
(a reaper thread, as Ollama's keep_alive); a model loaded at start stays loaded until another
needs its memory; keep_alive -1 keeps a model loaded for good.

An unloaded model's engine thread stops outside the lock every request takes (a stop can take
seconds); its bytes count as held until it has stopped, so no load overcommits the budget.

`ChatModel` offers the EngineLoop's surface (submit, call, encoder, ...) to the APIs, over
whichever loop is loaded now."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from edgespec.errors import DeadlineExceeded, NotReady
from edgespec.logs import get_logger

log = get_logger("edgespec.server.chat_models")

IDLE_STATS = {"active_requests": 0, "queue_depth": 0, "ready": False, "tick_totals": {}, "suffix_cache": {},
              "breaker_state": "", "idle": True}


class ChatModel:
    """One chat model: its entry (chat_config.ChatEntry), its planned bytes, and its EngineLoop
    while loaded. `make_loop(first)` builds a new, unstarted loop (`first`: its first load)."""

    def __init__(self, entry: Any, make_loop: Callable[[bool], Any], need_bytes: int):
        self.entry, self.name = entry, entry.name
        self.need_bytes = need_bytes
        self._make_loop = make_loop
        self._loop: Any = None
        self.uses = 0  # requests holding it (ChatModels.use)
        self.last_used = time.monotonic()
        self.loads = 0
        self.unloads = 0
        self._draining = False
        self.parallel = getattr(entry.engine, "parallel", 1)

    # ---- what the APIs use of an EngineLoop -----------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._loop is not None

    @property
    def loop(self) -> Any:
        return self._loop

    @property
    def encoder(self) -> Any:
        return self._loop.encoder if self._loop is not None else None

    @property
    def capabilities(self) -> frozenset[str]:
        return self._loop.capabilities if self._loop is not None else frozenset()

    @property
    def ready(self) -> bool:
        """Serving: loaded and ready, or unloaded and loadable on a request (not a model loaded at
        start before its first load: the daemon is still starting)."""
        if self._draining:
            return False
        if self._loop is None:
            return self.loads > 0 or self.entry.load == "on_demand"
        return bool(self._loop.ready)

    @property
    def stopped(self) -> bool:
        """Its engine thread failed (an unloaded model is not stopped: it loads on a request)."""
        return self._loop is not None and self._loop.stopped

    @property
    def error(self) -> BaseException | None:
        return self._loop.error if self._loop is not None else None

    @property
    def draining(self) -> bool:
        return self._draining or (self._loop is not None and self._loop.draining)

    def _current(self) -> Any:
        loop = self._loop
        if loop is None:
            raise NotReady(f"chat model {self.name!r} is not loaded")
        return loop

    def submit(self, job: Any) -> Any:
        return self._current().submit(job)

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        return self._current().call(fn, timeout=timeout)

    def compile(self, constraint: Any) -> Any:
        return self._current().compile(constraint)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._current().wait_loaded(timeout)

    def stats(self) -> dict[str, Any]:
        if self._loop is not None:
            return self._loop.stats()
        return {**IDLE_STATS, "parallel": self.parallel, "queue_capacity": 0, "draining": self._draining}

    def drain(self, on: bool = True) -> None:
        self._draining = on
        if self._loop is not None:
            self._loop.drain(on)

    # ---- load and unload (ChatModels, under its lock) -------------------------------------------

    def _load(self) -> None:
        self._loop = self._make_loop(self.loads == 0)
        self.loads += 1
        if self._draining:
            self._loop.drain(True)
        self._loop.start()
        log.info("chat_model_loading", model=self.name, bytes=self.need_bytes)

    def _unload(self) -> Any:
        loop, self._loop = self._loop, None
        self.unloads += 1
        return loop


class ChatModels:
    """The chat models by name (the default first) within `budget_bytes`, of which `side_bytes`
    are the embedding and rerank contexts'. `load_wait` bounds a wait with no deadline.
    `on_unload(model, loop)` runs as an unloaded model's loop is about to stop (outside the lock)."""

    def __init__(self, models: Sequence[ChatModel], *, budget_bytes: int, side_bytes: int = 0,
                 load_wait: float = 600.0, on_unload: Callable[[ChatModel, Any], None] | None = None):
        self.models = tuple(models)
        self.by_name = {m.name: m for m in self.models}
        self.default = self.models[0]
        self.budget_bytes, self.side_bytes = budget_bytes, side_bytes
        self.load_wait = load_wait
        self.on_unload = on_unload
        self._cond = threading.Condition()
        self._stopping: dict[Any, int] = {}  # an unloaded model's loop still stopping -> its bytes
        self._stopping_of: dict[Any, ChatModel] = {}  # that loop -> its model
        self._stoppers: list[threading.Thread] = []
        self._reaper: threading.Thread | None = None
        self._closed = False

    def find(self, name: str) -> ChatModel:
        """The model `name` names; the default for an empty or unknown one (the APIs answer those)."""
        return self.by_name.get(name) or self.default

    def start(self) -> None:
        """Load the models configured to load at start (the default first); start the reaper that
        unloads an on_demand model idle past its keep_alive."""
        with self._cond:
            for m in self.models:
                if m.entry.load == "start" and not m.loaded:
                    m._load()
            if self._reaper is None and any(m.entry.load == "on_demand" and m.entry.keep_alive >= 0
                                            for m in self.models):
                self._reaper = threading.Thread(target=self._reap, name="chat-models-reaper", daemon=True)
                self._reaper.start()

    def loaded_bytes(self) -> int:
        """The bytes held: the side contexts', the loaded models' and those of loops still stopping."""
        return self.side_bytes + sum(m.need_bytes for m in self.models if m.loaded) + sum(self._stopping.values())

    @contextlib.contextmanager
    def use(self, model: ChatModel, deadline: float | None) -> Iterator[ChatModel]:
        """Hold `model` loaded for as long as the block runs; load it first (within `deadline`,
        a time.monotonic() value, or load_wait seconds)."""
        self.acquire(model, deadline)
        try:
            yield model
        finally:
            self.release(model)

    def acquire(self, model: ChatModel, deadline: float | None) -> None:
        until = deadline if deadline is not None else time.monotonic() + self.load_wait
        with self._cond:
            model.uses += 1
            try:
                self._make_room(model, until)
                loop = model.loop
            except BaseException:
                model.uses -= 1
                self._cond.notify_all()
                raise
        try:
            self._wait_ready(model, loop, until)
        except BaseException:
            with self._cond:
                if model.loop is loop and loop.error is not None:  # a failed load: the next request tries again
                    model._unload()
            self.release(model)
            raise

    def release(self, model: ChatModel) -> None:
        with self._cond:
            model.uses -= 1
            model.last_used = time.monotonic()
            self._cond.notify_all()

    def _make_room(self, model: ChatModel, until: float) -> None:
        """Under the lock: `model` loaded (its load begun), after unloading idle models to make room."""
        while not model.loaded:
            if model in self._stopping_of.values():
                # its last unload still runs (on_unload writes its suffix-cache snapshot): a load
                # begun now would read the snapshot before it is written, and lose what it learnt
                now = time.monotonic()
                if now >= until:
                    raise DeadlineExceeded(f"model: chat model {model.name!r} was still unloading when its "
                                           "deadline passed")
                self._cond.wait(min(until - now, 1.0))
                continue
            held = self.loaded_bytes()
            if held + model.need_bytes <= self.budget_bytes:
                model._load()
                return
            now = time.monotonic()
            victim, wake = None, None
            if held - sum(self._stopping.values()) + model.need_bytes > self.budget_bytes:
                victim, wake = self._evictable(model, now)  # (else the loops stopping free enough)
            if victim is not None:
                self._unload(victim, reason=f"memory for {model.name}")
                continue
            if now >= until:
                raise DeadlineExceeded(f"model: chat model {model.name!r} needs {model.need_bytes} bytes and "
                                       f"the loaded models are in use, within their keep_alive or still "
                                       f"stopping: its deadline passed while it waited for memory")
            self._cond.wait(min(until - now, wake - now if wake is not None else 1.0, 1.0))

    @staticmethod
    def _idle_since(m: ChatModel, now: float) -> float | None:
        """When `m`'s keep_alive ends (or ended): None while it is in use, unloaded or kept for good."""
        if m.uses or not m.loaded or m.entry.keep_alive < 0:
            return None
        due = m.last_used + m.entry.keep_alive
        if due <= now and m.loop.stats().get("active_requests"):
            return now + 1.0  # a request not yet counted in `uses`: look again
        return due

    def _evictable(self, wanted: ChatModel, now: float) -> tuple[ChatModel | None, float | None]:
        """The least recently used idle model past its keep_alive, or None and when the next one will be."""
        best, wake = None, None
        for m in self.models:
            due = self._idle_since(m, now) if m is not wanted else None
            if due is None:
                continue
            if due <= now:
                if best is None or m.last_used < best.last_used:
                    best = m
            elif wake is None or due < wake:
                wake = due
        return best, wake

    def _reap(self) -> None:
        """The reaper thread: unload each on_demand model once it has been idle for its keep_alive."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                wake = now + 60.0
                for m in self.models:
                    due = self._idle_since(m, now) if m.entry.load == "on_demand" else None
                    if due is None:
                        continue
                    if due <= now:
                        self._unload(m, reason="keep_alive")
                    else:
                        wake = min(wake, due)
                self._cond.wait(max(0.0, wake - now))

    def _unload(self, m: ChatModel, reason: str) -> None:
        """Under the lock: unload `m`; its loop stops on a thread of its own, its bytes held until then."""
        loop = m._unload()
        log.info("chat_model_unloading", model=m.name, reason=reason, idle_seconds=round(time.monotonic() - m.last_used, 3))
        self._stopping[loop], self._stopping_of[loop] = m.need_bytes, m
        stopper = threading.Thread(target=self._stop_loop, args=(m, loop), name=f"unload-{m.name}", daemon=True)
        self._stoppers = [t for t in self._stoppers if t.is_alive()] + [stopper]
        stopper.start()

    def _stop_loop(self, m: ChatModel, loop: Any) -> None:
        try:
            if self.on_unload is not None:
                try:
                    self.on_unload(m, loop)
                except Exception as exc:  # never keep a loop from stopping
                    log.warning("chat_model_unload_hook_failed", model=m.name, error=str(exc))
            loop.stop(timeout=30.0)
        finally:
            with self._cond:
                self._stopping.pop(loop, None)
                self._stopping_of.pop(loop, None)
                self._cond.notify_all()

    @staticmethod
    def _wait_ready(model: ChatModel, loop: Any, until: float) -> None:
        """Wait (outside the lock) for the model's load to end; its failure or the deadline raised."""
        left = until - time.monotonic()
        if loop.ready:
            return
        try:
            done = loop.wait_loaded(max(0.0, left))
        except BaseException as exc:
            raise NotReady(f"chat model {model.name!r} failed to load: {exc}") from None
        if not done:
            raise DeadlineExceeded(f"model: chat model {model.name!r} is still loading: the request's deadline "
                                   "passed first (the load goes on; a later request finds it loaded)")

    def drain(self, on: bool) -> None:
        for m in self.models:
            m.drain(on)

    def stop(self) -> None:
        """Stop the reaper, every loaded model's loop and the loops still stopping."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            stoppers = list(self._stoppers)
        if self._reaper is not None:
            self._reaper.join(5.0)
        for m in self.models:
            loop = m.loop
            if loop is not None:
                loop.stop()
        for t in stoppers:
            t.join(35.0)

    def stats(self, totals: Callable[[], dict[str, int]] | None = None) -> dict[str, Any]:
        """Admin.Stats' and the gauges' view of every chat model: the default model's figures, the
        requests active and queued in all of them, and `totals()` (the daemon's counters summed
        over the models) in place of the default's own."""
        out = dict(self.default.stats())
        for m in self.models[1:]:
            other = m.stats()
            for key in ("active_requests", "queue_depth", "queue_capacity"):
                out[key] = out.get(key, 0) + other.get(key, 0)
            out["idle"] = out.get("idle", True) and other.get("idle", True)
        if totals is not None:
            out = {k: v for k, v in out.items() if not k.endswith("_total") and not k.startswith("finished_")}
            out.update(totals())
        return out

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """fn(engine) on the default model's engine thread (Admin's suffix cache controls)."""
        return self.default.call(fn, timeout=timeout)

    def loaded_figures(self) -> dict[str, int]:
        """1 per loaded chat model, 0 per unloaded (the edgespec_chat_model_loaded gauge)."""
        return {m.name: int(m.loaded) for m in self.models}
