"""Rerunnable experiments behind docs/experiments.md: the seed study's findings
reproduced small with the real model (SmolLM2-135M-Instruct, NF4 + LoRA/DoRA).

    python tools/experiments.py learning [scale flags]   # (a) train-side and holdout scores vs the start
    python tools/experiments.py floor    [scale flags]   # (b) the floor trap on signal-b: floor 0 vs -inf
    python tools/experiments.py ladder   [scale flags] [--rungs dapo,cispo,...]   # (c) the six rungs
    python tools/experiments.py start    [scale flags] [--set env.name=...]  # the starting model's answers only:
                                                         # validity and the non-zero-advantage share per floor
    python tools/experiments.py countdown [--steps N] [--threads T] [--set ...]   # (d) the countdown recipe as
                                                         # it is: probe share solved before and after
    python tools/experiments.py tools    [--steps N] [--seeds 1 2 3] [--set ...]   # (e) countdown with a
                                                         # calculator tool: valid tool calls and held-out
                                                         # success before and after, one run per seed
    python tools/experiments.py summarize --exp learning|floor|ladder|countdown|tools   # plots + tables again

Every experiment starts from a recipe (demo for (a) and (b), the ladder recipes for (c)) with the
scale flags applied to all runs alike as `--set` overrides, writes its runs under
<out>/<experiment>/, and then `summary.json`, a markdown summary and PNG plots into --figures.
Nothing here is measured anywhere else: docs/experiments.md quotes these files.

Run from the repository root with the project's Python (PYTHONPATH=python if not installed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

LADDER = ["dapo", "cispo", "cispo_repo_r", "cispo_repo_r_filtered", "cispo_repo_r_dora", "dapo_repo_r_dora"]


def scale_overrides(a: argparse.Namespace) -> list[str]:
    """The scale flags as config overrides, the same for every run of an experiment."""
    o = [f"run.steps={a.steps}", f"run.seed={a.seed}", f"run.threads={a.threads}",
         f"rollout.prompts_per_step={a.prompts_per_step}", f"rollout.group_size={a.group_size}",
         f"rollout.max_new_tokens={a.max_new_tokens}", f"probe.every={a.probe_every}",
         f"probe.prompts={a.probe_prompts}", f"probe.max_new_tokens={a.max_new_tokens}"]
    if a.lr:
        o.append(f"optim.lr={a.lr}")
    return o + list(a.set or [])


def demo_answer_style() -> list[str]:
    """The demo's answer settings as overrides for the ladder rungs (the same for every rung):
    the prefilled "<signal>", the stop string, the sampling and probe temperature, and no
    gradient checkpointing (135M fits; the shared-prefix forward needs the KV cache). The seed's
    rungs sample at temperature 1.0 with no prefix, where the untrained 135M model gives ~3%
    valid answers and no rung could learn at this scale."""
    from fasttrain.train.config import load_config
    d = load_config("demo")
    return [f"rollout.answer_prefix={json.dumps(d.rollout.answer_prefix)}",
            f"rollout.stop_strings={json.dumps(list(d.rollout.stop_strings))}",
            f"rollout.temperature={d.rollout.temperature}", f"probe.temperature={d.probe.temperature}",
            f"probe.samples={d.probe.samples}", "policy.gradient_checkpointing=false"]


def train(recipe: str, overrides: list[str], out: Path) -> dict[str, Any]:
    from fasttrain.train.config import load_config
    from fasttrain.train.trainer import Trainer

    cfg = load_config(recipe, overrides + [f"run.out={json.dumps(str(out))}"])
    t = time.time()
    export = Trainer(cfg, progress=sys.stderr.isatty()).train()
    export["wall_seconds"] = time.time() - t
    export["recipe"], export["overrides"] = recipe, overrides
    (Path(cfg.run.out) / export["run_id"] / "wall.json").write_text(json.dumps({"wall_seconds": export["wall_seconds"]}))
    print(f"{recipe}: run {export['run_id']} done in {export['wall_seconds']:.0f} s", flush=True)
    return export


def load_exports(root: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(root.glob("*/export.json")):
        e = json.loads(f.read_text())
        w = f.parent / "wall.json"
        e["wall_seconds"] = json.loads(w.read_text())["wall_seconds"] if w.exists() else math.nan
        out.append(e)
    return out


# ---- summaries --------------------------------------------------------------------------------
def _f(v, spec="+.4f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _probe_rows(e) -> list[str]:
    rows = ["| step | train core | train valid | holdout core | holdout valid |", "|---:|---:|---:|---:|---:|"]
    for p in e["probes"]:
        rows.append(f"| {p['step']} | {_f(p['train_core'])} | {_f(p['train_valid'], '.0%')} | "
                    f"{_f(p['holdout_core'])} | {_f(p['holdout_valid'], '.0%')} |")
    return rows


def _halves(e, key) -> tuple[float, float]:
    v = [s[key] for s in e["steps"]]
    h = max(1, len(v) // 2)
    return sum(v[:h]) / h, sum(v[-h:]) / h


def _halves_table(e, keys) -> list[str]:
    """Markdown rows: each rollout metric's mean over the first and the second half of the steps."""
    lines = ["", "| rollout mean (first half -> second half of the steps) | first | second |", "|---|---:|---:|"]
    for k in keys:
        if k in e["steps"][0]:
            a, b = _halves(e, k)
            lines.append(f"| {k} | {_f(a)} | {_f(b)} |")
    return lines


