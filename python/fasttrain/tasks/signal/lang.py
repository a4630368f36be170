"""The signal language: tokenizer, recursive-descent parser with hard limits, numpy evaluator.

Model output is data here, never code: the text is tokenized by one regular expression over
ASCII, parsed into a small tree of `Node`s, and the tree is evaluated by dispatching on node
kinds to numpy functions. Nothing is `eval`-ed or imported by name. Every limit (characters,
tokens, depth, nodes, window, constant size, lookback) is checked before any array work, so a
hostile answer (10,000 parentheses, 1e999, unicode) becomes a `SignalError` in microseconds.

Grammar (precedence climbing, left-associative):
    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/') unary)*
    unary := '-' unary | atom
    atom  := NUMBER | FIELD | NAME '(' expr (',' expr)* ')' | '(' expr ')'
Window arguments of time-series operators must be integer literals.

Evaluation works on [T, N] float32 arrays (days x assets). Rolling statistics use float64
prefix sums (O(T·N) whatever the window); ts_rank uses sliding_window_view, no Python loop over
days. Semantics chosen to be total (never NaN): log is the signed log sign(x)·log1p(|x|),
division by |y| < 1e-9 gives 0, rolling windows are partial over the first days (those days
sit in the warm-up and are never scored), non-finite results are zeroed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

FIELDS = ("open", "high", "low", "close", "volume", "returns")
# name -> (number of expression args, takes a window)
FUNCTIONS: dict[str, tuple[int, bool]] = {
    "abs": (1, False), "log": (1, False), "sign": (1, False),
    "rank": (1, False), "zscore": (1, False),
    "ts_mean": (1, True), "ts_std": (1, True), "ts_delta": (1, True),
    "ts_rank": (1, True), "ts_corr": (2, True), "delay": (1, True),
}
MIN_WINDOW = {"ts_std": 2, "ts_rank": 2, "ts_corr": 3}


@dataclass(frozen=True)
class Limits:
    max_chars: int = 400
    max_tokens: int = 160
    max_depth: int = 12
    max_nodes: int = 40
    max_window: int = 60
    max_lookback: int = 120   # days of history an expression may need (the slices' warm-up)
    max_constant: float = 1e6
    max_number_chars: int = 24


DEFAULT_LIMITS = Limits()


class SignalError(ValueError):
    """An answer that is not a valid expression. `stage` is 'tokenize', 'parse' or 'limits'."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class Node:
    """kind: 'num' (value), 'field' (name), 'neg' (args[0]), 'bin' (name in +-*/),
    'call' (name, args, window)."""

    kind: str
    name: str = ""
    value: float = 0.0
    args: tuple["Node", ...] = ()
    window: int = 0

    def __str__(self) -> str:  # canonical text; used as a cache key and by novelty/pattern checks
        if self.kind == "num":
            return repr(self.value)
        if self.kind == "field":
            return self.name
        if self.kind == "neg":
            return f"(-{self.args[0]})"
        if self.kind == "bin":
            return f"({self.args[0]}{self.name}{self.args[1]})"
        inner = ",".join(str(a) for a in self.args)
        return f"{self.name}({inner},{self.window})" if self.window else f"{self.name}({inner})"


_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|([A-Za-z_][A-Za-z_0-9]*)|(.))")


