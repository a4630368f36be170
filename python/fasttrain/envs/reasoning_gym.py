"""reasoning-gym's procedural generators as an environment (`env.name = "reasoning-gym"`).

    [env]
    name = "reasoning-gym"
    train_rows = 1000                    # train rows over the mixture, split by weight
    probe_rows = 100                     # frozen probe rows (0: 100)
    data_seed = 0                        # the rows are a pure function of this seed and the settings
    [env.generators.gcd]                 # reasoning-gym's dataset name
    weight = 1.0                         # share of the train rows (default 1)
    max_value = 1000                     # any field of the generator's own config class
    [env.generators.basic_arithmetic]
    weight = 2.0

reasoning-gym (the `reasoning-gym` extra: `pip install 'fasttrain[reasoning-gym]'`) generates
question/answer rows from a seed and scores an answer with the generator's own `score_answer`.

Rows. Each generator draws its train rows from the seed `row_seed(data_seed, name, "train",
level)` and its probe rows from `row_seed(data_seed, name, "probe", 0)`: different seeds, and on
top of that every train row whose question text is a probe question, or repeats an earlier train
question, is dropped (small generators repeat themselves), and more rows are drawn until the
generator has its share or 4x its share plus 64 draws were tried. The probe is drawn once, at the
recipe's settings, and never changes during a run (not with the curriculum either).

Channels. `core` (priority 3) is the generator's `score_answer(extracted, entry)`, a number in
[0, 1] (1 = correct; some generators give partial credit). `format` (priority 1) is 1 when the
answer holds exactly one `<answer>...</answer>` pair, 0.5 for several pairs, 0 for none. GDPO
standardises both inside each group, then weights them.

Extraction. The text inside the last `<answer>...</answer>` pair, stripped (reasoning-gym's own
`extract_answer` rule). Fallbacks, scored by the same `score_answer` but with no format credit:
an `<answer>` tag that is never closed (an answer cut off at max_new_tokens, or a recipe whose
rollout.answer_prefix is "<answer>") gives the rest of that tag's line; an answer without tags
gives its last non-empty line, stripped, with a leading "answer:" (any case) removed. An empty
answer is invalid (core -1). Nothing is executed.

Curriculum (`env.curriculum = true`, fasttrain.envs.rg_curriculum): each generator's train rows
come from reasoning-gym's `create_curriculum(name)` at its current global level (level 0 at the
start, the recipe's settings as the defaults underneath); the level moves with a window of
steps' mean score, and the rows are drawn again at the new level.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import re
from typing import Any, Mapping, Sequence

from .protocol import INVALID_CORE, Channel, Prompt, Score

__all__ = ["ReasoningGymEnvironment", "ReasoningGymError", "extract_rg_answer", "require_reasoning_gym",
           "row_seed", "check_generators"]

INSTALL = "reasoning-gym is not installed: pip install 'fasttrain[reasoning-gym]'"
ANSWER_FORMAT = ("Think briefly if you need to, then give only the final answer between <answer> and "
                 "</answer> tags, for example <answer>42</answer>.")
DEFAULT_PROBE_ROWS = 100
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
log = logging.getLogger("fasttrain.envs")
_LEAD = re.compile(r"^\s*(final\s+)?answer\s*[:=]\s*", re.IGNORECASE)


class ReasoningGymError(ValueError):
    """A generator or setting that reasoning-gym does not have (the message lists the close names)."""


def require_reasoning_gym():
    """The reasoning_gym module, or ImportError naming the extra to install."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(INSTALL) from None
    return reasoning_gym


