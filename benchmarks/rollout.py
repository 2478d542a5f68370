"""Rollout throughput: fp8rl's engine vs Hugging Face `generate`, side by side.

Same model weights, prompts, batch size and sampling settings (temperature 1,
no top-k/top-p, a fixed number of new tokens: EOS disabled on both sides so
both generate exactly batch x max_new_tokens tokens). Prints one JSON object
and a table: tokens/s per engine and flow, the ratio to transformers, and the
weight and KV-cache bytes per flow.

    python benchmarks/rollout.py                  # tiny-arith and SmolLM2-135M
    python benchmarks/rollout.py --models tiny-arith --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def bench_hf(folder: Path, prompts: list[list[int]], max_new: int, pad_id: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
              min_new_tokens=max_new, pad_token_id=pad_id, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=attn[:2], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=attn, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - P) * len(prompts)
    return {"engine": "transformers", "flow": "fp32", "seconds": dt, "tokens": n, "tokens_per_s": n / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,smollm2-135m-instruct")
    ap.add_argument("--flows", default="bf16,jet,jet-kv")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="small batch and budget, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_new_tokens = 4, 8
    from fp8rl.bench import bench_rollout
    from fp8rl.model import export_hf, load
    from fp8rl.prompts import encode_prompts
    from fp8rl.tasks import make_task
    from fp8rl.train import resolve_backend

    problems = make_task("arith").test_problems(args.batch)
    results = []
    for src in args.models.split(","):
        model, tok = load(src)
        backend = resolve_backend("auto", model)
        prompts = encode_prompts(tok, [p.question for p in problems])
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(model, tok, Path(tmp) / "hf", dtype=torch.float32)
            hf = bench_hf(Path(tmp) / "hf", prompts, args.max_new_tokens, tok.pad_token_id)
        hf["model"] = src
        results.append(hf)
        for flow in args.flows.split(","):
            r = bench_rollout(src, flow, backend, prompts, args.max_new_tokens, tok.pad_token_id)
            r["model"] = src
            r["ratio_vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
            results.append(r)
    report = {"batch": args.batch, "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "results": results}
    print(json.dumps(report, indent=2))
    print(f"\n{'model':<24}{'engine':<14}{'flow':<8}{'tok/s':>10}{'vs HF':>8}{'weights MB':>12}{'KV MB':>9}", file=sys.stderr)
    for r in results:
        print(f"{r['model']:<24}{r['engine']:<14}{r['flow']:<8}{r['tokens_per_s']:>10.1f}"
              f"{r.get('ratio_vs_transformers', 1.0):>8.2f}{r.get('weight_bytes', 0) / 1e6:>12.2f}"
              f"{r.get('kv_bytes', 0) / 1e6:>9.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
