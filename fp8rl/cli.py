"""`fp8rl` command line: train | eval | sft | mismatch | export | compare.

Each command takes a TOML `--config` (see configs/) plus flag overrides; flags
win over the file. `--json` prints one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

COMMON_FLAGS = ("config", "model", "task", "flow", "seed", "out", "backend")


def _add_common(p: argparse.ArgumentParser, out_default: str | None = None) -> None:
    p.add_argument("--config", help="TOML config file (see configs/); flags override its values")
    p.add_argument("--model", help="built-in name (tiny-arith, smollm2-135m-instruct), HF folder or .gguf file")
    p.add_argument("--task", help="arith | arith:KEY=VAL,... | gsm8k:PATH | reasoning-gym:NAME")
    p.add_argument("--flow", help="precision preset: bf16, fp8-rollout, jet, jet-e2e, jet-kv, fp8-grads")
    p.add_argument("--backend", help="GEMM backend: auto (default), reference (exact), cpu (FP32 emulation), amx (native BF16)")
    p.add_argument("--seed", type=int, help="random seed (data, sampling, init)")
    p.add_argument("--out", help=f"output directory{f' (default {out_default})' if out_default else ''}")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any config key, e.g. --set train.lr=1e-4 --set rollout.group_size=4 (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def _run_config(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    from fp8rl.config import load_config, parse_override

    overrides: dict[str, Any] = {}
    for name in COMMON_FLAGS[1:]:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    overrides.update(extra or {})
    return load_config(args.config, overrides)


def _emit(args: argparse.Namespace, result: dict[str, Any], human: str) -> None:
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(human)


def _load_under_flow(model_src: str, flow_name: str | None, backend: str):
    from fp8rl.model import load
    from fp8rl.model.transformer import apply_flow
    from fp8rl.precision import PRESETS, get_flow, refresh_weights
    from fp8rl.train import resolve_backend

    model, tok = load(model_src)
    if tok is None:
        raise SystemExit(f"error: model {model_src!r} has no tokenizer files")
    if flow_name is not None:
        flow = get_flow(flow_name) if flow_name not in PRESETS else PRESETS[flow_name]
        apply_flow(model, flow, backend=resolve_backend(backend, model))
        refresh_weights(model)
    return model, tok


# -- commands ----------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fp8rl.train import Trainer

    extra = {"train.steps": args.steps} if args.steps is not None else {}
    cfg = _run_config(args, extra)
    console = Console(stderr=args.json)
    console.print("[bold]fp8rl train[/bold] resolved config:")
    console.print_json(json.dumps(cfg.to_dict()))
    trainer = Trainer(cfg, resume=args.resume, log=console.print)
    summary = trainer.run(progress=not args.no_progress)
    human = (
        f"\nrun {cfg.out}: flow {summary['flow']}, {summary['steps']} steps in {summary['wall_time_s']:.0f} s\n"
        f"  held-out accuracy: {summary['eval_accuracy_before']} -> {summary['eval_accuracy_after']}\n"
        f"  reward: first step {summary['reward_mean_first']:.3f}, last 5 steps {summary['reward_mean_last5']:.3f}\n"
        f"  token_mult_prob_error: mean {summary['token_mult_prob_error_mean']:.6f}, "
        f"max {summary['token_mult_prob_error_max']:.6f}\n"
        f"  metrics: {cfg.out}/metrics.jsonl   plots: {', '.join(summary['plots'])}"
        if summary["steps"] else f"run {cfg.out}: nothing to do (0 steps)"
    )
    _emit(args, summary, human)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from fp8rl.evaluate import evaluate
    from fp8rl.tasks import make_task

    cfg = _run_config(args)
    model, tok = _load_under_flow(cfg.model, args.flow, cfg.backend)
    problems = make_task(cfg.task).test_problems(args.n)
    t0 = time.perf_counter()
    res = evaluate(
        model, tok, problems, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature if args.temperature is not None else 0.0,
        seed=cfg.seed, system_prompt=cfg.system_prompt,
    )
    res["seconds"] = time.perf_counter() - t0
    res["flow"] = args.flow or "fp32"
    human = f"accuracy {res['accuracy']:.3f} on {res['n']} held-out problems of {cfg.task} ({res['seconds']:.1f} s)"
    if not args.json:
        for s in res["samples"]:
            human += f"\n--- {s['question']}\n{s['completion']}\n(gold {s['gold']})"
    _emit(args, res, human)
    return 0


def cmd_mismatch(args: argparse.Namespace) -> int:
    from fp8rl.evaluate import measure_mismatch
    from fp8rl.tasks import make_task

    cfg = _run_config(args)
    model, tok = _load_under_flow(cfg.model, cfg.flow, cfg.backend)
    problems = make_task(cfg.task).test_problems(args.prompts)
    t0 = time.perf_counter()
    res = measure_mismatch(
        model, tok, problems, samples=args.samples, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=cfg.seed, system_prompt=cfg.system_prompt,
    )
    res.update(flow=cfg.flow, model=cfg.model, backend=model.head_backend, seconds=time.perf_counter() - t0)
    human = "\n".join(f"{k:>24}: {v}" for k, v in res.items())
    _emit(args, res, human)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from fp8rl.evaluate import evaluate
    from fp8rl.sft import SFTConfig, build_tiny_policy, run_sft, save_policy, sft_info
    from fp8rl.tasks import make_task

    task = make_task(args.task)
    cfg = SFTConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                    early_answer_noise=args.early_answer_noise)
    if args.model:
        from fp8rl.model import load

        model, tok = load(args.model)
        if tok is None:
            raise SystemExit(f"error: model {args.model!r} has no tokenizer files")
    else:
        model, tok = build_tiny_policy(task, cfg)
    print(f"fp8rl sft: {sum(p.numel() for p in model.parameters()):,} parameters, {cfg}", file=sys.stderr)
    t0 = time.perf_counter()
    with Progress(disable=args.json) as bar:
        tid = bar.add_task("sft", total=cfg.steps)

        def on_step(step: int, loss: float, lr: float) -> None:
            bar.update(tid, completed=step + 1, description=f"sft loss {loss:.3f}")

        losses = run_sft(model, tok, task, cfg, on_step=on_step)
    seconds = time.perf_counter() - t0
    ev = evaluate(model, tok, task.test_problems(args.eval_n), max_new_tokens=args.max_new_tokens)
    command = "fp8rl sft " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["sft"] else "fp8rl sft"
    info = sft_info(cfg, task, losses, ev, seconds, command)
    save_policy(model, tok, Path(args.out), info)
    info["out"] = args.out
    _emit(args, info, f"saved {args.out}: held-out accuracy {ev['accuracy']:.3f} (n={ev['n']}), "
                      f"final loss {losses[-1]:.4f}, {seconds:.0f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from fp8rl.model import export_fp8_block, export_hf, load

    if not args.model or not args.out:
        raise ValueError("export needs --model and --out (flags or config keys)")
    model, tok = load(args.model)
    if args.format == "hf":
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        export_hf(model, tok, Path(args.out), dtype=dtype, overwrite=args.overwrite)
    else:
        export_fp8_block(model, tok, Path(args.out), scale_fmt=args.scale_fmt, overwrite=args.overwrite)
    files = sorted(p.name for p in Path(args.out).iterdir())
    _emit(args, {"out": args.out, "format": args.format, "files": files}, f"wrote {args.out}: {', '.join(files)}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fp8rl.compare import run_compare

    extra = {"train.steps": args.steps} if args.steps is not None else {}
    cfg = _run_config(args, extra)
    flows = [f.strip() for f in args.flows.split(",") if f.strip()]
    from fp8rl.precision import PRESETS

    unknown = [f for f in flows if f not in PRESETS]
    if unknown:
        raise ValueError(f"unknown flow {unknown[0]!r} in --flows; valid presets: {', '.join(PRESETS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out or "runs/compare")
    report = run_compare(cfg, flows, seeds, out, progress=not args.json)
    _emit(args, report, (out / "report.md").read_text())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from fp8rl.bench import bench_flows, table

    flows = [f.strip() for f in args.flows.split(",") if f.strip()]
    report = bench_flows(args.model, flows, args.batch, args.max_new_tokens, args.backend)
    _emit(args, report, table(report))
    return 0


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8rl", description="On-policy FP8 reinforcement learning of language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.subcommands = sub.choices  # name -> the subcommand's parser (for flat TOML defaults)

    p = sub.add_parser("train", help="GRPO training under a precision flow",
                       description="GRPO training: rollout, reward, PPO update, quantize once, recalibrate.")
    _add_common(p, "runs/default")
    p.add_argument("--steps", type=int, help="number of RL steps (train.steps)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("eval", help="held-out accuracy", description="Held-out accuracy (greedy unless --temperature).")
    _add_common(p)
    p.add_argument("--n", type=int, default=200, help="number of held-out problems (default 200)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="generation budget (default 48)")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("mismatch", help="rollout vs training-forward log-prob mismatch",
                       description="Sample with the rollout engine, re-score with the training forward, "
                                   "print the mismatch metrics.")
    _add_common(p)
    p.add_argument("--prompts", type=int, default=16, help="number of problems (default 16)")
    p.add_argument("--samples", type=int, default=4, help="samples per problem (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation budget (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.set_defaults(fn=cmd_mismatch)

    p = sub.add_parser("sft", help="supervised warm-up; builds the tiny-arith policy",
                       description="Supervised fine-tuning on a task's worked solutions. Without --model it "
                                   "builds the built-in tiny policy from scratch (tokenizer + model).")
    p.add_argument("--config", dest="flat_config", help="TOML file whose keys are this command's flag names "
                   "(steps = 230, early_answer_noise = 0.4, ...); flags win")
    p.add_argument("--task", default="arith", help="task spec (default arith)")
    p.add_argument("--model", help="start from this model instead of a fresh tiny policy")
    p.add_argument("--out", default="runs/sft", help="output HF folder (default runs/sft)")
    p.add_argument("--steps", type=int, default=SFT_DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=SFT_DEFAULTS["batch_size"], help="sequences per step")
    p.add_argument("--lr", type=float, default=SFT_DEFAULTS["lr"], help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--early-answer-noise", type=float, default=0.0, metavar="P",
                   help="share of training solutions whose final line gives the first step's result (a bad "
                        "habit for RL to fix; the built-in tiny-arith policy uses 0.4)")
    p.add_argument("--eval-n", type=int, default=500, help="held-out problems to evaluate at the end")
    p.add_argument("--max-new-tokens", type=int, default=48, help="generation budget for the evaluation")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(fn=cmd_sft)

    p = sub.add_parser("compare", help="run several precision flows side by side and write a report",
                       description="Train each flow from the same policy, data and seeds; write report.md, "
                                   "report.json and plots into --out (default runs/compare).")
    _add_common(p, "runs/compare")
    p.add_argument("--flows", default="bf16,fp8-rollout,jet,jet-e2e,jet-kv,fp8-grads",
                   help="comma-separated presets (fp8-rollout runs with and without tis)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, help="RL steps per run (train.steps)")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("bench", help="rollout tokens/s and memory per precision flow",
                       description="Time the rollout engine under each flow on one model (EOS disabled, same "
                                   "prompts and batch); print tokens/s, weight and KV-cache bytes. "
                                   "benchmarks/ holds the comparisons against other tools.")
    p.add_argument("--model", default="tiny-arith", help="built-in name, HF folder or .gguf file")
    p.add_argument("--flows", default="bf16,jet,jet-kv", help="comma-separated presets")
    p.add_argument("--batch", type=int, default=32, help="sequences per rollout (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per sequence (default 48)")
    p.add_argument("--backend", default="auto", help="GEMM backend: auto, reference, cpu, amx")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("export", help="write an HF folder or a block-FP8 checkpoint",
                       description="Export a model as a plain HF folder or as the block-FP8 layout vLLM/SGLang load.")
    p.add_argument("--config", dest="flat_config", help="TOML file whose keys are this command's flag names "
                   "(model = ..., out = ..., format = \"fp8-block\"); flags win")
    p.add_argument("--model", help="built-in name, HF folder or .gguf file (required)")
    p.add_argument("--out", help="output folder (required)")
    p.add_argument("--format", choices=("hf", "fp8-block"), default="hf", help="output layout (default hf)")
    p.add_argument("--scale-fmt", choices=("fp32", "ue8m0"), default="fp32", help="fp8-block scale format")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="hf format: tensor dtype (default float32, an exact copy)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.set_defaults(fn=cmd_export)
    return parser


def _sft_defaults() -> dict[str, Any]:
    from dataclasses import asdict

    from fp8rl.sft import SFTConfig

    return asdict(SFTConfig())


SFT_DEFAULTS = _sft_defaults()


def _flat_toml_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """sft and export read a flat TOML file of their flag names (`steps = 300`,
    `early_answer_noise = 0.4`, `format = "fp8-block"`); flags on the command line win."""
    from fp8rl.config import read_toml

    args = parser.parse_args(argv)
    if getattr(args, "flat_config", None) is None:
        return args
    path = Path(args.flat_config)
    data = read_toml(path)
    sub = parser.subcommands[args.command]
    known = {a.dest for a in sub._actions} - {"help", "flat_config", "json"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]} in {path}; valid keys: {', '.join(sorted(known))}")
    sub.set_defaults(**data)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from fp8rl.train import TrainingError

    parser = build_parser()
    try:
        args = _flat_toml_config(parser, argv)
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, TrainingError) as e:
        # user-caused errors (bad config, data, paths): one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
