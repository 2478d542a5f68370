"""A sampling step's compiled loops against their torch code, side by side, in one run.

- per step: the rows' uniform noise (`kernels.uniform_rows` against one `torch.rand` per
  generator, what `RowNoise` draws) and the Gumbel-max pick (`kernels.argmax_sum` against
  `(logp + gumbel).argmax(-1)`) for `--rows` x `--vocab`, the best of `--rounds` rounds of
  `--calls` calls each, alternated, with the results compared bit for bit;
- a whole rollout (`fp8rl.bench.bench_rollout`'s `generate`, `--model`, bf16 on `amx` where
  the CPU has AMX, else `cpu`), `--batch` x `--max-new-tokens` tokens, with both kernels and
  with both switched off (the torch code `RowNoise` and `sample_next` fall back to), alternated
  for `--rounds` rounds in one process, the sampled tokens and log-probs compared.

    python benchmarks/sampling.py                                    # SmolLM2, 16 rows x 49,152, 16 x 64 rollout
    python benchmarks/sampling.py --rows 64 --batch 64 --max-new-tokens 128

Prints one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vs_trl import cpu_name
from fp8rl.allocator import keep_freed_memory
from fp8rl.fp8 import kernels
from fp8rl.fp8.backends import fast_backend
from fp8rl.model import load
from fp8rl.precision import PRESETS, apply_flow
from fp8rl.prompts import encode_prompts
from fp8rl.rollout import engine
from fp8rl.rollout.engine import SamplingParams, generate
from fp8rl.tasks import make_task


def mean_us(fn, calls: int) -> float:
    """Microseconds per call over `calls` calls, after one more."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def per_step(rows: int, vocab: int, calls: int, rounds: int) -> dict:
    def torch_noise() -> torch.Tensor:
        return torch.stack([torch.rand(1, vocab, generator=g) for g in gens_torch], dim=1)

    gens_kernel = [torch.Generator().manual_seed(r) for r in range(rows)]
    gens_torch = [torch.Generator().manual_seed(r) for r in range(rows)]
    same_noise = all(torch.equal(kernels.uniform_rows(gens_kernel, 1, vocab), torch_noise()) for _ in range(3))
    logp = torch.log_softmax(torch.randn(rows, vocab), dim=-1)
    gumbel = torch.rand(rows, vocab).clamp(min=1e-20).log_().neg_().log_().neg_()
    same_pick = torch.equal(kernels.argmax_sum(logp, gumbel), (logp + gumbel).argmax(dim=-1))
    out = {"rows": rows, "vocab": vocab, "same_noise": same_noise, "same_pick": same_pick}
    for name, kernel, torch_code in (
        ("noise", lambda: kernels.uniform_rows(gens_kernel, 1, vocab), torch_noise),
        ("pick", lambda: kernels.argmax_sum(logp, gumbel), lambda: (logp + gumbel).argmax(dim=-1)),
    ):
        k, t = [], []
        for _ in range(rounds):  # alternated: the VM's drift reaches both alike
            k.append(mean_us(kernel, calls))
            t.append(mean_us(torch_code, calls))
        out[name] = {"kernel_us": min(k), "torch_us": min(t), "speedup": min(t) / min(k)}
    return out


def rollout(model_src: str, batch: int, max_new: int, rounds: int) -> dict:
    model, tok = load(model_src)
    backend = fast_backend(model).name
    apply_flow(model, PRESETS["bf16"], backend=backend)
    prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])
    params = SamplingParams(max_new_tokens=max_new)

    def run() -> tuple[float, engine.Rollout]:
        start = time.perf_counter()
        out = generate(model, prompts, params, eos_ids=[], pad_id=tok.pad_token_id, seeds=list(range(batch)))
        return time.perf_counter() - start, out

    compiled = (kernels.uniform_rows, kernels.argmax_sum)
    off = (lambda *a: None, lambda *a: None)  # what they return without the kernels: the torch code runs
    run()  # warm-up: tile measurements, the allocator's heap
    seconds: dict[str, list[float]] = {"kernels": [], "torch": []}
    outs = {}
    try:
        for r in range(rounds):
            for mode in (("kernels", "torch") if r % 2 == 0 else ("torch", "kernels")):
                kernels.uniform_rows, kernels.argmax_sum = compiled if mode == "kernels" else off
                s, outs[mode] = run()
                seconds[mode].append(s)
    finally:
        kernels.uniform_rows, kernels.argmax_sum = compiled
    tokens = outs["kernels"].n_tokens
    k, t = statistics.median(seconds["kernels"]), statistics.median(seconds["torch"])
    return {"model": model_src, "backend": backend, "batch": batch, "max_new_tokens": max_new,
            "tokens_per_s": {m: [tokens / s for s in v] for m, v in seconds.items()},
            "median_tokens_per_s": {"kernels": tokens / k, "torch": tokens / t}, "speedup": t / k,
            "same_tokens": torch.equal(outs["kernels"].tokens, outs["torch"].tokens),
            "same_logprobs": torch.equal(outs["kernels"].logprobs, outs["torch"].logprobs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="alternations of the two paths")
    args = ap.parse_args()
    keep_freed_memory()  # as the fp8rl CLI runs (fp8rl/allocator.py)
    if kernels.library() is None or kernels.uniform_rows([torch.Generator()], 1, 1) is None:
        raise SystemExit("the compiled kernels are not available here: nothing to compare")
    step = per_step(args.rows, args.vocab, args.calls, args.rounds)
    roll = rollout(args.model, args.batch, args.max_new_tokens, args.rounds)
    print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d"), "per_step": step, "rollout": roll}, indent=2))
    print(f"{cpu_name()}, {torch.get_num_threads()} threads", file=sys.stderr)
    for name in ("noise", "pick"):
        x = step[name]
        print(f"{name} {args.rows} x {args.vocab}: kernel {x['kernel_us']:.0f} us, torch {x['torch_us']:.0f} us "
              f"({x['speedup']:.2f}x); same bits: {step['same_' + name]}", file=sys.stderr)
    m = roll["median_tokens_per_s"]
    print(f"rollout {args.model} {args.batch} x {args.max_new_tokens} bf16 on {roll['backend']}: kernels "
          f"{m['kernels']:.1f} tok/s, torch {m['torch']:.1f} tok/s ({roll['speedup']:.3f}x); same tokens "
          f"{roll['same_tokens']}, same log-probs {roll['same_logprobs']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
