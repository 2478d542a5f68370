"""Stacked GEMMs for the linears of one input (q/k/v, gate/up) against one GEMM per linear.

`linears_of_one_input` (fp8rl/fp8/linear.py) gives the q/k/v and gate/up linears of a layer
one stacked GEMM each where the backend measured that to give each linear its own call's
bits (`_group_gemm_exact` for `cpu`, `_native_group_exact` for `amx`). This script turns that
measurement off (one GEMM per linear, the code before) and on, alternately, on one model and
flow in one process, for `--rounds` rounds of:

- a fixed-length rollout (`--batch` x `--max-new-tokens`, EOS off, the engine's `generate`);
- a training forward with its backward over the rollout's sequences (the sum of the
  sampled tokens' log-probs; its gradient reaches every weight);

and checks that both ways give the same bits: the rollout's tokens and log-probs, the
training forward's log-probs and every weight's gradient. `--peak-memory` adds, per flow and
way, the peak resident memory (`ru_maxrss`) of a fresh process that runs only the rollouts.

    python benchmarks/linear_groups.py                                  # SmolLM2-135M, bf16 and jet, 16 x 64
    python benchmarks/linear_groups.py --model tiny-arith --batch 128 --max-new-tokens 48
    python benchmarks/linear_groups.py --peak-memory --rounds 1

Prints one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from vs_trl import cpu_name
from fp8rl.fp8 import backends
from fp8rl.model.load import load
from fp8rl.precision import PRESETS, apply_flow
from fp8rl.prompts import encode_prompts
from fp8rl.rollout.engine import SamplingParams, generate
from fp8rl.tasks import make_task

MEASURED = {name: getattr(backends, name) for name in ("_group_gemm_exact", "_native_group_exact")}


def stacked_gemms(on: bool) -> None:
    """Whether the linears of one input may take one stacked GEMM from here on: the
    backends' measurements, or a stand-in that says no to every shape."""
    for name, measured in MEASURED.items():
        setattr(backends, name, measured if on else (lambda *shape: False))


def train_pass(model, out) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """The sampled tokens' log-probs of a forward with a graph, every weight's gradient
    of their sum, and the seconds of forward plus backward."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logits = model(out.tokens[:, :-1])  # [B, S-1, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, out.tokens[:, 1:, None])[..., 0]
    logp = logp * out.completion_mask[:, 1:]
    logp.sum().backward()
    seconds = time.perf_counter() - t0
    return logp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], seconds


def compare(src: str, flow: str, batch: int, max_new: int, rounds: int) -> dict:
    model, tok = load(src)
    plan = apply_flow(model, PRESETS[flow], backend="auto")
    prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])

    def rollout():
        return generate(model, prompts, SamplingParams(max_new_tokens=max_new), eos_ids=[], pad_id=tok.pad_token_id,
                        seeds=list(range(batch)))

    results: dict[bool, dict] = {}
    tok_s: dict[str, list[float]] = {"separate": [], "stacked": []}
    train_s: dict[str, list[float]] = {"separate": [], "stacked": []}
    for r in range(rounds + 1):  # round 0 warms up both ways (tile and group measurements, packed weights)
        for on in (False, True):
            stacked_gemms(on)
            t0 = time.perf_counter()
            out = rollout()
            seconds = time.perf_counter() - t0
            logp, grads, t_train = train_pass(model, out)
            if r == 0:
                results[on] = {"tokens": out.tokens, "logprobs": out.logprobs, "train_logp": logp, "grads": grads}
                continue
            key = "stacked" if on else "separate"
            tok_s[key].append(out.n_tokens / seconds)
            train_s[key].append(t_train)
    stacked_gemms(True)
    a, b = results[False], results[True]
    same = (torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["logprobs"], b["logprobs"])
            and torch.equal(a["train_logp"], b["train_logp"])
            and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True)))
    ratios = [s / o for s, o in zip(tok_s["stacked"], tok_s["separate"])]
    train_ratios = [o / s for s, o in zip(train_s["stacked"], train_s["separate"])]
    return {"model": src, "flow": flow, "backend": plan.backend.name, "batch": batch, "max_new_tokens": max_new,
            "rollout_tokens_per_s": tok_s, "train_s": train_s,
            "rollout_speedup_median": statistics.median(ratios), "train_speedup_median": statistics.median(train_ratios),
            "same_bits": same}


def peak_memory_mb(src: str, flow: str, batch: int, max_new: int, stacked: bool) -> float:
    """ru_maxrss (MB) of a fresh process of this script that runs `--rounds`-like rollouts only."""
    cmd = [sys.executable, __file__, "--model", src, "--flows", flow, "--batch", str(batch),
           "--max-new-tokens", str(max_new), "--rollouts-only", "1" if stacked else "0"]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def rollouts_only(src: str, flow: str, batch: int, max_new: int, stacked: bool) -> float:
    """Four rollouts one way, then this process's peak resident memory in MB."""
    stacked_gemms(stacked)
    model, tok = load(src)
    apply_flow(model, PRESETS[flow], backend="auto")
    prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])
    for _ in range(4):
        generate(model, prompts, SamplingParams(max_new_tokens=max_new), eos_ids=[], pad_id=tok.pad_token_id,
                 seeds=list(range(batch)))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--flows", default="bf16,jet")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peak-memory", action="store_true", help="also each way's peak memory, in fresh processes")
    ap.add_argument("--rollouts-only", choices=("0", "1"), help=argparse.SUPPRESS)  # the --peak-memory child
    args = ap.parse_args()
    if args.rollouts_only is not None:
        print(rollouts_only(args.model, args.flows, args.batch, args.max_new_tokens, args.rollouts_only == "1"))
        return 0
    flows = args.flows.split(",")
    # Before this process holds a model: a child's ru_maxrss starts from its parent's resident size at fork.
    peaks = {f: {key: peak_memory_mb(args.model, f, args.batch, args.max_new_tokens, on)
                 for key, on in (("separate", False), ("stacked", True))} for f in flows if args.peak_memory}
    rows = [compare(args.model, f, args.batch, args.max_new_tokens, args.rounds) for f in flows]
    for r in rows:
        if r["flow"] in peaks:
            r["peak_mb"] = peaks[r["flow"]]
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "results": rows}
    print(json.dumps(report, indent=2))
    print(f"{report['cpu']}, {report['threads']} threads, {args.model}, {args.batch} x {args.max_new_tokens}", file=sys.stderr)
    for r in rows:
        print(f"{r['flow']} on {r['backend']} (same bits: {r['same_bits']}):", file=sys.stderr)
        for key in ("separate", "stacked"):
            print(f"  {key:<9} rollout tok/s {', '.join(f'{v:.1f}' for v in r['rollout_tokens_per_s'][key])};"
                  f"  train forward+backward s {', '.join(f'{v:.2f}' for v in r['train_s'][key])}", file=sys.stderr)
        print(f"  stacked vs separate, median of the rounds: rollout {r['rollout_speedup_median']:.2f}x, "
              f"training {r['train_speedup_median']:.2f}x", file=sys.stderr)
        if "peak_mb" in r:
            print(f"  peak memory of the rollouts alone: separate {r['peak_mb']['separate']:.0f} MB, "
                  f"stacked {r['peak_mb']['stacked']:.0f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
