"""Seconds per GRPO step on 1 process vs N data-parallel ranks (torchrun, gloo).

The same run (the default config's batch: tiny-arith, 16 prompts x 8 samples,
2 micro-batches, flow jet) trained for a few steps by `fp8rl train` in one
process with all cores and by `fp8rl train --nproc N` with one thread per rank,
side by side; the first step is a warm-up, the mean of the others is reported.
Also checks that the runs agree bit for bit (metrics apart from timings, and
the final weights).

    python benchmarks/data_parallel.py                 # 1 vs 2 ranks, 5 steps (about 2 minutes on 2 cores)
    python benchmarks/data_parallel.py --nproc 1,2 --steps 6 --flow jet-kv
    python benchmarks/data_parallel.py --nproc 1 --grad-chunks 1,2,4   # what the exact chunked sum costs

With several `--grad-chunks`, every (ranks, chunks) pair that splits runs; a run
is compared bit for bit with the first process count's run of the same chunks
(different chunk counts are different runs).

JSON on stdout, a table on stderr. Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from vs_trl import cpu_name  # benchmarks/ is on sys.path when a script here runs

from fp8rl.fp8.backends import amx_available

TIMING = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes"}


def run(nproc: int, chunks: int, steps: int, flow: str, backend: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fp8rl", "train", "--config", "configs/default.toml", "--out", str(out),
           "--steps", str(steps), "--flow", flow, "--backend", backend, "--no-progress",
           "--set", "eval.n=0", "--set", f"checkpoint.every={steps}", "--set", f"train.grad_chunks={chunks}",
           "--nproc", str(nproc)]
    env = dict(os.environ)
    if nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # one core per rank
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]
    mean = lambda k: sum(r[k] for r in timed) / len(timed)  # noqa: E731
    return {"nproc": nproc, "grad_chunks": chunks, "wall_s": wall, "step_s": mean("time_step_s"), "rollout_s": mean("time_rollout_s"),
            "train_s": mean("time_train_s"), "rows": rows}


def same_run(a: Path, b: Path, rows_a: list[dict], rows_b: list[dict], steps: int) -> bool:
    metrics = all({k: v for k, v in x.items() if k not in TIMING} == {k: v for k, v in y.items() if k not in TIMING}
                  for x, y in zip(rows_a, rows_b))
    wa = load_file(a / "checkpoints" / f"step_{steps}" / "model.safetensors")
    wb = load_file(b / "checkpoints" / f"step_{steps}" / "model.safetensors")
    return metrics and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="1,2", help="comma-separated process counts (first = the baseline)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--flow", default="jet")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--grad-chunks", default="2", help="comma-separated train.grad_chunks values (default config: 2)")
    args = ap.parse_args()
    counts = [int(x) for x in args.nproc.split(",")]
    chunk_counts = [int(x) for x in args.grad_chunks.split(",")]
    configs = [(n, c) for c in chunk_counts for n in counts if c % n == 0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        out = {(n, c): Path(tmp) / f"n{n}_c{c}" for n, c in configs}
        for n, c in configs:
            results.append(run(n, c, args.steps, args.flow, args.backend, out[n, c]))
        base = results[0]
        first = {}  # chunks -> the run of the first process count
        for r in results:
            ref = first.setdefault(r["grad_chunks"], r)
            r["speedup"] = base["step_s"] / r["step_s"]
            r["bitwise_equal_to_first"] = same_run(out[ref["nproc"], ref["grad_chunks"]], out[r["nproc"], r["grad_chunks"]],
                                                   ref["rows"], r["rows"], args.steps)
    for r in results:
        del r["rows"]
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "amx": amx_available(),
              "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(), "torch": torch.__version__,
              "flow": args.flow, "backend": args.backend,
              "steps_timed": args.steps - 1, "results": results}
    print(f"{'ranks':>5} {'chunks':>6} {'s/step':>8} {'rollout':>8} {'train':>8} {'speedup':>8} {'bitwise':>8}",
          file=sys.stderr)
    for r in results:
        print(f"{r['nproc']:>5} {r['grad_chunks']:>6} {r['step_s']:>8.2f} {r['rollout_s']:>8.2f} {r['train_s']:>8.2f} "
              f"{r['speedup']:>7.2f}x {str(r['bitwise_equal_to_first']):>8}", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
