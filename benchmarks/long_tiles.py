"""`amx`'s long row tiles on and off: a long input's GEMMs in calls longer than 128 rows where
measured to give the same bits and to be faster (fp8rl/fp8/backends.py `_long_tiles`), or in
128-row calls as before. Same code otherwise; the two sides run in alternating fresh processes
(the VM's speed drifts by 5-10% over minutes), the "off" side with `_NATIVE_LONG_CANDIDATES`
emptied before the first GEMM.

Each process loads the model under a flow on `amx`, then times (median of `--repeats`, after a
warm-up that measures the row tiles):
  - prefill: a rollout's first forward of `--rows` distinct prompts of `--tokens` tokens into a
    KV cache (what `generate` runs before its decode steps), in inference mode;
  - forward: a training-phase forward of the same tokens without a graph (what `score` runs).
It also checks that both sides give the same logits, bit for bit.

    python benchmarks/long_tiles.py                                       # SmolLM2-135M, 16 x 85
    python benchmarks/long_tiles.py --model tiny-arith --rows 128 --tokens 61

Prints one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from code_ab import run_child
from vs_trl import cpu_name

_CHILD = """
import hashlib, json, statistics, sys, time
import torch
from fp8rl.allocator import keep_freed_memory
keep_freed_memory()
import fp8rl.fp8.backends as backends
model_name, flow, rows, tokens, repeats, on = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "on"
if not on:
    backends._NATIVE_LONG_CANDIDATES = ()
from fp8rl.model import load
from fp8rl.model.transformer import make_context
from fp8rl.precision import apply_flow, refresh_weights
from fp8rl.rollout.engine import default_cache_len, phase
from fp8rl.rollout.kv_cache import KVCache
model, _ = load(model_name)
apply_flow(model, flow, "amx")
refresh_weights(model)
g = torch.Generator().manual_seed(0)
ids = torch.randint(2, model.config.vocab_size, (rows, tokens), generator=g)
pad = torch.zeros(rows, dtype=torch.long)
L = default_cache_len(tokens, 64)

def prefill():
    cache = KVCache.for_model(model, rows, L)
    with torch.inference_mode(), phase(model, "rollout"):
        return model(ids, make_context(pad, 0, tokens, model.key_slots(tokens, L, queries=tokens), cache), n_last=1)

def forward():
    with torch.no_grad(), phase(model, "train"):
        return model(ids)

out = {}
for name, fn in (("prefill", prefill), ("forward", forward)):
    logits = fn()  # warm-up: the row tiles are measured here
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    out[name + "_ms"] = statistics.median(times) * 1e3
    out[name + "_sha"] = hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()[:16]
print(json.dumps(out))
"""


def run(args: argparse.Namespace, on: bool) -> dict:
    return run_child([_CHILD, args.model, args.flow, str(args.rows), str(args.tokens), str(args.repeats),
                      "on" if on else "off"], dict(os.environ))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flow", default="bf16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=85, help="tokens per row (SmolLM2's arith prompts: about 85)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per process (their median)")
    ap.add_argument("--rounds", type=int, default=3, help="off, on pairs")
    args = ap.parse_args()
    rounds = []
    for i in range(args.rounds):
        off, on = run(args, False), run(args, True)
        for part in ("prefill", "forward"):
            if off[part + "_sha"] != on[part + "_sha"]:
                raise SystemExit(f"round {i + 1}: the {part} logits differ with the long tiles on")
        rounds.append({"off": off, "on": on, "prefill_speedup": off["prefill_ms"] / on["prefill_ms"],
                       "forward_speedup": off["forward_ms"] / on["forward_ms"]})
        print(f"round {i + 1}: prefill {off['prefill_ms']:.1f} -> {on['prefill_ms']:.1f} ms "
              f"({rounds[-1]['prefill_speedup']:.3f}x), forward {off['forward_ms']:.1f} -> {on['forward_ms']:.1f} ms "
              f"({rounds[-1]['forward_speedup']:.3f}x); logits equal", file=sys.stderr)
    medians = {part: statistics.median(r[part + "_speedup"] for r in rounds) for part in ("prefill", "forward")}
    print(f"median speedups (long tiles on / off): prefill {medians['prefill']:.3f}x, forward {medians['forward']:.3f}x",
          file=sys.stderr)
    print(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "model": args.model, "flow": args.flow, "rows": args.rows, "tokens": args.tokens,
                      "repeats": args.repeats, "rounds": rounds, "median_speedups": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