def tokenize(text: str, limits: Limits = DEFAULT_LIMITS) -> list[tuple[str, str]]:
    """[(kind, text)] with kind in num/name/op. Raises SignalError('tokenize')."""
    if len(text) > limits.max_chars:
        raise SignalError("tokenize", f"expression longer than {limits.max_chars} characters")
    if not text.isascii():
        raise SignalError("tokenize", "non-ASCII character in expression")
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        assert m is not None  # the '(.)' alternative matches any character
        pos = m.end()
        num, name, op = m.groups()
        if num is not None:
            if len(num) > limits.max_number_chars:
                raise SignalError("tokenize", "number literal too long")
            tokens.append(("num", num))
        elif name is not None:
            if name not in FIELDS and name not in FUNCTIONS:
                raise SignalError("tokenize", f"unknown name {name[:24]!r}")
            tokens.append(("name", name))
        elif op in "+-*/(),":
            tokens.append(("op", op))
        else:
            raise SignalError("tokenize", f"unexpected character {op!r}")
        if len(tokens) > limits.max_tokens:
            raise SignalError("tokenize", f"more than {limits.max_tokens} tokens")
    if not tokens:
        raise SignalError("tokenize", "empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], limits: Limits):
        self.toks, self.i, self.lim, self.nodes = tokens, 0, limits, 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, text: str) -> None:
        t = self.peek()
        if t is None or t[1] != text:
            got = "end of expression" if t is None else repr(t[1])
            raise SignalError("parse", f"expected {text!r}, got {got}")
        self.i += 1

    def node(self, **kw) -> Node:
        self.nodes += 1
        if self.nodes > self.lim.max_nodes:
            raise SignalError("limits", f"more than {self.lim.max_nodes} nodes")
        return Node(**kw)

    def expr(self, depth: int) -> Node:
        left = self.term(depth)
        while (t := self.peek()) is not None and t[1] in "+-" and t[0] == "op":
            self.i += 1
            left = self.node(kind="bin", name=t[1], args=(left, self.term(depth)))
        return left

    def term(self, depth: int) -> Node:
        left = self.unary(depth)
        while (t := self.peek()) is not None and t[1] in "*/" and t[0] == "op":
            self.i += 1
            left = self.node(kind="bin", name=t[1], args=(left, self.unary(depth)))
        return left

    def unary(self, depth: int) -> Node:
        # depth counts nested parentheses/calls/negations, checked before recursing, so
        # '((((…' fails at max_depth instead of hitting Python's recursion limit.
        if depth > self.lim.max_depth:
            raise SignalError("limits", f"nesting deeper than {self.lim.max_depth}")
        t = self.peek()
        if t is None:
            raise SignalError("parse", "unexpected end of expression")
        if t == ("op", "-"):
            self.i += 1
            inner = self.unary(depth + 1)
            if inner.kind == "num":
                return Node(kind="num", value=-inner.value)
            return self.node(kind="neg", args=(inner,))
        return self.atom(depth)

    def atom(self, depth: int) -> Node:
        kind, text = self.peek()  # type: ignore[misc]
        self.i += 1
        if kind == "num":
            value = float(text)
            if not np.isfinite(value) or abs(value) > self.lim.max_constant:
                raise SignalError("limits", f"constant {text[:24]} outside ±{self.lim.max_constant:g}")
            return self.node(kind="num", value=value)
        if kind == "op":
            if text == "(":
                inner = self.expr(depth + 1)
                self.take(")")
                return inner
            raise SignalError("parse", f"unexpected {text!r}")
        if text in FIELDS:
            return self.node(kind="field", name=text)
        n_args, has_window = FUNCTIONS[text]
        self.take("(")
        args = [self.expr(depth + 1)]
        for _ in range(n_args - 1):
            self.take(",")
            args.append(self.expr(depth + 1))
        window = 0
        if has_window:
            self.take(",")
            t = self.peek()
            if t is None or t[0] != "num":
                raise SignalError("parse", f"{text}: window must be an integer literal")
            self.i += 1
            w = float(t[1])
            lo = MIN_WINDOW.get(text, 1)
            if w != int(w) or not lo <= w <= self.lim.max_window:
                raise SignalError("limits", f"{text}: window must be an integer in [{lo}, {self.lim.max_window}]")
            window = int(w)
        self.take(")")
        return self.node(kind="call", name=text, args=tuple(args), window=window)


def parse(text: str, limits: Limits = DEFAULT_LIMITS) -> Node:
    """Parse one expression into a tree, or raise SignalError (never anything else)."""
    p = _Parser(tokenize(text, limits), limits)
    tree = p.expr(0)
    if p.i != len(p.toks):
        raise SignalError("parse", f"unexpected {p.toks[p.i][1]!r} after a complete expression")
    if lookback(tree) > limits.max_lookback:
        raise SignalError("limits", f"needs more than {limits.max_lookback} days of history")
    return tree


def lookback(node: Node) -> int:
    """Days of history the expression reads before the current day."""
    inner = max((lookback(a) for a in node.args), default=0)
    if node.kind == "call" and node.window:
        return inner + (node.window if node.name in ("delay", "ts_delta") else node.window - 1)
    return inner


def count_nodes(node: Node) -> int:
    return 1 + sum(count_nodes(a) for a in node.args)


def fields_used(node: Node) -> set[str]:
    if node.kind == "field":
        return {node.name}
    return set().union(*(fields_used(a) for a in node.args)) if node.args else set()


# ----------------------------------------------------------------------------- evaluation

def _rolling_mean(x: np.ndarray, w: int) -> np.ndarray:
    c = np.cumsum(x, axis=0, dtype=np.float64)              # [T, N] prefix sums in float64
    s = c.copy()
    s[w:] -= c[:-w]
    n = np.minimum(np.arange(1, len(x) + 1), w)[:, None]    # partial windows in the warm-up
    return s / n


