"""Model-free prompt lookup: if the last n tokens occurred earlier in the context, propose what
followed them. Costs no forward pass; pays when the answer copies from the prompt (RAG, JSON
extraction, code edits). Proposals are deterministic (point masses), so they can be grafted onto
any tree: a point candidate is exact under recursive rejection sampling."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from edgespec.drafters.base import DraftReport
from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree

# a request's prompt lookup: at most this many tokens, reach learnt with this EWMA weight
NGRAM_MAX = 8
NGRAM_EWMA = 0.15
# the daemon's pooled reach (ReachPriors): learnt from every request's lookups at this weight,
# for at most this many partitions (the suffix cache's; least recently used first out)
PRIOR_EWMA = 0.02
PRIOR_PARTITIONS = 1024


# a lookup's kind (its index in NgramDrafter.reach): how it matched (NGRAM: the context's last
# n >= n_min tokens occurred before; ONE_TOKEN: only its last token did) plus RELATION_STRIDE
# times how its first token stands to the suffix cache's proposal at that step (drafters/
# suffix.py): NO_SUFFIX (no proposal), AGREES (one of the proposal's first tokens), DISAGREES.
# On repetitive traffic the cache's word is the better one: a one-token lookup that contradicts it
# was accepted 2 % of the time against 31 % with no proposal, an n-gram one 29-45 % against 69 %
# (the repetitive suite at 4 streams); each kind learns its own reach.
NGRAM, ONE_TOKEN = 0, 1
NO_SUFFIX, AGREES, DISAGREES = 0, 1, 2
RELATION_STRIDE = 2
N_KINDS = 6


def kind_of(match: int, relation: int = NO_SUFFIX) -> int:
    return match + RELATION_STRIDE * relation


def is_ngram(kind: int) -> bool:
    """Whether a lookup of this kind matched n >= n_min context tokens (not a one-token guess)."""
    return kind % RELATION_STRIDE == NGRAM


def relation(first: int, suffix_firsts: set[int] | None) -> int:
    """How a lookup whose first token is `first` stands to the suffix cache's proposal, given
    the proposal's first tokens (None or empty: there is none)."""
    if not suffix_firsts:
        return NO_SUFFIX
    return AGREES if first in suffix_firsts else DISAGREES


def default_reach() -> list[list[float]]:
    """The reach a lookup starts from with nothing learnt, per kind (see `kind_of`): with no
    suffix proposal or one that agrees, an n-gram match 0.5 x 0.8^j, a one-token one 0.2 x 0.5^j;
    against the suffix cache's proposal a tenth of those (until measured otherwise)."""
    out = []
    for rel in (NO_SUFFIX, AGREES, DISAGREES):
        scale = 0.1 if rel == DISAGREES else 1.0
        out += [[scale * 0.5 * 0.8 ** j for j in range(NGRAM_MAX)], [scale * 0.2 * 0.5 ** j for j in range(NGRAM_MAX)]]
    return out


class ReachPriors:
    """What prompt lookups achieved in recent requests, per partition: the reach a new request's
    NgramDrafter starts from. A request's own reach learns fast (NGRAM_EWMA) but a short request
    ends before it has learnt much; without a pooled prior every request would graft lookups at
    the optimistic default until its own misses taught it otherwise, and on traffic the lookups
    do not fit that costs verification in every tick. Every settled lookup of every request
    also updates its partition's reach at PRIOR_EWMA (about the last 50 lookups).

    Keyed by the suffix cache's partition (SuffixCache.partition_of: by caller unless pooled):
    acceptance changes latency, so a prior shared across callers would let one caller learn how
    often another's text repeats itself. Engine thread only."""

    def __init__(self, max_partitions: int = PRIOR_PARTITIONS):
        self.max_partitions = max_partitions
        self._reach: OrderedDict[str, list[list[float]]] = OrderedDict()

    def reach(self, partition: str) -> list[list[float]]:
        """The partition's pooled reach (live: NgramDrafter.score updates it), made on first use."""
        r = self._reach.get(partition)
        if r is None:
            r = self._reach[partition] = default_reach()
            while len(self._reach) > self.max_partitions:
                self._reach.popitem(last=False)
        else:
            self._reach.move_to_end(partition)
        return r

    def clear(self) -> None:
        self._reach.clear()

    def flat(self) -> dict[str, float]:
        """For Admin.Stats: partitions held, and the mean first-token reach per kind (`kind_of`)."""
        n = len(self._reach)
        out = {"lookup_prior_partitions": float(n)}
        for kind in range(N_KINDS):
            out[f"lookup_prior_reach_{kind}"] = sum(r[kind][0] for r in self._reach.values()) / n if n else 0.0
        return out


def lookup_all(tokens: list[int], max_len: int, n_max: int = 4, n_min: int = 2,
               branches: int = 1) -> list[list[int]]:
    """Up to `branches` continuations with distinct first tokens, for the longest suffix (n from
    n_max down to n_min) that occurred before; most recent occurrence first."""
    L = len(tokens)
    if L < n_min + 1 or max_len <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # candidate starts: positions i < L - n where arr[i:i+n] == suffix
        hits = np.flatnonzero(arr[: L - n] == suffix[0])
        out: list[list[int]] = []
        firsts: set[int] = set()
        for i in hits[::-1]:
            if i + n < L and np.array_equal(arr[i:i + n], suffix):
                cont = [int(t) for t in arr[i + n: i + n + max_len]]
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    out.append(cont)
                    if len(out) == branches:
                        break
        if out:
            return out
    return []


