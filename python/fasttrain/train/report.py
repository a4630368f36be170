"""What a run leaves behind for judging it: export.json, report.md, PNG plots, and the ladder
table that compares several runs (docs/design.md, "The run folder")."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fasttrain.train.run_files import read_jsonl, write_json, write_text

__all__ = ["write_outputs", "write_report", "write_plots", "ladder_table"]


def _num(v: Any) -> Any:
    """Run files store non-finite floats as strings ("nan": e.g. the holdout of an environment
    that has no holdout slice); read them back as floats."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return v


def _diff(a: Any, b: Any) -> float | None:
    a, b = _num(a), _num(b)
    return a - b if a is not None and b is not None and math.isfinite(a - b) else None


def _fmt(v: Any, spec: str = "+.4f") -> str:
    v = _num(v)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def write_outputs(trainer, shipped: dict[str, Any] | None, interrupted: bool = False) -> dict[str, Any]:
    d: Path = trainer.dir
    metrics = read_jsonl(d / "metrics.jsonl")
    probes = read_jsonl(d / "probes.jsonl")
    start = probes[0] if probes and probes[0]["step"] == 0 else None
    export = {
        "run_id": trainer.run_id,
        "finished": time.time(),
        "interrupted": interrupted,
        "steps_done": trainer.step,
        "config": trainer.cfg.to_dict(),
        "env": {"name": trainer.env.name, "channels": [c.__dict__ for c in trainer.env.channels],
                "train_prompts": len(trainer.train_prompts), "probe_prompts": len(trainer.probe_prompts)},
        "steps": metrics,
        "zeta": [m["zeta"] for m in metrics],
        "nonzero_adv_share": [m["nonzero_adv_share"] for m in metrics],
        "probes": probes,
        "shipped": shipped,
        "start_probe": start,
        "holdout_change": _diff(shipped["holdout_core"], start["holdout_core"]) if shipped and start else None,
        "warnings": trainer.warnings,
        "skipped_rows": {"count": len(trainer.skipped_rows), "reasons": trainer.skipped_rows[:100]},
    }
    write_json(d / "export.json", export)
    plots = write_plots(d, metrics, probes)
    write_report(d, export, plots)
    return export


