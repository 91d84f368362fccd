"""Verify forward: ONE target `llama_decode` holding every decoding session's [root] + tree (a
plain session: its root alone) and the prefill pieces of sessions still reading their prompt,
sized beside the verification's tokens (schedule.pieces); a piece that ends its prompt brings
the request's first step along (Session.first_step_batch).

Each session's tree lives in its slot's sequence range, so the sessions never see each other's
cells. On a CPU the patched ggml (tools/patches/) makes every forward batch-invariant: each
token's logits and cells are the bits it would get decoded alone, whatever else shares the
forward, how many tokens it holds and where the shared cache put its cells. So nothing is split
for exactness: verification and prefill pieces share one forward (llama.cpp runs it as n_batch
pieces when it holds more), and a prompt's cells are the same whatever pieces it was read in,
alone or beside other streams.

With an EAGLE-3 head as the draft the target context is a FeatureContext: every forward's
features (the inputs of three target layers, per token, gathered over its llama_decode calls) go
to the sessions: a verification's before `finish_step` picks the accepted rows
(`Session.verified_features`), a prefill piece's with the piece (`Session.prefill_done`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from edgespec.tick.schedule import Piece, Plan, first_bare, pieces

if TYPE_CHECKING:
    from edgespec import backend
    from edgespec.tick.contract import TargetBatch, TickEngine, TickSession

# where one step's entries sit in the forward: (session, first entry, entries)
Span = tuple["TickSession", int, int]


@dataclass
class ForwardRecord:
    rows: dict[TickSession, np.ndarray] = field(default_factory=dict)  # session -> [its entries, vocab] logits
    tokens: int = 0  # verification tokens in the forward
    seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    first_tokens: int = 0  # the first steps' tokens, read after the pieces that ended their prompts
    # session -> its first step's (logits rows [entries, vocab], features or None)
    first: dict[TickSession, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)


def verify_forward(engine: TickEngine, plan: Plan) -> ForwardRecord:
    rec = ForwardRecord()
    ctx = engine.target_ctx
    tokens: list[int] = []
    positions: list[int] = []
    seqs: list[list[int]] = []
    spans: list[Span] = []
    for s in plan.decoding:
        _lay(spans, s, s.target_batch(), tokens, positions, seqs)
    n_verify = len(tokens)
    riders = list(pieces(engine, plan, n_verify))  # prefill pieces in the same forward (logits off)
    if not tokens and not riders:
        return rec
    # a piece that ends its prompt takes the request's first step after it (plain or auto: the
    # prompt's last token and what the prompt lookups and the suffix cache graft on it), logits
    # on: the first tokens come from the forward that read the prompt, as from a one-shot prefill.
    # The piece's cells join every sequence the step's tree lays out (the root's), as the
    # context's earlier cells were copied into them.
    first: dict[TickSession, TargetBatch] = {}
    bare: bool | None = None
    for s, toks, start in riders:
        if start + len(toks) == s.n_prompt - 1 and s.fuses_first:
            if bare is None:
                bare = first_bare(engine, plan)
            first[s] = s.first_step_batch(bare)
    _append(riders, tokens, positions, seqs, {s: batch[2][0] for s, batch in first.items()})
    n_read = len(tokens)
    spans_first: list[Span] = []
    for s, batch in first.items():
        _lay(spans_first, s, batch, tokens, positions, seqs)
    t0 = time.perf_counter()
    rows = ctx.decode_rows(tokens, positions, seqs,
                           [True] * n_verify + [False] * (n_read - n_verify) + [True] * (len(tokens) - n_read))
    dt = time.perf_counter() - t0
    # a FeatureContext's (an EAGLE-3 head drafts): every token's target features
    feats = cast("backend.FeatureContext", ctx).collected() if engine.features else None
    if n_verify:
        rec.seconds, rec.tokens = dt, n_verify
        for s, at, n in spans:
            rec.rows[s] = rows[at:at + n]
            if feats is not None:
                s.verified_features(feats[at:at + n])
        _done(riders, rec, 0.0, None if feats is None else feats[n_verify:n_read])
    else:
        _done(riders, rec, dt, None if feats is None else feats[:n_read])
    rec.first_tokens = len(tokens) - n_read
    for s, at, n in spans_first:
        row = at - n_read + n_verify  # logits rows: the verification's, then the first steps'
        rec.first[s] = (rows[row:row + n], None if feats is None else feats[at:at + n])
    return rec


def _lay(spans: list[Span], s: TickSession, batch: TargetBatch, tokens: list[int], positions: list[int],
         seqs: list[list[int]]) -> None:
    """One step's (tokens, positions, seqs) into the forward; its span (session, at, n) noted."""
    t, p, q = batch
    spans.append((s, len(tokens), len(t)))
    tokens += t
    positions += p
    seqs += q


def _append(group: list[Piece], tokens: list[int], positions: list[int], seqs: list[list[int]],
            shared: dict[TickSession, list[int]] | None = None) -> None:
    """The pieces' tokens, in their slots' main sequences; `shared`: session -> the sequences its
    first step's root is in (the piece's cells join them too; the main one first, which is the
    one a query's attention reads by)."""
    for s, toks, start in group:
        main = s.slot.target.base
        ids = [main]
        if shared and s in shared:
            ids += [q for q in shared[s] if q != main]
        tokens += toks
        positions += range(start, start + len(toks))
        seqs += [ids] * len(toks)


def _done(group: list[Piece], rec: ForwardRecord, seconds: float, feats: np.ndarray | None = None) -> None:
    """The group's pieces are in the cache; `feats`: their features, in the group's order."""
    rec.prefill_seconds += seconds
    at = 0
    for s, toks, _ in group:
        rec.prefill_tokens += len(toks)
        s.prefill_done(len(toks), None if feats is None else feats[at:at + len(toks)])
        at += len(toks)