def lookup(tokens: list[int], max_len: int, n_max: int = 4, n_min: int = 2) -> list[int]:
    """The most recent continuation of the longest matching suffix ([] if none)."""
    found = lookup_all(tokens, max_len, n_max, n_min, 1)
    return found[0] if found else []


class NgramDrafter:
    """One request's prompt lookup: its proposals (`look`, grafted by `propose` or `graft`), and
    how far the target accepts them, learnt from the tokens it then emits (`score`), which prices
    how many lookup tokens a verification may carry (`budget`). It needs no forward: the session
    grafts its proposals onto the step's tree (not a `Drafter` of drafters/base.py)."""

    name = "ngram"

    def __init__(self, max_tokens: int = 8, n_max: int = 4, n_min: int = 2, branches: int = 2,
                 prior: list[list[float]] | None = None):
        self.max_tokens = max_tokens
        self.branches = branches  # continuations proposed at once (distinct first tokens)
        self.n_max = n_max
        self.n_min = n_min
        # P(target accepts > j lookup tokens), learnt per kind of lookup (`kind_of`: how it
        # matched, and how it stands to the suffix cache's proposal); it starts from the pooled
        # reach of recent requests (`prior`, ReachPriors.reach, which it also updates)
        self._prior = prior
        self.reach = [list(r) for r in prior] if prior is not None else default_reach()
        self._pending: list[tuple[int, list[int], int]] = []  # (position, lookup, kind) awaiting their fate

    def look(self, tokens: list[int], suffix_firsts: Callable[[], set[int]] | None = None) -> tuple[list[int], int]:
        """This step's lookup (at most NGRAM_MAX tokens, [] if none) and its kind (`kind_of`);
        kept to be scored against the tokens the target emits after it (`score`).
        `suffix_firsts`: the first tokens of the suffix cache's proposal at this step (asked
        only when there is a lookup), or None when the request has no suffix cache."""
        prop, match = lookup(tokens, NGRAM_MAX, self.n_max, self.n_min), NGRAM
        if not prop and self.n_min > 1:
            prop, match = lookup(tokens, NGRAM_MAX, 1, 1), ONE_TOKEN
        kind = kind_of(match)
        if prop and suffix_firsts is not None:
            kind = kind_of(match, relation(prop[0], suffix_firsts()))
        if prop:
            self._pending.append((len(tokens), prop, kind))
        return prop, kind

    def score(self, tokens: list[int]) -> None:
        """Update P(L > j) from lookups whose fate `tokens` (the context now) settles (shadow
        evaluation: the lookup at a position is compared with the tokens emitted after it)."""
        keep = []
        for start, prop, kind in self._pending:
            got = tokens[start:start + len(prop)]
            match = 0
            while match < len(got) and got[match] == prop[match]:
                match += 1
            if match < len(got) or len(got) == len(prop):  # resolved: a mismatch seen, or all matched
                reach = self.reach[kind]
                pooled = self._prior[kind] if self._prior is not None else None
                for j in range(NGRAM_MAX):
                    hit = 1.0 if match > j else 0.0
                    reach[j] += NGRAM_EWMA * (hit - reach[j])
                    if pooled is not None:
                        pooled[j] += PRIOR_EWMA * (hit - pooled[j])
            else:
                keep.append((start, prop, kind))
        self._pending = keep

    def budget(self, kind: int, cost, base: int, unit: float) -> int:  # a CostModel
        """Lookup tokens of this kind worth adding to a verification of `base` tokens: the
        k <= NGRAM_MAX maximising E[min(L, k)] - extra(base, k) / unit, i.e.
        expected extra tokens minus the extra verification time priced in `unit` seconds per
        token (0 if no k gains). L is how many lookup tokens the target would accept (`reach`)."""
        best, best_gain = 0, 0.02
        expected = 0.0
        for k in range(1, NGRAM_MAX + 1):
            expected += self.reach[kind][k - 1]
            gain = expected - cost.extra_seconds(base, k) / unit
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator, limit: int | None = None) -> DraftReport:
        """Graft the lookup continuation onto `tree`: follow existing children that already hold
        the proposed tokens, then append the rest as a chain of point nodes (after any sibling
        the model proposed, so sampled siblings keep their proposal order)."""
        conts = lookup_all(tokens, self.max_tokens if limit is None else limit, self.n_max, self.n_min,
                           self.branches if limit is None else 1)
        for cont in conts:  # several continuations graft as a tree (shared prefixes merge)
            self.graft(tree, cont)
        return DraftReport()

    @staticmethod
    def graft(tree: DraftTree, cont: list[int]) -> None:
        """Add one continuation under the root as point nodes, following existing children that
        already hold its tokens."""
        node = 0
        for tok in cont:
            existing = next((c for c in range(1, len(tree)) if tree.parents[c] == node and tree.tokens[c] == tok),
                            None)
            node = existing if existing is not None else tree.add(node, tok, point=True)
