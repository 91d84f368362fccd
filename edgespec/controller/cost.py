"""CostModel: seconds of one target (verification) or draft forward as a function of its batch size.

Measured on the machine it runs on: `calibrate()` times a few batch sizes at load; every tick's
timed forwards then refine the curves online (`OnlineCurve`): the curve used is the start-up
calibration times a per-size level (slow: what calibration got wrong at that size, the host's
usual load) times a recent factor (fast: how much slower the machine runs now than usual, from
the last few forwards of any size). Both are medians of windows of ratios measured / calibrated:
they follow a host whose speed changes within a few ticks and ignore a single slowed forward.
Between calibrated sizes the time is piecewise linear;
beyond the largest it extrapolates linearly at the slope of the last doubling (the last segment's
where that is steeper: a dip at the last size must not price every wider forward like it). Lookups
follow the curve's lower envelope from the right (a size costs at most what any larger size costs:
`widths.py`): T(n) need not grow with n (a GPU's CUDA graphs and kernel switches, a CPU's
K-quant kernels, which take 4, 8 or 16 tokens at a time), and n tokens are priced at the cheapest
forward that holds them, padded up to it (`pad_to` names that width). The table itself keeps each
size's own time (the fastest of calibration's rounds): a slow timing of a small size never raises
a larger one's price (the envelope comes from the right), and `pad_to` needs the real dips to pad
from the first forward on; a size's own forwards correct it online.

Context: a target forward at a longer context than calibration's costs more, because attention
reads every cached token of a query's sequence for every query token (both the one-token cost and
the cost of each extra verified token grow with the context length). The curves
describe the calibration context; `ContextFit` adds d * (per_context + per_context_each * (n - 1))
for d tokens of context beyond it, both rates fitted online from the timed forwards (least squares
over EWMA statistics). `at(context)` is the model as seen from one request's current context.
A tick of S sessions holds S sequences in one forward: ggml's attention skips the cells a query's
mask hides, so each query reads its own sequence's cells, not all S sequences' (ggml-cpu's flash
attention `continue`s on a -inf mask entry). With d the context of all S together beyond
calibration's and the n tokens spread evenly, the extra is d * (per_context + per_context_each *
(n - S) / S): a plain tick (n = S) pays each sequence's one-token cost once; `at(context,
sessions)`.

One per engine, shared by its requests, confined to the engine thread.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable

from edgespec.controller.widths import envelope, pad_to, stable_width

KINDS = ("target", "draft", "head")
# the drafter kinds a session may draft with: a draft model's forwards ("draft") or an EAGLE-3
# head's ("head"); `CostModel.drafting(kind)` prices one of them as the draft
DRAFTERS = ("draft", "head")

# Placeholders until calibrate(): the measured CPU curves (2 threads, SmolLM2-135M; F32 target,
# Q4_0 draft), seconds per forward by batch size.
DEFAULT_TABLES: dict[str, dict[int, float]] = {
    "target": {1: 0.036, 2: 0.036, 4: 0.047, 8: 0.065, 16: 0.080},
    "draft": {1: 0.011, 2: 0.015, 4: 0.022, 8: 0.036, 16: 0.064},
    "head": {1: 0.0018, 2: 0.0019, 4: 0.0021, 8: 0.0026, 16: 0.0036},
}


class _Curve:
    """Piecewise-linear seconds(n) over sorted sizes (immutable: OnlineCurve makes new ones)."""

    __slots__ = ("sizes", "secs", "_mono", "_cache")

    def __init__(self, table: dict[int, float]):
        if not table:
            raise ValueError("empty cost table")
        items = sorted((int(n), float(s)) for n, s in table.items())
        if items[0][0] < 1 or any(s <= 0 for _, s in items):
            raise ValueError(f"cost table needs sizes >= 1 and seconds > 0, got {table!r}")
        self.sizes = [n for n, _ in items]
        self.secs = [s for _, s in items]
        self._refresh()

    def _refresh(self) -> None:
        self._mono = list(envelope(dict(zip(self.sizes, self.secs))).values())  # non-decreasing
        self._cache: dict[int, float] = {}

    def _weights(self, n: int) -> list[tuple[int, float]]:
        """[(index, weight)] of the table entries whose weighted sum is the value at n."""
        sz = self.sizes
        if len(sz) == 1:
            return [(0, n / sz[0])]  # one point: proportional
        if n <= sz[0]:
            return [(0, 1.0)]
        i = bisect_left(sz, n)
        if i < len(sz) and sz[i] == n:
            return [(i, 1.0)]
        if i >= len(sz):  # beyond the table: see _extrapolate
            return []
        lo, hi = sz[i - 1], sz[i]
        w = (n - lo) / (hi - lo)
        return [(i - 1, 1.0 - w), (i, w)]

    def _extrapolate(self, n: int, secs: list[float]) -> float:
        """`secs` beyond the last size: linear at the steeper of the last segment's slope and the
        slope over the last doubling (from the largest size at most half the last). A CPU's
        K-quant kernels make T(16) about T(12) and T(32) about T(28); extrapolated from that last
        segment, every wider forward would cost what the last size does."""
        sz, last = self.sizes, len(self.sizes) - 1
        j = max((k for k in range(last) if sz[k] * 2 <= sz[last]), default=0)
        slopes = [(secs[last] - secs[k]) / (sz[last] - sz[k]) for k in {j, last - 1}]
        return secs[last] + max(0.0, *slopes) * (n - sz[last])

    def __call__(self, n: int) -> float:
        v = self._cache.get(n)
        if v is None:
            v = self._at(n, self._mono)
            self._cache[n] = v
        return v

    def _at(self, n: int, secs: list[float]) -> float:
        if len(self.sizes) > 1 and n > self.sizes[-1]:
            v = self._extrapolate(n, secs)
        else:
            v = sum(w * secs[i] for i, w in self._weights(n))
        return max(v, self._mono[0] * 0.5)  # never extrapolate to ~0 or below

    def raw(self, n: int) -> float:
        """Seconds of a forward of exactly n tokens, unpadded (the table itself, interpolated)."""
        return self._at(n, self.secs)

    def as_dict(self) -> dict[str, float]:
        """The values lookups use (non-decreasing), by table size."""
        return {str(n): round(s, 7) for n, s in zip(self.sizes, self._mono)}


def _median(xs) -> float:
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class OnlineCurve:
    """A calibrated curve followed online: seconds(n) = calibrated(n) * level(n) * recent.

    Each timed forward of n tokens gives a ratio r = measured / calibrated(n), filed under its
    nearest calibrated size (on a log scale). `level(b)` is the median of the last LONG ratios at
    size b (sizes with fewer than MIN_OBS: the median of the last LONG ratios of every size):
    what calibration got wrong at that size, and the host's usual load. `recent` is the median
    of the last RECENT ratios, each divided by its size's current level: how much slower or
    faster than usual the host runs right now, learnt from forwards of any size (a plain tick's
    one token prices the speculative sizes too). Medians: a step in the host's speed is followed
    after RECENT // 2 + 1 forwards, and one forward slowed 10x by another tenant moves nothing."""

    RECENT = 9
    LONG = 31
    MIN_OBS = 3

    def __init__(self, calib: _Curve):
        self.calib = calib
        self.recent: deque[tuple[int, float]] = deque(maxlen=self.RECENT)  # (size index, ratio)
        self.long: deque[float] = deque(maxlen=self.LONG)
        self.per_size: list[deque[float]] = [deque(maxlen=self.LONG) for _ in calib.sizes]
        self.n = 0  # observations
        self.curve = calib
        self._levels = [1.0] * len(calib.sizes)
        self._recent = 1.0
        self._host = 1.0

    def _nearest(self, n: int) -> int:
        sz = self.calib.sizes
        i = bisect_left(sz, n)
        if i == 0:
            return 0
        if i >= len(sz):
            return len(sz) - 1
        return i if (sz[i] / n) < (n / sz[i - 1]) else i - 1

    @property
    def host_factor(self) -> float:
        """Measured / calibrated seconds right now (the usual level times the recent deviation)."""
        return self._host

    def observe(self, n: int, seconds: float) -> None:
        r = seconds / self.calib.raw(n)  # against n's own calibrated time, not the envelope's
        b = self._nearest(n)
        self.per_size[b].append(r)
        self.long.append(r)
        self.recent.append((b, r))
        self.n += 1
        k = self.MIN_OBS
        usual = _median(self.long) if len(self.long) >= k else 1.0
        self._levels = [_median(w) if len(w) >= k else usual for w in self.per_size]
        self._recent = _median([x / self._levels[i] for i, x in self.recent]) if len(self.recent) >= k else 1.0
        self._host = usual * self._recent
        self.curve = _Curve({size: sec * lv * self._recent
                             for size, sec, lv in zip(self.calib.sizes, self.calib.secs, self._levels)})

    def as_dict(self) -> dict:
        return {"host_factor": round(self.host_factor, 4), "recent": round(self._recent, 4),
                "level": {str(n): round(f, 4) for n, f in zip(self.calib.sizes, self._levels)}}


