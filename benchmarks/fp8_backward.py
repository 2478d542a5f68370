"""The FP8 backward's operands as QTensors, or as the values a backend multiplies, alternated.

Under `jet-e2e`, `jet-kv` and `fp8-grads` every linear's backward quantizes its gradient
(1 x 128 blocks for the dgrad, 128 x 1 for the wgrad) and its saved input (128 x 1). On `cpu`
and `amx` the GEMMs multiply dequantized values, so `Backend.grad_operand` makes them in one
compiled pass (FP32 for `cpu`, BF16 for `amx`) instead of codes that are then dequantized
(and, for `amx`, rounded to BF16): the same bits (tests/test_fp8_linear.py). This script
times one training forward and backward of a model under a flow, in one process, with
`Backend.grad_operand_dtype` set to None (the QTensor of `quantize`: the path before) and
with the backend's own, alternated round by round, and reports the backward's median seconds.

    python benchmarks/fp8_backward.py --model smollm2-135m-instruct --flow jet-kv --backend amx
    python benchmarks/fp8_backward.py --model smollm2-135m-instruct --flow jet-kv --backend cpu --rounds 7

JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from vs_trl import cpu_name  # benchmarks/ is on sys.path when a script here runs

from fp8rl.model import load
from fp8rl.precision import apply_flow, phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flow", default="jet-kv", help="a flow with an FP8 backward: jet-e2e, jet-kv, fp8-grads")
    ap.add_argument("--backend", default="amx", choices=["cpu", "amx"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=146, help="sequence length (a SmolLM2 GRPO step's width)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, each both paths (after one warm-up round)")
    args = ap.parse_args()

    model, _ = load(args.model)
    plan = apply_flow(model, args.flow, backend=args.backend)
    if plan.linear["train"].dgrad != "fp8" and plan.linear["train"].wgrad != "fp8":
        sys.exit(f"flow {args.flow} has no FP8 backward GEMM; take jet-e2e, jet-kv or fp8-grads")
    backend_cls = type(plan.backend)
    own = backend_cls.grad_operand_dtype
    paths = {"qtensor": None, "grad_operand": own}  # Backend.grad_operand_dtype of each path
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))

    def backward_s() -> float:
        model.zero_grad(set_to_none=True)
        with phase(model, "train"):
            logits = model(ids)
            loss = logits.float().logsumexp(-1).mean()
        t0 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for r in range(args.rounds + 1):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                backend_cls.grad_operand_dtype = paths[name]
                s = backward_s()
                if r > 0:  # round 0 warms both up
                    times[name].append(s)
    finally:
        backend_cls.grad_operand_dtype = own
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.model}, {args.flow} on {args.backend}, {args.batch} x {args.tokens} tokens, {cpu_name()}",
          file=sys.stderr)
    for k, v in times.items():
        print(f"  {k:13s} backward {med[k]:.3f} s (rounds: {', '.join(f'{x:.3f}' for x in v)})", file=sys.stderr)
    print(f"  speed-up of grad_operand: {med['qtensor'] / med['grad_operand']:.3f}x", file=sys.stderr)
    print(json.dumps({"model": args.model, "flow": args.flow, "backend": args.backend, "cpu": cpu_name(),
                      "batch": args.batch, "tokens": args.tokens, "backward_s": times, "median_s": med,
                      "speedup": med["qtensor"] / med["grad_operand"]}))


if __name__ == "__main__":
    main()
