"""What a GRPO step pays for its rollout: the vLLM engine vs fp8rl's own, per flow.

`rollout.engine = "vllm"` (fp8rl/rollout/vllm_engine.py) puts two costs on every
step: the refit (the policy's new weights loaded into the running vLLM, then
audited bit for bit) and vLLM's generation. fp8rl's own engine pays the weight
refresh (`refresh_weights`: the FP8 flows requantize every linear once per
step) and its generation. This script times both, in one process, on the same
prompts (tiny-arith problems), batch and budget: temperature 1, a seed per
sample, EOS disabled so every engine generates exactly batch x tokens.
Generation is timed after a warm-up call; the refit and the refresh are the
median of three. vLLM runs BF16 flows only (docs/design.md section 5).

Needs an environment with both fp8rl and vLLM (`.ci/vllm` builds one; the
commands are in docs/design.md section 5):

    python benchmarks/vllm_engine.py --json report.json               # tiny-arith and SmolLM2-135M
    python benchmarks/vllm_engine.py --models tiny-arith --batch 64 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def _median_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,smollm2-135m-instruct")
    ap.add_argument("--flows", default="bf16,jet,jet-kv", help="fp8rl engine flows (vLLM runs bf16)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the report here (vLLM logs to stdout too)")
    args = ap.parse_args()

    from fp8rl.fp8.backends import fast_backend
    from fp8rl.model import load
    from fp8rl.precision import PRESETS, apply_flow, refresh_weights
    from fp8rl.prompts import encode_prompts
    from fp8rl.rollout.calibrate import calibrate
    from fp8rl.rollout.engine import SamplingParams, generate, left_pad
    from fp8rl.rollout.vllm_engine import VLLMEngine, import_vllm
    from fp8rl.tasks import make_task

    vllm = import_vllm()
    problems = make_task("arith").test_problems(args.batch)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = []
    for src in args.models.split(","):
        for flow in ["vllm", *args.flows.split(",")]:
            model, tok = load(src)
            backend = fast_backend(model).name  # the same backend for every flow of a model
            prompts = encode_prompts(tok, [p.question for p in problems])
            kw = dict(eos_ids=[], pad_id=tok.pad_token_id, seeds=list(range(len(prompts))))
            row = {"model": src, "engine": "vllm" if flow == "vllm" else "fp8rl", "flow": "bf16" if flow == "vllm" else flow}
            if flow == "vllm":
                apply_flow(model, "bf16", backend)
                t0 = time.perf_counter()
                engine = VLLMEngine(model, tok, max_model_len=max(map(len, prompts)) + args.max_new_tokens)
                row["startup_s"] = time.perf_counter() - t0
                row["refit_s"] = _median_seconds(lambda: engine.refit(model))  # load_weights + audit
                row["audit_s"] = _median_seconds(lambda: engine.audit(model))
                sample = lambda: engine.generate(prompts, params, **kw)  # noqa: E731
            else:
                apply_flow(model, PRESETS[flow], backend)
                row["backend"] = backend
                if PRESETS[flow].needs_calibration:
                    calibrate(model, *left_pad(prompts, tok.pad_token_id))
                row["refit_s"] = _median_seconds(lambda: refresh_weights(model))
                sample = lambda: generate(model, prompts, params, **kw)  # noqa: E731
            with torch.no_grad():
                sample()  # warm-up
                t0 = time.perf_counter()
                out = sample()
                seconds = time.perf_counter() - t0
            row.update(seconds=seconds, tokens=out.n_tokens, tokens_per_s=out.n_tokens / seconds)
            results.append(row)
            if flow == "vllm":
                del engine
        base = next(r for r in results if r["model"] == src and r["engine"] == "vllm")
        for r in results:
            if r["model"] == src:
                r["speed_vs_vllm"] = r["tokens_per_s"] / base["tokens_per_s"]
    report = {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "vllm": vllm.__version__, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
              "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    else:
        print(json.dumps(report, indent=2))
    print(f"\n{report['cpu']}, {report['threads']} threads, {args.batch} x {args.max_new_tokens} tokens", file=sys.stderr)
    print(f"{'model':<24}{'engine':<8}{'flow':<8}{'tok/s':>9}{'vs vLLM':>9}{'refit s':>10}{'audit s':>9}", file=sys.stderr)
    for r in results:
        audit = f"{r['audit_s']:>9.3f}" if "audit_s" in r else f"{'-':>9}"
        print(f"{r['model']:<24}{r['engine']:<8}{r['flow']:<8}{r['tokens_per_s']:>9.1f}{r['speed_vs_vllm']:>9.2f}"
              f"{r['refit_s']:>10.3f}{audit}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