class ContextFit:
    """seconds(n, d) - curve(n) ~ d * (one + each * (n - 1)): the extra a target forward over n
    tokens costs at d tokens of context beyond calibration's. Least squares on EWMA-weighted
    sufficient statistics (a small ridge keeps it defined), rates clamped at >= 0."""

    # the fit learns from forwards at least this far beyond the calibration context (where the
    # context's share dominates); nearer ones refine the curves, net of the fit's estimate
    MIN_D = 512

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self.sxx = [[0.0, 0.0], [0.0, 0.0]]
        self.sxr = [0.0, 0.0]
        self.one = 0.0  # seconds per context token, one query token
        self.each = 0.0  # seconds per context token, per extra query token
        self.observations = 0

    def extra(self, n: int, d: int, sessions: int = 1) -> float:
        """Seconds d tokens of context beyond calibration's add to a forward of n tokens spread
        over `sessions` sequences (d: all of theirs together)."""
        s = max(1, sessions)
        return d * (self.one + self.each * max(0, n - s) / s) if d > 0 else 0.0

    def observe(self, n: int, d: int, residual: float, sessions: int = 1) -> None:
        s = max(1, sessions)
        if d < self.MIN_D * s:  # the context's share dominates only where each sequence is long
            return
        if self.observations >= 8:  # one slowed forward (another tenant, a page fault) is not a rate
            residual = min(residual, 3.0 * self.extra(n, d, s) + 0.002)
        x = (float(d), float(d * max(0, n - s) / s))
        a = self.alpha if self.observations else 1.0
        for i in range(2):
            self.sxr[i] += a * (x[i] * residual - self.sxr[i])
            for j in range(2):
                self.sxx[i][j] += a * (x[i] * x[j] - self.sxx[i][j])
        self.observations += 1
        (p, q), (_, r) = self.sxx
        ridge = 1e-3 * (p + r) + 1e-12
        p, r = p + ridge, r + ridge
        det = p * r - q * q
        one = (r * self.sxr[0] - q * self.sxr[1]) / det
        each = (p * self.sxr[1] - q * self.sxr[0]) / det
        if one < 0 or each < 0:  # refit with the negative rate at 0
            one, each = (max(0.0, self.sxr[0] / p), 0.0) if each < 0 else (0.0, max(0.0, self.sxr[1] / r))
        self.one, self.each = one, each

    def as_dict(self) -> dict:
        return {"per_context_token_us": round(self.one * 1e6, 4), "per_context_token_each_extra_us":
                round(self.each * 1e6, 4), "observations": self.observations}


