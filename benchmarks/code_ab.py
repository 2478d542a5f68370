"""Old code against new: one flow's rollout tokens/s (or, with `--step`, its GRPO step) under a
git revision and under the working tree, in alternating fresh processes (the VM's speed drifts by
5-10% over minutes, so only rounds run side by side compare).

The revision is checked out into a temporary worktree and put first on PYTHONPATH for its
processes; the compiled kernels are cached per source, so both builds coexist. Each process
runs `fp8rl.bench.bench_rollout` (a warm-up, then `--repeats` timed rollouts, their median) on
the held-out `arith` prompts with EOS disabled, as benchmarks/rollout.py does. With `--step`,
it runs vs_trl.py's fp8rl side instead (`run_fp8rl`: that model's vs_trl shape, one warm-up step,
then `--repeats` timed GRPO steps, their mean) and reports steps per second, so the ratio reads
the same way (above 1: the working tree is faster). With `--load`, it times loading the model
(after the imports `fp8rl train` makes) and reads the process's peak RSS, reported as loads per
second.

    python benchmarks/code_ab.py --base 9c01299 --model smollm2-135m-instruct --flow bf16 \\
        --batch 64 --max-new-tokens 128 --rounds 3
    python benchmarks/code_ab.py --base 8d1e6cf --model tiny-arith --step --repeats 8 --rounds 3
    python benchmarks/code_ab.py --base e3fefe2 --model smollm2-135m-instruct --load --rounds 3

Prints one JSON object on stdout (every round's tokens/s, the new/old ratio per round and of
the medians) and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_trl import cpu_name

from fp8rl.config import parse_override

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys
from fp8rl.allocator import keep_freed_memory
keep_freed_memory()
import fp8rl
from fp8rl.bench import bench_rollout
from fp8rl.fp8.backends import fast_backend
from fp8rl.model import load
from fp8rl.prompts import encode_prompts
from fp8rl.tasks import make_task
src, flow, batch, new, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, tok = load(src)
prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])
r = bench_rollout(src, flow, fast_backend(model).name, prompts, new, tok.pad_token_id, repeats)
print(json.dumps({"fp8rl": fp8rl.__file__, "tokens_per_s": r["tokens_per_s"], "backend": r["backend"]}))
"""

_STEP_CHILD = """
import json, sys, tempfile
from pathlib import Path
from fp8rl.allocator import keep_freed_memory
keep_freed_memory()
import fp8rl
from fp8rl.fp8.backends import fast_backend
from fp8rl.model import load
from vs_trl import DEFAULT_SHAPES, run_fp8rl
src, flow, repeats, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
P, G, L = DEFAULT_SHAPES[src]
model, _ = load(src)
backend = fast_backend(model).name
del model
with tempfile.TemporaryDirectory() as tmp:
    r = run_fp8rl(src, flow, backend, P, G, L, 1e-6, repeats, Path(tmp), overrides)
print(json.dumps({"fp8rl": fp8rl.__file__, "tokens_per_s": 1.0 / r["step_s"], "backend": backend,
                  "step_s": r["step_s"], "train_s": r["time_train_s"], "rollout_s": r["time_rollout_s"]}))
"""


_LOAD_CHILD = """
import json, resource, sys, time
import fp8rl
import fp8rl.train  # what `fp8rl train` has imported before it loads the model
from fp8rl.model import load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
model, _ = load(sys.argv[1])
seconds = time.perf_counter() - t0
print(json.dumps({"fp8rl": fp8rl.__file__, "tokens_per_s": 1.0 / seconds, "backend": "-", "load_s": seconds,
                  "rss_before_mb": before, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "param_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}))
"""


