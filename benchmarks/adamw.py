"""One AdamW step on a model's trainable weights: torch's default on the CPU (the
single-tensor loop), the multi-tensor (`foreach`) implementation, torch's fused
kernel and fp8rl's (`fp8rl.optim.AdamW`, one compiled pass per tensor: what the
trainer uses), side by side in one run, plus whether each gives the default's
bits after a few steps and how many weights differ: the measurement behind the choice.

    python benchmarks/adamw.py                                  # SmolLM2-135M's weights
    python benchmarks/adamw.py --model tiny-arith --repeats 20

The weights are the model's shapes filled with random values (nothing is loaded
but the config), the gradients random with a wide spread of magnitudes. The first
step of each implementation is a warm-up (AdamW's state is created there); the
best of `--repeats` timed steps is reported. JSON on stdout, a table on stderr.
Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from vs_trl import cpu_name  # benchmarks/ is on sys.path when a script here runs

from fp8rl.model.load import load_config, resolve
from fp8rl.model.transformer import Transformer
from fp8rl.optim import AdamW

IMPLEMENTATIONS = {
    "single-tensor (torch's CPU default)": lambda ps, hyper: torch.optim.AdamW(ps, **hyper),
    "foreach": lambda ps, hyper: torch.optim.AdamW(ps, foreach=True, **hyper),
    "fused": lambda ps, hyper: torch.optim.AdamW(ps, fused=True, **hyper),
    "fp8rl (fp8rl/optim.py, the trainer's)": lambda ps, hyper: AdamW(ps, **hyper),
}


def weights(shapes: list[torch.Size], seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * torch.exp2(torch.randint(-20, 2, p.shape, generator=g).float())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=3, help="steps compared bit for bit with the default")
    args = ap.parse_args()
    with torch.device("meta"):  # the model's shapes, nothing allocated
        shapes = [p.shape for p in Transformer(load_config(resolve(args.model))).parameters() if p.requires_grad]
    hyper = {"lr": 1e-6, "betas": (0.9, 0.99), "weight_decay": 0.0}
    results, final = [], {}
    for name, make in IMPLEMENTATIONS.items():
        params = weights(shapes, 0)
        opt = make(params, hyper)
        for step in range(args.check_steps):  # the first step creates the state (the warm-up)
            set_grads(params, step + 1)
            opt.step()
        final[name] = [p.detach().clone() for p in params]
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - t0)
        results.append({"implementation": name, "step_s": best})
        del params, opt
    default = next(iter(final.values()))
    for r in results:
        mine = final[r["implementation"]]
        r["bitwise_equal_to_default"] = all(torch.equal(a, b) for a, b in zip(mine, default))
        r["weights_differing"] = sum(int((a != b).sum()) for a, b in zip(mine, default))
        r["speedup"] = results[0]["step_s"] / r["step_s"]
    n = sum(torch.Size(s).numel() for s in shapes)
    out = {"benchmark": "adamw", "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(),
                                             "torch": torch.__version__},
           "model": args.model, "parameters": n, "results": results}
    print(json.dumps(out, indent=2))
    print(f"\nAdamW step on {args.model}'s {n / 1e6:.1f}M trainable weights, {cpu_name()}, "
          f"{torch.get_num_threads()} threads (best of {args.repeats})", file=sys.stderr)
    for r in results:
        print(f"  {r['implementation']:<38} {r['step_s'] * 1e3:8.1f} ms  {r['speedup']:5.2f}x  "
              f"bitwise equal to the default after {args.check_steps} steps: {r['bitwise_equal_to_default']} "
              f"({r['weights_differing']} weights differ)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