class _AtContext:
    """A CostModel's lookups at one context length, of one sequence or of `sessions` together
    (target forwards only: the draft works on a bounded window)."""

    def __init__(self, model: CostModel, d: int, sessions: int = 1):
        self._m, self._d, self._s = model, d, sessions

    def verify_seconds(self, n: int) -> float:
        return self._m.verify_seconds(n) + self._m.ctx.extra(n, self._d, self._s)

    def extra_seconds(self, base: int, k: int) -> float:
        ctx = self._m.ctx
        return self._m.extra_seconds(base, k) + ctx.extra(base + k, self._d, self._s) - ctx.extra(base, self._d, self._s)

    def curve(self, kind: str) -> Callable[[int], float]:
        if kind == "target":
            return self.verify_seconds
        return self._m.curve(kind)

    def seconds(self, kind: str, n: int) -> float:
        return self.curve(kind)(n)

    def drafting(self, kind: str):
        """This view with drafter `kind`'s forwards as the draft (CostModel.drafting)."""
        return _drafting(self, kind)

    def __getattr__(self, name: str):  # draft_seconds, expand_seconds, ...
        return getattr(self._m, name)


def _drafting(base, kind: str):
    """`base` (a CostModel or its view at a context) with drafter `kind`'s forwards as the draft:
    itself for the draft model's."""
    if kind not in DRAFTERS:
        raise ValueError(f"drafter kind must be one of {DRAFTERS}, got {kind!r}")
    return base if kind == "draft" else _Drafting(base, kind)


