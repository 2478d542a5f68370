"""Each process's largest resident set while a run starts, on 1 process and on N
data-parallel ranks (torchrun, gloo): what a run needs before its first step.

Each process loads the model of a run config and reads its peak resident set (Linux's
VmHWM), starts that count again (/proc/self/clear_refs), then builds the `Trainer` on the
loaded model (flow applied, FSDP2 master built, linears' FP32 weights released on ranks,
Q/K/V calibration, the KL reference if `train.kl_coef` > 0; with `--resume`, from a
checkpoint) into a temporary folder and reads the peak of that set-up alone. With `--resume`
a first run trains one step and writes its checkpoint (on the same process count), and the
measured processes resume it.

    python benchmarks/startup_memory.py --config configs/smollm2.toml --nproc 1,2 --set train.grad_chunks=2
    python benchmarks/startup_memory.py --config configs/smollm2.toml --nproc 2 --set train.grad_chunks=2 \
        --set train.kl_coef=0.01
    python benchmarks/startup_memory.py --config configs/smollm2.toml --nproc 2 --set train.grad_chunks=2 --resume

To compare two revisions, run it with each on PYTHONPATH (a `git worktree` of the old one).
JSON on stdout (per process count: every rank's peak RSS in bytes), a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def peak_rss() -> int:
    """This process's largest resident set since it started or since ``reset_peak_rss()``
    (Linux: VmHWM of /proc/self/status), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (this script needs Linux)")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current resident set (Linux's clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(args: argparse.Namespace) -> None:
    """One process of the measurement: the model loaded (its peak), then the trainer built
    on it (the peak of the set-up alone), both gathered to rank 0."""
    from fp8rl.config import load_config, parse_override
    from fp8rl.distributed import World
    from fp8rl.model import load
    from fp8rl.train import Trainer

    overrides = dict(parse_override(item) for item in args.set)
    overrides["out"] = args.out
    world = World.from_env()
    if args.write_checkpoint or args.resume:  # a run that checkpoints its first step, and its resumption
        overrides.update({"checkpoint.every": 1, "eval.n": 0, "eval.every": 0,
                          "train.steps": 1 if args.write_checkpoint else 2})
    if args.write_checkpoint:  # the checkpoint to resume: written, then this process ends
        Trainer(load_config(args.config, overrides), log=lambda _m: None, world=world).run(progress=False)
        return
    cfg = load_config(args.config, overrides)
    model, tokenizer = load(cfg.model)
    loaded = peak_rss()
    reset_peak_rss()
    Trainer(cfg, model=model, tokenizer=tokenizer, resume=args.resume, log=lambda _m: None, world=world)
    peaks = world.gather_objects({"load": loaded, "setup": peak_rss()})
    if world.is_main:
        import fp8rl

        print(json.dumps({"peak_rss_bytes": peaks, "fp8rl": str(Path(fp8rl.__file__).parent)}))


def launch(nproc: int, args: argparse.Namespace, out: Path, extra: list[str]) -> list[dict[str, int]]:
    """This script as `--worker` on `nproc` processes; every rank's peak RSS of the load
    and of the set-up after it."""
    script = [str(Path(__file__).resolve()), "--worker", "--config", args.config, "--out", str(out),
              *[a for item in args.set for a in ("--set", item)], *extra]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if nproc > 1 else dict(os.environ)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:  # the ranks' own error lines, not torchrun's report around them
        said = [line for line in done.stderr.splitlines() if "Error: " in line and "ChildFailedError" not in line]
        sys.exit(f"{nproc} process(es) failed: " + ("\n".join(dict.fromkeys(said)) or done.stderr[-3000:]))
    if "--write-checkpoint" in extra:  # the run that writes the checkpoint: nothing measured
        return []
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"{nproc} process(es) printed no result:\n{done.stdout[-2000:]}")
    got = json.loads(lines[-1])
    print(f"fp8rl from {got['fp8rl']}", file=sys.stderr)
    return got["peak_rss_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2.toml")
    ap.add_argument("--nproc", default="1,2", help="comma-separated process counts")
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    ap.add_argument("--resume", action="store_true", help="measure processes that resume a 1-step checkpoint")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--write-checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for nproc in (int(n) for n in args.nproc.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            if args.resume:
                launch(nproc, args, out, ["--write-checkpoint"])
            results[nproc] = launch(nproc, args, out, ["--resume"] if args.resume else [])
        print(f"{nproc} process(es), peak RSS of the load / of the set-up after it: " +
              ", ".join(f"rank {r} {p['load'] / 2**30:.2f} / {p['setup'] / 2**30:.2f} GiB"
                        for r, p in enumerate(results[nproc])), file=sys.stderr)
    print(json.dumps({"config": args.config, "set": args.set, "resume": args.resume,
                      "peak_rss_bytes": {str(k): v for k, v in results.items()}}))


if __name__ == "__main__":
    main()
