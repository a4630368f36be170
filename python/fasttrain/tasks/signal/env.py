"""The built-in "signal" environment, worlds A and B: twelve channels scored on a frozen panel.

The answer is one signal-language expression inside <signal>...</signal>. It becomes a
market-neutral portfolio each day: z-score the signal across assets, clip at ±3, demean, scale
to unit gross exposure (w[d] sums to 0, |w[d]| sums to 1). Over the S scored days of a slice:
    pnl[d] = w[d]·r[d+1]   turnover[d] = |w[d] - w[d-1]|_1   net[d] = pnl[d] - fee·turnover[d]
    ic_h[d] = corr(w[d], zscored rank of the h-day forward return)   (a rank-IC proxy)

Channels (value ranges; the value an invalid answer gets is in brackets):
  core          3.0  squash(mean over 4 time folds of the annualised net Sharpe),
                     squash(s) = s / (|s| + 3); 0 = break-even;
                     (-1, 1)  [-1]
  stability     1.0  1 - |a - b| / (|a| + |b| + 0.01), a, b = mean 1-day IC in the first and
                     second half (in-sample vs out-of-sample); [0, 1]  [0]
  action_cost   1.0  -mean(turnover)·fee in basis points per day; [-2·fee_bp, 0]  [-2·fee_bp]
  secondary     1.0  mean IC with the prompt's horizon (3, 5, ... days); [-1, 1]  [-0.1]
  complexity    0.2  -min(1, nodes/40 + 0.5·[nodes > prompt budget]); [-1, 0]  [-1]
  format        1.0  1 with an opening and a closing tag in order, 0.5 with one tag, else 0
  syntax        1.0  0 unknown symbol, 0.25 parse error, 0.5 over a limit, 0.75 field not
                     allowed by the prompt, 1 scorable; [0, 1]
  novelty       1.0  1 - max |corr| of the daily pnl with an archive of earlier answers and
                     known baselines; [0, 1]  [0]
  neutrality    1.0  -max(0, |corr(pnl, market)| - 0.1) / 0.9; [-1, 0]  [-1]
  min_activity  1.0  share of scored days with a non-flat cross-section; [0, 1]  [0]
  pattern_guard 0.3  0, minus 1 for a constant, 0.5 for a bare/monotone copy of one field,
                     0.25 per degenerate nesting (rank(rank x), x - x, ...); [-1, 0]  [-1]
  stress        1.0  core in a perturbed world: execution one day late and fees doubled;
                     (-1, 1)  [-1]; world B: always 0 (off)
An answer is invalid when it has no complete tag pair, does not parse, breaks a limit or the
prompt's field list, or is flat on more than half of the scored days.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from fasttrain.envs.protocol import INVALID_CORE, Channel, Prompt, Score, invalid_score
from fasttrain.tasks.signal.lang import (DEFAULT_LIMITS, FIELDS, Limits, Node, SignalError, count_nodes, cs_rank,
                                         cs_zscore, evaluate, fields_used, parse)
from fasttrain.tasks.signal.panel import WORLD_A, WORLD_B, World, generate_panel
from fasttrain.tasks.signal.prompts import HORIZONS, make_prompts

# The example answers are part of each prompt (prompts.EXAMPLES), chosen from the fields that
# prompt allows; the format line shared by every prompt names none.
ANSWER_FORMAT = "Answer with one expression inside <signal>...</signal>."
OPEN_TAG, CLOSE_TAG = "<signal>", "</signal>"
WARMUP = DEFAULT_LIMITS.max_lookback      # history rows before each slice's first scored day
N_FOLDS = 4
BASELINES = ("returns", "-ts_delta(close, 5)", "ts_delta(close, 60)", "volume",
             "ts_std(returns, 20)", "(close - low) / (high - low)")
ARCHIVE_SIZE = 256
CACHE_ENTRIES = 32                         # memoised subtrees per slice (~1.1 MB each; cleared when full)


def signal_channels(stress_on: bool = True) -> list[Channel]:
    d = {
        "core": (3.0, "s/(|s|+3), s = mean fold net Sharpe (annualised); 0 = break-even; (-1, 1)"),
        "stability": (1.0, "1 - |IC_in - IC_out| / (|IC_in| + |IC_out| + 0.01); [0, 1]"),
        "action_cost": (1.0, "-mean daily turnover x fee, bp/day; [-2 fee_bp, 0]"),
        "secondary": (1.0, "mean rank IC at the prompt's horizon; [-1, 1]"),
        "complexity": (0.2, "-min(1, nodes/40 + 0.5 [over prompt budget]); [-1, 0]"),
        "format": (1.0, "1 both tags, 0.5 one tag, 0 none"),
        "syntax": (1.0, "0 unknown symbol, .25 parse error, .5 limit, .75 field not allowed, 1 ok"),
        "novelty": (1.0, "1 - max |corr| of pnl with archive + baselines; [0, 1]"),
        "neutrality": (1.0, "-max(0, |corr(pnl, market)| - 0.1) / 0.9; [-1, 0]"),
        "min_activity": (1.0, "share of days with a non-flat cross-section; [0, 1]"),
        "pattern_guard": (0.3, "penalty for constant / copied field / degenerate nesting; [-1, 0]"),
        "stress": (1.0, "core with 1-day execution delay and 2x fee; (-1, 1)"
                   if stress_on else "off in this world: always 0"),
    }
    return [Channel(k, p, desc) for k, (p, desc) in d.items()]


@dataclass
class Slice:
    """Precomputed arrays of one time slice. Rows [0, start) are warm-up history."""

    name: str
    data: dict[str, np.ndarray]          # field -> [start + S, N] float32
    start: int
    fwd1: np.ndarray                     # [S, N] next-day return of each scored day
    fwd2: np.ndarray                     # [S, N] return one day later (late execution)
    fwd_rank: dict[int, np.ndarray]      # horizon -> [S, N] z-scored rank of h-day fwd return
    market: np.ndarray                   # [S] equal-weight next-day return


def _build_slice(name: str, panel: dict[str, np.ndarray], lo: int, hi: int) -> Slice:
    """Scored days [lo, hi - 1): each one's forward returns stay inside [lo, hi)."""
    ret = panel["returns"].astype(np.float64)
    days = np.arange(lo, hi - 1)
    fwd1 = ret[days + 1]
    fwd2 = np.zeros_like(fwd1)
    fwd2[:-1] = ret[days[:-1] + 2]
    csum = np.vstack([np.zeros(ret.shape[1]), np.cumsum(ret, 0)])
    fwd_rank = {}
    for h in HORIZONS:
        end = np.minimum(days + 1 + h, hi)                          # truncated at the slice end
        fwd_rank[h] = cs_zscore(cs_rank((csum[end] - csum[days + 1]).astype(np.float32))).astype(np.float32)
    return Slice(name=name, data={k: v[lo - WARMUP:hi - 1] for k, v in panel.items()},
                 start=WARMUP, fwd1=fwd1.astype(np.float32), fwd2=fwd2.astype(np.float32),
                 fwd_rank=fwd_rank, market=fwd1.mean(1))