class _Drafting:
    """A CostModel (or its view at a context) that prices `kind`'s forwards as the draft: a
    session drafting with the EAGLE-3 head sees the head's curve in draft_seconds /
    expand_seconds / draft_row, one drafting with the draft model the draft model's."""

    def __init__(self, base, kind: str):
        self._b, self.kind = base, kind

    @property
    def draft_row(self) -> float:
        return self._b.row_seconds(self.kind)

    def draft_seconds(self, n: int) -> float:
        return self._b.curve(self.kind)(n)

    def expand_seconds(self, n: int) -> float:
        return self._b.curve(self.kind)(n) + (n - 1) * self.draft_row

    def at(self, context: int, sessions: int = 1) -> _Drafting:
        return _Drafting(self._b.at(context, sessions), self.kind)

    def drafting(self, kind: str):
        return _drafting(self._b, kind)

    def __getattr__(self, name: str):  # verify_seconds, extra_seconds, curve, version, ...
        return getattr(self._b, name)


class CostModel:
    """target/draft forward seconds by batch size. `version` changes on every update (cache key)."""

    def __init__(self, alpha: float = 0.1, tables: dict[str, dict[int, float]] | None = None):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        tables = tables or DEFAULT_TABLES
        self._online = {k: OnlineCurve(_Curve(tables.get(k) or DEFAULT_TABLES[k])) for k in KINDS}
        self._curves = {k: o.curve for k, o in self._online.items()}
        self.calibrated = False
        self.measured: set[str] = set()  # the kinds calibrate() timed on this machine
        self.observations = {k: 0 for k in KINDS}
        self.version = 0
        # seconds each output row beyond the first adds to a draft forward (its output head): a
        # catch-up of n tokens needs the last token's logits, a tree expansion of n nodes all n;
        # per drafter kind (row_seconds)
        self.rows = {k: 0.0 for k in DRAFTERS}
        self.calib_context = 0  # tokens of context the curves were measured at
        # the fixed widths every forward is padded into (backend.Context, `[speculation]
        # pad_forwards`): pad_to rounds up into them; None: forwards run at their own width
        self.widths: tuple[int, ...] | None = None
        # the kinds whose forwards the backend pads to `pad_to`'s width (engine.pad_forwards): a
        # forward of n tokens is timed at that width, and `observe` files it there
        self.padded: set[str] = set()
        self.ctx = ContextFit(alpha)

    @property
    def draft_row(self) -> float:
        return self.rows["draft"]

    @draft_row.setter
    def draft_row(self, value: float) -> None:
        self.rows["draft"] = value

    def row_seconds(self, kind: str) -> float:
        """Seconds each output row beyond the first adds to a forward of drafter `kind`."""
        return self.rows.get(kind, 0.0)

    def drafting(self, kind: str) -> CostModel:
        """This model with drafter `kind`'s forwards as the draft ("draft": itself)."""
        return _drafting(self, kind)

    def at(self, context: int, sessions: int = 1) -> CostModel:
        """The model for a forward whose batch follows `context` cached tokens: those of one
        sequence, or of `sessions` sequences together (a tick's)."""
        d = context - max(1, sessions) * self.calib_context
        if d <= 0 or (self.ctx.one == 0.0 and self.ctx.each == 0.0):
            return self
        return _AtContext(self, d, max(1, sessions))  # type: ignore[return-value]

    @classmethod
    def from_tables(cls, target: dict[int, float], draft: dict[int, float], alpha: float = 0.1) -> CostModel:
        m = cls(alpha, {"target": target, "draft": draft})
        m.calibrated = True
        return m

    def calibrate(
        self,
        measure: Callable[[str, int], float],
        sizes: Iterable[int] = (1, 2, 4, 8, 16, 32),
        kinds: Iterable[str] = ("target", "draft"),
        draft_row: float | dict[str, float] | None = None,
        context: int = 0,
    ) -> None:
        """measure(kind, batch) -> seconds of ONE forward (a draft forward with the last token's
        logits only) after `context` cached tokens. Replaces the tables of `kinds`; `draft_row`
        sets the draft's extra seconds per additional output row (a number: the draft model's;
        a dict: per drafter kind)."""
        if draft_row is not None:
            rows = draft_row if isinstance(draft_row, dict) else {"draft": draft_row}
            for k, v in rows.items():
                if v is not None:
                    self.rows[k] = max(0.0, float(v))
        self.calib_context = context
        sizes = tuple(sizes)
        for kind in kinds:
            if kind not in KINDS:
                raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
            self.measured.add(kind)
            secs = {n: float(measure(kind, n)) for n in sizes}
            self._online[kind] = OnlineCurve(_Curve(secs))
            self._curves[kind] = self._online[kind].curve
        self.calibrated = True
        self.version += 1

    def verify_seconds(self, n: int) -> float:
        """Seconds of one target forward over n tokens (n = nodes + 1)."""
        return self._curves["target"](n)

    def extra_seconds(self, base: int, k: int) -> float:
        """What k more tokens add to a target forward over `base`: the online curve's difference,
        but never less than the start-up calibration's difference times the host factor. Each
        size's online level is a median of its own forwards, so a level measured high at a small
        size (forwards at longer contexts, a slow minute) flattens the non-decreasing curve above
        it, and tokens there would look free; calibration timed every size alike, in isolation."""
        if k <= 0:
            return 0.0
        online = self._online["target"]
        floor = (online.calib(base + k) - online.calib(base)) * online.host_factor
        return max(self.verify_seconds(base + k) - self.verify_seconds(base), floor)

    def draft_seconds(self, n: int) -> float:
        """Seconds of one draft forward over n tokens with the last one's logits (a catch-up)."""
        return self._curves["draft"](n)

    def expand_seconds(self, n: int) -> float:
        """Seconds of one draft forward over n tree nodes, each needing its logits."""
        return self._curves["draft"](n) + (n - 1) * self.draft_row

    def curve(self, kind: str) -> Callable[[int], float]:
        """The memoised seconds(n) lookup of `kind` (valid until the next update)."""
        return self._curves[kind]

    def pad_to(self, n: int, kind: str = "target", widths: Iterable[int] | None = None) -> int:
        """The width a forward of n tokens runs at for the price `curve(kind)(n)` quotes: n, or a
        wider measured size that costs less (widths.pad_to). `widths`: a fixed set (a GPU's,
        widths.WIDTHS) the forward is always rounded up into, the cheapest of them that holds n;
        by default the model's own `widths` (set where the backend pads forwards)."""
        c = self._curves[kind]
        widths = self.widths if widths is None else widths
        if widths is None:
            return pad_to(n, c.raw, c.sizes)
        ws = tuple(widths)
        base = stable_width(n, ws)
        return pad_to(base, c.raw, ws) if base in ws else base

    def seconds(self, kind: str, n: int) -> float:
        return self._curves[kind](n)

    def calibrated_seconds(self, kind: str, n: int) -> float:
        """The start-up calibration's seconds for a forward of n tokens (before online refinement)."""
        return self._online[kind].calib(n)

    def observe(self, kind: str, n: int, seconds: float, context: int | None = None, sessions: int = 1) -> None:
        """Online refinement from one timed forward of batch n (OnlineCurve; alpha 0 turns it
        off). A target forward whose sequences (`sessions` of them, `context` cached tokens
        together) reach well beyond calibration's context refines the context fit instead
        (with alpha, its EWMA weight)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if n < 1 or not seconds > 0 or self.alpha == 0.0:
            return
        if kind in self.padded:
            # the forward ran at the width pad_to names: filed under n, a padded forward's time
            # would teach n's own size that it costs what the wider one does, and the next
            # forward of n would run unpadded at n's real price
            n = self.pad_to(n, kind)
        if kind == "target" and context is not None:
            s = max(1, sessions)
            d = context - s * self.calib_context
            if d >= ContextFit.MIN_D * s:
                # a long context teaches the fit only: refining the curve from it too would let
                # the curve absorb what the context costs (both would learn from one residual)
                self.ctx.observe(n, d, seconds - self._curves[kind](n), s)
                self.observations[kind] += 1
                self.version += 1
                return
            seconds = max(seconds - self.ctx.extra(n, d, s), 0.5 * seconds)
        online = self._online[kind]
        online.observe(n, seconds)
        self._curves[kind] = online.curve
        self.observations[kind] += 1
        self.version += 1

    def observe_step(self, verify_tokens: int, verify_seconds: float, draft_batches: Iterable[int],
                     draft_seconds: float, context: int | None = None) -> None:
        """Online refinement from one engine step: its verification forward, and its draft time
        split over the draft forwards in proportion to their predicted times. Forward 1 is the
        catch-up; later ones expand tree nodes, whose extra output rows are taken off before they
        refine the (catch-up) draft curve."""
        if verify_tokens >= 1 and verify_seconds > 0:
            self.observe("target", verify_tokens, verify_seconds, context)
        batches = tuple(draft_batches)
        if not batches or not draft_seconds > 0:
            return
        preds = [self.draft_seconds(b) if i == 0 else self.expand_seconds(b) for i, b in enumerate(batches)]
        total = sum(preds)
        for i, (b, pr) in enumerate(zip(batches, preds)):
            share = draft_seconds * pr / total
            self.observe("draft", b, share if i == 0 else share - (b - 1) * self.draft_row)

    def host_factor(self, kind: str = "target") -> float:
        """Measured / calibrated seconds of the recent forwards of `kind` (1: as at start-up)."""
        return self._online[kind].host_factor

    def flat(self) -> dict[str, float]:
        """The curves as flat numbers (Admin.Stats' tick_totals map): per kind the host factor
        and, per calibrated size n, the seconds used now and those of the start-up calibration
        (cost_target_seconds_8, cost_target_calibrated_seconds_8, ...)."""
        out: dict[str, float] = {}
        for kind, o in self._online.items():
            if kind == "head" and "head" not in self.measured:
                continue  # no head loaded: its placeholder curve prices nothing
            out[f"cost_{kind}_host_factor"] = o.host_factor
            for n, now, cal in zip(o.calib.sizes, o.curve._mono, o.calib._mono):
                out[f"cost_{kind}_seconds_{n}"] = now
                out[f"cost_{kind}_calibrated_seconds_{n}"] = cal
        return out

    def as_dict(self) -> dict:
        return {
            "calibrated": self.calibrated,
            "alpha": self.alpha,
            "observations": dict(self.observations),
            "target_seconds": self._curves["target"].as_dict(),
            "draft_seconds": self._curves["draft"].as_dict(),
            "calibrated_target_seconds": self._online["target"].calib.as_dict(),
            "calibrated_draft_seconds": self._online["draft"].calib.as_dict(),
            "online": {k: o.as_dict() for k, o in self._online.items()},
            "draft_row_seconds": round(self.draft_row, 7),
            "head_seconds": self._curves["head"].as_dict(),
            "head_row_seconds": round(self.rows["head"], 7),
            "calib_context": self.calib_context,
            "context": self.ctx.as_dict(),
        }