def row_seed(data_seed: int, name: str, split: str, level: int) -> int:
    """The seed of one generator's rows: a hash of (data_seed, name, split, level), 31 bits."""
    h = hashlib.sha256(f"{data_seed}/{name}/{split}/{level}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def extract_rg_answer(text: str) -> tuple[str | None, float]:
    """(the answer to score, format credit). See the module doc for the rule."""
    tags = list(_TAG.finditer(text))
    if tags:
        return tags[-1].group(1).strip(), (1.0 if len(tags) == 1 else 0.5)
    opened = text.rfind("<answer>")
    if opened >= 0:                     # cut off (or never closed): the rest of the tag's line
        rest = text[opened + len("<answer>"):].strip().split("\n", 1)[0].strip()
        return rest or None, 0.0
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None, 0.0
    return _LEAD.sub("", lines[-1]).strip() or None, 0.0


def _close(word: str, names: Sequence[str]) -> str:
    near = difflib.get_close_matches(word, list(names), n=5, cutoff=0.5)
    return f"; close names: {', '.join(near)}" if near else ""


def check_generators(generators: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[float, dict[str, Any]]]:
    """{name: (weight, settings)} after checking every name and setting against reasoning-gym's
    registry and config classes (ReasoningGymError names the close matches). No rows are drawn."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS
    if not generators:
        raise ReasoningGymError("env.generators: name at least one reasoning-gym generator, e.g. "
                                "[env.generators.gcd] (fasttrain init NAME --reasoning-gym gcd writes one)")
    out: dict[str, tuple[float, dict[str, Any]]] = {}
    for name, raw in generators.items():
        if name not in DATASETS:
            raise ReasoningGymError(f"env.generators: reasoning-gym has no generator {name!r}{_close(name, sorted(DATASETS))}")
        if not isinstance(raw, Mapping):
            raise ReasoningGymError(f"env.generators.{name}: must be a table of settings")
        settings = dict(raw)
        weight = settings.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ReasoningGymError(f"env.generators.{name}.weight: {weight!r} is not a number > 0")
        fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
        for key in settings:
            if key not in fields:
                raise ReasoningGymError(f"env.generators.{name}: {key!r} is not a setting of {name}"
                                        f"{_close(key, fields)}; its settings: {', '.join(fields)}")
        try:
            cfg = DATASETS[name][1](**settings, seed=0, size=1)
            if callable(getattr(cfg, "validate", None)):
                cfg.validate()
        except (AssertionError, TypeError, ValueError) as e:
            raise ReasoningGymError(f"env.generators.{name}: reasoning-gym refuses these settings: "
                                    f"{e or type(e).__name__}") from None
        out[name] = (float(weight), settings)
    return out


def _split_rows(total: int, weights: Sequence[float]) -> list[int]:
    """`total` rows split by weight (largest remainder; each generator gets at least one)."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    n = [int(x) for x in exact]
    for i in sorted(range(len(n)), key=lambda i: (-(exact[i] - n[i]), i))[: total - sum(n)]:
        n[i] += 1
    return [max(1, k) for k in n]


class ReasoningGymEnvironment:
    """See the module doc. `prompts("train")` are the rows at the generators' current levels,
    `prompts("probe")` the frozen probe rows."""

    data_slices = ("train",)
    answer_format = ANSWER_FORMAT

    def __init__(self, generators: Mapping[str, Mapping[str, Any]], train_rows: int = 1000, probe_rows: int = 0,
                 data_seed: int = 0, curriculum: bool = False, curriculum_window: int = 8,
                 curriculum_upper: float = 0.75, curriculum_lower: float = 0.25):
        self.generators = check_generators(generators)
        self.name = "reasoning-gym:" + "+".join(self.generators)
        self.channels = [Channel("core", 3.0, "the generator's score_answer on the extracted answer, in [0, 1]"),
                         Channel("format", 1.0, "1: one <answer>...</answer> pair; 0.5: several; 0: none")]
        self.data_seed = int(data_seed)
        names = list(self.generators)
        self.train_counts = dict(zip(names, _split_rows(int(train_rows), [w for w, _ in self.generators.values()])))
        self.probe_counts = dict(zip(names, _split_rows(int(probe_rows or DEFAULT_PROBE_ROWS),
                                                        [w for w, _ in self.generators.values()])))
        self.short_rows: list[str] = []        # generators that gave fewer distinct rows than their share
        self._datasets: dict[tuple[str, str, int], Any] = {}
        self.curriculum = None
        if curriculum:
            from .rg_curriculum import Curriculum
            self.curriculum = Curriculum(names, window=curriculum_window, upper=curriculum_upper,
                                         lower=curriculum_lower)
        self._probe = self._rows_all("probe", None)
        self._probe_questions = {p.fields["entry"]["question"] for p in self._probe}
        self._train: list[Prompt] | None = None
        self._train_levels: tuple[int, ...] | None = None

    # ---- rows ------------------------------------------------------------------------------
    def _dataset(self, name: str, split: str, level: int | None):
        """The generator's dataset object for this split and curriculum level (None: the recipe's settings)."""
        key = (name, split, -1 if level is None else level)
        if key not in self._datasets:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
            _, settings = self.generators[name]
            seed = row_seed(self.data_seed, name, split, 0 if level is None else level)
            n = 4 * max(self.train_counts[name], self.probe_counts[name]) + 64
            if level is None:
                ds = reasoning_gym.create_dataset(name, **settings, seed=seed, size=n)
            else:
                from reasoning_gym.factory import create_curriculum
                cur = create_curriculum(name)
                cur.set_global_level(level)
                defaults = {k: v for k, v in settings.items()}
                cfg = cur.generate_configuration(defaults=defaults)
                cfg.seed, cfg.size = seed, n
                ds = DATASETS[name][0](config=cfg)
            self._datasets[key] = ds
        return self._datasets[key]

    def _rows(self, name: str, split: str, level: int | None) -> list[Prompt]:
        want = (self.probe_counts if split == "probe" else self.train_counts)[name]
        ds = self._dataset(name, split, level)
        seen = set() if split == "probe" else set(self._probe_questions)
        out: list[Prompt] = []
        for i in range(len(ds)):
            if len(out) == want:
                break
            entry = ds[i]
            q = entry["question"]
            if q in seen:
                continue
            seen.add(q)
            lv = "p" if level is None else f"L{level}"
            out.append(Prompt(f"rg/{name}/{split}/{lv}/{i}", q, {"generator": name, "entry": entry,
                                                                   "split": split, "level": level}))
        if len(out) < want:         # a small generator: fewer rows than its share, said once
            self.short_rows.append(f"{name} ({split}): only {len(out)} distinct questions of {want} "
                                   f"in {len(ds)} draws")
            log.warning("reasoning-gym: %s", self.short_rows[-1])
        return out

    def _rows_all(self, split: str, levels: Mapping[str, int] | None) -> list[Prompt]:
        rows: list[Prompt] = []
        for name in self.generators:
            rows += self._rows(name, split, None if levels is None else levels[name])
        return rows

    def levels(self) -> dict[str, int] | None:
        return None if self.curriculum is None else dict(self.curriculum.levels)

    @property
    def train_version(self) -> tuple[int, ...]:
        """Changes when the train rows change (a curriculum level moved): the trainer then asks
        for them again."""
        lv = self.levels()
        return () if lv is None else tuple(lv.values())

    def prompts(self, split: str) -> list[Prompt]:
        if split == "probe":
            return list(self._probe)
        if split != "train":
            raise ValueError(f"split must be 'train' or 'probe', got {split!r}")
        if self._train is None or self._train_levels != self.train_version:
            self._train = self._rows_all("train", self.levels())
            self._train_levels = self.train_version
        return list(self._train)

    # ---- scoring -------------------------------------------------------------------------------
    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train") -> Score:
        name, entry = prompt.fields["generator"], prompt.fields["entry"]
        answer, fmt = extract_rg_answer(answer_text)
        if answer is None:
            return Score({"core": INVALID_CORE, "format": 0.0}, False, INVALID_CORE, False, "empty answer")
        ds = self._dataset(name, prompt.fields["split"], prompt.fields.get("level"))
        core = float(ds.score_answer(answer, entry))
        return Score({"core": core, "format": fmt}, True, core, core > 0, None)

    def score_many(self, prompts: Sequence[Prompt], answers: Sequence[str], data_slice: str = "train") -> list[Score]:
        if len(prompts) != len(answers):
            raise ValueError("prompts and answers differ in length")
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]

    # ---- curriculum ------------------------------------------------------------------------------
    def end_step(self, prompts: Sequence[Prompt], scores: Sequence[Score]) -> dict[str, float]:
        """After a step's scoring (every answer, kept or dropped): the curriculum sees each
        generator's mean score and may move its level. Returns the metrics to log."""
        if self.curriculum is None:
            return {}
        per: dict[str, list[float]] = {n: [] for n in self.generators}
        for p, s in zip(prompts, scores):
            if p.fields.get("level") is not None:
                per[p.fields["generator"]].append(max(0.0, s.core) if s.valid else 0.0)
        return self.curriculum.observe({n: (sum(v) / len(v) if v else None) for n, v in per.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": None if self.curriculum is None else self.curriculum.state_dict()}

    def load_state_dict(self, st: Mapping[str, Any]) -> None:
        if self.curriculum is not None and st.get("curriculum") is not None:
            self.curriculum.load_state_dict(st["curriculum"])
