"""[[chat]] entries as configured (every problem named by its field) and the chat models' memory
rule (chat_models.ChatModels) on stand-in loops: load on first use, unload an idle model past its
keep_alive to make room, never one in use, and a wait bounded by the request's deadline."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace as NS

import pytest

from edgespec.errors import DeadlineExceeded, NotReady
from edgespec.server.chat_models import ChatModel, ChatModels
from edgespec.server.config import DEMO_DRAFT, InvalidConfig, load


def _toml(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_entries_are_checked_and_every_problem_names_its_field(tmp_path):
    with pytest.raises(InvalidConfig) as e:
        load(_toml(tmp_path, """
[[chat]]
name = "a b"
colour = 1
[chat.target]
n_ctx = 5
rpc_servers = ["h:1"]
[chat.speculation]
draft_tokens = "many"
[[chat]]
load = "later"
[chat.target]
path = "/nowhere/x.gguf"
"""), env={})
    keys = {k for k, _ in e.value.problems}
    assert {"chat[0].name", "chat[0].colour", "chat[0].target.n_ctx", "chat[0].target.rpc_servers",
            "chat[0].speculation.draft_tokens", "chat[0].target.path", "chat[1].load", "chat[1].name",
            "chat[1].target.path"} <= keys, e.value.problems
    with pytest.raises(InvalidConfig) as e:
        load(_toml(tmp_path, "chat = 3\n"), env={})
    assert e.value.problems[0][0] == "chat"


def test_an_entry_takes_its_own_model_and_speculation_over_the_top_level_sections(tmp_path, demo_pair):
    cfg = load(_toml(tmp_path, f"""
