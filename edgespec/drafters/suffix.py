"""A cross-request suffix cache (after SuffixDecoding, Oliaro et al. 2025): what recent requests
emitted, indexed so that the context's last tokens find every earlier place they occurred, and
what followed there becomes a tree of point drafts scored by how often each continuation
followed. It costs no forward pass, so a likely continuation rides along in a verification
where a draft forward would not pay (repetitive traffic: templated extraction, SQL over one
schema, forms, agent loops re-emitting JSON).

Structure (pure Python + numpy, one instance per engine, driven by the engine thread):

    documents    finished requests' token arrays (the reply, anchored by the prompt's last
                 ANCHOR tokens; or prompt and reply), in one LRU over all partitions
    index        per partition: K-gram -> its most recent occurrences (document, position)
    partitions   one per caller identity by default (a token's name, a certificate's subject;
                 anonymous callers share one): a caller's drafts never come from another's text

Lookup: the context's last K tokens give the occurrences; each is extended backwards to its
match length (up to MATCH_MAX); the occurrences matching at least min(longest, MATCH_ENOUGH)
tokens vote; their continuations form a trie whose node score is the share of votes reaching it,
with one pseudo-vote for a continuation never seen (an empirical P(this continuation | the match):
one earlier occurrence predicts its continuation with 1/2, ten that agree with 10/11). At most
NODES_PER_MATCH nodes per matched token are kept.

Acceptance: what a node's votes say is not what the target does with it. A node's probability of
being accepted is the product, along its path, of learnt conditional acceptances
P(node accepted | its parent accepted), looked up by three features of the node (`_feature`):
how long the context matched, the node's share of its parent's votes (all agree, a majority, a
minority) and how many votes its parent had. Each partition learns these from the shadow
evaluation of every proposal against what the target then emitted (`SuffixDrafter.score`), with
a Beta prior and forgetting. Replayed on the shipped repetitive suite,
a continuation several earlier replies agree on after a match of more than 7 tokens was accepted
0.93-0.99 of the time, a lone earlier reply's 0.89 there and 0.68 after a 3-token match, a
minority continuation 0.15-0.35. The proposal is ordered by
that probability, best first (a node's never exceeds its parent's, so every prefix of the list
is a tree), and the budget grafts the nodes whose probability pays for their verification.

Memory is bounded in bytes by an accounting of what each document, index key and occurrence
holds (the constants below over-estimate CPython's allocations: tests/drafters/test_suffix.py
measures them with tracemalloc); inserting beyond `max_bytes` evicts the least recently used
documents (a document is used when it is inserted or one of its continuations is proposed).

Exactness: every proposal is a point draft, verified by the same verifier as any draft
(edgespec/verify.py): the cache can change the speed, never the output.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

K = 3  # index key: the context's last K tokens
MATCH_MAX = 32  # a match is extended backwards up to this many tokens
MATCH_ENOUGH = 8  # occurrences matching at least this many tokens vote equally
OCCURRENCES = 64  # most recent occurrences kept per key
VOTERS = 32  # occurrences that vote on one proposal at most
DEPTH_MAX = 16  # deepest proposed continuation
NODES_PER_MATCH = 2.0  # a proposal holds at most this many nodes per matched token
ANCHOR = 8  # prompt tokens kept before a stored reply (what the reply's first tokens follow)
MIN_SCORE = 0.05  # nodes voted for by fewer are never proposed
# learnt acceptance: a Beta(PRIOR_ACCEPT, PRIOR_REJECT) prior per feature; the counts are halved
# when a feature's trials reach FORGET (recent traffic weighs most)
PRIOR_ACCEPT = 2.0
PRIOR_REJECT = 2.0
FORGET = 512.0
MATCH_BUCKETS = (3, 5, 7)  # match length buckets: <= 3, <= 5, <= 7, more
EVIDENCE_BUCKETS = (1, 3)  # the parent's votes: 1, 2-3, more
N_FEATURES = (len(MATCH_BUCKETS) + 1) * 3 * (len(EVIDENCE_BUCKETS) + 1)

# accounting, bytes (over-estimates of CPython's allocations; measured in tests/drafters/test_suffix.py)
DOC_BYTES = 240  # a document's record and array header
TOKEN_BYTES = 4  # a stored token (int32)
KEY_BYTES = 240  # an index key: its dict slot, hash int and occurrence list
OCC_BYTES = 48  # one occurrence: a list slot and its int

SNAPSHOT_MAGIC = b"EDGESPEC-SUFFIX-1\n"


@dataclass
class Proposal:
    """Candidate continuation nodes, best first: parents[i] < i (-1: under the root)."""

    tokens: list[int] = field(default_factory=list)  # [n]
    parents: list[int] = field(default_factory=list)  # [n]
    scores: list[float] = field(default_factory=list)  # [n] the share of votes reaching the node
    probs: list[float] = field(default_factory=list)  # [n] learnt P(accepted), non-increasing
    features: list[int] = field(default_factory=list)  # [n] the acceptance feature of each node
    match: int = 0  # matched context tokens
    voters: int = 0  # occurrences that voted

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self, n: int | None = None) -> list[list[int]]:
        """The token path of each of the first n nodes (root excluded)."""
        out: list[list[int]] = []
        for i in range(len(self.tokens) if n is None else n):
            p = self.parents[i]
            out.append((out[p] if p >= 0 else []) + [self.tokens[i]])
        return out


class Acceptance:
    """Learnt P(a node is accepted | its parent was) per feature (`_feature`): Beta-prior counts
    from the shadow evaluation, halved as a feature's trials reach FORGET."""

    __slots__ = ("accepted", "trials")

    def __init__(self) -> None:
        self.accepted = np.full(N_FEATURES, PRIOR_ACCEPT)  # [features]
        self.trials = np.full(N_FEATURES, PRIOR_ACCEPT + PRIOR_REJECT)  # [features]

    def p(self, feature: int) -> float:
        return float(self.accepted[feature] / self.trials[feature])

    def update(self, feature: int, accepted: bool) -> None:
        self.accepted[feature] += accepted
        self.trials[feature] += 1.0
        if self.trials[feature] >= FORGET:
            self.accepted[feature] /= 2.0
            self.trials[feature] /= 2.0