@lru_cache(maxsize=8)
def _slices(world: World, bounds: tuple[tuple[str, int, int], ...]) -> dict[str, Slice]:
    panel = generate_panel(world)
    return {name: _build_slice(name, panel, lo, hi) for name, lo, hi in bounds}


def _sharpe(x: np.ndarray) -> float:
    sd = x.std()
    return float(x.mean() / sd * np.sqrt(252.0)) if sd > 1e-12 else 0.0


def squash(sharpe: float) -> float:
    """Annualised Sharpe -> (-1, 1): s / (|s| + 3). Sign-preserving; saturates slowly, so very
    costly answers (Sharpe -20 vs -40) stay distinguishable, unlike tanh."""
    return float(sharpe / (abs(sharpe) + 3.0))


def _core(net: np.ndarray, folds: int) -> float:
    return squash(float(np.mean([_sharpe(f) for f in np.array_split(net, folds)])))


_IDEMPOTENT = {"rank", "zscore", "sign", "abs"}
_MONOTONE = {"rank", "zscore", "neg", "log"}


def pattern_penalty(tree: Node) -> float:
    """0 for a healthy expression; -1 constant, -0.5 monotone copy of one field,
    -0.25 per degenerate nesting; clipped to [-1, 0]."""
    if not fields_used(tree):
        return -1.0
    pen = 0.0
    node = tree
    while True:                          # peel monotone wrappers and scaling by constants
        if node.kind == "neg" or (node.kind == "call" and node.name in _MONOTONE):
            node = node.args[0]
        elif node.kind == "bin" and node.name in "*/" and node.args[1].kind == "num":
            node = node.args[0]
        elif node.kind == "bin" and node.name == "*" and node.args[0].kind == "num":
            node = node.args[1]
        else:
            break
    if node.kind == "field":
        pen -= 0.5

    def walk(n: Node) -> float:
        p = 0.0
        if n.kind == "call" and n.name in _IDEMPOTENT and n.args[0].kind == "call" \
                and n.args[0].name == n.name:
            p -= 0.25
        if n.kind == "neg" and n.args[0].kind == "neg":
            p -= 0.25
        if n.kind == "bin" and n.name in "-/" and str(n.args[0]) == str(n.args[1]):
            p -= 0.25
        return p + sum(walk(a) for a in n.args)

    return max(-1.0, pen + walk(tree))


