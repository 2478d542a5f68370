"""The compiled quantization (fp8rl/fp8/kernels.c) against its torch code, side by side.

Four measurements, each alternating the two paths in one run (the torch path is what
runs with `FP8RL_KERNELS=0`, or where no C compiler is):

- per call: `quantize_dequantize` of a few activation shapes, compiled vs torch (best of 5
  rounds of `--calls` calls), and a check that both give the same bits;
- weights: every FP8 linear's weight quantized to 128 x 128 blocks (what `refresh_weights`
  does once per optimizer step) and dequantized to BF16 (the form the `amx` backend
  multiplies), compiled vs torch, alternated for `--rounds` rounds, bits compared;
- a decode step: one model's bf16 and jet decode forwards (`decode_step.time_decode`), and
  jet again on the torch path, interleaved for `--rounds` rounds (this VM's noise moves
  whole minutes, so each round holds one of each);
- with `--default-runs N`: N pairs of `fp8rl train --config configs/default.toml`, torch path
  then compiled, each in a fresh process, with their metrics compared line for line.

    python benchmarks/compiled_quant.py                                    # tiny-arith and SmolLM2, 16 rows
    python benchmarks/compiled_quant.py --models smollm2-135m-instruct --rows 64 --rounds 6
    python benchmarks/compiled_quant.py --models '' --default-runs 2       # the default run, 2 pairs (~6 min)

Prints one JSON object on stdout and tables on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from decode_step import time_decode
from vs_trl import cpu_name
from fp8rl.fp8 import kernels
from fp8rl.fp8.linear import WEIGHT_BLOCK, FP8Linear
from fp8rl.fp8.quant import dequantize, quantize, quantize_dequantize
from fp8rl.model.load import load
from fp8rl.precision import apply_flow, refresh_weights
from fp8rl.runlog import read_metrics

SHAPES = [(16, 576), (64, 576), (16, 1536), (128, 128), (576, 384), (576, 1536)]
TIMING = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes"}


def use_kernels(on: bool) -> None:
    """The path `quantize_dequantize` takes from here on, as `FP8RL_KERNELS` would set it."""
    os.environ[kernels.ENV_SWITCH] = "1" if on else "0"
    kernels.library.cache_clear()


def per_call(calls: int) -> list[dict]:
    def best_us(x: torch.Tensor, compiled: bool) -> float:
        quantize_dequantize(x, compiled=compiled)
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                quantize_dequantize(x, compiled=compiled)
            rounds.append((time.perf_counter() - t0) / calls * 1e6)
        return min(rounds)

    out = []
    with torch.inference_mode():
        for shape in SHAPES:
            x = torch.randn(shape)
            same = torch.equal(quantize_dequantize(x).view(torch.int32),
                               quantize_dequantize(x, compiled=False).view(torch.int32))
            torch_us, compiled_us = best_us(x, False), best_us(x, True)
            out.append({"shape": list(shape), "torch_us": torch_us, "compiled_us": compiled_us,
                        "speedup": torch_us / compiled_us, "same_bits": same})
    return out


def weight_refresh(src: str, rounds: int) -> dict:
    model, _ = load(src)
    apply_flow(model, "jet", "auto")
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]

    def refresh(compiled: bool) -> list:
        out = []
        for lin in linears:
            q = quantize(lin.weight.detach(), WEIGHT_BLOCK, scale_fmt=lin.plan.scale_fmt, name=lin.name, compiled=compiled)
            out.append((q, dequantize(q, torch.bfloat16, compiled=compiled)))
        return out

    same = all(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
               and torch.equal(da.view(torch.int16), db.view(torch.int16))
               for (a, da), (b, db) in zip(refresh(False), refresh(True), strict=True))
    ms: dict[str, list[float]] = {"torch": [], "compiled": []}
    with torch.no_grad():
        for _ in range(rounds):
            for key, compiled in (("torch", False), ("compiled", True)):
                t0 = time.perf_counter()
                refresh(compiled)
                ms[key].append((time.perf_counter() - t0) * 1e3)
    return {"model": src, "linears": len(linears), "weights": sum(m.weight.numel() for m in linears),
            "ms": ms, "same_bits": same}


def decode_rounds(src: str, rows: int, rounds: int) -> dict:
    models = {}
    for flow in ("bf16", "jet"):
        model, _ = load(src)
        apply_flow(model, flow, "auto")
        refresh_weights(model)
        models[flow] = model
    ms: dict[str, list[float]] = {"bf16": [], "jet": [], "jet (torch path)": []}
    calls: dict[str, int] = {}
    for _ in range(rounds):
        for key, flow, on in (("bf16", "bf16", True), ("jet", "jet", True), ("jet (torch path)", "jet", False)):
            use_kernels(on)
            r = time_decode(models[flow], rows, 16, 48, 10)
            ms[key].append(r["ms_per_step"])
            calls[key] = r["torch_calls"]
    use_kernels(True)
    return {"model": src, "rows": rows, "ms_per_step": ms, "torch_calls": calls}


def default_runs(pairs: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            lines = {}
            for on in (False, True):
                run = Path(tmp) / f"run{i}_{int(on)}"
                env = {**os.environ, kernels.ENV_SWITCH: "1" if on else "0"}
                t0 = time.perf_counter()
                subprocess.run(["fp8rl", "train", "--config", "configs/default.toml", "--out", str(run), "--no-progress"],
                               check=True, env=env, capture_output=True)
                wall = time.perf_counter() - t0
                rows = read_metrics(run / "metrics.jsonl")
                lines[on] = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
                out.append({"pair": i, "compiled": on, "wall_s": wall,
                            "steps_s": sum(r["time_step_s"] for r in rows),
                            "rollout_s": sum(r["time_rollout_s"] for r in rows),
                            "train_s": sum(r["time_train_s"] for r in rows),
                            "eval": (run / "eval.jsonl").read_text()})
            out[-1]["metrics_equal_to_torch_path"] = lines[True] == lines[False] and out[-1]["eval"] == out[-2]["eval"]
    for r in out:
        del r["eval"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-arith,smollm2-135m-instruct", help="decode steps of these ('' for none)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--default-runs", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if kernels.library() is None:
        raise SystemExit("no compiled kernels on this machine (no C compiler, or FP8RL_KERNELS=0): nothing to compare")
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "per_call": per_call(args.calls),
              "weights": [weight_refresh(m, args.rounds) for m in args.models.split(",") if m],
              "decode": [decode_rounds(m, args.rows, args.rounds) for m in args.models.split(",") if m],
              "default_runs": default_runs(args.default_runs)}
    print(json.dumps(report, indent=2))
    print(f"{report['cpu']}, {report['threads']} threads", file=sys.stderr)
    print(f"{'quantize_dequantize':<22}{'torch us':>10}{'compiled us':>13}{'speedup':>9}{'same bits':>11}", file=sys.stderr)
    for r in report["per_call"]:
        print(f"{str(tuple(r['shape'])):<22}{r['torch_us']:>10.1f}{r['compiled_us']:>13.1f}{r['speedup']:>8.2f}x"
              f"{str(r['same_bits']):>11}", file=sys.stderr)
    for w in report["weights"]:
        print(f"\n{w['model']}: {w['linears']} FP8 weights ({w['weights'] / 1e6:.1f}M) quantized and dequantized to BF16, "
              f"ms per round (same bits: {w['same_bits']}):", file=sys.stderr)
        for key, values in w["ms"].items():
            print(f"  {key:<18}{', '.join(f'{v:.1f}' for v in values)}", file=sys.stderr)
    for d in report["decode"]:
        print(f"\n{d['model']}, decode step of {d['rows']} rows, ms per round (torch calls):", file=sys.stderr)
        for key, values in d["ms_per_step"].items():
            print(f"  {key:<18}{', '.join(f'{v:.1f}' for v in values)}  ({d['torch_calls'][key]})", file=sys.stderr)
    for r in report["default_runs"]:
        print(f"default run, pair {r['pair']}, {'compiled' if r['compiled'] else 'torch path'}: steps {r['steps_s']:.1f} s "
              f"(rollout {r['rollout_s']:.1f}, training {r['train_s']:.1f}), wall {r['wall_s']:.1f} s"
              + (f"; metrics equal to the torch path's: {r['metrics_equal_to_torch_path']}"
                 if "metrics_equal_to_torch_path" in r else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
