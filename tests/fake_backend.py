"""A fake llama.cpp backend with scripted logits, for fast unit tests of the tick, the KV commit
and the emit logic (the real backend is exercised by the slow tests). The engine over it,
fake_backed_engine(), is the real Engine: only the models and contexts are fakes. (The tests'
one fake engine, for what sits around an engine, is tests/fake_backed_engine.py.)

The fake "model" is a bigram table: the logits after a token depend on that token only, so
every decoding order (plain, chain, tree, batched or alone) must produce the same greedy text;
the fake KV cache keeps cells (position, token, sequence set) like llama.cpp's unified cache, so
the KV invariants are checked for real. Every decode is recorded."""

from __future__ import annotations

import numpy as np

from edgespec.config import EngineConfig, ModelConfig, shared_cells
from edgespec.engine import Engine
from edgespec.kv import SeqRange
from edgespec.slots import Slot, seqs_per_slot

VOCAB = 64
EOS = 1


class FakeModel:
    def __init__(self, table: np.ndarray, path: str = "/fake/model.gguf"):
        self.table = table  # [VOCAB, VOCAB] logits of the next token given the previous one
        self.n_vocab = VOCAB
        self.bos, self.eos = 0, EOS
        self.eog_tokens = (EOS,)
        self.path = path
        self.desc, self.n_params, self.size_bytes = "fake", 1, 1
        self.n_swa = 0  # full attention
        self.weight_types = frozenset({"FAKE"})
        self.ftype = "fake"  # not a type the engine treats as batch-invariant (engine.reuse_chunk)

    def is_eog(self, t: int) -> bool:
        return t == EOS

    def piece(self, t: int) -> bytes:
        # token 2 is the first byte of a 2-byte character (é = c3 a9), token 3 its second
        return {0: b"", 1: b"", 2: b"\xc3", 3: b"\xa9"}.get(t, bytes([ord("a") + t % 26]))

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return ([0] if add_special else []) + [4 + (ord(c) % (VOCAB - 4)) for c in text]

    def detokenize(self, ids) -> str:
        return b"".join(self.piece(t) for t in ids).decode("utf-8", errors="replace")

    def close(self) -> None:
        pass


def piece_model(pieces: list[str]) -> type[FakeModel]:
    """A FakeModel whose token t >= 2 spells pieces[t - 2] (0 BOS, 1 EOS), tokenising text longest
    piece first: a vocabulary a grammar can read (JSON, <think> markers)."""

    class PieceModel(FakeModel):
        def piece(self, t: int) -> bytes:
            return b"" if t < 2 else pieces[t - 2].encode()

        def token_text(self, t: int) -> bytes:
            return {0: b"<s>", 1: b"</s>"}.get(t, b"")

        def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
            out, i = ([0] if add_special else []), 0
            while i < len(text):  # longest piece first
                k = max((j for j, p in enumerate(pieces) if text.startswith(p, i)), key=lambda j: len(pieces[j]))
                out.append(k + 2)
                i += len(pieces[k])
            return out

    return PieceModel


