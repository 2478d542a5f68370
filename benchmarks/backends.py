"""Which backend is fastest here: GRPO steps per backend, side by side, and what `auto` picks.

`backend = "auto"` (fp8rl/fp8/backends.py `choose_backend`, its rule `fast_backend`)
picks `amx` on CPUs with AMX tiles (every model size), `amx` on CPUs with AVX512-BF16
and no AMX for dense models and for mixtures of experts at least
`AVX512_BF16_MIN_MOE_WIDTH` wide (`cpu` below), `cpu` on
AVX2-only CPUs, after checking batch invariance on the model's shapes. This script is
the measurement behind that rule: the same GRPO steps (the trainer, default task, fixed seed) on every
backend in the registry, for the built-in tiny policy and SmolLM2-135M, bf16 and
jet flows; the first step is a warm-up, the next ones are timed.

    python benchmarks/backends.py                          # both models (about 6 min on 2 cores)
    python benchmarks/backends.py --models tiny-arith --steps 4
    python benchmarks/backends.py --models tiny-arith,width-192,width-256,width-384   # where the pick turns
    python benchmarks/backends.py --models tiny-moe,moe-width-256 --backends cpu,amx  # mixtures of experts

`width-N` is tiny-arith's architecture widened to hidden size N (MLP 3N, heads of 32,
half as many KV heads) with seeded random weights and tiny-arith's tokenizer, run on
the default run's batch: the model sizes between the tiny policy and SmolLM2, to see
at which width a backend overtakes another on this CPU. `moe-width-N` is tiny-moe's
(4 experts, top 2) at hidden and expert width N. Their answers are random
tokens that run to the 48-token budget, so compare its rows with each other only.

Run it on each kind of CPU, or let oneDNN / MKL / torch take another CPU's code
path on this one (what tests/test_engine.py OTHER_CPUS does):

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/backends.py   # AVX-512-BF16, no AMX (AMD EPYC-like)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/backends.py

JSON on stdout, a table on stderr; each configuration runs in a fresh process, and
"peak MB" is that process's peak resident memory (torch itself included).
`reference` is left out for SmolLM2 unless asked for (`--backends`): its float64
GEMMs take minutes per step there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8rl.config import RunConfig
from fp8rl.fp8.backends import BACKENDS, amx_available, avx512_bf16_available, resolve_backend

MODEL_SETTINGS = {
    # the default run's batch (configs/default.toml)
    "tiny-arith": {"rollout.prompts_per_step": 16, "rollout.group_size": 8, "rollout.max_new_tokens": 48,
                   "train.micro_batches": 2},
    # benchmarks/vs_trl.py's SmolLM2 batch
    "smollm2-135m-instruct": {"rollout.prompts_per_step": 4, "rollout.group_size": 4,
                              "rollout.max_new_tokens": 64, "train.micro_batches": 1},
}


def width_model(name: str, folder: Path) -> str:
    """``width-N`` -> the path of a random-weight tiny-arith of hidden size N written
    under ``folder``; ``moe-width-N`` the same for tiny-moe (experts N wide); any other
    name is returned as it is."""
    if not name.startswith(("width-", "moe-width-")):
        return name
    import dataclasses

    from fp8rl.model import load
    from fp8rl.model.export import export_hf
    from fp8rl.model.transformer import Transformer

    moe = name.startswith("moe-")
    width = int(name.removeprefix("moe-").removeprefix("width-"))
    if width % 64:
        raise SystemExit(f"{name}: the width must be a multiple of 64 (heads of 32, half as many KV heads)")
    tiny, tok = load("tiny-moe" if moe else "tiny-arith")
    config = dataclasses.replace(tiny.config, hidden_size=width, intermediate_size=width if moe else 3 * width,
                                 num_heads=width // 32, num_kv_heads=width // 64)
    if moe:
        config = dataclasses.replace(config, moe_intermediate_size=width)
    torch.manual_seed(width)
    out = folder / name
    if not out.exists():
        export_hf(Transformer(config), tok, out, dtype=torch.float32)
    return str(out)


def time_steps(model: str, flow: str, backend: str, steps: int) -> dict:
    """Mean phase times of ``steps - 1`` GRPO steps after a warm-up, in a fresh
    process (so that its peak resident memory is this configuration's own)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_time_steps, model, flow, backend, steps).result()


def _time_steps(model: str, flow: str, backend: str, steps: int) -> dict:
    from fp8rl.model import load
    from fp8rl.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig().replace(**{
            "model": model, "flow": flow, "backend": backend, "out": str(Path(tmp) / "run"), "seed": 0,
            "train.steps": steps, "train.lr": 1e-6, "eval.n": 0, "eval.every": 0, "checkpoint.every": 0,
            **MODEL_SETTINGS.get(model, MODEL_SETTINGS["tiny-arith"]),
        })
        policy, tok = load(model)
        trainer = Trainer(cfg, model=policy, tokenizer=tok, log=lambda s: None)
        rows = [trainer.train_step().metrics for _ in range(steps)][1:]  # the first is a warm-up
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("time_rollout_s", "time_train_s", "time_step_s")}
    return {"model": model, "flow": flow, "backend": trainer.backend, **mean,
            "token_mult_prob_error": max(r["token_mult_prob_error"] for r in rows),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,smollm2-135m-instruct")
    ap.add_argument("--flows", default="bf16,jet")
    ap.add_argument("--backends", default="", help="comma-separated; default: all (no reference for SmolLM2)")
    ap.add_argument("--steps", type=int, default=3, help="steps per run, the first a warm-up")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is a warm-up)")
    from fp8rl.model import load

    rows, picks = [], {}
    with tempfile.TemporaryDirectory() as models:  # the width-N models' folders
        for name in args.models.split(","):
            model = width_model(name, Path(models))
            names = args.backends.split(",") if args.backends else [
                b for b in BACKENDS if not (b == "reference" and name != "tiny-arith")]
            picks[name] = resolve_backend("auto", load(model)[0]).name
            for flow in args.flows.split(","):
                for backend in names:
                    t0 = time.perf_counter()
                    rows.append({**time_steps(model, flow, backend, args.steps), "model": name})
                    print(f"{name} {flow} {backend}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "amx_tiles": amx_available(),
              "avx512_bf16": avx512_bf16_available(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "env": env, "auto_picks": picks,
              "results": rows}
    print(json.dumps(report, indent=2))
    print(f"\nAMX tiles: {amx_available()}, AVX512-BF16: {avx512_bf16_available()}, "
          f"torch kernels: {report['cpu_capability']}, env: {env or '-'}",
          file=sys.stderr)
    print(f"{'model':<24}{'flow':<12}{'backend':<11}{'rollout s':>10}{'train s':>9}{'step s':>8}{'vs fastest':>11}"
          f"{'tmpe':>10}{'peak MB':>9}  auto", file=sys.stderr)
    for r in rows:
        same = [x["time_step_s"] for x in rows if x["model"] == r["model"] and x["flow"] == r["flow"]]
        auto = "<-" if picks[r["model"]] == r["backend"] else ""
        print(f"{r['model']:<24}{r['flow']:<12}{r['backend']:<11}{r['time_rollout_s']:>10.2f}{r['time_train_s']:>9.2f}"
              f"{r['time_step_s']:>8.2f}{r['time_step_s'] / min(same):>11.2f}{r['token_mult_prob_error']:>10.6f}"
              f"{r['peak_mem_bytes'] / 1e6:>9.0f}  {auto}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
