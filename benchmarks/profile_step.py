"""Where a GRPO step's time goes: one step of the trainer under torch.profiler.

Builds the trainer from a run config (the default run's unless given), runs one
warm-up step, then profiles the next one and prints

- the step's phases (rollout = prefill + decode steps, scoring, optimizer
  micro-steps with their backward), in ms;
- for the rollout and for the training phase (scoring + optimizer steps),
  the torch ops that take the most time, with call counts, so that per-op
  overhead (many calls, little time each) and arithmetic (few calls, much
  time each) show apart;
- the GEMM arithmetic of each phase (FLOPs counted on one more step by
  torch's FlopCounterMode, backward included) against this CPU's FP32 GEMM
  rate on a large square matmul: the time the arithmetic alone would take,
  the floor that no reduction of per-op overhead can go below.

    python benchmarks/profile_step.py                                   # the default run (tiny policy, jet)
    python benchmarks/profile_step.py --set model=smollm2-135m-instruct --set rollout.prompts_per_step=4 \\
        --set rollout.group_size=4 --set rollout.max_new_tokens=64 --set train.micro_batches=1
    python benchmarks/profile_step.py --set flow=bf16 --set backend=cpu --rows 30

Add `--steps N` to time N steps without the profiler first (each step's rollout,
training and width, then min / median / max: how much of a difference between two runs
is the machine's noise), `--trace trace.json` to write a Chrome trace (chrome://tracing, Perfetto), and
`--shapes` to list each op per input shapes (which rows a GEMM runs on, how big the
tensors of the elementwise passes are; recording them slows a training step's large
ops several-fold, so take the times from a run without it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from fp8rl.allocator import keep_freed_memory
from fp8rl.config import load_config, parse_override
from fp8rl.train import Trainer


def _profiled(trainer: Trainer, method: str, sink: list, shapes: bool = False) -> None:
    """Make ``trainer.<method>`` run under its own profiler (recording input shapes if
    ``shapes``), appended to ``sink``."""
    fn = getattr(trainer, method)

    def wrapped(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
            out = fn(*args, **kwargs)
        sink.append(prof)
        return out

    setattr(trainer, method, wrapped)


def _inplace_mm_flops(_out, a: list, b: list, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``addmm_`` / ``baddbmm_`` (operand shapes ``[.., M, K]``, ``[.., K, N]``),
    which FlopCounterMode does not count by itself: the backends accumulate K blocks in place."""
    return 2 * math.prod(a) * b[-1]


def _counted(trainer: Trainer, method: str, flops: list) -> None:
    """Make ``trainer.<method>`` count its FLOPs (forward and backward), appended to ``flops``."""
    fn = getattr(trainer, method)
    aten = torch.ops.aten
    inplace = {aten.addmm_: _inplace_mm_flops, aten.baddbmm_: _inplace_mm_flops}

    def wrapped(*args, **kwargs):
        with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
            out = fn(*args, **kwargs)
        flops.append(counter.get_total_flops())
        return out

    setattr(trainer, method, wrapped)