class FakeContext:
    """A unified KV cache of (position, token, sequences) cells and bigram logits."""

    def __init__(self, model: FakeModel, n_ctx: int, n_seq_max: int, n_batch: int = 64):
        self.model = model
        self.n_ctx, self.n_seq_max, self.n_batch, self.n_vocab = n_ctx, n_seq_max, n_batch, VOCAB
        self.cells: list[list] = []  # [pos, token, set(seqs)]
        self.decodes: list[int] = []  # batch size of every decode
        self.decode_seconds = 0.0
        self._rows = np.zeros((0, VOCAB), dtype=np.float32)
        self.aborted = False  # the abort flag (backend.Context.abort): the next decode raises
        self.before_decode = lambda tokens: None  # a test's hook, e.g. to abort mid-tick

    abortable = True

    def abort(self) -> None:
        self.aborted = True

    def clear_abort(self) -> None:
        self.aborted = False

    def decode_rows(self, tokens, positions, seq_ids, logits) -> np.ndarray:
        assert len(tokens) <= self.n_batch * 8
        self.before_decode(tokens)
        if self.aborted:
            from edgespec.errors import ForwardAborted

            raise ForwardAborted(f"forward of {len(tokens)} tokens aborted")
        self.decodes.append(len(tokens))
        for t, p, ss in zip(tokens, positions, seq_ids):
            for s in ss:
                assert 0 <= s < self.n_seq_max, f"seq {s} outside the context's {self.n_seq_max}"
                want = self.pos_max(s) + 1
                assert p == want or any(c[0] == p - 1 and s in c[2] for c in self.cells), \
                    f"seq {s}: position {p} does not follow its cells (max {want - 1})"
            self.cells.append([p, t, set(ss)])
        assert len(self.cells) <= self.n_ctx, "KV cache full"
        out = [self.model.table[t] for t, lg in zip(tokens, logits) if lg]
        self._rows = np.array(out, dtype=np.float32).reshape(-1, VOCAB)
        return self._rows.copy()

    def decode(self, tokens, positions, seq_ids, logits) -> None:
        self.decode_rows(list(tokens), list(positions), list(seq_ids), list(logits))

    def decode_seq(self, tokens, start_pos, seq_ids=(0,), last_logits=True) -> None:
        n = len(tokens)
        if n:
            self.decode(tokens, range(start_pos, start_pos + n), [seq_ids] * n, [False] * (n - 1) + [last_logits])

    def logits(self, i: int) -> np.ndarray:
        return self._rows[i]

    def logits_rows(self, n: int) -> np.ndarray:
        return self._rows[:n]

    def _gc(self) -> None:
        self.cells = [c for c in self.cells if c[2]]

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        lo = 0 if p0 < 0 else p0
        hi = 1 << 62 if p1 < 0 else p1
        for c in self.cells:
            if (seq < 0 or seq in c[2]) and lo <= c[0] < hi:
                c[2].discard(seq) if seq >= 0 else c[2].clear()
        self._gc()

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        lo = 0 if p0 < 0 else p0
        hi = 1 << 62 if p1 < 0 else p1
        for c in self.cells:
            if src in c[2] and lo <= c[0] < hi:
                c[2].add(dst)

    def pos_max(self, seq: int) -> int:
        return max((c[0] for c in self.cells if seq in c[2]), default=-1)

    def pos_min(self, seq: int) -> int:
        return min((c[0] for c in self.cells if seq in c[2]), default=-1)

    def seq_cells(self, seq: int) -> list[tuple[int, int]]:
        """(position, token) of every cell in `seq`, by position (a cell per entry: a position
        held twice appears twice)."""
        return sorted((c[0], c[1]) for c in self.cells if seq in c[2])

    def tokens_of(self, seq: int) -> list[int]:
        return [c[1] for c in sorted((c for c in self.cells if seq in c[2]), key=lambda c: c[0])]

    def seq_state(self, seq: int) -> bytes:
        """backend.Context.seq_state: the (position, token) cells of `seq`, as bytes."""
        return np.asarray(self.seq_cells(seq), dtype=np.int64).tobytes()

    def load_seq_state(self, seq: int, data: bytes) -> None:
        assert self.pos_max(seq) < 0, "load_seq_state needs an empty sequence"
        for p, t in np.frombuffer(data, dtype=np.int64).reshape(-1, 2).tolist():
            self.cells.append([p, t, {seq}])
        assert len(self.cells) <= self.n_ctx, "KV cache full"

    def clear(self) -> None:
        self.cells = []

    def close(self) -> None:
        pass


def bigram_table(seed: int = 0, eos_bias: float = -4.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = rng.normal(0, 3, size=(VOCAB, VOCAB))
    t[:, EOS] += eos_bias
    t[:, 0] = -30  # never BOS
    return t


def fake_backed_engine(parallel: int = 3, n_ctx: int = 256, draft_noise: float = 0.5, max_tree_leaves: int = 8,
                **cfg_changes) -> Engine:
    """The real Engine over fake contexts: the target's bigram table, and a draft that is the same table
    plus noise (so drafts are mostly, not always, right)."""
    table = bigram_table()
    target = FakeModel(table, "/fake/target.gguf")
    draft = FakeModel(table + np.random.default_rng(1).normal(0, draft_noise, table.shape), "/fake/draft.gguf")
    cfg = EngineConfig(ModelConfig("/fake/target.gguf", n_ctx=n_ctx, n_batch=64),
                       ModelConfig("/fake/draft.gguf", n_ctx=n_ctx, n_batch=64), parallel=parallel,
                       max_tree_leaves=max_tree_leaves, **cfg_changes)
    n_seq = seqs_per_slot(parallel, max_tree_leaves)
    tctx = FakeContext(target, shared_cells(parallel, n_ctx), parallel * n_seq)
    dctx = FakeContext(draft, shared_cells(parallel, n_ctx), parallel * n_seq)
    slots = [Slot(i, SeqRange(tctx, i * n_seq, n_seq, n_ctx), SeqRange(dctx, i * n_seq, n_seq, n_ctx))
             for i in range(parallel)]
    eng = Engine(cfg, target, draft, slots, (tctx, dctx))
    eng.goodput.enabled = False  # its decisions follow wall-clock rates: tests/tick/test_goodput.py drives it
    eng.cost.alpha = 0.0  # the fake's forwards take Python's time, not a model's: keep the tables' curves
    return eng