def summarize_learning(exports, fig_dir: Path) -> str:
    e = exports[-1]
    lines = [f"run `{e['run_id']}`, {e['steps_done']} steps, wall {e['wall_seconds']:.0f} s", ""] + _probe_rows(e)
    lines += _halves_table(e, ("core", "reward", "valid", "reward_format", "reward_syntax", "nonzero_adv_share",
                               "kl", "entropy"))
    _plot_learning(e, fig_dir / "learning.png")
    return "\n".join(lines) + "\n"


def summarize_floor(exports, fig_dir: Path) -> str:
    lines = ["| floor | run | steps | non-zero-advantage share (mean) | guarded share | KL (last) | reward (first half -> second) | core (first half -> second) |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for e in exports:
        fl = e["config"]["advantages"]["floor"]
        st = e["steps"]
        share = sum(s["nonzero_adv_share"] for s in st) / len(st)
        guarded = sum(s["guarded_share"] for s in st) / len(st)
        r0, r1 = _halves(e, "reward")
        c0, c1 = _halves(e, "core")
        lines.append(f"| {fl} | `{e['run_id']}` | {len(st)} | {share:.1%} | {guarded:.1%} | {st[-1]['kl']:.2e} | "
                     f"{r0:+.4f} -> {r1:+.4f} | {c0:+.4f} -> {c1:+.4f} |")
    _plot_floor(exports, fig_dir / "floor_trap.png")
    return "\n".join(lines) + "\n"


def summarize_ladder(exports, fig_dir: Path) -> str:
    from fasttrain.train.report import ladder_table
    order = {r: i for i, r in enumerate(LADDER)}
    exports = sorted(exports, key=lambda e: order.get(e["config"]["run"]["name"], 99))
    table = ladder_table([[e] for e in exports])          # one seed per rung
    extra = ["", "| rung | start holdout | shipped train core | wall s |", "|---:|---:|---:|---:|"]
    for i, e in enumerate(exports, 1):
        sp, sh = e.get("start_probe") or {}, e.get("shipped") or {}
        extra.append(f"| {i} | {_f(sp.get('holdout_core'))} | {_f(sh.get('train_core'))} | {e['wall_seconds']:.0f} |")
    return table + "\n".join(extra) + "\n"


def summarize_countdown(exports, fig_dir: Path) -> str:
    e = exports[-1]
    lines = [f"run `{e['run_id']}`, {e['steps_done']} steps, wall {e['wall_seconds']:.0f} s", "",
             "| probe step | solved (answer) | valid |", "|---:|---:|---:|"]
    lines += [f"| {p['step']} | {p['train_core']:.1%} | {p['train_valid']:.0%} |" for p in e["probes"]]
    lines += _halves_table(e, ("reward_answer", "reward_format", "valid", "nonzero_adv_share", "kl", "entropy",
                               "mean_length"))
    _plot_countdown(e, fig_dir / "countdown.png")
    return "\n".join(lines) + "\n"


def _plot_countdown(e, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st, pr = e["steps"], e["probes"]
    x = [s["step"] for s in st]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    ax[0].plot([p["step"] for p in pr], [p["train_core"] for p in pr], "o-", label="probe: share solved")
    ax[0].set_ylim(-0.02, max(0.2, max(p["train_core"] for p in pr) * 1.2))
    ax[0].set_title("probe (unseen problems)")
    for k in ("reward_answer", "reward_format"):
        ax[1].plot(x, [s[k] for s in st], "o-", label=k)
    ax[1].set_title("rollout rewards (mean over answers)")
    for k in ("nonzero_adv_share", "entropy", "kl"):
        ax[2].plot(x, [s[k] for s in st], label=k)
    ax[2].set_title("non-zero-advantage share, entropy, KL")
    _save_steps_figure(plt, fig, ax, f"(d) countdown: {e['run_id']}", path)


def _save_steps_figure(plt, fig, ax, title: str, path: Path) -> None:
    """Panels over steps: x label and legend on each, the title, then the PNG."""
    for a in ax:
        a.set_xlabel("step")
        a.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_learning(e, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st, pr = e["steps"], e["probes"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    x = [s["step"] for s in st]
    ax[0].plot([p["step"] for p in pr], [p["train_core"] for p in pr], "o-", label="probe, train slice (selector)")
    ax[0].plot([p["step"] for p in pr], [p["holdout_core"] for p in pr], "s-", label="probe, holdout slice")
    ax[0].set_title("probe core score")
    ax[1].plot(x, [s["core"] for s in st], label="rollout core")
    ax[1].plot(x, [s["reward"] for s in st], label="rollout reward")
    ax[1].set_title("train-side rollouts")
    for k in ("valid", "reward_format", "reward_syntax", "nonzero_adv_share"):
        if k in st[0]:
            ax[2].plot(x, [s[k] for s in st], label=k)
    ax[2].set_title("validity channels, non-zero-advantage share")
    _save_steps_figure(plt, fig, ax, f"(a) learning: {e['run_id']}", path)


def _plot_floor(exports, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for e in exports:
        lab = f"floor {e['config']['advantages']['floor']}"
        x = [s["step"] for s in e["steps"]]
        for a, k in zip(ax, ("nonzero_adv_share", "kl", "reward")):
            a.plot(x, [s[k] for s in e["steps"]], "o-", label=lab)
            a.set_title(k)
            a.set_xlabel("step")
    for a in ax:
        a.legend(fontsize=8)
    fig.suptitle("(b) the floor trap on signal-b, same seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize_tools(exports, fig_dir: Path) -> str:
    """Per seed: the probe's share of answers with a calculate call that returned a value
    (used_calculator) and its share solved (held-out: probe problems are never trained on), at the
    first and the last probe; then the mean over seeds."""
    lines = ["| seed | run | valid tool call: start -> end | held-out solved: start -> end | tool calls / step | wall |",
             "|---:|---|---:|---:|---:|---:|"]
    ends = []
    for e in exports:
        first, last = e["probes"][0], e["probes"][-1]
        key = "train_reward_used_calculator"
        calls = sum(s.get("tool_calls", 0) for s in e["steps"]) / max(1, len(e["steps"]))
        lines.append(f"| {e['config']['run']['seed']} | {e['run_id']} | {_f(first.get(key), '.0%')} -> "
                     f"{_f(last.get(key), '.0%')} | {_f(first['train_success'], '.0%')} -> {_f(last['train_success'], '.0%')}"
                     f" | {calls:.1f} | {e['wall_seconds']:.0f} s |")
        ends.append((first.get(key, math.nan), last.get(key, math.nan), first["train_success"], last["train_success"]))
    if ends:
        m = [sum(x[i] for x in ends) / len(ends) for i in range(4)]
        lines.append(f"| mean | {len(ends)} seeds | {_f(m[0], '.0%')} -> {_f(m[1], '.0%')} | "
                     f"{_f(m[2], '.0%')} -> {_f(m[3], '.0%')} | | |")
    return "\n".join(lines) + "\n"


SUMMARIES = {"learning": summarize_learning, "floor": summarize_floor, "ladder": summarize_ladder,
             "countdown": summarize_countdown, "tools": summarize_tools}


def write_summary(exp: str, root: Path, fig_dir: Path, command: str) -> str:
    exports = load_exports(root)
    if not exports:
        raise SystemExit(f"{exp}: no finished runs under {root}")
    text = f"## {exp}\n\ncommand: `{command}`\n\n" + SUMMARIES[exp](exports, fig_dir)
    (root / "summary.md").write_text(text)
    (root / "summary.json").write_text(json.dumps([{k: e.get(k) for k in (
        "run_id", "steps_done", "wall_seconds", "probes", "shipped", "start_probe", "holdout_change",
        "nonzero_adv_share", "zeta", "warnings")} | {"steps": e["steps"], "config": e["config"]} for e in exports],
        indent=1, default=str))
    print(text)
    return text


# ---- experiments ------------------------------------------------------------------------------
def run_learning(a, root: Path) -> None:
    train("demo", scale_overrides(a) + [f"run.name=learning"], root)


def run_floor(a, root: Path) -> None:
    base = scale_overrides(a) + ['env.name="signal-b"']
    for floor in a.floors:
        train("demo", base + [f"advantages.floor={floor}", f'run.name="floor{floor}"'], root)


def run_countdown(a, root: Path) -> None:
    """The countdown recipe as it is (its own scale), only steps, seed, threads and --set changed."""
    train("countdown", [f"run.steps={a.steps}", f"run.seed={a.seed}", f"run.threads={a.threads}"] + list(a.set or []),
          root)


def run_tools(a, root: Path) -> None:
    """The tools recipe as it is, one run per seed; only steps, seed, threads and --set changed."""
    for seed in a.seeds:
        train("tools", [f"run.steps={a.steps}", f"run.seed={seed}", f"run.threads={a.threads}",
                        f'run.name="tools-s{seed}"'] + list(a.set or []), root)


def run_ladder(a, root: Path) -> None:
    from fasttrain.train.config import load_config
    from fasttrain.train.prompt_filter import filter_prompts, selection_path

    rungs = a.rungs.split(",") if a.rungs else LADDER
    unknown = [r for r in rungs if r not in LADDER]
    if unknown:
        raise SystemExit(f"--rungs: unknown rung(s) {unknown}; the ladder: {','.join(LADDER)}")
    over = scale_overrides(a) + demo_answer_style() + [
        f"filter.samples={a.filter_samples}", f"filter.max_prompts={a.filter_prompts}",
        f"filter.min_keep={a.filter_min_keep}"]
    for r in rungs:
        extra = []
        if r == "cispo_repo_r_filtered":
            sel = root / "filter-selection.json"
            extra = [f"env.prompts={json.dumps(str(sel))}"]
            cfg = load_config(r, over + extra + [f"run.out={json.dumps(str(root))}"])
            if not sel.exists():
                filter_prompts(cfg, sel)
        train(r, over + extra, root)


def run_start(a, root: Path) -> None:
    """The starting model only (no training): one rollout batch of the demo recipe at the scale flags,
    scored, with the GDPO + floor-guard advantages computed under each --floors value on the same
    answers. Cheap (no backward); says whether a run can learn at all from its first step."""
    import dataclasses
    import torch
    from fasttrain.rl import floor_guard, gdpo_advantages, guarded_answers, nonzero_share
    from fasttrain.train.answers import sample_answers, score_answers
    from fasttrain.train.config import load_config
    from fasttrain.train.trainer import Trainer, step_seed

    cfg = load_config("demo", scale_overrides(a) + [f"run.out={json.dumps(str(root))}"])
    tr = Trainer(cfg, progress=False)
    tr._setup()
    t = time.time()
    prompts = tr._prompts_for_step(1)
    G = cfg.rollout.group_size
    roll, texts = sample_answers(tr.model, tr.tokenizer, tr.env, prompts, group_size=G,
                                 max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                 seed=step_seed(cfg.run.seed, 1), answer_prefix=cfg.rollout.answer_prefix,
                                 stop_strings=cfg.rollout.stop_strings)
    rep = [p for p in prompts for _ in range(G)]
    scores = score_answers(tr.env, rep, texts, cfg.env.train_slice, record=False)
    rewards = torch.tensor([[s.channels[c] for c in tr.channel_names] for s in scores], dtype=torch.float64)
    core = torch.tensor([s.core for s in scores], dtype=torch.float64)
    valid = torch.tensor([s.valid for s in scores])
    adv = gdpo_advantages(rewards, G, tr.weights, cfg.advantages.batch_normalize).double()
    res = {"env": cfg.env.name, "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
           "answers": len(texts), "valid": float(valid.double().mean()),
           "format": float(rewards[:, tr.channel_names.index("format")].mean()) if "format" in tr.channel_names else None,
           "syntax": float(rewards[:, tr.channel_names.index("syntax")].mean()) if "syntax" in tr.channel_names else None,
           "core": float(core.mean()), "seconds": time.time() - t, "examples": texts[:4],
           "nonzero_share_before_guard": nonzero_share(adv), "by_floor": {}}
    for fl in a.floors:
        g = guarded_answers(core, valid, fl, cfg.advantages.guard_invalid)
        res["by_floor"][str(fl)] = {"guarded": float(g.double().mean()), "nonzero_adv_share": nonzero_share(floor_guard(adv, g, G))}
    name = f"start-{cfg.env.name}-T{cfg.rollout.temperature}-n{cfg.rollout.max_new_tokens}-s{cfg.run.seed}.json"
    (root / name).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["learning", "floor", "ladder", "countdown", "tools", "start", "summarize"])
    ap.add_argument("--exp", choices=list(SUMMARIES), help="for summarize: which experiment")
    ap.add_argument("--out", default="runs/experiments", help="runs go under OUT/<experiment>/")
    ap.add_argument("--figures", default="docs/img", help="where the PNG plots go")
    g = ap.add_argument_group("scale (applied to every run of the experiment)")
    g.add_argument("--steps", type=int, default=12)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--threads", type=int, default=1, help="1 lets two experiments share 2 cores")
    g.add_argument("--prompts-per-step", type=int, default=2)
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--probe-every", type=int, default=4)
    g.add_argument("--probe-prompts", type=int, default=8)
    g.add_argument("--lr", type=float, default=0.0, help="0: the recipe's own")
    g.add_argument("--set", action="append", help="any further section.key=value override")
    g.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="tools experiment: one run per seed")
    g.add_argument("--floors", type=float, nargs="+", default=[0.0, -math.inf], help="floor experiment: the floors")
    g.add_argument("--rungs", default="", help=f"ladder: comma-separated subset of {','.join(LADDER)}")
    g.add_argument("--filter-samples", type=int, default=4)
    g.add_argument("--filter-prompts", type=int, default=16, help="ladder rung 4: train prompts the filter scores")
    g.add_argument("--filter-min-keep", type=int, default=4)
    a = ap.parse_args(argv)
    exp = a.exp if a.experiment == "summarize" else a.experiment
    if exp is None and a.experiment == "summarize":
        ap.error("summarize needs --exp")
    root = Path(a.out) / exp
    root.mkdir(parents=True, exist_ok=True)
    command = "python tools/experiments.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.experiment == "start":
        return run_start(a, root)
    if a.experiment != "summarize":
        {"learning": run_learning, "floor": run_floor, "ladder": run_ladder, "countdown": run_countdown,
         "tools": run_tools}[exp](a, root)
    write_summary(exp, root, Path(a.figures), command)


if __name__ == "__main__":
    main()
