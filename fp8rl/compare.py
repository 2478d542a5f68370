"""`fp8rl compare`: the precision flows side by side, from the same start.

Every flow runs from the same initial policy, data and seeds (several seeds);
`fp8-rollout` runs twice, without correction and with `tis`, since that is the
recipe's known repair. The report folder gets `report.md` (a table of final
held-out accuracy with its spread over seeds, mismatch, step-time split and
memory, then per-answer mismatch, IS weights, reward trend and FP8-gradient
flush shares), `report.json`, and `accuracy.png` / `mismatch.png` (one line per
flow, mean over seeds with a min-max band). `compare.sweep` repeats the grid at
several settings (answer length, in configs/long-answers.toml) and adds a
report across them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from fp8rl.config import RunConfig, sweep_points
from fp8rl.runlog import read_metrics


@dataclass(frozen=True)
class Variant:
    label: str
    flow: str
    correction: str


def variants(flows: list[str], base_correction: str) -> list[Variant]:
    out: list[Variant] = []
    for f in flows:
        if f == "fp8-rollout":
            out.append(Variant("fp8-rollout", f, "none"))
            out.append(Variant("fp8-rollout+tis", f, "tis"))
        else:
            out.append(Variant(f, f, base_correction))
    return out


def weight_bytes(model: torch.nn.Module, rollout_fp8: bool) -> int:
    """Bytes of the weights the rollout engine reads: FP8 data + scales for
    converted linears when the rollout runs them in FP8, BF16 for everything else.
    `model` must be under its flow (apply_flow quantized the weights)."""
    from fp8rl.fp8 import FP8Linear

    total = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FP8Linear) and rollout_fp8:
            total += module.qweight.nbytes  # FP8 data + scales, as the rollout reads them
            seen.add(id(module.weight))
            if module.bias is not None:
                total += module.bias.numel() * 2
                seen.add(id(module.bias))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 2
    return total


def kv_bytes(model: torch.nn.Module, precision: str, batch: int, cache_len: int) -> int:
    from fp8rl.rollout.kv_cache import KVCache

    c = model.config
    ones = [torch.ones(c.num_kv_heads)] * c.num_layers
    cache = KVCache(c.num_layers, batch, c.num_kv_heads, cache_len, c.head_dim,
                    "fp8" if precision == "fp8" else "bf16",
                    k_scales=ones if precision == "fp8" else None, v_scales=ones if precision == "fp8" else None,
                    device="meta")
    return cache.nbytes


def _spread(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _mean_of(runs: list[list[dict[str, Any]]], key: str) -> float | None:
    """Mean of `key` over every step of every run; None where no step logged it
    (`grad_flushed_frac` exists only when gradients travel in FP8)."""
    xs = [x[key] for run in runs for x in run if key in x]
    return statistics.fmean(xs) if xs else None


def run_compare(
    base: RunConfig,
    flows: list[str],
    seeds: list[int],
    report_dir: Path,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The flows x seeds grid of `base`, or, with `compare.sweep`, one grid per
    sweep point in `report_dir`/<label> and a combined report across them.
    Finished runs are reused (a run folder with a config resumes), so the same
    command continues an interrupted study."""
    points = sweep_points(base.compare.sweep)
    if not points:
        return _run_grid(base, flows, seeds, report_dir, progress=progress, log=log)
    # Every point's config is built (and so validated) before the first run starts.
    configs = [(label, base.replace(**over, **{"compare.sweep": []})) for label, over in points]
    reports = {}
    for (label, cfg), (_, over) in zip(configs, points):
        log(f"compare: sweep point {label}: {' '.join(f'{k}={v}' for k, v in over.items())}")
        reports[label] = (cfg, _run_grid(cfg, flows, seeds, Path(report_dir) / label, progress=progress, log=log))
    return _write_sweep_report(base, flows, seeds, Path(report_dir), reports)