def run_once(pythonpath: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    if args.step:  # vs_trl.py (run_fp8rl) from this folder, fp8rl from PYTHONPATH's first entry
        env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(Path(__file__).resolve().parent)
        argv = [_STEP_CHILD, args.model, args.flow, str(args.repeats),
                json.dumps(dict(parse_override(s) for s in args.set))]
    elif args.load:
        argv = [_LOAD_CHILD, args.model]
    else:
        argv = [_CHILD, args.model, args.flow, str(args.batch), str(args.max_new_tokens), str(args.repeats)]
    return run_child(argv, env)


def run_child(argv: list[str], env: dict[str, str]) -> dict:
    """``python -c argv[0] argv[1:]`` in a fresh process (cwd: the temp folder, so that the
    checkout's own folder does not shadow PYTHONPATH); the JSON object on its last stdout line."""
    done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"a benchmark process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree against")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flow", default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rollouts per process (their median), or with --step timed GRPO steps (their mean)")
    ap.add_argument("--step", action="store_true",
                    help="time vs_trl.py's GRPO step of the model (its shape; --batch, --max-new-tokens unused) "
                         "instead of a fixed-length rollout; reported as steps/s")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="with --step: a run-config override of the step (e.g. train.grad_chunks=2)")
    ap.add_argument("--load", action="store_true",
                    help="time loading the model (`fp8rl.model.load`, after the imports of `fp8rl train`) and "
                         "its peak RSS instead; reported as loads/s")
    ap.add_argument("--rounds", type=int, default=3, help="old, new pairs")
    args = ap.parse_args()
    if args.step and args.load:
        ap.error("--step and --load time different things: pass one")
    if args.set and not args.step:
        ap.error("--set overrides the GRPO step's config: it needs --step")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.base],
                       check=True, capture_output=True)
        try:
            rounds = []
            for i in range(args.rounds):
                old = run_once(str(tree), args)
                new = run_once(str(ROOT), args)
                if not old["fp8rl"].startswith(str(tree)) or not new["fp8rl"].startswith(str(ROOT)):
                    raise SystemExit(f"imported the wrong code: {old['fp8rl']}, {new['fp8rl']}")
                rounds.append({"old": old["tokens_per_s"], "new": new["tokens_per_s"],
                               "ratio": new["tokens_per_s"] / old["tokens_per_s"]})
                if args.step:
                    for side, r in (("old", old), ("new", new)):
                        rounds[-1][side + "_parts"] = {k: r[k] for k in ("step_s", "train_s", "rollout_s")}
                    what = (f"old step {old['step_s']:.3f} s (train {old['train_s']:.3f})  new step "
                            f"{new['step_s']:.3f} s (train {new['train_s']:.3f})")
                elif args.load:
                    for side, r in (("old", old), ("new", new)):
                        rounds[-1][side + "_parts"] = {k: r[k] for k in ("load_s", "rss_before_mb", "peak_rss_mb",
                                                                         "param_mb")}
                    what = (f"old load {old['load_s']:.2f} s, peak RSS {old['peak_rss_mb']:.0f} MB  new load "
                            f"{new['load_s']:.2f} s, peak RSS {new['peak_rss_mb']:.0f} MB "
                            f"(before loading {new['rss_before_mb']:.0f}, parameters {new['param_mb']:.0f} MB)")
                else:
                    what = f"old {old['tokens_per_s']:.1f}  new {new['tokens_per_s']:.1f} tok/s"
                print(f"round {i + 1}: {what}  new/old speed {rounds[-1]['ratio']:.3f}  ({new['backend']})",
                      file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    old_m = statistics.median(r["old"] for r in rounds)
    new_m = statistics.median(r["new"] for r in rounds)
    unit = "steps/s" if args.step else "loads/s" if args.load else "tok/s"
    print(f"medians: old {old_m:.3f}, new {new_m:.3f} {unit}: {new_m / old_m:.3f}x", file=sys.stderr)
    print(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "base": args.base, "model": args.model, "flow": args.flow, "step": args.step,
                      "load": args.load, "unit": unit, "batch": args.batch,
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rounds": rounds,
                      "median_ratio": new_m / old_m}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