def fp32_gemm_rate(n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of this CPU's FP32 GEMM on an n x n x n matmul (best of ``reps``),
    with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def op_table(profs: list, rows: int, shapes: bool = False) -> str:
    """The ops of ``profs`` by self time, summed over the profiles; with ``shapes``
    (profiles recorded with ``record_shapes``) one line per op and input shapes."""
    ops: dict[str, list[float]] = {}
    for prof in profs:
        for e in prof.key_averages(group_by_input_shape=shapes):
            key = f"{e.key} {e.input_shapes}" if shapes else e.key
            ops.setdefault(key, [0.0, 0])
            ops[key][0] += e.self_cpu_time_total
            ops[key][1] += e.count
    total, calls = sum(v[0] for v in ops.values()) / 1e3, sum(v[1] for v in ops.values())
    width = 72 if shapes else 40
    lines = [f"  {total:.0f} ms of op time in {calls} op calls",
             f"    {'op (input shapes)' if shapes else 'op':<{width}}{'self ms':>10}{'calls':>9}{'us/call':>10}"]
    for key, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"    {key[: width - 1]:<{width}}{us / 1e3:>10.1f}{n:>9}{us / max(1, n):>10.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--rows", type=int, default=20, help="ops listed per phase")
    ap.add_argument("--trace", help="also write a Chrome trace of the profiled rollout here")
    ap.add_argument("--shapes", action="store_true", help="list the ops per input shapes")
    ap.add_argument("--steps", type=int, default=1, help="steps timed without the profiler")
    args = ap.parse_args()
    keep_freed_memory()  # as the fp8rl CLI runs (fp8rl/allocator.py); for every engine in this process
    overrides = dict(parse_override(s) for s in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        overrides.update({"out": str(Path(tmp) / "run"), "eval.n": 0, "eval.every": 0, "checkpoint.every": 0})
        cfg = load_config(args.config, overrides)
        trainer = Trainer(cfg, log=lambda s: None)
        print(f"model {cfg.model}, flow {cfg.flow}, backend {trainer.backend}, "
              f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} rollouts of <= "
              f"{cfg.rollout.max_new_tokens} tokens, {cfg.train.micro_batches} micro-batch(es)")
        trainer.train_step()  # warm-up: weight conversions, tile measurements, allocator
        timed = []
        for _ in range(max(args.steps, 1)):  # timed without the profiler
            step = trainer.train_step()
            m = step.metrics
            timed.append(m["time_step_s"])
            print(f"step {m['time_step_s'] * 1e3:.0f} ms: rollout {m['time_rollout_s'] * 1e3:.0f} ms "
                  f"({m['rollout_tokens_per_s']:.0f} tokens/s), training {m['time_train_s'] * 1e3:.0f} ms; "
                  f"width {step.rollout.tokens.shape[1]} tokens; "
                  f"token_mult_prob_error {m['token_mult_prob_error']:.6f}")
        if len(timed) > 1:
            print(f"{len(timed)} steps: min {min(timed) * 1e3:.0f} ms, median {statistics.median(timed) * 1e3:.0f} ms, "
                  f"max {max(timed) * 1e3:.0f} ms")
        rollout, training = [], []
        for method, sink in (("_rollout", rollout), ("_score", training), ("_optimize", training)):
            _profiled(trainer, method, sink, args.shapes)
        trainer.train_step()
        for method in ("_rollout", "_score", "_optimize"):
            del trainer.__dict__[method]  # back to the class's methods
        flops = {"_rollout": [], "_score": [], "_optimize": []}
        for method, sink in flops.items():
            _counted(trainer, method, sink)
        trainer.train_step()
        rate = fp32_gemm_rate()
        roll_f, train_f = sum(flops["_rollout"]), sum(flops["_score"]) + sum(flops["_optimize"])
        print(f"\nGEMM arithmetic of one more step (FlopCounterMode): rollout {roll_f / 1e9:.2f} GFLOP, "
              f"training {train_f / 1e9:.2f} GFLOP; this CPU's FP32 GEMM rate (1024^3, "
              f"{torch.get_num_threads()} threads) {rate / 1e9:.1f} GFLOP/s: at that rate the arithmetic "
              f"alone takes rollout {roll_f / rate * 1e3:.0f} ms, training {train_f / rate * 1e3:.0f} ms "
              f"(timed step above: {m['time_rollout_s'] * 1e3:.0f} and {m['time_train_s'] * 1e3:.0f} ms)")
        print("\nrollout (prefill + decode steps), profiled:")
        print(op_table(rollout, args.rows, args.shapes))
        print("\ntraining (scoring + optimizer micro-steps with their backward), profiled:")
        print(op_table(training, args.rows, args.shapes))
        if args.trace:
            rollout[0].export_chrome_trace(args.trace)
            print(f"\nChrome trace of the rollout: {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