def write_report(d: Path, export: dict[str, Any], plots: list[str]) -> None:
    cfg = export["config"]
    m = export["steps"]
    sh = export["shipped"]
    lines = [f"# Run {export['run_id']}", ""]
    lines.append(f"- recipe: `{cfg['run']['name']}`; policy `{cfg['policy']['model']}` "
                 f"({cfg['policy']['quantize']}, {cfg['policy']['adapter']} r {cfg['policy']['rank']} "
                 f"α {cfg['policy']['alpha']:g}); env `{export['env']['name']}`")
    lines.append(f"- loss {cfg['loss']['kind']}, β {cfg['loss']['beta']:g}, token mask "
                 f"{cfg['loss']['token_mask']}, passes {cfg['loss']['passes']}, REPO-R "
                 f"{'on' if cfg['loss']['repo_r'] else 'off'}; guard {cfg['advantages']['guard']} "
                 f"(floor {cfg['advantages']['floor']})")
    lines.append(f"- {cfg['rollout']['prompts_per_step']} prompts × {cfg['rollout']['group_size']} answers, "
                 f"{cfg['rollout']['max_new_tokens']} new tokens, lr {cfg['optim']['lr']:g}, "
                 f"seed {cfg['run']['seed']}")
    lines.append(f"- steps done: {export['steps_done']} / {cfg['run']['steps']}"
                 + (" (interrupted)" if export["interrupted"] else ""))
    if m:
        secs = sum(r["seconds_step"] for r in m)
        lines.append(f"- training time {secs:.1f} s ({secs / len(m):.2f} s/step); "
                     f"last step: reward {m[-1]['reward']:+.3f}, core {m[-1]['core']:+.4f}, "
                     f"valid {m[-1]['valid']:.0%}, non-zero advantages {m[-1]['nonzero_adv_share']:.0%}, "
                     f"KL {m[-1]['kl']:.4f}, entropy {m[-1]['entropy']:.3f}, ζ {m[-1]['zeta']:.2e}")
        skipped = sum(1 for r in m if r["skipped"])
        if skipped:
            lines.append(f"- skipped updates (non-finite loss): {skipped}")
    if sh:
        lines.append(f"- **shipped: step {sh['step']}** (best train-side probe core {sh['train_core']:+.4f}); "
                     f"holdout {_fmt(sh['holdout_core'])}, change vs start {_fmt(export['holdout_change'])}")
    lines += ["", "## Probe", "", "| step | train core | train valid | holdout core | holdout valid | |",
              "|---:|---:|---:|---:|---:|---|"]
    for p in export["probes"]:
        mark = "shipped" if sh and p["step"] == sh["step"] else ""
        lines.append(f"| {p['step']} | {_fmt(p['train_core'])} | {_fmt(p['train_valid'], '.0%')} | "
                     f"{_fmt(p['holdout_core'])} | {_fmt(p['holdout_valid'], '.0%')} | {mark} |")
    if export["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- step {w['step']}: {w['message']}" for w in export["warnings"]]
    skipped = export.get("skipped_rows") or {"count": 0, "reasons": []}
    if skipped["count"]:
        lines += ["", f"## Rows left out (env.skip_bad_rows): {skipped['count']}", ""] + \
                 [f"- {r}" for r in skipped["reasons"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    write_text(d / "report.md", "\n".join(lines) + "\n")


def write_plots(d: Path, metrics: list[dict[str, Any]], probes: list[dict[str, Any]]) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    steps = [r["step"] for r in metrics]

    def save(fig, name):
        tmp = d / f".{name}.tmp.png"
        fig.tight_layout()
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        tmp.replace(d / name)
        out.append(name)

    if metrics:
        fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
        for ax, (key, title) in zip(axes.flat, [("reward", "reward (priority-weighted sum)"), ("core", "core"),
                                                ("valid", "valid share"), ("kl", "KL to base"),
                                                ("entropy", "entropy"), ("loss", "loss (last pass)")]):
            ax.plot(steps, [r[key] for r in metrics], lw=1)
            ax.set_title(title)
            ax.set_xlabel("step")
        save(fig, "training_curves.png")
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        ax[0].plot(steps, [r["zeta"] for r in metrics], lw=1)
        ax[0].set_title("REPO-R ζ")
        ax[1].plot(steps, [r["nonzero_adv_share"] for r in metrics], lw=1)
        ax[1].axhline(0.5, color="grey", ls=":")
        ax[1].set_ylim(-0.02, 1.02)
        ax[1].set_title("share of answers with non-zero advantage")
        for a in ax:
            a.set_xlabel("step")
        save(fig, "zeta_and_share.png")
    if probes:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ps = [p["step"] for p in probes]
        ax.plot(ps, [p["train_core"] for p in probes], "o-", label="train slice (selector)")
        hold = [_num(p["holdout_core"]) for p in probes]
        if any(h is not None and math.isfinite(h) for h in hold):
            ax.plot(ps, hold, "s-", label="holdout slice")
        ax.set_xlabel("step")
        ax.set_title("probe core")
        ax.legend()
        save(fig, "probe_scores.png")
    return out


def _rung_name(cfg: dict[str, Any]) -> str:
    return (f"{cfg['run']['name']}: {cfg['loss']['kind']}, {cfg['policy']['adapter']}, "
            f"{'REPO-R, ' if cfg['loss']['repo_r'] else ''}{cfg['loss']['token_mask']} tokens, "
            f"{cfg['loss']['passes']} pass{'es' if cfg['loss']['passes'] > 1 else ''}"
            f"{', filtered prompts' if cfg['env']['prompts'] else ''}")


def _holdouts(runs: list[dict[str, Any]], key: str) -> list[float] | None:
    """Each seed's holdout core of the shipped checkpoint (key "shipped") or of the start probe
    ("start_probe"); None when a run has none (no holdout slice, no probe)."""
    out = []
    for e in runs:
        v = _num((e.get(key) or {}).get("holdout_core"))
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        out.append(float(v))
    return out


def _cell(iv) -> str:
    if iv is None:
        return "-"
    return iv.show("+.3f") + (" *" if iv.excludes_zero else "")


def ladder_table(rungs: list[list[dict[str, Any]]]) -> str:
    """The table that ranks the rungs (exports [rung][seed], the same seeds on every rung): the
    shipped holdout core as mean and 95% t-interval over seeds; the change against the rung's own
    start probe and against the previous rung as paired differences (same seeds) with their
    95% intervals; * marks an interval that excludes 0."""
    from fasttrain.train.intervals import mean_interval, paired_difference

    seeds = len(rungs[0]) if rungs else 0
    lines = [f"| rung | configuration | shipped steps | holdout, shipped (mean [95%], {seeds} seed"
             f"{'s' if seeds != 1 else ''}) | change vs start (paired) | vs previous rung (paired) |",
             "|---:|---|---|---:|---:|---:|"]
    prev = None
    for i, runs in enumerate(rungs, 1):
        hold, start = _holdouts(runs, "shipped"), _holdouts(runs, "start_probe")
        steps = ", ".join(str((e["shipped"] or {}).get("step", "-")) for e in runs)
        lines.append(f"| {i} | {_rung_name(runs[0]['config'])} | {steps} | "
                     f"{_cell(mean_interval(hold) if hold else None)} | "
                     f"{_cell(paired_difference(start, hold) if hold and start else None)} | "
                     f"{_cell(paired_difference(prev, hold) if hold and prev and len(prev) == len(hold) else None)} |")
        prev = hold
    lines += ["", "Intervals are Student-t over seeds; a change is the mean of the per-seed differences "
              "(seed i of one rung against seed i of the other). * the 95% interval excludes 0."]
    return "\n".join(lines) + "\n"