class SignalEnvironment:
    """World A (`signal-a`) or B (`signal-b`) of the built-in environment; see module doc."""

    def __init__(self, variant: str = "a", train_slice: str | None = None,
                 holdout_slice: str | None = None, limits: Limits = DEFAULT_LIMITS,
                 fee_bp: float | None = None):
        if variant not in ("a", "b"):
            raise ValueError("variant must be 'a' or 'b'")
        self.variant = variant
        self.name = f"signal-{variant}"
        self.limits = limits
        self.answer_format = ANSWER_FORMAT
        if variant == "a":
            self.world, self.fee_bp, self.stress_on = WORLD_A, 2.0, True
            T = self.world.n_days
            self._bounds = (("train", WARMUP, 1400), ("holdout", 1400, T))
            self._alias = {}
        else:
            self.world, self.fee_bp, self.stress_on = WORLD_B, 2.0 * 19, False
            T = self.world.n_days
            edges = np.linspace(WARMUP, T, 5).astype(int)
            self._bounds = tuple((f"slice{i}", int(edges[i]), int(edges[i + 1])) for i in range(4))
            self._alias = {"train": train_slice or "slice0", "holdout": holdout_slice or "slice3"}
        if fee_bp is not None:                       # override (tests, what-if studies)
            self.fee_bp = float(fee_bp)
        self.data_slices = tuple(b[0] for b in self._bounds)
        for alias, target in self._alias.items():
            if target not in self.data_slices:
                raise ValueError(f"{alias}_slice must be one of {self.data_slices}, got {target!r}")
        self.channels = signal_channels(self.stress_on)
        self._worst = {"core": INVALID_CORE, "stability": 0.0, "action_cost": -2.0 * self.fee_bp,
                       "secondary": -0.1, "complexity": -1.0, "novelty": 0.0, "neutrality": -1.0,
                       "min_activity": 0.0, "pattern_guard": -1.0,
                       "stress": INVALID_CORE if self.stress_on else 0.0}
        self._caches: dict[str, dict] = {}
        self._archive: dict[str, list[np.ndarray]] = {}
        self._prompts: dict[str, list[Prompt]] = {}

    # -- data and prompts
    def slice(self, data_slice: str) -> Slice:
        name = self._alias.get(data_slice, data_slice)
        if name not in self.data_slices:
            raise ValueError(f"{self.name}: unknown data slice {data_slice!r}; "
                             f"choose from {self.data_slices} or {tuple(self._alias)}")
        return _slices(self.world, self._bounds)[name]

    def prompts(self, split: str) -> list[Prompt]:
        if split not in self._prompts:
            self._prompts[split] = make_prompts(split, self.answer_format, self.name)
        return self._prompts[split]

    # -- scoring
    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train",
              record: bool = True) -> Score:
        return self.score_many([prompt], [answer_text], data_slice, record=record)[0]

    def score_many(self, prompts: Sequence[Prompt], answers: Sequence[str],
                   data_slice: str = "train", record: bool = True) -> list[Score]:
        """Score a batch. Novelty is measured against the archive as it was before the batch,
        so the order inside a batch does not matter; with `record`, valid answers with core > 0
        then join the archive (pass record=False for probes and evaluation)."""
        if len(prompts) != len(answers):
            raise ValueError("prompts and answers differ in length")
        sl = self.slice(data_slice)
        archive = self._archive_for(sl)
        raw = [self._score_one(p, a, sl) for p, a in zip(prompts, answers)]
        out = []
        for score, behaviour in raw:
            if behaviour is not None:
                corr = np.abs(archive @ behaviour) / len(behaviour) if len(archive) else np.zeros(1)
                score.channels["novelty"] = float(np.clip(1.0 - corr.max(), 0.0, 1.0))
                if record and score.success:
                    self._archive[sl.name].append(behaviour)
            out.append(score)
        del self._archive[sl.name][:-ARCHIVE_SIZE - len(BASELINES)]
        return out

    def _archive_for(self, sl: Slice) -> np.ndarray:
        if sl.name not in self._archive:
            vecs = []
            for text in BASELINES:
                w = self._weights(evaluate(parse(text, self.limits), sl.data)[sl.start:])
                vecs.append(self._behaviour((w * sl.fwd1).sum(1)))
            self._archive[sl.name] = vecs
        return np.array(self._archive[sl.name]).reshape(-1, len(sl.fwd1))

    @staticmethod
    def _behaviour(pnl: np.ndarray) -> np.ndarray:
        sd = pnl.std()
        return ((pnl - pnl.mean()) / sd if sd > 1e-12 else np.zeros_like(pnl)).astype(np.float64)

    @staticmethod
    def _weights(sig: np.ndarray) -> np.ndarray:
        z = np.clip(cs_zscore(sig), -3.0, 3.0)
        z -= z.mean(axis=1, keepdims=True)
        gross = np.abs(z).sum(axis=1, keepdims=True)
        return np.divide(z, gross, out=np.zeros_like(z), where=gross > 1e-12).astype(np.float32)

    def _invalid(self, reason: str, **known: float) -> tuple[Score, None]:
        return invalid_score(self.channels, reason, self._worst, **known), None

    def _score_one(self, prompt: Prompt, text: str, sl: Slice) -> tuple[Score, np.ndarray | None]:
        if not isinstance(text, str):
            return self._invalid("answer is not text")
        # str.find, not a lazy regex: '<signal>' x 5000 would make a regex scan quadratic
        i = text.find(OPEN_TAG)
        j = text.find(CLOSE_TAG, i + len(OPEN_TAG)) if i >= 0 else -1
        if j < 0:
            fmt = 0.5 if (i >= 0 or CLOSE_TAG in text) else 0.0
            return self._invalid("no <signal>...</signal> block", format=fmt)
        try:
            tree = parse(text[i + len(OPEN_TAG):j].strip(), self.limits)
        except SignalError as e:
            syn = {"tokenize": 0.0, "parse": 0.25, "limits": 0.5}[e.stage]
            return self._invalid(f"{e.stage}: {e}", format=1.0, syntax=syn)
        allowed = prompt.fields.get("allowed_fields", FIELDS)
        bad = sorted(fields_used(tree) - set(allowed))
        if bad:
            return self._invalid(f"fields not allowed by the prompt: {bad}", format=1.0, syntax=0.75)
        nodes = count_nodes(tree)
        budget = prompt.fields.get("budget", self.limits.max_nodes)
        complexity = -min(1.0, nodes / self.limits.max_nodes + (0.5 if nodes > budget else 0.0))
        pattern = pattern_penalty(tree)

        cache = self._caches.setdefault(sl.name, {})
        if len(cache) > CACHE_ENTRIES:
            cache.clear()
        sig = evaluate(tree, sl.data, cache)[sl.start:]             # [S, N]
        w = self._weights(sig)                                      # [S, N]
        gross = np.abs(w).sum(axis=1)
        active = float((gross > 0.5).mean())
        known = dict(format=1.0, syntax=1.0, complexity=complexity, pattern_guard=pattern,
                     min_activity=active)
        if active < 0.5:
            return self._invalid("signal is flat across assets on most days", **known)

        fee = self.fee_bp * 1e-4
        pnl = (w * sl.fwd1).sum(axis=1)                             # [S]
        turnover = np.empty_like(pnl)
        turnover[0] = gross[0]
        turnover[1:] = np.abs(np.diff(w, axis=0)).sum(axis=1)
        net = pnl - fee * turnover
        core = _core(net, N_FOLDS)

        wn = np.sqrt((w.astype(np.float64) ** 2).sum(axis=1) * w.shape[1])   # ||w||·sqrt(N)
        def ic(zr: np.ndarray) -> np.ndarray:
            return np.divide((w * zr).sum(axis=1), wn, out=np.zeros_like(wn), where=wn > 0)
        ic1 = ic(sl.fwd_rank[1])
        half = len(ic1) // 2
        a, b = ic1[:half].mean(), ic1[half:].mean()
        stability = 1.0 - abs(a - b) / (abs(a) + abs(b) + 0.01)
        secondary = float(ic(sl.fwd_rank[prompt.fields.get("horizon", 5)]).mean())
        c = np.corrcoef(pnl, sl.market)[0, 1] if pnl.std() > 1e-12 else 0.0
        neutrality = -max(0.0, abs(float(c)) - 0.1) / 0.9
        stress = 0.0
        if self.stress_on:
            late = (w[:-1] * sl.fwd2[:-1]).sum(axis=1) - 2 * fee * turnover[:-1]
            stress = squash(_sharpe(late))
        channels = dict(core=core, stability=float(stability),
                        action_cost=-float(turnover.mean()) * self.fee_bp,
                        secondary=secondary, complexity=complexity, format=1.0, syntax=1.0,
                        novelty=0.0, neutrality=neutrality, min_activity=active,
                        pattern_guard=pattern, stress=stress)
        return (Score(channels=channels, valid=True, core=core, success=core > 0.0, reason=None),
                self._behaviour(pnl))
