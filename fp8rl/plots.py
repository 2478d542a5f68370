"""Plots of a run directory and comparisons between runs (PNG, matplotlib Agg).

Figures are built with `matplotlib.figure.Figure` directly (no pyplot), so no
global figure state and never a display, whatever the default backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fp8rl.runlog import EVAL_FILE, METRICS_FILE, read_metrics

Records = Sequence[Mapping[str, Any]]  # one run: metrics.jsonl records, each with "step"


def series(records: Records, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `metric`, skipping records where it is missing or not finite."""
    pts = [(r["step"], _number(r.get(metric))) for r in records]
    pts = [(s, v) for s, v in pts if v is not None]
    steps, vals = zip(*pts) if pts else ((), ())
    return np.asarray(steps, dtype=float), np.asarray(vals, dtype=float)


def _number(v: Any) -> float | None:
    """v as a finite float, or None (missing, bool, string, NaN/inf)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def plot_run(run_dir: Path) -> list[Path]:
    """Write `plots/reward.png`, `plots/mismatch.png`, `plots/timing.png` of a run.

    Reads `metrics.jsonl` and `eval.jsonl`; metrics a run lacks are left out
    (an empty axis says "no data"). Returns the three paths.
    """
    run_dir = Path(run_dir)
    recs = read_metrics(run_dir / METRICS_FILE)
    evals = read_metrics(run_dir / EVAL_FILE)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = _figure("reward and accuracy")
    _lines(ax, recs, ["reward_mean", "accuracy"])
    s, v = series(evals, "accuracy")
    if len(s):
        ax.plot(s, v, "o", label="eval accuracy")
    _finish(ax, "step", "reward / accuracy")
    reward = _save(fig, out_dir / "reward.png")

    fig = Figure(figsize=(7, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.set_title("rollout vs training mismatch")
    _lines(top, recs, ["token_mult_prob_error"])
    if top.has_data():
        top.axhline(1.0, color="grey", lw=0.8, ls=":")  # 1.0 = no mismatch
    _finish(top, None, "token_mult_prob_error")
    _lines(bottom, recs, ["gen_kl"])
    _finish(bottom, "step", "gen_kl")
    mismatch = _save(fig, out_dir / "mismatch.png")

    fig, ax = _figure("time per step")
    parts = ["time_rollout_s", "time_train_s", "time_sync_s"]
    # stack only steps that have all three parts, so the bands line up
    rows = [r for r in recs if all(_number(r.get(p)) is not None for p in parts)]
    if rows:
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r[p] for r in rows] for p in parts], labels=parts, alpha=0.8)
        _lines(ax, recs, ["time_step_s"], color="black")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # head-room for the legend above the stack
    _finish(ax, "step", "seconds")
    timing = _save(fig, out_dir / "timing.png")
    return [reward, mismatch, timing]


def plot_compare(
    runs: Mapping[str, Records | Sequence[Records]],
    metric: str,
    out: Path,
    ylabel: str | None = None,
    title: str | None = None,
) -> Path:
    """One line per flow of `metric` vs step, written to `out` (PNG).

    runs: flow name -> one run's records, or -> a list of runs (seeds), each a
    list of records. With several seeds the line is the mean over the seeds
    that logged that step, and a shaded band spans their min..max.
    """
    fig, ax = _figure(title or metric)
    for flow, value in runs.items():
        seeds = _as_seeds(value)
        per_step: dict[float, list[float]] = {}
        for recs in seeds:
            for s, v in zip(*series(recs, metric)):
                per_step.setdefault(s, []).append(v)
        if not per_step:
            continue
        steps = np.array(sorted(per_step))
        vals = [np.array(per_step[s]) for s in steps]
        (line,) = ax.plot(steps, [v.mean() for v in vals], label=f"{flow} (n={len(seeds)})")
        if len(seeds) > 1:
            ax.fill_between(
                steps, [v.min() for v in vals], [v.max() for v in vals], color=line.get_color(), alpha=0.2, lw=0
            )
    _finish(ax, "step", ylabel or metric)
    return _save(fig, Path(out))


def plot_sweep(
    series: Mapping[str, Sequence[tuple[float, float, float]]],
    out: Path,
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    """One line per flow through its sweep points, each point (x, mean, std);
    the std as an error bar (0: none). Written to `out` (PNG)."""
    fig, ax = _figure(title)
    for flow, points in series.items():
        pts = sorted(points)
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                    marker="o", capsize=3, label=flow)
    _finish(ax, xlabel, ylabel)
    return _save(fig, Path(out))


def _as_seeds(value: Records | Sequence[Records]) -> list[Records]:
    """A single run (list of dicts) becomes [run]; a list of runs stays as is."""
    if len(value) > 0 and isinstance(value[0], Mapping):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def _figure(title: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    return fig, ax


def _lines(ax: Any, records: Records, metrics: list[str], **kw: Any) -> None:
    for m in metrics:
        s, v = series(records, m)
        if len(s):
            ax.plot(s, v, label=m, **kw)


def _finish(ax: Any, xlabel: str | None, ylabel: str) -> None:
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
