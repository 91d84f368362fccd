"""The EAGLE-3 drafter over a real target and a tiny trained head: greedy chains and trees drafted
by it and verified against the target's argmax reproduce the target's greedy text exactly, with
the head's KV invariants checked after every step; a drafter that leaves drafted cells behind is
caught by the same check."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import ModelConfig
from edgespec.controller.shapes import Shape
from edgespec.drafters.eagle3 import Eagle3Drafter
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree
from tests.heads.conftest import TRAIN_PROMPTS, synthetic_prompts

pytestmark = pytest.mark.slow

N_SEQ = 16


@pytest.fixture(scope="module")
def pair(demo_pair, tiny_head):
    target = backend.Model(demo_pair.target)
    head = backend.Model(tiny_head["path"])
    cfg = ModelConfig(path=str(demo_pair.target), n_ctx=1024, n_batch=256, threads=1)
    tctx = backend.FeatureContext(target, cfg, backend.target_layer_ids(head), n_seq_max=N_SEQ)
    hctx = backend.HeadContext(head, tctx, cfg, n_seq_max=N_SEQ)
    yield target, tctx, hctx
    hctx.close()
    tctx.close()
    head.close()
    target.close()


def prompt_tokens(target, text: str) -> list[int]:
    return target.tokenize(target.chat_prompt([("user", text)]), add_special=True, parse_special=True)


def plain_greedy(tctx, tokens: list[int], n: int) -> list[int]:
    tctx.clear()
    toks = list(tokens)
    tctx.decode_seq(toks, 0)
    for _ in range(n):
        toks.append(int(np.argmax(tctx.logits(-1))))
        tctx.decode_seq(toks[-1:], len(toks) - 1)
    return toks[len(tokens):]


def speculative_greedy(tctx, drafter: Eagle3Drafter, tokens: list[int], n: int, shape: Shape,
                       check=True) -> tuple[list[int], list[int]]:
    """The harness: the target holds tokens[:-1] in seq 0; each step it decodes [root] + tree in
    one forward (node i in the seqs of the leaves below it), the longest path equal to its argmax
    is kept (plus its bonus token), and the drafter gets the features of the root and the accepted
    nodes. Returns (generated tokens, accepted drafted tokens per step)."""
    tctx.clear()
    toks = list(tokens)
    tctx.decode_seq(toks[:-1], 0, last_logits=False)
    drafter.begin(toks)
    drafter.add_features(tctx.features())
    per_step = []
    while len(toks) - len(tokens) < n:
        L = len(toks)
        tree = DraftTree.root(toks[-1])
        drafter.propose(tree, toks, shape, SamplingParams(), np.random.default_rng(0))
        tree.check()
        leaves, below = tree.leaf_sets()
        assert len(leaves) < N_SEQ
        for li in range(len(leaves)):
            tctx.seq_cp(0, 1 + li, -1, -1)
        tctx.decode(tree.tokens, [L - 1 + d for d in tree.depths],
                    [[1 + li for li in below[i]] for i in range(len(tree))], [True] * len(tree))
        rows = tctx.logits_rows(len(tree))
        node, path = 0, []
        children = tree.children()
        while True:
            best = int(np.argmax(rows[node]))
            nxt = [c for c in children[node] if tree.tokens[c] == best]
            if not nxt:
                break
            node = nxt[0]
            path.append(node)
        bonus = int(np.argmax(rows[node]))
        feats = tctx.features([0] + path)
        # target KV: seq 0 gets the root and the accepted path (a leaf seq below the last node)
        src = 1 + below[node][0]
        tctx.seq_cp(src, 0, L - 1, L + len(path))
        for li in range(len(leaves)):
            tctx.seq_rm(1 + li, -1, -1)
        drafter.accept(tree, path, toks + [tree.tokens[i] for i in path] + [bonus])
        toks += [tree.tokens[i] for i in path] + [bonus]
        drafter.add_features(feats)
        per_step.append(len(path))
        assert tctx.pos_max(0) == len(toks) - 2
        if check:
            drafter.check_kv(toks)
    return toks[len(tokens):][:n], per_step


CHAIN = Shape(mode="chain", depth=4, width=1, nodes=4)
TREE = Shape(mode="tree", depth=4, width=3, nodes=12, expand=2)
N_TOKENS = 40


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculation_reproduces_the_targets_text(pair, shape):
    target, tctx, hctx = pair
    drafter = Eagle3Drafter(hctx)
    prompts = synthetic_prompts(TRAIN_PROMPTS + 1)  # trained-on answers (long acceptances) + one unseen
    accepted = []
    for text in (prompts[0], prompts[1], prompts[TRAIN_PROMPTS]):
        toks = prompt_tokens(target, text)
        ref = plain_greedy(tctx, toks, N_TOKENS)
        out, per_step = speculative_greedy(tctx, drafter, toks, N_TOKENS, shape)
        assert out == ref, f"speculative output differs from plain greedy for {text!r}"
        accepted += per_step
    # the harness must have exercised multi-token acceptance, not only rejections
    assert max(accepted) >= 3, accepted
    assert sum(accepted) / len(accepted) > 0.5


class LeakyDrafter(Eagle3Drafter):
    """A broken twin: forgets to drop the drafted cells after verification."""

    def accept(self, tree, accepted, tokens):
        self._used_seqs = set()


def test_kv_check_rejects_a_drafter_that_leaves_drafted_cells(pair):
    target, tctx, hctx = pair
    toks = prompt_tokens(target, synthetic_prompts(1)[0])
    with pytest.raises(AssertionError, match="seq"):
        speculative_greedy(tctx, LeakyDrafter(hctx), toks, 8, TREE)


def test_propose_needs_the_features_of_every_committed_token(pair):
    target, tctx, hctx = pair
    drafter = Eagle3Drafter(hctx)
    toks = prompt_tokens(target, "Hi")
    tctx.clear()
    tctx.decode_seq(toks[:-2], 0, last_logits=False)
    drafter.begin(toks)
    drafter.add_features(tctx.features())
    with pytest.raises(ValueError, match="add_features"):
        drafter.propose(DraftTree.root(toks[-1]), toks, CHAIN, SamplingParams(), np.random.default_rng(0))


def test_sampled_tree_draws_children_without_replacement(pair):
    target, tctx, hctx = pair
    drafter = Eagle3Drafter(hctx)
    toks = prompt_tokens(target, synthetic_prompts(1)[0])
    tctx.clear()
    tctx.decode_seq(toks[:-1], 0, last_logits=False)
    drafter.begin(toks)
    drafter.add_features(tctx.features())
    tree = DraftTree.root(toks[-1])
    drafter.propose(tree, toks, TREE, SamplingParams(temperature=1.0), np.random.default_rng(1))
    tree.check()  # distinct siblings, q on every node with sampled children
    assert tree.n_draft == TREE.nodes and not any(tree.point[1:])
    d2t_mask = np.isfinite(hctx.logits(0))
    for q in tree.q:
        if q is not None:
            assert abs(q.sum() - 1) < 1e-5 and not q[~d2t_mask].any()  # mass only on the draft vocabulary
    drafter.accept(tree, [], toks)
    drafter.check_kv(toks)


class StaleFeatures(Eagle3Drafter):
    """A broken twin: gets every feature row one position late (the row before the right one),
    as an engine passing the wrong verify rows would."""

    def add_features(self, features):
        prev = getattr(self, "_prev_row", None)
        shifted = features if prev is None else np.concatenate([prev, features[:-1]])
        self._prev_row = features[-1:]
        if prev is None:  # the first (prefill) call: shift within it
            shifted = np.concatenate([features[:1], features[:-1]])
        super().add_features(shifted)


def test_acceptance_depends_on_the_right_feature_rows(pair):
    """Exactness cannot tell a head fed the wrong rows (the target verifies every token), so
    acceptance does: on the head's own training answers the right rows are accepted far more often."""
    target, tctx, hctx = pair
    res = {}
    for name, cls in (("right", Eagle3Drafter), ("stale", StaleFeatures)):
        acc = []
        for text in synthetic_prompts(2):
            toks = prompt_tokens(target, text)
            acc += speculative_greedy(tctx, cls(hctx), toks, N_TOKENS, CHAIN, check=False)[1]
        res[name] = sum(acc) / len(acc)
    assert res["right"] > 0.8 and res["right"] > 1.5 * res["stale"], res
