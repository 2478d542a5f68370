"""`fp8rl compare`: the precision flows side by side, from the same start.

Every flow runs from the same initial policy, data and seeds (several seeds);
`fp8-rollout` runs twice, without correction and with `tis`, since that is the
recipe's known repair. The report folder gets `report.md` (a table of final
held-out accuracy with its spread over seeds, mismatch, step-time split and
memory), `report.json`, and `accuracy.png` / `mismatch.png` (one line per flow,
mean over seeds with a min-max band).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from fp8rl.config import RunConfig
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


def run_compare(
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


def markdown_table(rows: list[dict[str, Any]], base: RunConfig, seeds: list[int]) -> str:
    bf16_w = next((r["weight_bytes"] for r in rows if r["flow"] == "bf16"), None)
    bf16_kv = next((r["kv_bytes"] for r in rows if r["flow"] == "bf16"), None)
    lines = [
        f"# fp8rl compare: {base.model} on {base.task}, {base.train.steps} steps, seeds {seeds}",
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
    lines += ["", "![accuracy](accuracy.png) ![mismatch](mismatch.png) ![reward](reward.png)", ""]
    return "\n".join(lines)