def _delay(x: np.ndarray, n: int) -> np.ndarray:
    out = np.empty_like(x)
    out[n:] = x[:-n]
    out[:n] = x[0]
    return out


@lru_cache(maxsize=8)
def _rank_layout(t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row offsets [T, 1] and rank values [T·N] for the flat scatter in cs_rank."""
    rows = (np.arange(t, dtype=np.intp) * n)[:, None]
    values = np.tile(np.linspace(0, 1, n, dtype=np.float32), t)
    return rows, values


def cs_rank(x: np.ndarray) -> np.ndarray:
    """Cross-sectional rank per day scaled to [0, 1] (ties broken by asset order)."""
    t, n = x.shape
    rows, values = _rank_layout(t, n)
    order = np.argsort(x, axis=1)
    order += rows                                            # flat positions, one scatter
    out = np.empty(t * n, np.float32)
    out[order.ravel()] = values
    return out.reshape(t, n)


def cs_zscore(x: np.ndarray) -> np.ndarray:
    """Cross-sectional z-score per day, float32 (0 on a flat day)."""
    d = x - x.mean(axis=1, keepdims=True)
    sd = np.sqrt(np.einsum("ij,ij->i", d, d) / x.shape[1])[:, None]
    return np.divide(d, sd, out=np.zeros_like(d), where=sd > 1e-12 * (1.0 + np.abs(x).max(axis=1, keepdims=True)))


def _ts_rank(x: np.ndarray, w: int) -> np.ndarray:
    pad = np.concatenate([np.repeat(x[:1], w - 1, axis=0), x])
    win = sliding_window_view(pad, w, axis=0)               # [T, N, w], a view
    return (win < x[:, :, None]).sum(axis=2, dtype=np.int32) / np.float32(w - 1)


def _ts_corr(x: np.ndarray, y: np.ndarray, w: int) -> np.ndarray:
    x = x.astype(np.float64)
    y = y.astype(np.float64)
    mx, my = _rolling_mean(x, w), _rolling_mean(y, w)
    cov = _rolling_mean(x * y, w) - mx * my
    vx = _rolling_mean(x * x, w) - mx * mx
    vy = _rolling_mean(y * y, w) - my * my
    den = np.sqrt(np.maximum(vx, 0) * np.maximum(vy, 0))
    # relative threshold: prefix-sum cancellation leaves ~1e-16·E[x²] noise in a zero variance
    tiny = 1e-9 * (np.abs(mx * my) + 1e-12)
    return np.clip(np.divide(cov, den, out=np.zeros_like(cov), where=den > tiny), -1, 1)


def _finite32(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    return a


def evaluate(node: Node, data: dict[str, np.ndarray], cache: dict | None = None) -> np.ndarray:
    """Value of the tree on a slice: `data` maps field -> [T, N] float32. `cache` (optional)
    memoises subtrees by canonical text; answers in one group share many subtrees."""
    key = str(node) if cache is not None else None
    if key is not None and key in cache:
        return cache[key]
    with np.errstate(all="ignore"):
        out = _finite32(_eval(node, data, cache))
    if key is not None:
        cache[key] = out
    return out


def _eval(node: Node, data: dict[str, np.ndarray], cache: dict | None) -> np.ndarray:
    k = node.kind
    if k == "field":
        return data[node.name]
    if k == "num":
        return np.full(data["close"].shape, node.value, np.float32)
    a = [evaluate(c, data, cache) for c in node.args]
    if k == "neg":
        return -a[0]
    if k == "bin":
        x, y = a
        if node.name == "+":
            return x + y
        if node.name == "-":
            return x - y
        if node.name == "*":
            return x * y
        return np.divide(x, y, out=np.zeros_like(x), where=np.abs(y) > 1e-9)
    f, w, x = node.name, node.window, a[0]
    if f == "abs":
        return np.abs(x)
    if f == "log":
        return np.sign(x) * np.log1p(np.abs(x))
    if f == "sign":
        return np.sign(x)
    if f == "rank":
        return cs_rank(x)
    if f == "zscore":
        return cs_zscore(x)
    if f == "ts_mean":
        return _rolling_mean(x, w)
    if f == "ts_std":
        x64 = x.astype(np.float64)
        m = _rolling_mean(x64, w)
        return np.sqrt(np.maximum(_rolling_mean(x64 * x64, w) - m * m, 0))
    if f == "ts_delta":
        return x - _delay(x, w)
    if f == "delay":
        return _delay(x, w)
    if f == "ts_rank":
        return _ts_rank(x, w)
    if f == "ts_corr":
        return _ts_corr(x, a[1], w)
    raise AssertionError(f"unhandled operator {f}")  # the parser admits only FUNCTIONS
