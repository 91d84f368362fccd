"""Verify forward: ONE target `llama_decode` holding every decoding session's [root] + tree (a
plain session: its root alone), then the prefill pieces of sessions still reading their prompt.

Each session's tree lives in its slot's sequence range, so the sessions never see each other's
cells. With the patched ggml (tools/patches/), a forward of up to 32 tokens gives every token
the logits a one-token forward would, bit for bit; beyond that ggml's tiled kernel runs, whose
rounding differs in the last bits (a greedy difference then needs a near-tie). Prefill pieces
run as their own forward in the same tick: folded into the verification batch they would push
it past 32 columns, and they cost the same either way (a prefill piece is compute-bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ForwardRecord:
    rows: dict = field(default_factory=dict)  # session -> [its batch entries, vocab] logits
    tokens: int = 0  # verification tokens in the forward
    seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0


def verify_forward(engine, plan) -> ForwardRecord:
    rec = ForwardRecord()
    ctx = engine.target_ctx
    tokens, positions, seqs, spans = [], [], [], []
    for s in plan.decoding:
        t, p, q = s.target_batch()
        spans.append((s, len(tokens), len(t)))
        tokens += t
        positions += p
        seqs += q
    if tokens:
        t0 = time.perf_counter()
        rows = ctx.decode_rows(tokens, positions, seqs, [True] * len(tokens))
        rec.seconds = time.perf_counter() - t0
        rec.tokens = len(tokens)
        for s, at, n in spans:
            rec.rows[s] = rows[at:at + n]
    for s, toks, start in plan.prefill:
        t0 = time.perf_counter()
        s.slot.target.decode_seq(toks, start, (0,), last_logits=False)
        rec.prefill_seconds += time.perf_counter() - t0
        rec.prefill_tokens += len(toks)
        s.prefill_done(len(toks))
    return rec
