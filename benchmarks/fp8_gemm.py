"""Benchmark block FP8 quantization and GEMM against FP32 / BF16 matmul.

Shapes: 4096^3, and the linear layers of SmolLM2-135M (hidden 576,
intermediate 1536, 3 KV heads of 64) on 2048 tokens:

    q_proj/o_proj  [2048, 576]  x [576, 576]^T
    k_proj/v_proj  [2048, 576]  x [192, 576]^T
    gate/up_proj   [2048, 576]  x [1536, 576]^T
    down_proj      [2048, 1536] x [576, 1536]^T

For each GEMM ``y[M, N] = x[M, K] @ w[N, K]^T`` it measures:
- quantization throughput (GB/s of FP32 input read) for the activation
  (1x128 tiles) and the weight (128x128 blocks),
- ``fp8_matmul`` per backend (``reference``, ``cpu``, ``amx``) on pre-quantized operands, ``reference`` skipped
  for 4096^3 (float64, minutes on a laptop CPU),
- torch FP32 matmul, torch BF16 matmul (BF16 in, BF16 out), and the BF16 GEMM
  as FP8Linear runs it on CPU (BF16-rounded operands, FP32 math),
- FP8 weight bytes (data + scales) / BF16 weight bytes;
- FP8 attention storage (static per-head scales: the Q/K/V/P values ``jet-kv``
  multiplies) on the default run's softmax P [64, 4, 68, 80]: the FP8 round trip
  (``quantize_static``'s cast, then ``fp8_to_float`` times the scale) against
  ``dequantize_static`` (the same bits without FP8), side by side.

Prints one JSON object, then a short table. ``--quick``: 256 tokens, no
4096^3, fewer repeats (a smoke run of a few seconds).

    python benchmarks/fp8_gemm.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Callable

import torch

from fp8rl.fp8 import BACKENDS, fp8_matmul, quantize


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up call, in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def shapes(tokens: int, big: bool) -> list[tuple[str, int, int, int]]:
    out = [
        ("smollm2 q/o_proj", tokens, 576, 576),
        ("smollm2 k/v_proj", tokens, 192, 576),
        ("smollm2 gate/up_proj", tokens, 1536, 576),
        ("smollm2 down_proj", tokens, 576, 1536),
    ]
    if big:
        out.insert(0, ("4096^3", 4096, 4096, 4096))
    return out


def bench_one(name: str, m: int, n: int, k: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    qx, qw = quantize(x), quantize(w, (128, 128))
    r: dict = {"name": name, "M": m, "N": n, "K": k}
    t = best_ms(lambda: quantize(x), repeats)
    r["quant_act_ms"], r["quant_act_GBps"] = t, x.numel() * 4 / t / 1e6
    t = best_ms(lambda: quantize(w, (128, 128)), repeats)
    r["quant_weight_ms"], r["quant_weight_GBps"] = t, w.numel() * 4 / t / 1e6
    for backend in BACKENDS:
        if BACKENDS[backend].exact and m * n * k > 2**31:
            r["fp8_reference_ms"] = None  # float64 reference: skipped on big shapes
            continue
        n_rep = 1 if BACKENDS[backend].exact else repeats
        r[f"fp8_{backend}_ms"] = best_ms(lambda: fp8_matmul(qx, qw, backend=backend), n_rep)
    r["fp32_ms"] = best_ms(lambda: x @ w.T, repeats)
    xb, wb = x.bfloat16(), w.bfloat16()
    r["bf16_ms"] = best_ms(lambda: xb @ wb.T, repeats)
    r["bf16_emulated_ms"] = best_ms(lambda: x.bfloat16().float() @ w.bfloat16().float().T, repeats)
    r["fp8_cpu_vs_fp32"] = r["fp8_cpu_ms"] / r["fp32_ms"]
    r["fp8_cpu_vs_bf16"] = r["fp8_cpu_ms"] / r["bf16_ms"]
    r["fp8_amx_vs_bf16"] = r["fp8_amx_ms"] / r["bf16_ms"]
    r["fp8_weight_bytes"], r["bf16_weight_bytes"] = qw.nbytes, w.numel() * 2
    r["fp8_weight_bytes_ratio"] = qw.nbytes / (w.numel() * 2)
    return r


def bench_attention_storage(shape: tuple[int, ...], repeats: int) -> dict:
    """FP8 round trip vs ``dequantize_static`` on a softmax-like tensor (per-head scale 1/448)."""
    from fp8rl.fp8.quant import dequantize_static, fp8_to_float, quantize_static

    p = torch.softmax(torch.randn(shape), dim=-1)
    s = torch.full((shape[1],), 1 / 448).view(1, -1, 1, 1)
    round_trip = best_ms(lambda: fp8_to_float(quantize_static(p, s)) * s, repeats)
    direct = best_ms(lambda: dequantize_static(p, s), repeats)
    assert torch.equal(dequantize_static(p, s), fp8_to_float(quantize_static(p, s)) * s)
    return {"shape": list(shape), "fp8_round_trip_ms": round_trip, "dequantize_static_ms": direct}


def table(rows: list[dict]) -> str:
    head = (
        f"{'gemm':22s} {'MxNxK':>16s} {'qact GB/s':>9s} {'qw GB/s':>8s} {'fp8 ref':>9s} {'fp8 cpu':>8s} {'fp8 amx':>8s} "
        f"{'fp32':>7s} {'bf16':>7s} {'bf16emu':>8s} {'w bytes':>7s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = "skip" if r["fp8_reference_ms"] is None else f"{r['fp8_reference_ms']:.1f}"
        lines.append(
            f"{r['name']:22s} {r['M']:>5d}x{r['N']:>4d}x{r['K']:>4d} "
            f"{r['quant_act_GBps']:9.2f} {r['quant_weight_GBps']:8.2f} "
            f"{ref:>9s} {r['fp8_cpu_ms']:8.2f} {r['fp8_amx_ms']:8.2f} {r['fp32_ms']:7.2f} {r['bf16_ms']:7.2f} {r['bf16_emulated_ms']:8.2f} "
            f"{r['fp8_weight_bytes_ratio']:7.4f}"
        )
    lines.append("times in ms (best of repeats); w bytes = FP8 weight (data + scales) / BF16 weight")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 tokens, no 4096^3, few repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens, repeats = (256, 2) if args.quick else (2048, 5)
    rows = [bench_one(*s, repeats=repeats) for s in shapes(tokens, big=not args.quick)]
    result = {
        "benchmark": "fp8_gemm",
        "quick": args.quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "results": rows,
        "attention_storage": bench_attention_storage((64, 4, 68, 80), repeats * 4),
    }
    print(json.dumps(result))
    print(table(rows))
    a = result["attention_storage"]
    print(f"FP8 attention storage {a['shape']}: round trip {a['fp8_round_trip_ms']:.2f} ms, "
          f"dequantize_static {a['dequantize_static_ms']:.2f} ms")


if __name__ == "__main__":
    main()
