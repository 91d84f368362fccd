"""Verify forward: ONE target `llama_decode` holding every decoding session's [root] + tree (a
plain session: its root alone), then the prefill pieces of sessions still reading their prompt.

Each session's tree lives in its slot's sequence range, so the sessions never see each other's
cells. With the patched ggml (tools/patches/), a forward of up to EXACT_COLUMNS tokens gives every
token the logits a one-token forward would, bit for bit; beyond that ggml's tiled kernel runs,
whose rounding differs (by up to ~1e-2 in the logits: a greedy difference at a near-tie). So on a
CPU the verification of a tick with more tokens than that runs as consecutive llama_decode calls
of EXACT_COLUMNS tokens (`Engine.verify_chunk`; each writes its cells before the next reads them,
and a node always comes after its parent), which costs a little more than one tiled forward and
keeps every request's output what it would be alone. Prefill pieces join the verification
forward only while it stays within EXACT_COLUMNS; small pieces of several prompts share one
forward under the same bound; a larger piece runs as its own forward in the same tick (it is
compute-bound: it costs the same either way), on a CPU in calls of EXACT_COLUMNS tokens too, so a
prompt's cells are the same whatever pieces it was read in, alone or beside other streams.

With an EAGLE-3 head as the draft the target context is a FeatureContext: every forward's
features (the inputs of three target layers, per token, gathered over its llama_decode calls) go
to the sessions: a verification's before `finish_step` picks the accepted rows
(`Session.verified_features`), a prefill piece's with the piece (`Session.prefill_done`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EXACT_COLUMNS = 32  # the patched kernel's column limit (tools/patches/ggml-cpu-small-batch.patch)


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
    n_verify = len(tokens)
    groups = _pack(plan.prefill, n_verify)
    if tokens or groups[0]:
        riders = groups.pop(0)  # prefill pieces riding in the verification forward (logits off)
        _append(riders, tokens, positions, seqs)
        t0 = time.perf_counter()
        rows = ctx.decode_rows(tokens, positions, seqs, [True] * n_verify + [False] * (len(tokens) - n_verify),
                               chunk=engine.verify_chunk)
        dt = time.perf_counter() - t0
        rec.seconds, rec.tokens = dt, n_verify
        feats = ctx.collected() if engine.features else None
        for s, at, n in spans:
            rec.rows[s] = rows[at:at + n]
            if feats is not None:
                s.verified_features(feats[at:at + n])
        _done(riders, rec, 0.0, None if feats is None else feats[n_verify:])
    else:
        groups.pop(0)
    for group in groups:
        tokens, positions, seqs = [], [], []
        _append(group, tokens, positions, seqs)
        t0 = time.perf_counter()
        ctx.decode_rows(tokens, positions, seqs, [False] * len(tokens), chunk=engine.verify_chunk)
        _done(group, rec, time.perf_counter() - t0, ctx.collected() if engine.features else None)
    return rec


def _pack(pieces: list, n_verify: int) -> list[list]:
    """Prefill pieces into forwards: [those riding with the verification], then the others, small
    ones sharing a forward while it holds at most EXACT_COLUMNS tokens."""
    groups: list[list] = [[]]
    room = EXACT_COLUMNS - n_verify if n_verify else 0
    shared, shared_n = [], 0
    for piece in pieces:
        n = len(piece[1])
        if n <= room:
            groups[0].append(piece)
            room -= n
        elif n <= EXACT_COLUMNS and shared_n + n <= EXACT_COLUMNS:
            shared.append(piece)
            shared_n += n
        else:
            groups.append([piece])
    if shared:
        groups.append(shared)
    return groups


def _append(group: list, tokens: list, positions: list, seqs: list) -> None:
    for s, toks, start in group:
        main = [s.slot.target.base]
        tokens += toks
        positions += range(start, start + len(toks))
        seqs += [main] * len(toks)


def _done(group: list, rec: ForwardRecord, seconds: float, feats=None) -> None:  # noqa: ANN001
    """The group's pieces are in the cache; `feats`: their features, in the group's order."""
    rec.prefill_seconds += seconds
    at = 0
    for s, toks, _ in group:
        rec.prefill_tokens += len(toks)
        s.prefill_done(len(toks), None if feats is None else feats[at:at + len(toks)])
        at += len(toks)
