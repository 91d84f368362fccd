"""Verification of one session's step: its rows of the target forward (node order) made into
the distribution the request samples from (logit_bias and penalties, a grammar's mask), then
the pure verifier for the request's sampling (edgespec/verify.py, edgespec/constraint.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgespec.sampling import logits_to_probs
from edgespec.tree import DraftTree
from edgespec.verify import VerifyResult, verify_greedy, verify_stochastic

if TYPE_CHECKING:
    from edgespec.tick.contract import VerdictSession


def verify(sess: VerdictSession, tree: DraftTree, rows: np.ndarray) -> tuple[VerifyResult, np.ndarray]:
    """`rows`: [len(tree), n_vocab] the target's logits, node order (this session's own: they may
    be adjusted in place). Returns the verdict and the rows it read (what logprobs report)."""
    if sess.adjuster is not None:  # logit_bias and penalties, each node by its own path
        rows = sess.adjuster.rows(rows, tree, sess.tokens[sess.n_prompt:],
                                  inplace=rows.dtype == np.float32 and rows.flags.writeable)
    if sess.matcher is not None:
        # the target's distribution masked by the grammar: row i by the state after node i's
        # path; the drafter drew from q masked alike, so q is verified as it was drawn
        from edgespec.constraint import masked_rows, verify_masked

        masks = sess.matcher.node_bits(tree)
        res = verify_masked(tree, rows, masks, sess.sampling, sess.rng, q_masked=False)
        if sess.req.logprobs is not None:  # logprobs under the distribution sampled from
            rows = masked_rows(rows, masks)
        return res, rows
    if sess.sampling.greedy:
        return verify_greedy(tree, np.argmax(rows, axis=1)), rows
    return verify_stochastic(tree, lambda i: logits_to_probs(rows[i], sess.sampling), sess.rng), rows
