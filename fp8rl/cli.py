"""`fp8rl` command line: train | eval | mismatch | audit | sft | export | compare | bench.

Every command reads the same run config (fp8rl/config.py), with one
precedence: dataclass defaults < the command's own defaults
(`COMMAND_DEFAULTS`) < the TOML `--config` < `--set KEY=VALUE` < flags. A
flag's argparse `dest` is the config key it sets (`--n` -> `eval.n`), so
`_run_config` is the one place where flags become config. `--json` prints one
JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from fp8rl.allocator import keep_freed_memory
from fp8rl.config import CHOICES, RunConfig, default_values, load_config, parse_override

BACKEND_HELP = "GEMM backend: auto (choose_backend's pick) or one of {backends}"

# Flags of the top-level config keys (dest = the key); each command takes those it uses.
TOP_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"help": "built-in name (tiny-arith, tiny-moe, tiny-chain, smollm2-135m-instruct), HF folder or .gguf file"},
    "task": {"help": "arith | arith:KEY=VAL,... | gsm8k:PATH | reasoning-gym:NAME"},
    "flow": {"help": "precision preset: {presets}"},
    "backend": {"help": BACKEND_HELP},
    "seed": {"type": int, "help": "random seed (data, sampling, init)"},
    "out": {"help": "output directory"},
}

# Each command's own defaults of top-level keys: a layer below the config file,
# so a file or flag that sets the key wins.
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"out": "runs/sft", "model": ""},  # model "" = build the tiny policy from scratch
    "compare": {"out": "runs/compare"},
    "export": {"out": "", "model": ""},  # export needs both, from a flag or the config
}


def _names(text: str) -> tuple[str, ...]:
    """`a,b,c` -> ("a", "b", "c") (for --flows)."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _ints(text: str) -> tuple[int, ...]:
    """`0,1,2` -> (0, 1, 2) (for --seeds)."""
    try:
        return tuple(int(s) for s in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _config_flag(
    p: argparse.ArgumentParser, flag: str, key: str, text: str, defaults: dict[str, Any], **kw: Any
) -> None:
    """`flag` sets config key `key` (its dest). Its argparse default is None, so an
    absent flag lets the lower layers through; the help names the key and its default."""
    shown = defaults[key]
    shown = ",".join(map(str, shown)) if isinstance(shown, tuple) else shown
    if key in CHOICES:
        kw.setdefault("choices", CHOICES[key])
    else:
        kw.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
    text += f" [{key} = {shown}]" if shown != "" else f" [{key}]"
    p.add_argument(flag, dest=key, default=None, help=text, **kw)


class _Parser(argparse.ArgumentParser):
    """Fills `{presets}` and `{backends}` in flag help from the registries only when
    help is printed. The registries import torch (~1 s), which `fp8rl --help` and
    argument errors must not pay; `fp8rl CMD --help` does, and in exchange lists the
    names from the registries themselves, so a new preset or backend needs no edit
    here. (A HelpFormatter hook would be called too early: Python 3.14 expands every
    help string at add_argument time to validate it.)"""

    def format_help(self) -> str:
        for action in self._actions:
            if action.help and ("{presets}" in action.help or "{backends}" in action.help):
                action.help = action.help.format(**_registry_names())
        return super().format_help()


def _registry_names() -> dict[str, str]:
    from fp8rl.fp8.backends import BACKENDS
    from fp8rl.precision import PRESETS

    return {"presets": ", ".join(PRESETS), "backends": ", ".join(BACKENDS)}  # the registries, never a copy


def _add_common(
    p: argparse.ArgumentParser, keys: Sequence[str], defaults: dict[str, Any], **texts: str
) -> None:
    """--config, --set, --json, and the flags of the top-level `keys` (`texts` replace their help)."""
    p.add_argument("--config", help="TOML config file (see configs/); --set and flags override its values")
    for key in keys:
        spec = TOP_FLAGS[key]
        text = texts.get(key, spec["help"])  # {presets} / {backends}: filled by _Parser when printed
        _config_flag(p, f"--{key}", key, text, defaults, type=spec.get("type", str))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any config key, e.g. --set train.lr=1e-4 --set rollout.group_size=4 (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The one configuration path of every command: dataclass defaults < COMMAND_DEFAULTS
    < --config < --set < flags (the parsed args whose dest is a config key)."""
    keys = default_values()
    overrides = dict(parse_override(item) for item in args.set)
    overrides.update({k: v for k, v in vars(args).items() if k in keys and v is not None})
    return load_config(args.config, overrides, COMMAND_DEFAULTS.get(args.command, {}))


def _emit(args: argparse.Namespace, result: dict[str, Any], human: str) -> None:
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(human)


def _load_any(model_src: str) -> tuple[Any, Any]:
    """(model, tokenizer or None) of a model source, or of a training run's
    checkpoint (`runs/NAME/checkpoints/step_N`, written by one process or by
    data-parallel ranks): its run's model with the trained weights."""
    from fp8rl.model import load

    ckpt = Path(model_src).expanduser()
    if not ((ckpt / "meta.json").is_file() and (ckpt / "model.safetensors").is_file()):
        return load(model_src)
    from fp8rl.checkpoint import load_checkpoint

    run = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    if not isinstance(run, dict) or not isinstance(run.get("model"), str):
        raise ValueError(f"{ckpt / 'config.json'}: not a run config (no 'model'); is {ckpt} a training checkpoint?")
    model, tok = load(run["model"])
    meta = load_checkpoint(ckpt, model)
    if "attention_scales" in meta:  # the run's FP8 Q/K/V scales (FP8 KV flows)
        model.set_attention_scales(meta["attention_scales"])
    return model, tok


def _load(model_src: str) -> tuple[Any, Any]:
    """(model, tokenizer); a model without tokenizer files is an error here."""
    model, tok = _load_any(model_src)
    if tok is None:
        raise ValueError(f"model {model_src!r} has no tokenizer files")
    return model, tok


def _load_under_flow(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """`cfg.model` under `cfg.flow` on `cfg.backend`: (model, tokenizer, plan)."""
    from fp8rl.precision import apply_flow

    model, tok = _load(cfg.model)
    plan = apply_flow(model, cfg.flow, backend=cfg.backend)
    return model, tok, plan


# -- commands ----------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fp8rl.distributed import World
    from fp8rl.train import Trainer

    cfg = _run_config(args)
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _torchrun(args.nproc, args.argv)
    console = Console(stderr=args.json)
    world = World.from_env()  # torchrun's ranks, or one process
    # Everything that can be refused (model, task, run directory) is checked
    # while the trainer is built, before the config is printed and the run starts.
    if world.size > 1:
        _stop_on_sigterm(world.rank)
    trainer = Trainer(cfg, resume=args.resume, log=console.print, world=world)
    if not world.is_main:
        trainer.run(progress=False)
        return 0
    console.print("[bold]fp8rl train[/bold] resolved config:")
    console.print_json(json.dumps(cfg.to_dict()))
    summary = trainer.run(progress=not args.no_progress)
    human = (
        f"\nrun {cfg.out}: flow {summary['flow']} on {summary['backend']}, {summary['steps']} steps in "
        f"{summary['wall_time_s']:.0f} s\n"
        f"  held-out accuracy: {summary['eval_accuracy_before']} -> {summary['eval_accuracy_after']}\n"
        f"  reward: first step {summary['reward_mean_first']:.3f}, last 5 steps {summary['reward_mean_last5']:.3f}\n"
        f"  token_mult_prob_error: mean {summary['token_mult_prob_error_mean']:.6f}, "
        f"max {summary['token_mult_prob_error_max']:.6f}\n"
        f"  metrics: {cfg.out}/metrics.jsonl   plots: {', '.join(summary['plots'])}"
        + "".join(f"\n  warning: {w}" for w in summary["warnings"])
        if summary["steps"] else f"run {cfg.out}: nothing to do (0 steps)"
    )
    _emit(args, summary, human)
    return 0


def _stop_on_sigterm(rank: int) -> None:
    """torchrun ends the surviving ranks of a run that lost one with SIGTERM: say so
    in one line (as a failed collective does) instead of dying silently."""
    import signal

    from fp8rl.distributed import RankLostError

    def stop(signum: int, frame: Any) -> None:
        raise RankLostError(f"rank {rank}: another data-parallel rank stopped (torchrun ended this one); "
                            "continue with --resume")

    signal.signal(signal.SIGTERM, stop)


def _torchrun(nproc: int, argv: list[str]) -> int:
    """This `fp8rl train` command (`argv`) again, under torchrun on `nproc` local processes."""
    import subprocess

    rest: list[str] = []
    skip = False
    for a in argv:  # drop --nproc N / --nproc=N: each rank is one process
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fp8rl", *rest]
    return subprocess.call(cmd)


def cmd_eval(args: argparse.Namespace) -> int:
    from fp8rl.evaluate import evaluate
    from fp8rl.tasks import make_task

    cfg = _run_config(args)
    problems = make_task(cfg.task).test_problems(cfg.eval.n)
    model, tok, _ = _load_under_flow(cfg)
    t0 = time.perf_counter()
    res = evaluate(
        model, tok, problems, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
        batch_size=cfg.eval.batch_size, seed=cfg.seed, system_prompt=cfg.system_prompt,
    )
    res["seconds"] = time.perf_counter() - t0
    res["flow"] = cfg.flow
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
    m = cfg.mismatch
    problems = make_task(cfg.task).test_problems(m.prompts)
    model, tok, plan = _load_under_flow(cfg)
    engine = None
    if cfg.rollout.engine == "vllm":
        from fp8rl.rollout.vllm_engine import VLLMEngine, check_engine_supported

        check_engine_supported(plan.flow, model)
        engine = VLLMEngine(model, tok, model.config.max_position_embeddings, cfg.seed)
    t0 = time.perf_counter()
    res = measure_mismatch(
        model, tok, problems, samples=m.samples, max_new_tokens=m.max_new_tokens,
        temperature=m.temperature, seed=cfg.seed, system_prompt=cfg.system_prompt, calibration=cfg.calibration,
        engine=engine,
    )
    res.update(flow=cfg.flow, model=cfg.model, backend=plan.backend.name, engine=cfg.rollout.engine,
               seconds=time.perf_counter() - t0)
    human = "\n".join(f"{k:>24}: {v}" for k, v in res.items())
    _emit(args, res, human)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from fp8rl.rollout.vllm_engine import VLLMEngine, check_engine_supported

    cfg = _run_config(args)
    model, tok, plan = _load_under_flow(cfg)
    check_engine_supported(plan.flow, model)
    engine = VLLMEngine(model, tok, model.config.max_position_embeddings, cfg.seed)
    checked = engine.audit(model)  # raises, naming the parameter, on any difference
    res = {"model": cfg.model, "flow": cfg.flow, "engine": f"vllm {engine.version}", "parameters_checked": len(checked),
           "identical": True}
    _emit(args, res, f"vLLM {engine.version} holds the policy's {cfg.flow} weights bit for bit "
                     f"({len(checked)} parameters checked)")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from fp8rl.evaluate import evaluate
    from fp8rl.prompts import encode_prompts
    from fp8rl.runlog import atomic_write_text
    from fp8rl.sft import build_tiny_policy, run_sft, save_policy, sft_info
    from fp8rl.tasks import make_task

    cfg = _run_config(args)
    s, out = cfg.sft, Path(cfg.out)
    # save_policy replaces `out`: never a folder sft did not write (a shared config's `out` is a run directory)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path {out} is a file, not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / "sft.json").is_file():
        raise FileExistsError(f"output directory {out} is not empty and holds no sft policy; choose another --out")
    task = make_task(cfg.task)
    model, tok = _load(cfg.model) if cfg.model else build_tiny_policy(task, s, seed=cfg.seed)
    test = task.test_problems(s.eval_n)
    longest = max((len(p) for p in encode_prompts(tok, [p.question for p in test], cfg.system_prompt)), default=0)
    context = model.config.max_position_embeddings
    if longest + s.max_new_tokens > context:  # found now, not after the training
        raise ValueError(
            f"sft: the evaluation's longest prompt has {longest} tokens; with sft.max_new_tokens = "
            f"{s.max_new_tokens} it exceeds the model's context of {context} positions "
            f"(lower sft.max_new_tokens{'' if cfg.model else ' or raise sft.max_position_embeddings'})"
        )
    print(f"fp8rl sft: {sum(p.numel() for p in model.parameters()):,} parameters, seed {cfg.seed}, {s}",
          file=sys.stderr)
    t0 = time.perf_counter()
    with Progress(disable=args.json) as bar:
        tid = bar.add_task("sft", total=s.steps)

        def on_step(step: int, loss: float, lr: float) -> None:
            bar.update(tid, completed=step + 1, description=f"sft loss {loss:.3f}")

        losses = run_sft(model, tok, task, s, seed=cfg.seed, on_step=on_step, system_prompt=cfg.system_prompt)
    seconds = time.perf_counter() - t0
    command = "fp8rl sft " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["sft"] else "fp8rl sft"
    # Saved before the evaluation, so that nothing can lose the trained weights; sft.json gets the eval after.
    save_policy(model, tok, out, sft_info(s, cfg.seed, task, losses, {}, seconds, command))
    ev = evaluate(model, tok, test, max_new_tokens=s.max_new_tokens, system_prompt=cfg.system_prompt)
    info = sft_info(s, cfg.seed, task, losses, ev, seconds, command)
    atomic_write_text(out / "sft.json", json.dumps(info, indent=2) + "\n")
    info["out"] = cfg.out
    _emit(args, info, f"saved {cfg.out}: held-out accuracy {ev['accuracy']:.3f} (n={ev['n']}), "
                      f"final loss {losses[-1]:.4f}, {seconds:.0f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from fp8rl.model import export_fp8_block, export_hf

    cfg = _run_config(args)
    if not cfg.model or not cfg.out:
        raise ValueError("export needs --model and --out (flags or config keys)")
    e, out = cfg.export, Path(cfg.out)
    model, tok = _load_any(cfg.model)
    if e.format == "hf":
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[e.dtype]
        export_hf(model, tok, out, dtype=dtype, overwrite=args.overwrite)
    else:
        export_fp8_block(model, tok, out, scale_fmt=e.scale_fmt, overwrite=args.overwrite)
    files = sorted(p.name for p in out.iterdir())
    _emit(args, {"out": cfg.out, "format": e.format, "files": files}, f"wrote {cfg.out}: {', '.join(files)}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fp8rl.compare import run_compare

    cfg = _run_config(args)
    out = Path(cfg.out)
    log = (lambda line: print(line, file=sys.stderr)) if args.json else print  # --json: stdout is the report only
    report = run_compare(cfg, list(cfg.compare.flows), list(cfg.compare.seeds), out, progress=not args.json, log=log)
    _emit(args, report, (out / "report.md").read_text())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from fp8rl.bench import bench_flows, table

    report = bench_flows(_run_config(args))
    _emit(args, report, table(report))
    return 0


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fp8rl", description="On-policy FP8 reinforcement learning of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    base = default_values()

    def command(name: str, **kw: Any) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
        """A subcommand's parser and the defaults its help shows (its own over the dataclasses')."""
        return sub.add_parser(name, **kw), {**base, **COMMAND_DEFAULTS.get(name, {})}

    run_keys = ("model", "task", "flow", "backend", "seed", "out")

    p, d = command("train", help="GRPO training under a precision flow",
                   description="GRPO training: rollout, reward, PPO update, quantize once, recalibrate.")
    _add_common(p, run_keys, d)
    _config_flag(p, "--steps", "train.steps", "number of RL steps", d, type=int)
    _config_flag(p, "--engine", "rollout.engine", "who samples the rollouts (vllm: BF16 flows)", d)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel processes on this machine: runs `torchrun --standalone "
                        "--nproc-per-node N -m fp8rl train ...` (across machines, call torchrun yourself)")
    p.set_defaults(fn=cmd_train)

    p, d = command("eval", help="held-out accuracy",
                   description="Held-out accuracy under the config's flow (greedy unless --temperature).")
    _add_common(p, run_keys, d)
    _config_flag(p, "--n", "eval.n", "number of held-out problems", d, type=int)
    _config_flag(p, "--temperature", "eval.temperature", "sampling temperature (0 = greedy)", d, type=float)
    _config_flag(p, "--max-new-tokens", "eval.max_new_tokens", "generation budget", d, type=int)
    p.set_defaults(fn=cmd_eval)

    p, d = command("mismatch", help="rollout vs training-forward log-prob mismatch",
                   description="Sample with the rollout engine, re-score with the training forward, "
                               "print the mismatch metrics.")
    _add_common(p, run_keys, d)
    _config_flag(p, "--prompts", "mismatch.prompts", "number of problems", d, type=int)
    _config_flag(p, "--samples", "mismatch.samples", "samples per problem", d, type=int)
    _config_flag(p, "--max-new-tokens", "mismatch.max_new_tokens", "generation budget", d, type=int)
    _config_flag(p, "--temperature", "mismatch.temperature", "sampling temperature", d, type=float)
    _config_flag(p, "--engine", "rollout.engine", "who samples (vllm: BF16 flows)", d)
    p.set_defaults(fn=cmd_mismatch)

    p, d = command("audit", help="check that a vLLM engine computes with the policy's weights",
                   description="Start a vLLM engine on the policy (as rollout.engine = 'vllm' does) and compare "
                               "every vLLM parameter with the policy's weights, bit for bit; the trainer runs the "
                               "same check after every refit.")
    _add_common(p, ("model", "flow", "backend", "seed"), d)
    p.set_defaults(fn=cmd_audit)

    p, d = command("sft", help="supervised warm-up; builds the tiny-arith, tiny-moe and tiny-chain policies",
                   description="Supervised fine-tuning on a task's worked solutions. Without a model (no --model, "
                               "no `model` in the config) it builds the built-in tiny policy from scratch "
                               "(tokenizer + model).")
    _add_common(p, ("model", "task", "seed", "out"), d,
                model="start from this model instead of a fresh tiny policy", out="output HF folder")
    _config_flag(p, "--steps", "sft.steps", "optimizer steps", d, type=int)
    _config_flag(p, "--batch-size", "sft.batch_size", "sequences per step", d, type=int)
    _config_flag(p, "--lr", "sft.lr", "peak learning rate", d, type=float)
    _config_flag(p, "--early-answer-noise", "sft.early_answer_noise",
                 "share of training solutions whose final line gives the first step's result (a bad habit "
                 "for RL to fix; the built-in tiny-arith policy uses 0.4)", d, type=float, metavar="P")
    _config_flag(p, "--eval-n", "sft.eval_n", "held-out problems to evaluate at the end", d, type=int)
    _config_flag(p, "--max-new-tokens", "sft.max_new_tokens", "generation budget for the evaluation", d, type=int)
    p.set_defaults(fn=cmd_sft)

    p, d = command("compare", help="run several precision flows side by side and write a report",
                   description="Train each flow from the same policy, data and seeds; write report.md, "
                               "report.json and plots into --out.")
    _add_common(p, run_keys, d)
    _config_flag(p, "--flows", "compare.flows", "comma-separated presets (fp8-rollout runs with and without tis)",
                 d, type=_names)
    _config_flag(p, "--seeds", "compare.seeds", "comma-separated seeds", d, type=_ints)
    _config_flag(p, "--steps", "train.steps", "RL steps per run", d, type=int)
    p.set_defaults(fn=cmd_compare)

    p, d = command("bench", help="rollout tokens/s and memory per precision flow",
                   description="Time the rollout engine under each flow on one model (EOS disabled, same "
                               "prompts and batch); print tokens/s, weight and KV-cache bytes. "
                               "benchmarks/ holds the comparisons against other tools.")
    _add_common(p, ("model", "backend"), d)
    _config_flag(p, "--flows", "bench.flows", "comma-separated presets", d, type=_names)
    _config_flag(p, "--batch", "bench.batch", "sequences per rollout", d, type=int)
    _config_flag(p, "--max-new-tokens", "bench.max_new_tokens", "tokens per sequence", d, type=int)
    p.set_defaults(fn=cmd_bench)

    p, d = command("export", help="write an HF folder or a block-FP8 checkpoint",
                   description="Export a model as a plain HF folder or as the block-FP8 layout vLLM/SGLang load.")
    _add_common(p, ("model", "out"), d, model=TOP_FLAGS["model"]["help"] + "; required",
                out="output folder; required")
    _config_flag(p, "--format", "export.format", "output layout", d)
    _config_flag(p, "--scale-fmt", "export.scale_fmt", "fp8-block scale format", d)
    _config_flag(p, "--dtype", "export.dtype", "hf format: tensor dtype (float32 is an exact copy)", d)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(fn=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    keep_freed_memory()  # fewer page faults, the same bits (fp8rl/allocator.py)
    from fp8rl.distributed import RankLostError
    from fp8rl.train import TrainingError  # imports torch: only once the arguments parse

    try:
        return args.fn(args)
    except (ValueError, OSError, TrainingError) as e:
        # User-caused errors: bad config, data, model or checkpoint files (ValueError),
        # paths that are missing, are files, or cannot be written (OSError): one
        # clear line, no traceback.
        message = " ".join(str(e).split("\n"))
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank meets the error; one line says it
            print(f"error: {message}", file=sys.stderr)
        return 2
    except RankLostError as e:  # a peer died: every surviving rank says so, in one line
        print(f"error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