[speculation]
draft_tokens = 6
[[chat]]
name = "twin"
keep_alive = 5
[chat.target]
path = "{DEMO_DRAFT}"
n_ctx = 256
[chat.draft]
enabled = false
[chat.speculation]
tree_nodes = 8
"""), env={})
    default, twin = cfg.chat_entries()
    assert default.name == "SmolLM2-135M-Instruct.F32" and default.load == "start"
    assert default.engine.draft is not None and default.keep_alive == 300.0  # [models] keep_alive
    assert twin.name == "twin" and twin.load == "on_demand" and twin.keep_alive == 5.0
    assert twin.engine.target.path == str(demo_pair.draft)  # a bare name: the models directory's
    assert twin.engine.target.n_ctx == 256 and twin.engine.draft is None
    assert (twin.speculation.draft_tokens, twin.speculation.tree_nodes) == (6, 8)
    with pytest.raises(InvalidConfig) as e:  # the default's own name is taken
        load(_toml(tmp_path, f'[[chat]]\nname = "{default.name}"\n[chat.target]\npath = "{DEMO_DRAFT}"\n'), env={})
    assert e.value.problems[0][0] == "chat[0].name"


def test_sighup_rereads_each_entrys_speculation(tmp_path, demo_pair):
    from edgespec.server.config import reload_config

    text = f'[[chat]]\nname = "twin"\n[chat.target]\npath = "{DEMO_DRAFT}"\n[chat.speculation]\ntree_nodes = 8\n'
    path = _toml(tmp_path, text)
    cfg = load(path, env={})
    path.write_text(text.replace("tree_nodes = 8", "tree_nodes = 4"))
    assert reload_config(cfg, env={}).chat[0].speculation.tree_nodes == 4


class StandInLoop:
    """An EngineLoop's lifecycle: started, loaded after `load_seconds`, stopped (`stopping` set as
    its stop begins; the stop returns once `may_stop` is set)."""

    def __init__(self, load_seconds: float = 0.0):
        self.load_seconds = load_seconds
        self.loaded = threading.Event()
        self.stopped_ = False
        self.error = None
        self.stopping = threading.Event()
        self.may_stop = threading.Event()
        self.may_stop.set()

    def start(self):
        timer = threading.Timer(self.load_seconds, self.loaded.set)
        timer.daemon = True
        timer.start()
        return self

    def wait_loaded(self, timeout=None):
        return self.loaded.wait(timeout)

    @property
    def ready(self):
        return self.loaded.is_set() and not self.stopped_

    def stop(self, timeout=None):
        self.stopping.set()
        self.may_stop.wait(timeout)
        self.stopped_ = True

    def stats(self):
        return {"active_requests": 0}

    def drain(self, on):
        pass


def _models(load_seconds: float = 0.0, keep_alive: float = 0.0, budget: int = 150,
            more: tuple[tuple[str, str, float], ...] = ()):
    """Models a (start) and b (on_demand) of 100 bytes each, with `more` (name, load, keep_alive)."""
    loops: list[StandInLoop] = []

    def model(name: str, load: str, need: int, keep: float = keep_alive) -> ChatModel:
        entry = NS(name=name, load=load, keep_alive=keep, engine=NS(parallel=1))

        def make(first: bool) -> StandInLoop:
            loops.append(StandInLoop(load_seconds))
            return loops[-1]

        return ChatModel(entry, make, need)

    return ChatModels([model("a", "start", 100), model("b", "on_demand", 100),
                       *(model(n, load, 100, keep) for n, load, keep in more)],
                      budget_bytes=budget, load_wait=5.0), loops


def test_a_model_loads_on_first_use_and_an_idle_one_makes_room():
    models, loops = _models()
    a, b = models.by_name["a"], models.by_name["b"]
    assert not a.ready and b.ready  # before the start: a model loaded at start is not serving yet
    models.start()
    assert models.loaded_figures() == {"a": 1, "b": 0}
    with models.use(b, None):  # a is idle and past its keep_alive (0): it goes
        assert models.loaded_figures() == {"a": 0, "b": 1} and loops[0].stopped_
    with models.use(a, None):
        assert models.loaded_figures() == {"a": 1, "b": 0}
    assert (a.loads, a.unloads, b.loads, b.unloads) == (2, 1, 1, 1)
    assert models.loaded_bytes() <= models.budget_bytes


def test_a_model_in_use_or_within_its_keep_alive_is_never_unloaded_and_the_wait_ends_at_the_deadline():
    models, _ = _models(keep_alive=60.0)
    models.start()
    a, b = models.by_name["a"], models.by_name["b"]
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="model"):  # a used just now: within its keep_alive
        models.acquire(b, time.monotonic() + 0.2)
    assert 0.2 <= time.monotonic() - started < 2 and models.loaded_figures() == {"a": 1, "b": 0}
    assert b.uses == 0  # the failed wait holds nothing
    models, _ = _models(keep_alive=0.0)
    models.start()
    a, b = models.by_name["a"], models.by_name["b"]
    with models.use(a, None):  # in use: not unloaded, whatever its keep_alive
        with pytest.raises(DeadlineExceeded):
            models.acquire(b, time.monotonic() + 0.1)
    got = threading.Event()
    with models.use(a, None):  # released meanwhile: the waiting request gets the memory
        t = threading.Thread(target=lambda: (models.acquire(b, time.monotonic() + 5), got.set()))
        t.start()
        time.sleep(0.1)
        assert not got.is_set()
    t.join(5)
    assert got.is_set() and models.loaded_figures() == {"a": 0, "b": 1}


def test_a_slow_stop_of_an_unloaded_model_holds_no_other_request_and_its_memory_until_it_ends():
    """a is unloaded to make room for b while c (loaded, within its keep_alive) keeps serving: a's
    engine thread stops outside the lock, so a request for c goes past at once, and a's bytes are
    held until its stop ends, so b loads only then (budget 250: two models of 100 at a time)."""
    models, loops = _models(budget=250, more=(("c", "on_demand", 60.0),))
    models.start()
    a, b, c = (models.by_name[n] for n in "abc")
    with models.use(c, None):
        pass
    a_loop = loops[0]
    a_loop.may_stop.clear()
    b_got, c_got = threading.Event(), threading.Event()
    try:
        threading.Thread(target=lambda: (models.acquire(b, None), b_got.set()), daemon=True).start()
        assert a_loop.stopping.wait(5)  # a, idle past its keep_alive (0), is being stopped for b
        threading.Thread(target=lambda: (models.acquire(c, None), c_got.set()), daemon=True).start()
        assert c_got.wait(5), "a request for a loaded model waited for another model's stop"
        assert not b_got.is_set() and not b.loaded  # a's bytes still count: b would overcommit
        assert models.loaded_bytes() == 200 and c.loaded and not a.loaded
    finally:
        a_loop.may_stop.set()
    assert b_got.wait(5) and models.loaded_figures() == {"a": 0, "b": 1, "c": 1}
    assert models.loaded_bytes() == 200 <= models.budget_bytes
    models.release(b)
    models.release(c)
    models.stop()


def test_an_idle_on_demand_model_unloads_after_its_keep_alive_with_memory_to_spare():
    """keep_alive 0.05 s, memory for all: b (on_demand) unloads once idle that long and loads again
    on its next request; a (loaded at start) stays loaded, and so does d (keep_alive -1)."""
    models, loops = _models(keep_alive=0.05, budget=1000, more=(("d", "on_demand", -1.0),))
    unloading: list[tuple[str, bool]] = []  # the hook (a suffix-cache snapshot) runs before the loop stops
    models.on_unload = lambda m, loop: unloading.append((m.name, loop.stopping.is_set()))
    models.start()
    a, b, d = (models.by_name[n] for n in "abd")
    with models.use(d, None):
        pass
    with models.use(b, None):
        b_loop = loops[-1]
        time.sleep(0.2)  # in use: never unloaded, however long it runs
        assert b.loaded and not b_loop.stopping.is_set()
    assert b_loop.stopping.wait(5)  # idle past its keep_alive: the reaper unloads it
    deadline = time.monotonic() + 5
    while models.loaded_bytes() != 200 and time.monotonic() < deadline:  # its stop done: bytes given back
        time.sleep(0.01)
    assert models.loaded_figures() == {"a": 1, "b": 0, "d": 1} and models.loaded_bytes() == 200
    assert (a.unloads, b.unloads, d.unloads) == (0, 1, 0) and unloading == [("b", False)]
    with models.use(b, None):  # and loads again on demand
        assert b.loaded and b.loads == 2
    models.stop()
    assert not models._reaper.is_alive()


def test_a_model_loads_again_only_once_its_unload_has_saved_and_stopped():
    """A request for a model whose unload still runs (its on_unload hook, the suffix-cache
    snapshot, still writing) waits for it: a load begun before would read the snapshot before it
    was written, and the next unload would overwrite it without what the model had learnt."""
    models, loops = _models(keep_alive=0.05, budget=1000)
    saving, saved = threading.Event(), threading.Event()
    models.on_unload = lambda m, loop: (saving.set(), saved.wait(5))
    models.start()
    b = models.by_name["b"]
    with models.use(b, None):
        pass
    assert saving.wait(5)  # idle past its keep_alive: the reaper unloads b, which saves
    got = threading.Event()
    threading.Thread(target=lambda: (models.acquire(b, None), got.set()), daemon=True).start()
    time.sleep(0.2)
    assert not got.is_set() and not b.loaded and len(loops) == 2  # no second loop of b while the first saves
    saved.set()
    assert got.wait(5) and b.loaded and b.loads == 2 and loops[1].stopped_
    models.release(b)
    with pytest.raises(DeadlineExceeded, match="still unloading"):  # and the wait ends at the deadline
        saving.clear()
        saved.clear()
        deadline = time.monotonic() + 5
        while b.loaded and time.monotonic() < deadline:
            time.sleep(0.01)
        assert saving.wait(5)
        models.acquire(b, time.monotonic() + 0.1)
    saved.set()
    models.stop()


def test_a_load_longer_than_the_deadline_is_a_deadline_error_and_goes_on():
    models, loops = _models(load_seconds=0.5, budget=1000)
    models.start()
    b = models.by_name["b"]
    with pytest.raises(DeadlineExceeded, match="still loading"):
        models.acquire(b, time.monotonic() + 0.05)
    with models.use(b, time.monotonic() + 5):  # the same load, finished
        assert b.loads == 1 and b.ready


def test_a_failed_load_is_not_ready_and_the_next_request_tries_again():
    models, loops = _models(budget=1000)
    models.start()
    b = models.by_name["b"]

    def failing(first):
        loop = StandInLoop()
        loop.error = RuntimeError("bad file")
        loop.start = lambda: loop
        loop.wait_loaded = lambda timeout=None: (_ for _ in ()).throw(loop.error)
        return loop

    b._make_loop = failing
    with pytest.raises(NotReady, match="failed to load"):
        models.acquire(b, None)
    assert not b.loaded and b.uses == 0


def _echo(name: str):
    async def app(scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name.encode() + b":" + body})

    return app


def _dispatch(models: ChatModels, admitted=lambda scope: True, max_body_bytes: int = 1 << 16):
    from starlette.testclient import TestClient

    from edgespec.server.chat_routing import ModelDispatch, error_app

    app = ModelDispatch(models, {"a": _echo("a"), "b": _echo("b")}, max_body_bytes=max_body_bytes,
                        admitted=admitted, error=error_app)
    return TestClient(app)


def test_the_http_dispatch_routes_by_model_and_hands_the_body_on_unchanged():
    models, _ = _models(budget=1000, keep_alive=60.0)
    models.start()
    client = _dispatch(models)
    body = b'{"model": "b", "messages": []}'
    r = client.post("/v1/chat/completions", content=body)
    assert r.text == "b:" + body.decode() and models.loaded_figures() == {"a": 1, "b": 1}
    assert models.by_name["b"].uses == 0  # given back as the answer ended
    assert client.post("/v1/completions", content=b'{"model": "nope"}').text.startswith("a:")  # a answers (or 404s)
    assert client.get("/v1/models").text == "a:"  # not a chat route: the default app's


def test_a_refused_caller_or_an_oversized_body_never_loads_a_model():
    models, _ = _models(budget=1000)
    models.start()
    r = _dispatch(models, admitted=lambda scope: False).post("/v1/chat/completions", content=b'{"model": "b"}')
    assert r.text.startswith("a:") and models.loaded_figures() == {"a": 1, "b": 0}  # the API answers 401
    big = b'{"model": "b", "x": "' + b"y" * 2000 + b'"}'
    r = _dispatch(models, max_body_bytes=1000).post("/v1/chat/completions", content=big)
    assert r.text == "a:" + big.decode() and models.loaded_figures() == {"a": 1, "b": 0}  # the API answers 413


def test_a_load_past_the_requests_timeout_is_a_504_over_http():
    models, _ = _models(load_seconds=30.0, budget=1000)
    models.start()
    r = _dispatch(models).post("/v1/chat/completions",
                               content=b'{"model": "b", "edgespec": {"timeout_seconds": 0.05}}')
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    r = _dispatch(models).post("/v1/messages", content=b'{"model": "b", "edgespec": {"timeout_seconds": 0.05}}')
    assert r.status_code == 504 and r.json()["type"] == "error", r.text  # Anthropic's error shape there
    assert models.by_name["b"].uses == 0
