"""One decode step's cost against the number of running rows: arithmetic or per-call overhead?

Loads a built-in policy under a flow, prefills a batch of random prompts into a
KV cache, then times single-token decode forwards (the engine's `generate` step
without sampling) at each batch size and counts the torch calls one of them
makes (views included). If the time barely falls with the rows, the step is
per-call overhead, not arithmetic. For comparison it also times one training-phase
forward without a graph (what scoring runs) over `--forward ROWSxTOKENS` (64x68:
the default run's half batch of ~68-token sequences).

    python benchmarks/decode_step.py                                   # tiny-arith, jet, 128/64/16/4 rows
    python benchmarks/decode_step.py --modes inference,no_grad         # what inference mode saves
    python benchmarks/decode_step.py --model smollm2-135m-instruct --flow bf16 --rows 16,4 --forward 16x80
    python benchmarks/decode_step.py --model tiny-chain --rows 64 --cache-len 400 --forward 64x400   # long answers
    python benchmarks/decode_step.py --model smollm2-135m-instruct --rows 16 --ops 20   # where a step's time goes
    python benchmarks/decode_step.py --model smollm2-135m-instruct --flow jet-kv --rows 64 --prompt-len 85 \
        --cache-len 224 --prefill 64                                    # and the prefill of 64 prompts

`--ops N` also prints, per row count, the N ops of the profiled step with the most self
time, per input shapes (profile_step.py's table).

Prints one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fp8rl.allocator import keep_freed_memory
from fp8rl.model.load import load
from fp8rl.model.transformer import make_context
from fp8rl.precision import apply_flow, refresh_weights
from fp8rl.rollout.engine import phase
from fp8rl.rollout.kv_cache import KVCache
from profile_step import op_table


def rollout_layers(model, module_forward: bool) -> list | None:
    """What the engine's `generate` runs the steps with: the model's `rollout_layers`
    (built in the rollout phase), or None (the module forward) with ``module_forward``."""
    if module_forward:
        return None
    with phase(model, "rollout"):
        return model.rollout_layers()


def time_decode(
    model, rows: int, prompt_len: int, cache_len: int, repeats: int, mode: str = "inference", ops: int = 0,
    module_forward: bool = False,
) -> dict:
    """Mean seconds of one decode forward over ``rows`` rows, and its torch call count;
    ``mode``: "inference" (``torch.inference_mode``, what the engine runs) or "no_grad";
    ``ops`` > 0: also the op table (``op_table``, per input shapes) of the profiled step;
    ``module_forward``: the decoder layers' module forward instead of the engine's
    `rollout_layers` (the same bits)."""
    grad_off = torch.inference_mode if mode == "inference" else torch.no_grad
    cache = KVCache.for_model(model, rows, cache_len)
    pad_left = torch.zeros(rows, dtype=torch.long)
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(2, model.config.vocab_size, (rows, prompt_len), generator=g)
    token = torch.randint(2, model.config.vocab_size, (rows, 1), generator=g)
    layers = rollout_layers(model, module_forward)
    with grad_off(), phase(model, "rollout"):
        model(prompt, make_context(pad_left, 0, prompt_len, cache_len, cache), n_last=1, layers=layers)
        for i in range(3):  # warm-up: tile measurements, allocator
            model(token, make_context(pad_left, prompt_len + i, 1, cache_len, cache), layers=layers)
        start = time.perf_counter()
        for i in range(repeats):
            model(token, make_context(pad_left, prompt_len + 3 + i, 1, cache_len, cache), layers=layers)
        seconds = (time.perf_counter() - start) / repeats
        with profile(activities=[ProfilerActivity.CPU], record_shapes=ops > 0) as prof:
            model(token, make_context(pad_left, prompt_len + 3 + repeats, 1, cache_len, cache), layers=layers)
    calls = sum(e.count for e in prof.key_averages())
    out = {"rows": rows, "mode": mode, "ms_per_step": seconds * 1e3, "torch_calls": calls}
    return out | ({"op_table": op_table([prof], ops, shapes=True)} if ops > 0 else {})


def time_prefill(model, rows: int, prompt_len: int, cache_len: int, repeats: int, module_forward: bool = False) -> dict:
    """Median seconds of the rollout's prefill of ``rows`` distinct random prompts of
    ``prompt_len`` tokens into a fresh KV cache of ``cache_len`` slots (as `generate`
    runs it: inference mode, attending over `key_slots`), after one untimed prefill."""
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(2, model.config.vocab_size, (rows, prompt_len), generator=g)
    pad_left = torch.zeros(rows, dtype=torch.long)
    keys = model.key_slots(prompt_len, cache_len, queries=prompt_len)
    layers = rollout_layers(model, module_forward)
    times = []
    with torch.inference_mode(), phase(model, "rollout"):
        for i in range(repeats + 1):
            cache = KVCache.for_model(model, rows, cache_len)
            start = time.perf_counter()
            model(prompt, make_context(pad_left, 0, prompt_len, keys, cache), n_last=1, layers=layers)
            if i:
                times.append(time.perf_counter() - start)
    return {"rows": rows, "prompt_len": prompt_len, "cache_len": cache_len, "ms": sorted(times)[len(times) // 2] * 1e3}


def time_forward(model, rows: int, tokens: int, repeats: int) -> dict:
    """Median seconds of one training-phase forward of ``rows`` x ``tokens`` without a graph."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(2, model.config.vocab_size, (rows, tokens), generator=g)
    times = []
    with torch.no_grad(), phase(model, "train"):
        model(ids)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    return {"rows": rows, "tokens": tokens, "ms": sorted(times)[len(times) // 2] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-arith")
    ap.add_argument("--flow", default="jet")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rows", default="128,64,16,4")
    ap.add_argument("--modes", default="inference",
                    help="inference (torch.inference_mode, as the engine) and/or no_grad, comma-separated: "
                         "each row count is timed under each, alternately")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache-len", type=int, default=0,
                    help="key slots of the KV cache (0: just enough for the timed steps); a decode step attends "
                         "to all of them, as the engine's static cache does (the `chain` study: ~400)")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="print the N ops of each profiled step with the most self time, per input shapes")
    ap.add_argument("--forward", default="64x68", metavar="ROWSxTOKENS", help="the training-phase forward timed too")
    ap.add_argument("--prefill", type=int, default=0, metavar="ROWS",
                    help="also time the rollout's prefill of ROWS distinct prompts of --prompt-len tokens "
                         "(the median of --prefill-repeats)")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--module-forward", action="store_true",
                    help="run the decoder layers' module forward instead of the rollout layers the engine runs "
                         "(Transformer.rollout_layers: the same bits without the module dispatch)")
    args = ap.parse_args()
    try:
        f_rows, f_tokens = (int(n) for n in args.forward.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--forward {args.forward!r}: expected ROWSxTOKENS, e.g. 64x68") from None
    if f_rows < 1 or f_tokens < 1:
        raise SystemExit(f"--forward {args.forward!r}: rows and tokens must be at least 1")
    keep_freed_memory()  # as the fp8rl CLI runs (fp8rl/allocator.py); for every engine in this process
    model, _ = load(args.model)
    backend = apply_flow(model, args.flow, args.backend).backend
    refresh_weights(model)
    cache_len = max(args.cache_len, (args.prompt_len + 3 + args.repeats + 1 + 15) // 16 * 16)
    results = [time_decode(model, int(r), args.prompt_len, cache_len, args.repeats, mode, args.ops, args.module_forward)
               for r in args.rows.split(",") for mode in args.modes.split(",")]
    forward = time_forward(model, f_rows, f_tokens, 5)
    prefill = (time_prefill(model, args.prefill, args.prompt_len, cache_len, args.prefill_repeats, args.module_forward)
               if args.prefill else None)
    print(json.dumps({"model": args.model, "flow": args.flow, "backend": backend.name, "cache_len": cache_len,
                      "layers": "module" if args.module_forward else "rollout_layers",
                      "threads": torch.get_num_threads(), "results": results, "forward": forward,
                      "prefill": prefill}, indent=2))
    print(f"{args.model}, flow {args.flow}, backend {backend.name}, {torch.get_num_threads()} threads, "
          f"{cache_len} key slots", file=sys.stderr)
    print(f"{'rows':>6}{'mode':>11}{'ms/step':>10}{'torch calls':>13}", file=sys.stderr)
    for r in results:
        print(f"{r['rows']:>6}{r['mode']:>11}{r['ms_per_step']:>10.2f}{r['torch_calls']:>13}", file=sys.stderr)
    for r in (r for r in results if "op_table" in r):
        print(f"\none decode step over {r['rows']} rows ({r['mode']}):\n{r['op_table']}", file=sys.stderr)
    print(f"training-phase forward, {f_rows} x {f_tokens} tokens, no graph: {forward['ms']:.1f} ms", file=sys.stderr)
    if prefill:
        print(f"prefill, {prefill['rows']} x {prefill['prompt_len']} tokens into {cache_len} slots: "
              f"{prefill['ms']:.1f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
