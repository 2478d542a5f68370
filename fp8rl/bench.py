"""`fp8rl bench`: rollout throughput and memory of each precision flow, side by side.

For one model, prompts and batch: tokens/s of the rollout engine under each
flow (EOS disabled, so every flow generates exactly batch x max_new_tokens
tokens), the bytes of the weights the rollout reads, and the KV-cache bytes.
benchmarks/rollout.py adds transformers' `generate` as the baseline.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from fp8rl.compare import kv_bytes, weight_bytes
from fp8rl.config import RunConfig


def bench_rollout(
    model_src: str, flow: str, backend: str, prompts: Sequence[Sequence[int]], max_new: int, pad_id: int,
    repeats: int = 1,
) -> dict[str, Any]:
    """Load `model_src` under `flow` on `backend` ("auto" or a backend name), warm up,
    then time `repeats` batched rollouts (the same seeds): the median's seconds, and all."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    from fp8rl.model import load
    from fp8rl.precision import PRESETS, apply_flow
    from fp8rl.rollout.calibrate import calibrate
    from fp8rl.rollout.engine import SamplingParams, default_cache_len, generate, left_pad
    from fp8rl.rollout.kv_cache import KVCache

    model, _ = load(model_src)
    f = PRESETS[flow]
    plan = apply_flow(model, f, backend=backend)
    if f.kv_cache == "fp8" or f.attention == "fp8":
        calibrate(model, *left_pad(prompts, pad_id))
    # warm-up as benchmarks/vllm_worker.py's: two prompts, the full length (the per-shape measurements
    # of the decode steps' key prefixes happen once per process, as in a training run)
    warm = prompts[:2]
    generate(model, warm, SamplingParams(max_new_tokens=max_new), eos_ids=[], pad_id=pad_id,
             seeds=list(range(len(warm))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = generate(model, prompts, SamplingParams(max_new_tokens=max_new), eos_ids=[], pad_id=pad_id,
                       seeds=list(range(len(prompts))))
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]  # the median (the middle one of an odd count)
    cache_len = default_cache_len(max(len(p) for p in prompts), max_new)
    return {
        "engine": "fp8rl", "model": model_src, "flow": flow, "backend": plan.backend.name, "seconds": seconds,
        "all_seconds": times, "tokens": out.n_tokens, "tokens_per_s": out.n_tokens / seconds,
        "weight_bytes": weight_bytes(model, f.rollout_linear == "fp8"),
        "kv_bytes": kv_bytes(model, f.kv_cache, len(prompts), cache_len),
        # what this engine's cache holds (a fused cache: the stored format; an unfused one: FP32 values)
        "kv_resident_bytes": KVCache.for_model(model, len(prompts), cache_len, device="meta").resident_nbytes,
    }


def bench_flows(cfg: RunConfig) -> dict[str, Any]:
    """`cfg.bench.flows` side by side on `cfg.model` and `cfg.backend` (resolved per flow by apply_flow)."""
    from fp8rl.model import load
    from fp8rl.prompts import encode_prompts
    from fp8rl.tasks import make_task

    model_src, batch, max_new = cfg.model, cfg.bench.batch, cfg.bench.max_new_tokens
    _, tok = load(model_src)
    prompts = encode_prompts(tok, [p.question for p in make_task("arith").test_problems(batch)])
    rows = [bench_rollout(model_src, f, cfg.backend, prompts, max_new, tok.pad_token_id) for f in cfg.bench.flows]
    base = next((r for r in rows if r["flow"] == "bf16"), rows[0])
    for r in rows:
        r["speed_vs_" + base["flow"]] = r["tokens_per_s"] / base["tokens_per_s"]
        r["weight_ratio_vs_" + base["flow"]] = r["weight_bytes"] / base["weight_bytes"]
        r["kv_ratio_vs_" + base["flow"]] = r["kv_bytes"] / base["kv_bytes"]
    return {"model": model_src, "batch": batch, "max_new_tokens": max_new, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "results": rows}


def table(report: dict[str, Any]) -> str:
    lines = [f"{'flow':<12}{'backend':<11}{'tok/s':>10}{'weights MB':>12}{'KV MB':>9}"]
    for r in report["results"]:
        lines.append(f"{r['flow']:<12}{r['backend']:<11}{r['tokens_per_s']:>10.1f}"
                     f"{r['weight_bytes'] / 1e6:>12.2f}{r['kv_bytes'] / 1e6:>9.2f}")
    return "\n".join(lines)