def _feature(match: int, votes: int, parent_votes: int) -> int:
    """A node's acceptance feature: the match length's bucket, its share of the parent's votes
    (all, at least half, less) and the parent's votes' bucket."""
    m = sum(match > b for b in MATCH_BUCKETS)
    share = 2 if votes >= parent_votes else 1 if 2 * votes >= parent_votes else 0
    e = sum(parent_votes > b for b in EVIDENCE_BUCKETS)
    return (m * 3 + share) * (len(EVIDENCE_BUCKETS) + 1) + e


class _Partition:
    __slots__ = ("index", "accept", "hits", "lookups")

    def __init__(self) -> None:
        self.index: dict[int, list[int]] = {}  # key hash -> occurrences (doc id << 16 | pos), oldest first
        self.accept = Acceptance()  # learnt from the shadow evaluation of this partition's proposals
        self.hits = 0
        self.lookups = 0


POS_BITS = 16  # a stored document holds at most 2**16 tokens (its tail beyond is dropped)
POS_MASK = (1 << POS_BITS) - 1


class SuffixCache:
    """The engine's cross-request suffix cache. `max_bytes`: the memory bound; `store`: "output"
    (replies, anchored by their prompt's last ANCHOR tokens) or "prompt_and_output"; `pooled`:
    every caller shares one partition (a timing side channel across callers: docs/appliance.md, threat model)."""

    def __init__(self, max_bytes: int = 64 << 20, store: str = "output", pooled: bool = False):
        if store not in ("output", "prompt_and_output"):
            raise ValueError(f"store must be output or prompt_and_output, got {store!r}")
        self.max_bytes = int(max_bytes)
        self.store = store
        self.pooled = pooled
        self._docs: collections.OrderedDict[int, tuple[str, np.ndarray]] = collections.OrderedDict()  # LRU
        self._parts: dict[str, _Partition] = {}
        self._next_id = 1
        self.bytes = 0
        self.keys = 0
        self.occurrences = 0
        self.inserted = 0  # documents inserted since start
        self.evicted = 0

    # -- identity ---------------------------------------------------------------------------
    def partition_of(self, caller: str) -> str:
        return "" if self.pooled else caller

    def _part(self, caller: str, create: bool) -> _Partition | None:
        name = self.partition_of(caller)
        p = self._parts.get(name)
        if p is None and create:
            p = self._parts[name] = _Partition()
        return p

    # -- updates ----------------------------------------------------------------------------
    def insert(self, caller: str, prompt: list[int] | tuple[int, ...], output: list[int] | tuple[int, ...]) -> None:
        """A request finished: store what it emitted (and, per `store`, its prompt)."""
        if not output:
            return
        head = list(prompt) if self.store == "prompt_and_output" else list(prompt[-ANCHOR:])
        toks = np.asarray(head + list(output), dtype=np.int32)[-POS_MASK:]
        if len(toks) <= K:
            return
        need = self._doc_bytes(len(toks))
        if need > self.max_bytes:
            return
        part = self._part(caller, create=True)
        assert part is not None  # created
        doc = self._next_id
        self._next_id += 1
        self._docs[doc] = (self.partition_of(caller), toks)
        self.bytes += DOC_BYTES + TOKEN_BYTES * len(toks)
        index = part.index
        base = doc << POS_BITS
        for pos, key in enumerate(_keys(toks)):
            occ = index.get(key)
            if occ is None:
                occ = index[key] = []
                self.keys += 1
                self.bytes += KEY_BYTES
            occ.append(base | pos)
            self.occurrences += 1
            self.bytes += OCC_BYTES
            if len(occ) > OCCURRENCES:
                occ.pop(0)
                self.occurrences -= 1
                self.bytes -= OCC_BYTES
        self.inserted += 1
        while self.bytes > self.max_bytes and self._docs:
            self._evict_oldest()

    def _doc_bytes(self, n: int) -> int:
        """An upper bound of what a document of n tokens adds."""
        return DOC_BYTES + TOKEN_BYTES * n + (n - K) * (KEY_BYTES + OCC_BYTES)

    def _evict_oldest(self) -> None:
        doc, (name, toks) = self._docs.popitem(last=False)
        self.bytes -= DOC_BYTES + TOKEN_BYTES * len(toks)
        self.evicted += 1
        part = self._parts.get(name)
        if part is None:
            return
        index = part.index
        for key in set(_keys(toks)):
            occ = index.get(key)
            if occ is None:
                continue
            kept = [o for o in occ if o >> POS_BITS != doc]
            gone = len(occ) - len(kept)
            self.occurrences -= gone
            self.bytes -= gone * OCC_BYTES
            if kept:
                index[key] = kept
            else:
                del index[key]
                self.keys -= 1
                self.bytes -= KEY_BYTES
        if not index and name in self._parts:
            del self._parts[name]

    def clear(self) -> None:
        self._docs.clear()
        self._parts.clear()
        self.bytes = self.keys = self.occurrences = 0

    # -- lookup -----------------------------------------------------------------------------
    def propose(self, caller: str, context: list[int], max_nodes: int = 32, max_depth: int = DEPTH_MAX) -> Proposal:
        """The continuation tree of `context`'s longest earlier matches in the caller's partition."""
        part = self._part(caller, create=False)
        out = Proposal()
        if part is None or len(context) < K or max_nodes <= 0 or max_depth <= 0:
            return out
        part.lookups += 1
        tail = context[-K:]
        occ = part.index.get(hash(tuple(tail)))
        if not occ:
            return out
        ctx = context[-MATCH_MAX:]
        found: list[tuple[int, int, np.ndarray, int]] = []  # (match, doc, tokens, continuation start)
        for o in reversed(occ):
            doc, pos = o >> POS_BITS, o & POS_MASK
            entry = self._docs.get(doc)
            if entry is None:
                continue
            toks = entry[1]
            start = pos + K
            if start >= len(toks) or toks[pos:start].tolist() != tail:
                continue
            m = K
            while m < len(ctx) and pos - (m - K) - 1 >= 0 and toks[pos - (m - K) - 1] == ctx[-m - 1]:
                m += 1
            found.append((m, doc, toks, start))
        if not found:
            return out
        enough = min(max(f[0] for f in found), MATCH_ENOUGH)
        voters = [f for f in found if f[0] >= enough][:VOTERS]
        # the continuations' trie: node -> votes
        kids: dict[int, dict[int, int]] = {-1: {}}
        votes: list[int] = []
        toks_of: list[int] = []
        parent_of: list[int] = []
        depth = min(max_depth, DEPTH_MAX)
        for _, doc, toks, start in voters:
            node = -1
            for t in toks[start:start + depth].tolist():
                nxt = kids[node].get(t)
                if nxt is None:
                    nxt = len(votes)
                    kids[node][t] = nxt
                    kids[nxt] = {}
                    votes.append(0)
                    toks_of.append(t)
                    parent_of.append(node)
                votes[nxt] += 1
                node = nxt
            self._docs.move_to_end(doc)  # used: least recently used goes first
        n = len(voters)
        cap = min(max_nodes, max(1, int(NODES_PER_MATCH * enough)))
        # each node's learnt P(accepted): its parent's times P(accepted | parent accepted)
        accept = part.accept
        prob: list[float] = []
        feat: list[int] = []
        for i in range(len(votes)):  # parents come before their children (trie order)
            p = parent_of[i]
            feat.append(_feature(enough, votes[i], n if p < 0 else votes[p]))
            prob.append((1.0 if p < 0 else prob[p]) * accept.p(feat[-1]))
        # best first, then most voted: a child's probability and votes never exceed its parent's,
        # and on a full tie the stable sort keeps the trie order, so parents come first
        order = sorted(range(len(votes)), key=lambda i: (-prob[i], -votes[i]))
        remap: dict[int, int] = {-1: -1}
        for i in order:
            if len(out.tokens) >= cap:
                break
            if votes[i] / (n + 1) < MIN_SCORE or parent_of[i] not in remap:
                continue
            remap[i] = len(out.tokens)
            out.tokens.append(toks_of[i])
            out.parents.append(remap[parent_of[i]])
            out.scores.append(votes[i] / (n + 1))
            out.probs.append(prob[i])
            out.features.append(feat[i])
        out.match, out.voters = enough, n
        if out.tokens:
            part.hits += 1
        return out

    # -- learnt acceptance (shadow evaluation of proposals against what the target emitted) ---
    def learn(self, caller: str, outcomes: list[tuple[int, bool]]) -> None:
        """(feature, accepted) trials of a proposal the emitted tokens decided."""
        part = self._part(caller, create=False)
        if part is not None:
            for feature, ok in outcomes:
                part.accept.update(feature, ok)

    def acceptance(self, caller: str) -> Acceptance:
        """The caller's partition's learnt acceptance (a fresh prior when it has none)."""
        part = self._part(caller, create=False)
        return part.accept if part is not None else Acceptance()

    # -- reporting --------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "documents": len(self._docs),
            "partitions": len(self._parts),
            "keys": self.keys,
            "occurrences": self.occurrences,
            "inserted": self.inserted,
            "evicted": self.evicted,
            "lookups": sum(p.lookups for p in self._parts.values()),
            "hits": sum(p.hits for p in self._parts.values()),
        }

    # -- persistence ------------------------------------------------------------------------
    def save(self, path: Path, model: str = "") -> int:
        """Write the documents (oldest first) to `path`, checksummed, with the identity of the
        model whose token ids they are (`model`); returns the bytes written. The snapshot holds
        callers' text (their replies, and prompts if stored)."""
        docs = [(name, toks.tolist()) for name, toks in self._docs.values()]
        body = zlib.compress(json.dumps({"store": self.store, "model": model, "docs": docs}).encode())
        digest = hashlib.sha256(body).digest()
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(SNAPSHOT_MAGIC + struct.pack("<Q", len(body)) + digest + body)
        tmp.replace(path)
        return len(SNAPSHOT_MAGIC) + 8 + len(digest) + len(body)

    def load(self, path: Path, max_file_bytes: int | None = None, model: str = "", n_vocab: int | None = None) -> int:
        """Read a snapshot written by `save` (documents re-inserted, oldest first, within
        max_bytes); returns the documents loaded. ValueError, with nothing loaded, when it is not
        one, its checksum fails, it was written for another model than `model`, or a token id is
        outside [0, n_vocab): drafts of another vocabulary's ids would fail every tick they join."""
        raw = Path(path).read_bytes() if max_file_bytes is None else _read_at_most(Path(path), max_file_bytes)
        head = len(SNAPSHOT_MAGIC)
        if not raw.startswith(SNAPSHOT_MAGIC) or len(raw) < head + 40:
            raise ValueError(f"{path}: not a suffix cache snapshot")
        (n,) = struct.unpack("<Q", raw[head:head + 8])
        digest, body = raw[head + 8:head + 40], raw[head + 40:]
        if len(body) != n or hashlib.sha256(body).digest() != digest:
            raise ValueError(f"{path}: checksum mismatch (truncated or altered snapshot)")
        data = json.loads(zlib.decompress(body))
        if not isinstance(data, dict) or not isinstance(data.get("docs", []), list):
            raise ValueError(f"{path}: malformed snapshot")
        if model and data.get("model") != model:
            raise ValueError(f"{path}: written for model {str(data.get('model'))[:200]!r}, not {model!r} (stale)")
        docs = data.get("docs", [])
        for doc in docs:
            if not (isinstance(doc, list) and len(doc) == 2 and isinstance(doc[0], str) and isinstance(doc[1], list)
                    and all(type(t) is int and 0 <= t < (n_vocab if n_vocab is not None else 1 << 31)
                            for t in doc[1])):
                raise ValueError(f"{path}: malformed document or a token id outside the vocabulary "
                                 f"({n_vocab} tokens)")
        for name, toks in docs:
            self._insert_doc("" if self.pooled else name, toks)
        return len(docs)

    def _insert_doc(self, name: str, toks: list[int]) -> None:
        """Re-insert a stored document as it was (its anchor or prompt included), into partition `name`."""
        store, self.store = self.store, "prompt_and_output"
        try:
            self.insert(name, [], toks)
        finally:
            self.store = store