def _run_grid(
    base: RunConfig,
    flows: list[str],
    seeds: list[int],
    report_dir: Path,
    *,
    progress: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from fp8rl.model import load
    from fp8rl.plots import plot_compare
    from fp8rl.precision import PRESETS, apply_flow
    from fp8rl.rollout.engine import default_cache_len
    from fp8rl.train import Trainer

    report_dir = Path(report_dir)
    if report_dir.exists() and not report_dir.is_dir():
        raise FileExistsError(f"output path {report_dir} is a file, not a folder; choose another --out")
    report_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for v in variants(flows, base.train.correction):
        runs = []
        for seed in seeds:
            out = report_dir / "runs" / f"{v.label}-seed{seed}"
            cfg = base.replace(**{"flow": v.flow, "seed": seed, "out": str(out), "train.correction": v.correction})
            resume = (out / "config.json").exists()
            log(f"compare: {v.label} seed {seed} -> {out}{' (resuming)' if resume else ''}")
            summary = Trainer(cfg, resume=resume, log=log).run(progress=progress)
            runs.append({"summary": summary, "metrics": read_metrics(out / "metrics.jsonl"),
                         "eval": read_metrics(out / "eval.jsonl")})
        results[v.label] = {"variant": v.__dict__, "runs": runs}

    batch = base.rollout.prompts_per_step * base.rollout.group_size
    cache_len = default_cache_len(64, base.rollout.max_new_tokens)
    rows = []
    for label, res in results.items():
        flow = PRESETS[res["variant"]["flow"]]
        m = [r["metrics"] for r in res["runs"]]
        acc = [r["summary"]["eval_accuracy_after"] for r in res["runs"]]
        acc0 = [r["summary"]["eval_accuracy_before"] for r in res["runs"]]
        tmpe = [x["token_mult_prob_error"] for run in m for x in run]
        fresh, _ = load(base.model)
        apply_flow(fresh, flow, backend=base.backend)
        row = {
            "label": label,
            "flow": flow.name,
            "correction": res["variant"]["correction"],
            "seeds": len(res["runs"]),
            "accuracy_before": statistics.fmean(acc0),
            "accuracy_mean": _spread(acc)[0],
            "accuracy_std": _spread(acc)[1],
            "accuracy_min": min(acc),
            "accuracy_max": max(acc),
            "token_mult_prob_error_mean": statistics.fmean(tmpe),
            "token_mult_prob_error_max": max(tmpe),
            "gen_kl_mean": statistics.fmean(x["gen_kl"] for run in m for x in run),
            "response_len_mean": _mean_of(m, "response_len_mean"),
            "seq_log_ratio_abs_mean": _mean_of(m, "seq_log_ratio_abs_mean"),
            "seq_ratio_off_2x_frac": _mean_of(m, "seq_ratio_off_2x_frac"),
            "is_weight_mean": _mean_of(m, "is_weight_mean"),
            "is_clip_frac": _mean_of(m, "is_clip_frac"),
            "grad_flushed_frac": _mean_of(m, "grad_flushed_frac"),
            "grad_flushed_frac_by_layer": {
                k.split(".", 1)[1]: _mean_of(m, k) for k in sorted({k for run in m for x in run for k in x})
                if k.startswith("grad_flushed_frac.")
            },
            # training reward over the first and the last 5 steps (mean over seeds): learning, or not
            "reward_first5": statistics.fmean(x["reward_mean"] for run in m for x in run[:5]),
            "reward_last5": statistics.fmean(x["reward_mean"] for run in m for x in run[-5:]),
            "time_rollout_s": statistics.fmean(x["time_rollout_s"] for run in m for x in run),
            "time_train_s": statistics.fmean(x["time_train_s"] for run in m for x in run),
            "time_sync_s": statistics.fmean(x["time_sync_s"] for run in m for x in run),
            "weight_bytes": weight_bytes(fresh, flow.rollout_linear == "fp8"),
            "kv_bytes": kv_bytes(fresh, flow.kv_cache, batch, cache_len),
            "diverged": any(r["summary"]["skipped_steps"] for r in res["runs"]),
        }
        rows.append(row)

    plot_compare({k: [r["eval"] for r in v["runs"]] for k, v in results.items()}, "accuracy",
                 report_dir / "accuracy.png", ylabel="held-out accuracy", title="accuracy vs step")
    plot_compare({k: [r["metrics"] for r in v["runs"]] for k, v in results.items()}, "token_mult_prob_error",
                 report_dir / "mismatch.png", ylabel="token_mult_prob_error", title="rollout/training mismatch")
    plot_compare({k: [r["metrics"] for r in v["runs"]] for k, v in results.items()}, "reward_mean",
                 report_dir / "reward.png", ylabel="reward_mean", title="training reward vs step")
    report = {"config": base.to_dict(), "flows": flows, "seeds": seeds, "rows": rows}
    (report_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (report_dir / "report.md").write_text(markdown_table(rows, base, seeds))
    return report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]], base: RunConfig, seeds: list[int], title: str | None = None) -> str:
    bf16_w = next((r["weight_bytes"] for r in rows if r["flow"] == "bf16"), None)
    bf16_kv = next((r["kv_bytes"] for r in rows if r["flow"] == "bf16"), None)
    lines = [
        title or f"# fp8rl compare: {base.model} on {base.task}, {base.train.steps} steps, seeds {seeds}",
        "",
        "| flow | correction | accuracy before | accuracy after (mean ± std) | min..max | "
        "token_mult_prob_error mean / max | gen_kl mean | step time s (rollout / train / sync) | "
        "weights MB | KV MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = f"{r['weight_bytes'] / 1e6:.2f}" + (f" ({r['weight_bytes'] / bf16_w:.2f}x)" if bf16_w else "")
        kv = f"{r['kv_bytes'] / 1e6:.2f}" + (f" ({r['kv_bytes'] / bf16_kv:.2f}x)" if bf16_kv else "")
        lines.append(
            f"| {r['label']} | {r['correction']} | {r['accuracy_before']:.3f} | "
            f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | {r['accuracy_min']:.3f}..{r['accuracy_max']:.3f} | "
            f"{r['token_mult_prob_error_mean']:.6f} / {r['token_mult_prob_error_max']:.6f} | {r['gen_kl_mean']:.2e} | "
            f"{r['time_rollout_s']:.2f} / {r['time_train_s']:.2f} / {r['time_sync_s']:.2f} | {w} | {kv} |"
        )
    lines += [
        "",
        "| flow | answer tokens | mean \\|s\\| (sequence log-ratio) | answers off by > 2x | IS weight mean | "
        "IS clipped | reward, first 5 steps -> last 5 | FP8 gradient entries flushed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {_fmt(r['response_len_mean'], '.1f')} | {_fmt(r['seq_log_ratio_abs_mean'], '.3f')} | "
            f"{_fmt(r['seq_ratio_off_2x_frac'], '.1%')} | {_fmt(r['is_weight_mean'], '.4f')} | "
            f"{_fmt(r['is_clip_frac'], '.2%')} | {r['reward_first5']:.3f} -> {r['reward_last5']:.3f} | "
            f"{_fmt(r['grad_flushed_frac'], '.2%')} |"
        )
    flushed = [r for r in rows if r["grad_flushed_frac_by_layer"]]
    for r in flushed:
        per = ", ".join(f"{k} {v:.2%}" for k, v in r["grad_flushed_frac_by_layer"].items())
        lines += ["", f"{r['label']}: nonzero gradient entries flushed to zero by FP8 transport, per layer: {per}"]
    lines += ["", "![accuracy](accuracy.png) ![mismatch](mismatch.png) ![reward](reward.png)", ""]
    return "\n".join(lines)


def _write_sweep_report(
    base: RunConfig, flows: list[str], seeds: list[int], report_dir: Path,
    reports: dict[str, tuple[RunConfig, dict[str, Any]]],
) -> dict[str, Any]:
    """report.md / report.json across the sweep points, and two plots against the
    mean answer length of each point: held-out accuracy, and the sequence-level
    mismatch mean |s|, one line per flow."""
    from fp8rl.plots import plot_sweep

    parts = [f"# fp8rl compare: {base.model}, {base.train.steps} steps, seeds {seeds}, swept over "
             f"{', '.join(reports)}", "", "![accuracy vs answer length](length_accuracy.png) "
             "![sequence mismatch vs answer length](length_mismatch.png)", ""]
    acc: dict[str, list[tuple[float, float, float]]] = {}
    seq: dict[str, list[tuple[float, float, float]]] = {}
    for label, (cfg, report) in reports.items():
        table = markdown_table(report["rows"], cfg, seeds, title=f"## {label}: {cfg.task}, "
                               f"rollout.max_new_tokens {cfg.rollout.max_new_tokens}")
        parts.append(table.replace("](", f"]({label}/"))
        for r in report["rows"]:
            length = r["response_len_mean"] or 0.0
            acc.setdefault(r["label"], []).append((length, r["accuracy_mean"], r["accuracy_std"]))
            seq.setdefault(r["label"], []).append((length, r["seq_log_ratio_abs_mean"] or 0.0, 0.0))
    plot_sweep(acc, report_dir / "length_accuracy.png", xlabel="mean answer tokens",
               ylabel="held-out accuracy after training", title="accuracy vs answer length")
    plot_sweep(seq, report_dir / "length_mismatch.png", xlabel="mean answer tokens",
               ylabel="mean |s| (sequence log importance ratio)", title="off-policy drift vs answer length")
    combined = {"config": base.to_dict(), "flows": flows, "seeds": seeds,
                "sweep": {label: report for label, (_, report) in reports.items()}}
    (report_dir / "report.json").write_text(json.dumps(combined, indent=2) + "\n")
    (report_dir / "report.md").write_text("\n".join(parts))
    return combined
