"""glibc's allocator settings (fp8rl/allocator.py) on and off, side by side.

Each measurement runs in its own process, alternating the two settings, so that
the heap of one cannot help the other: a SmolLM2 rollout (tokens/s over three
timed rollouts after a warm-up), SmolLM2 GRPO steps (4 prompts x 4, 64 tokens, one
micro-batch, the other training settings of `--config`; the mean of 4 steps after a
warm-up, each step's time and page faults kept) and the built-in default run (`fp8rl
train --config configs/default.toml`, wall seconds). The "kept" processes call
`keep_freed_memory` as the CLI does; the "glibc default" ones replace it with a
no-op; the "trimmed at 1 GiB" ones call it, then set glibc's trim threshold back
to 1 GiB (the CLI's setting until 2026-12-06: the heap gave back a free top over
1 GiB, which a SmolLM2 step faulted in again). Prints one JSON object and a table
with each process's peak RSS and minor page faults.

    python benchmarks/allocator.py                          # all three, 2 rounds
    python benchmarks/allocator.py --jobs rollout --rounds 3  # rollouts only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("glibc default", "trimmed at 1 GiB", "kept")


def child_rollout(model_src: str, flow: str, batch: int, max_new: int) -> dict:
    import torch

    from fp8rl.fp8.backends import fast_backend
    from fp8rl.model import load
    from fp8rl.precision import PRESETS, apply_flow
    from fp8rl.prompts import encode_prompts
    from fp8rl.rollout.engine import SamplingParams, generate
    from fp8rl.tasks import make_task

    model, tok = load(model_src)
    prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])
    plan = apply_flow(model, PRESETS[flow], backend=fast_backend(model).name)
    run = lambda n, rows: generate(model, prompts[:rows], SamplingParams(max_new_tokens=n), eos_ids=[],  # noqa: E731
                                   pad_id=tok.pad_token_id, seeds=list(range(rows)))
    run(2, 2)  # warm-up: the backend's per-shape measurements
    seconds, tokens = [], 0
    for _ in range(3):
        t0 = time.perf_counter()
        tokens = run(max_new, batch).n_tokens
        seconds.append(time.perf_counter() - t0)
    return {"backend": plan.backend.name, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / statistics.median(seconds), "threads": torch.get_num_threads()}


# Steps timed after the warm-up: the heap reaches its peak in the first two, and a trimmed heap
# faults its top in again in the later ones.
STEPS_TIMED = 4


def child_step(model_src: str, flow: str, config: str) -> dict:
    """GRPO steps of ``model_src``, 4 prompts x 4, 64 tokens, one optimizer step per rollout
    batch (as benchmarks/vs_trl.py and the profiling recipe run it) and ``config``'s other
    training settings (the default run's two gradient chunks): a warm-up step, then
    STEPS_TIMED steps, each with its own time and minor page faults."""
    from fp8rl.config import load_config
    from fp8rl.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, {
            "model": model_src, "flow": flow, "rollout.prompts_per_step": 4, "rollout.group_size": 4,
            "rollout.max_new_tokens": 64, "train.micro_batches": 1, "out": str(Path(tmp) / "run"),
            "eval.n": 0, "eval.every": 0, "checkpoint.every": 0})
        trainer = Trainer(cfg, log=lambda s: None)
        trainer.train_step()  # warm-up
        steps, train_s, faults = [], [], []
        for _ in range(STEPS_TIMED):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            m = trainer.train_step().metrics
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            steps.append(m["time_step_s"])
            train_s.append(m["time_train_s"])
    return {"seconds": statistics.mean(steps), "train_s": statistics.mean(train_s), "step_seconds": steps,
            "step_faults": faults, "backend": trainer.backend}


def child_train(config: str) -> dict:
    from fp8rl import cli

    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        rc = cli.main(["train", "--config", config, "--out", out, "--no-progress", "--json"])
        seconds = time.perf_counter() - t0
        summary = json.loads(Path(out, "summary.json").read_text()) if rc == 0 else {}
    if rc != 0:
        raise SystemExit(f"fp8rl train exited {rc}")
    return {"seconds": seconds, "steps": summary["steps"], "eval_accuracy_after": summary["eval_accuracy_after"]}


def run_child(mode: str, job: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, *job], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ALLOCATOR_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"child {mode} {job} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("ALLOCATOR_RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flow", default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--config", default="configs/default.toml",
                    help="the training run to time (train), whose training settings the steps use (step)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the settings, each in the other order")
    ap.add_argument("--jobs", default="rollout,step,train", help="which to time: rollout, step, train")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("job", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child is not None:  # one measurement, in this process
        from fp8rl import allocator, cli

        if args.child != "glibc default":
            if not allocator.keep_freed_memory():
                raise SystemExit("keep_freed_memory had no effect here (not glibc)")
        if args.child == "trimmed at 1 GiB":
            import ctypes

            ctypes.CDLL(None).mallopt(allocator.M_TRIM_THRESHOLD, 1 << 30)
        cli.keep_freed_memory = lambda: False  # the CLI's own call (the train job) must not undo the A/B
        kind, *rest = args.job
        if kind == "rollout":
            result = child_rollout(rest[0], rest[1], int(rest[2]), int(rest[3]))
        else:
            result = child_step(rest[0], rest[1], rest[2]) if kind == "step" else child_train(rest[0])
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result["maxrss_mb"], result["minor_faults"] = usage.ru_maxrss / 1024, usage.ru_minflt
        print("ALLOCATOR_RESULT " + json.dumps(result))
        return 0

    known = {"rollout": ["rollout", args.model, args.flow, str(args.batch), str(args.max_new_tokens)],
             "step": ["step", args.model, args.flow, args.config], "train": ["train", args.config]}
    if not args.jobs or set(args.jobs.split(",")) - set(known):
        raise SystemExit(f"--jobs takes a comma-separated subset of {', '.join(known)}, got {args.jobs!r}")
    jobs = [(kind, known[kind]) for kind in args.jobs.split(",")]
    rows = []
    for r in range(args.rounds):
        for kind, job in jobs:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:  # alternate which goes first
                res = run_child(mode, job)
                rows.append({"round": r, "job": kind, "mode": mode, **res})
                print(f"round {r} {kind:<8}{mode:<18}" + (f"{res['tokens_per_s']:8.1f} tok/s" if kind == "rollout"
                      else f"{res['seconds']:8.2f} s") + f"   maxrss {res['maxrss_mb']:.0f} MB"
                      f"   minor faults {res['minor_faults']}" + (
                          "   per step: " + ", ".join(f"{t:.2f} s {f} faults" for t, f in
                                                      zip(res["step_seconds"], res["step_faults"]))
                          if kind == "step" else ""), file=sys.stderr)
    summary = {}
    for kind, _ in jobs:
        for mode in MODES:
            got = [x for x in rows if x["job"] == kind and x["mode"] == mode]
            key = "tokens_per_s" if kind == "rollout" else "seconds"
            summary[f"{kind} {mode}"] = {key: statistics.median(x[key] for x in got),
                                         "maxrss_mb": max(x["maxrss_mb"] for x in got),
                                         "minor_faults": statistics.median(x["minor_faults"] for x in got)}
            if kind == "step":
                summary[f"{kind} {mode}"]["train_s"] = statistics.median(x["train_s"] for x in got)
        b = summary[f"{kind} kept"]
        for base, name in (("glibc default", "speedup"), ("trimmed at 1 GiB", "speedup over trimmed")):
            a = summary[f"{kind} {base}"]
            summary[f"{kind} {name}"] = (b["tokens_per_s"] / a["tokens_per_s"] if kind == "rollout"
                                         else a["seconds"] / b["seconds"])
    import torch
    from vs_trl import cpu_name  # benchmarks/ is on sys.path when this script runs

    report = {"cpu": cpu_name(), "torch": torch.__version__, "model": args.model,
              "flow": args.flow, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
              "config": args.config, "rows": rows, "summary": summary}
    print(json.dumps(report, indent=2))
    for k, v in summary.items():
        print(f"{k:<34}{v if isinstance(v, float) else json.dumps(v)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