def snapshot_path(model: str = "") -> Path:
    """Where the daemon keeps the cache between runs (speculation.suffix_cache_persist): the state
    directory ($EDGESPEC_HOME, /var/lib/edgespec under systemd); a [[chat]] model's (`model`, its
    name) beside the default model's: its name made a file name's, and a hash of it (names that
    differ only where the file name replaced a character still differ)."""
    from edgespec.config import edgespec_home

    if not model:
        return edgespec_home() / "suffix-cache.snapshot"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)
    return edgespec_home() / f"suffix-cache.{safe}.{hashlib.sha256(model.encode()).hexdigest()[:8]}.snapshot"


def snapshot_limit(max_bytes: int) -> int:
    """The largest snapshot file loaded for a cache of `max_bytes` (a compressed snapshot is far
    smaller than the accounted bytes its documents take)."""
    return 2 * max_bytes + (1 << 20)


def _read_at_most(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return raw


def _keys(toks: np.ndarray) -> list[int]:
    """The index key of every K-gram of `toks` that something follows, by start position (the
    hash of the token tuple; a collision is caught at lookup, which compares the tokens)."""
    t = toks.tolist()
    return [hash(tuple(t[i:i + K])) for i in range(len(t) - K)]


class SuffixDrafter:
    """One request's view of the cache: this step's proposal (`look`), how many of its nodes pay
    for their verification (`budget`, priced like a prompt lookup on the tick's marginal cost),
    the graft onto the step's tree (`graft`), and the shadow evaluation of every proposal against
    the tokens the target then emitted (`score`), which teaches the caller's partition how often
    nodes like these are accepted. Needs no forward (not a `Drafter` of drafters/base.py)."""

    name = "suffix"

    def __init__(self, cache: SuffixCache, caller: str = ""):
        self.cache = cache
        self.caller = caller
        self._pending: list[tuple[int, Proposal]] = []  # (position, proposal) awaiting their fate
        self._at = -1
        self._last = Proposal()

    def look(self, tokens: list[int], max_nodes: int = 32, max_depth: int = DEPTH_MAX) -> Proposal:
        """The proposal for the context `tokens` (computed once per context length)."""
        if self._at == len(tokens):
            return self._last
        prop = self.cache.propose(self.caller, tokens, max_nodes, max_depth)
        self._at, self._last = len(tokens), prop
        if prop.tokens:
            self._pending.append((len(tokens), prop))
        return prop

    @staticmethod
    def expected(prop: Proposal, k: int) -> float:
        """Expected accepted tokens of the proposal's first k nodes (their learnt probabilities)."""
        return sum(prop.probs[:k])

    @staticmethod
    def budget(prop: Proposal, cost, base: int, unit: float, room: int | None = None) -> int:
        """Nodes of `prop` worth adding to a verification of `base` tokens: the k maximising
        E[accepted of the first k] - extra(base, k) / unit, i.e. expected
        extra tokens minus the extra verification priced in `unit` seconds per token (0 if no
        k gains). `room`: the deepest path the context still has room for."""
        best, best_gain, expected = 0, 0.02, 0.0
        depth: list[int] = []
        for k in range(1, len(prop) + 1):
            p = prop.parents[k - 1]
            depth.append(1 if p < 0 else depth[p] + 1)
            if room is not None and depth[-1] > room:
                break
            expected += prop.probs[k - 1]
            gain = expected - cost.extra_seconds(base, k) / unit
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    @staticmethod
    def graft(tree, prop: Proposal, k: int) -> list[int]:  # a DraftTree
        """Add the proposal's first k nodes under the root as point nodes, following existing
        children that already hold their tokens; returns the tree nodes added."""
        at: list[int] = []
        added: list[int] = []
        for i in range(k):
            p = prop.parents[i]
            parent = 0 if p < 0 else at[p]
            tok = prop.tokens[i]
            node = next((c for c in range(1, len(tree)) if tree.parents[c] == parent and tree.tokens[c] == tok), None)
            if node is None:
                node = tree.add(parent, tok, point=True)
                added.append(node)
            at.append(node)
        return added

    def score(self, tokens: list[int]) -> None:
        """Shadow evaluation: a proposal made at a position is compared with the tokens emitted
        after it, once they decide it (a mismatch seen, or its deepest path emitted). Every node
        whose parent lay on the emitted path was a trial of its feature: accepted if it lies on
        the path too. Grafted or not, so the learning does not depend on the budget."""
        keep = []
        for start, prop in self._pending:
            outcomes = trials(prop, tokens[start:])
            if outcomes is None:
                keep.append((start, prop))
            else:
                self.cache.learn(self.caller, outcomes)
        self._pending = keep


def trials(prop: Proposal, got: list[int]) -> list[tuple[int, bool]] | None:
    """The (feature, accepted) trials `got` (the tokens emitted after the proposal's context)
    decides, or None while it does not yet (the emitted path still runs along the proposal)."""
    on_path = {-1}
    node, depth = -1, 0
    while depth < len(got):
        nxt = next((i for i in range(len(prop)) if prop.parents[i] == node and prop.tokens[i] == got[depth]), None)
        if nxt is None:
            break
        on_path.add(nxt)
        node, depth = nxt, depth + 1
    if depth == len(got) and any(prop.parents[i] == node for i in range(len(prop))):
        return None  # the emitted tokens end inside the proposal: its next node is undecided
    return [(prop.features[i], i in on_path) for i in range(len(prop)) if prop.parents[i] in on_path]
