"""Which drafter a request drafts with, when the engine holds two (a draft model and an EAGLE-3
head): the one whose chains promise the tick it joins more tokens per second.

For each drafter k, with its own learnt acceptance a_k (the cross-request prior of the requests
that drafted with it, top-1 rates by depth) and its own measured forward curve D_k, the request
is priced inside the tick it joins: L sessions decoding with it, the L - 1 others taken as plain,
m_k of them already drafting with k (their forwards absorb its batch: one forward per level).

    E_k(d)     = 1 + sum_{j<=d} prod_{i<=j} a_k[i]              expected tokens of a chain of d
    seconds(d) = V(L + d) + D'_k(1) + (d - 1) * (D'_k(1) + row_k)  one target forward, d draft levels
    D'_k(n)    = D_k(m_k + n) - D_k(m_k)  (D_k(n) when m_k = 0)  its share of the drafter's forward
    speedup_k  = max_d [(L - 1 + E_k(d)) / seconds(d)] / [L / V(L)] / spec_bias_k

What a drafter costs once, before its first proposal, counts too, spread over the request's
`max_tokens` (plain decoding's share of the tick, V(L) / L a token, over the speed-up above):
the prompt prefill the target must compute again because that drafter cannot use the slot's
kept prefill (a head needs the target's features of every token it has not absorbed), and the
drafter's own catch-up over the prompt tokens it does not hold:

    T_k = max_tokens * (V(L) / L) / speedup_k + once_k,   chosen: the smallest T_k

Alone (L = 1) the per-token part is the chain part of the controller's own estimate. Under load the target's
forward is shared, so each verified token costs a small share of it, while a draft model's
forward stays whole: a cheap head that is right less often can then be worth more than an
accurate draft model, and the other way round alone. Chains stand in for the shapes the
controller may then choose (trees, runner-ups): the comparison between drafters is what counts.
Pure: no engine, no llama.cpp.

Exploration: a drafter chosen for fewer than `min_requests` requests is tried first (its prior
is still the default), and every `explore_every`-th choice takes the runner-up, so both priors
keep following the traffic; but only a runner-up whose estimate is within `explore_within` of
the best: one its costs rule out at this load (a draft model's whole forwards, and its catch-up
over a prompt, beside three other streams) is not tried on a request that would pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_REQUESTS = 2  # requests each drafter is tried on before the estimates decide
EXPLORE_EVERY = 16  # every this many choices go to the runner-up
EXPLORE_WITHIN = 0.85  # ... when its estimate is at least this share of the best one
MAX_DEPTH = 8  # the longest chain considered


def estimate(acceptance: list[float], cost, load: int, sharing: int = 0, spec_bias: float = 1.0) -> float:
    """Expected speedup of the tick over plain decoding when one of its `load` sessions drafts
    chains with a drafter of top-1 acceptance `acceptance[depth - 1]` and forward curve
    `cost.draft_seconds` (a CostModel.drafting view), `sharing` sessions already drafting with it."""
    L = max(1, load)
    verify = cost.verify_seconds
    d = cost.draft_seconds
    m = max(0, sharing)
    first = d(m + 1) - d(m) if m else d(1)
    plain = L / verify(L)
    best, e, reach = 0.0, 1.0, 1.0
    for depth, a in enumerate(acceptance[:MAX_DEPTH], start=1):
        reach *= a
        e += reach
        secs = verify(L + depth) + first + (depth - 1) * (first + cost.draft_row)
        best = max(best, (L - 1 + e) / secs)
    return best / plain / max(spec_bias, 1e-6)


@dataclass
class DrafterChoice:
    """The per-request choice between drafters; one per engine, confined to its thread."""

    min_requests: int = MIN_REQUESTS
    explore_every: int = EXPLORE_EVERY
    explore_within: float = EXPLORE_WITHIN
    choices: int = 0
    chosen: dict = field(default_factory=dict)  # drafter -> requests it was chosen for
    last: dict = field(default_factory=dict)  # drafter -> the last choice's estimated speedup

    def estimate(self, prior, cost, load: int, sharing: int) -> float:
        """estimate() for a drafter's AcceptancePrior (its top-1 rates) and cost view."""
        a = [row[0] for row in prior.view(MAX_DEPTH, 1)]
        return estimate(a, cost, load, sharing, prior.spec_bias)

    def choose(self, options: dict, load: int, sharing: dict, tokens: int = 0, once: dict | None = None) -> str:
        """options: drafter -> (its AcceptancePrior, its cost view); `load`: sessions decoding
        once this request joins; sharing: drafter -> sessions already drafting with it;
        `tokens`: the request's max_tokens; once: drafter -> seconds it costs before its first
        proposal (prefill lost, catch-up). The estimates kept in `last` are speed-ups over plain
        decoding of the whole request (its one-off costs included)."""
        names = list(options)
        self.choices += 1
        fresh = [k for k in names if self.chosen.get(k, 0) < self.min_requests]
        est = {k: self.estimate(p, c, load, sharing.get(k, 0)) for k, (p, c) in options.items()}
        if tokens > 0 and once:
            L = max(1, load)
            for k, (_, c) in options.items():
                plain = tokens * c.verify_seconds(L) / L
                est[k] = plain / (plain / est[k] + max(0.0, once.get(k, 0.0)))
        self.last = est
        top = max(est.values())
        near = [k for k in names if est[k] >= self.explore_within * top]  # worth trying at this load
        fresh = [k for k in fresh if k in near]
        if fresh:
            pick = min(fresh, key=lambda k: (self.chosen.get(k, 0), names.index(k)))
        else:
            ranked = sorted(near, key=lambda k: -est[k])
            pick = ranked[1] if len(ranked) > 1 and self.choices % self.explore_every == 0 else ranked[0]
        self.chosen[pick] = self.chosen.get(pick, 0) + 1
        return pick
