"""Learn the target's n-gram table (edgespec/drafters/table.py) from its own answers.

The target answers synthetic prompts greedily: code tasks, JSON extraction, clause summaries,
context-grounded questions and open chat, built from fixed templates and from text every Python
installation carries (the standard library's sources and its LICENSE), so the same machine gets
the same prompts every time. The bench suites are never used. Decoding runs `batch` sequences per
target forward (one llama.cpp context, one sequence id each), which makes generation several
times faster than one request at a time.
"""

from __future__ import annotations

import random
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgespec import backend
from edgespec.config import ModelConfig
from edgespec.drafters.table import NgramTable

NOUNS = ("a stack", "a queue", "a binary search", "a CSV parser", "an LRU cache", "a rate limiter",
         "a matrix multiply", "a URL parser", "a word counter", "a prime sieve", "a JSON validator",
         "a date formatter", "a retry decorator", "a linked list", "a trie", "merge sort",
         "a bank account class", "a temperature converter", "a palindrome check", "a file walker")
LANGS = ("Python", "JavaScript", "Go", "Rust", "C", "Java", "SQL", "Bash")
TOPICS = ("photosynthesis", "the French revolution", "how vaccines work", "compound interest", "black holes",
          "the water cycle", "machine learning", "healthy sleep", "the stock market", "climate change",
          "the immune system", "electric cars", "the internet", "volcanoes", "democracy", "coffee",
          "time management", "the moon landing", "recycling", "inflation")
EXTRACT = ("Extract every name, date, number and product from this text as a JSON object:\n",
           "Return a JSON list of the key facts in this text:\n",
           "Convert this into JSON with fields title, summary, entities:\n")
CLAUSE = ("Summarize this clause in plain English:\n", "Continue this contract clause:\n",
          "What obligations does this clause create?\n")
QUESTIONS = ("What is this about?", "What does it require?", "Which terms are defined?", "What is the main point?")
CHAT = ("Tell me about ", "Explain ", "Write a short essay on ", "Give me five facts about ",
        "What should I know about ")


class PromptMaker:
    """Deterministic synthetic prompts (given the seed and this Python's standard library)."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        lib = Path(sysconfig.get_paths()["stdlib"])
        self.code = sorted(str(p) for p in lib.glob("*.py"))
        lic = lib / "LICENSE.txt"
        self.legal = [str(lic)] if lic.is_file() else self.code[:1]

    def _snippet(self, files: list[str], lo: int = 200, hi: int = 500) -> str:
        r = self.rng
        for _ in range(20):
            try:
                text = Path(r.choice(files)).read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue
            if len(text) >= lo:
                start = r.randrange(0, max(1, len(text) - hi))
                return text[start:start + r.randint(lo, hi)]
        return "The parties agree to the terms set out below."

    def __call__(self) -> str:
        r = self.rng
        k = r.random()
        if k < 0.25:
            if r.random() < 0.5:
                return f"Write {r.choice(NOUNS)} in {r.choice(LANGS)}."
            return "Explain what this code does and improve it:\n" + self._snippet(self.code)
        if k < 0.45:
            return r.choice(EXTRACT) + self._snippet(self.code + self.legal)
        if k < 0.6:
            return r.choice(CLAUSE) + self._snippet(self.legal)
        if k < 0.8:
            ctx = self._snippet(self.code + self.legal)
            return f"Answer using only the context.\nContext:\n{ctx}\nQuestion: {r.choice(QUESTIONS)}"
        return r.choice(CHAT) + r.choice(TOPICS) + "."


def generate_answers(model: backend.Model, n_tokens: int, *, batch: int = 16, max_answer: int = 160,
                     threads: int = 0, seed: int = 0,
                     progress: Callable[[int, int], None] = lambda done, total: None) -> list[list[int]]:
    """Greedy answers of `model` to synthetic prompts until `n_tokens` answer tokens exist; each
    returned sequence is prompt + answer (the table learns from both)."""
    make = PromptMaker(seed)
    ctx = backend.Context(model, ModelConfig(path=str(model.path), n_ctx=batch * (512 + max_answer + 32), n_batch=512, threads=threads),
                          n_seq_max=batch)
    out: list[list[int]] = []
    done = 0
    try:
        while done < n_tokens:
            ctx.clear()
            seqs: list[list[int]] = []
            n_prompt: list[int] = []
            for s in range(batch):
                toks = model.tokenize(model.chat_prompt([("user", make())]), True, True)[:512]
                ctx.decode_seq(toks, 0, (s,), last_logits=True)
                seqs.append(toks + [int(np.argmax(ctx.logits(-1)))])
                n_prompt.append(len(toks))
            live = list(range(batch))
            for _ in range(max_answer - 1):
                live = [s for s in live if not model.is_eog(seqs[s][-1])]
                if not live:
                    break
                ctx.decode([seqs[s][-1] for s in live], [len(seqs[s]) - 1 for s in live], [(s,) for s in live],
                           [True] * len(live))
                nxt = np.argmax(ctx.logits_rows(len(live)), axis=1)
                for j, s in enumerate(live):
                    seqs[s].append(int(nxt[j]))
            for s, seq in enumerate(seqs):
                if model.is_eog(seq[-1]):
                    seq.pop()
                out.append(seq)
                done += len(seq) - n_prompt[s]
            progress(min(done, n_tokens), n_tokens)
    finally:
        ctx.close()
    return out


def build_table(target_path: Path, out: Path, n_tokens: int = 40_000, *, threads: int = 0, seed: int = 0,
                log: Callable[[str], None] = lambda s: None) -> NgramTable:
    model = backend.Model(target_path)
    t0 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 5 or done >= total:
            last[0] = now
            log(f"n-gram table: {done}/{total} answer tokens ({done / max(now - t0, 1e-9):.0f} tok/s)")

    try:
        seqs = generate_answers(model, n_tokens, threads=threads, seed=seed, progress=progress)
        table = NgramTable.build(seqs, model.n_vocab, model.desc)
    finally:
        model.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    log(f"n-gram table: {len(table)} contexts -> {out} ({time.perf_counter() - t0:.0f} s)")
    return table
