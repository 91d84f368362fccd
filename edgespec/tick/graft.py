"""Grafts: tokens that join a step's tree at no draft forward, between the drafter and the
target forward. Prompt lookups (the n-gram drafter's, sized by their measured yield and the
tick's verification price) and, under a grammar, the tokens it forces next. Each graft is a
point draft: the verifier decides, so exactness is untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgespec.drafters import NgramDrafter
from edgespec.drafters.ngram import is_ngram
from edgespec.tree import DraftTree

if TYPE_CHECKING:
    from edgespec.tick.contract import GraftSession
    from edgespec.tick.step import Batch, StepRecord

FORCED_MAX = 16  # grammar-forced tokens grafted into one step at most


def forced(sess: GraftSession, st: StepRecord) -> None:
    """Structured output: the tokens the grammar forces after the committed text (a JSON
    schema's `{"` and key names) are drafts the masked target accepts with certainty; they are
    grafted under the root at no draft cost (exact like any draft: the verifier decides)."""
    matcher = sess.matcher
    assert matcher is not None  # called under a constraint only (Session.drafted)
    room = min(sess.remaining - 1, sess.room(), FORCED_MAX)
    toks = matcher.forced(room) if room > 0 else []
    if not toks:
        return
    n = len(st.tree)
    NgramDrafter.graft(st.tree, toks)
    cap_leaves(st.tree, sess.slot.target.n_seq_max)
    st.forced = len(st.tree) > n
    if st.batch is not None:
        st.batch.tokens += len(st.tree) - n


def lookup(sess: GraftSession, st: StepRecord) -> None:
    """The step's prompt lookup: n-gram-only speculation's own tree, or as many lookup tokens
    grafted onto the drafter's tree (or a plain step's root) as pay for their verification."""
    prop, tree = st.lookup, st.tree
    if not prop:
        return
    ngram = sess.ngram
    assert ngram is not None  # only its lookups fill st.lookup (Session.begin_step)
    room = sess.room()
    if st.shape.mode != "plain" and sess.remaining > 1:
        if sess.drafter is None and is_ngram(st.kind):  # n-gram-only speculation: its own tree
            ngram.propose(tree, sess.tokens, st.shape, sess.sampling, sess.rng,
                          limit=None if room >= ngram.max_tokens else max(0, room))
            cap_leaves(tree, sess.slot.target.n_seq_max)
        else:  # graft as many lookup tokens as pay for their verification
            k = min(budget(sess, len(tree), st.kind, st.batch), room)
            if k > 0:
                n = len(tree)
                ngram.graft(tree, prop[:k])
                cap_leaves(tree, sess.slot.target.n_seq_max)
                if st.batch is not None:
                    st.batch.tokens += len(tree) - n
    elif sess.controller is not None:
        # auto mode decoding plainly: graft a lookup when its measured yield pays
        k = min(budget(sess, 1, st.kind, st.batch), room)
        if k > 0:
            ngram.graft(tree, prop[:k])
            st.ngram_only = tree.n_draft > 0
            if st.batch is not None:
                st.batch.tokens += tree.n_draft


def suffix(sess: GraftSession, st: StepRecord) -> None:
    """Graft the suffix cache's continuation tree (edgespec/drafters/suffix.py): as many of its
    nodes (best first) as pay for their place in the verification at the tick's marginal cost;
    in auto mode decoding plainly too (the cache costs no forward)."""
    if sess.remaining <= 1 or (st.shape.mode == "plain" and sess.controller is None):
        return
    sfx = sess.suffix
    assert sfx is not None  # called with the suffix cache on only (Session.drafted)
    prop = sfx.look(sess.tokens)
    if not prop.tokens:
        return
    cost = sess.cost.at(sess.n_past)
    base, unit = len(st.tree), cost.verify_seconds(1)
    if st.batch is not None:
        base, unit = st.batch.tokens, max(st.batch.unit, 1e-9)
    k = sfx.budget(prop, cost, base, unit, room=min(sess.room(), sess.remaining - 1))
    if k <= 0:
        return
    n = len(st.tree)
    sfx.graft(st.tree, prop, k)
    cap_leaves(st.tree, sess.slot.target.n_seq_max)
    if st.shape.mode == "plain":
        st.ngram_only = st.tree.n_draft > 0
    if st.batch is not None:
        st.batch.tokens += len(st.tree) - n


def cap_leaves(tree: DraftTree, n_seq_max: int) -> None:
    """A graft adds a branch (a leaf, a sequence of the slot's range) unless it follows one
    already there; one that does not fit is taken back (the last nodes added)."""
    while len(tree.leaves()) > n_seq_max:
        tree.pop()


def budget(sess: GraftSession, base: int, kind: int = 0, batch: Batch | None = None) -> int:
    """Lookup tokens worth adding to a verification batch of `base` tokens, priced by the
    n-gram drafter's learnt reach (NgramDrafter.budget) in plain-decoding tokens at this
    context. In a tick of several sessions (`batch`) the extra time is what k more tokens add
    to the whole tick's forward, priced in the tick's own seconds per expected token."""
    cost = sess.cost.at(sess.n_past)
    unit = cost.verify_seconds(1)
    if batch is not None:
        base, unit = batch.tokens, max(batch.unit, 1e-9)
    ngram = sess.ngram
    assert ngram is not None
    return ngram.budget(kind, cost, base, unit)
