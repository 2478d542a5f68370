"""What `train.rescore = "verified"` saves, and that it changes no number.

Builds two trainers of one run config (the default run's unless given), one with
`train.rescore = "all"` (the training forward re-scores every row's behaviour
log-probs) and one with `"verified"` (the later micro-batches take the rollout's
log-probs in a step where the first micro-batch's re-scored ones equal them bit for
bit; docs/design.md section 5), and runs their steps alternately in one process,
so that the machine's slow and fast phases fall on both. Prints each step's time and
rescored rows on both sides, the median ratio, and whether every metric except
times and memory, and every weight after the last step, are equal.

    python benchmarks/rescore.py                       # the default run's first 12 steps
    python benchmarks/rescore.py --steps 30 --set flow=fp8-rollout   # off-policy: re-scores every row

Prints one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import torch

from fp8rl.config import load_config, parse_override
from fp8rl.train import Trainer

NOT_COMPARED = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s",
                "peak_mem_bytes", "rescored_rows"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=12, help="steps on each side; the first is a warm-up")
    args = ap.parse_args()
    overrides = dict(parse_override(s) for s in args.set)
    trainers = {}
    for mode in ("all", "verified"):
        cfg = load_config(args.config, {**overrides, "out": tempfile.mkdtemp(prefix=f"rescore-{mode}-"),
                                        "train.rescore": mode})
        trainers[mode] = Trainer(cfg, log=lambda s: None)
    steps: list[dict] = []
    same_metrics = True
    for i in range(args.steps):
        rows = {mode: t.train_step().metrics for mode, t in trainers.items()}
        a, v = rows["all"], rows["verified"]
        same = {k: x for k, x in a.items() if k not in NOT_COMPARED} == {k: x for k, x in v.items() if k not in NOT_COMPARED}
        same_metrics = same_metrics and same
        steps.append({"all_s": a["time_step_s"], "verified_s": v["time_step_s"], "rescored_all": a["rescored_rows"],
                      "rescored_verified": v["rescored_rows"], "same_metrics": same})
        print(f"step {i + 1:3d}: all {a['time_step_s'] * 1e3:6.0f} ms ({a['rescored_rows']} rows scored), "
              f"verified {v['time_step_s'] * 1e3:6.0f} ms ({v['rescored_rows']} rows scored)"
              f"{'' if same else '  METRICS DIFFER'}", file=sys.stderr)
    timed = steps[1:] or steps
    med_all = statistics.median(s["all_s"] for s in timed)
    med_verified = statistics.median(s["verified_s"] for s in timed)
    weights = zip(trainers["all"].model.parameters(), trainers["verified"].model.parameters(), strict=True)
    same_weights = all(torch.equal(p, q) for p, q in weights)
    print(f"median step: all {med_all * 1e3:.0f} ms, verified {med_verified * 1e3:.0f} ms "
          f"({med_all / med_verified:.2f}x); metrics equal: {same_metrics}; weights equal: {same_weights}",
          file=sys.stderr)
    json.dump({"config": args.config, "overrides": overrides, "steps": steps, "median_all_s": med_all,
               "median_verified_s": med_verified, "speedup": med_all / med_verified,
               "same_metrics": same_metrics, "same_weights": same_weights,
               "threads": torch.get_num_threads()}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
