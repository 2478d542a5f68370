"""One GRPO step: fp8rl (bf16 and jet flows) against Hugging Face TRL's GRPOTrainer.

Both sides get the same weights (fp8rl's model exported as a float32 Hugging
Face folder for TRL), the same prompt strings and token ids, the same group
size, completion budget, sampling (temperature 1, no top-k/top-p, stop at
EOS), reward function and optimizer settings (AdamW, same lr, betas (0.9,
0.99), no weight decay, grad clip 1, PPO clip 0.2/0.28, no KL term), and one
optimizer step over all prompts x group samples. Each side runs `--warmup`
untimed steps (1 by default), then the timed steps (3 by default: the mean) on the
next prompts of the same problem stream. One timed step is not enough: a step after
one warm-up still grows the process's heap, TRL's by more (its first timed SmolLM2
step 20.3 s against 14.5 s for the mean of three, benchmarks/README.md); `--warmup 2`
times both sides' steady state, as the steps of a long run are.

TRL is given its fastest fair CPU setup: float32 weights (bf16 matmuls are
several times slower than float32 on this CPU), gradient checkpointing off
(GRPOConfig turns it on by default), no reference model (beta=0), and one
training forward/backward over the whole batch, as fp8rl does with
`train.micro_batches=1` (where the training forward's log-probs also serve as
the old ones for the mismatch metrics and importance weights, as in TRL).
fp8rl runs on its fastest CPU backend for each model by default (`--backend fast`:
fp8rl.fp8.backends.fast_backend, the rule of `auto`: "amx", native BF16 GEMMs,
where the CPU has AMX tiles, or AVX512-BF16 and a dense model or a mixture of experts
at least 192 wide; "cpu" elsewhere).

Completions stop at EOS on both sides, so the sampled lengths differ and so
does the work: the report gives the mean completion length on each side, the
step-time ratio, and a per-token ratio (seconds per generated token).

A second part times rollout alone at a fixed length (EOS disabled, both
sides generate exactly batch x max_new_tokens tokens): fp8rl's engine against
transformers `generate` on the same model, prompts and batch (the functions
of `benchmarks/rollout.py`).

    pip install trl                        # into the environment fp8rl is installed in
    python benchmarks/vs_trl.py            # tiny-arith and SmolLM2-135M (2 min 45 s on a 2-core Xeon with AMX)
    python benchmarks/vs_trl.py --quick    # smoke run: tiny-arith, 2 prompts x 2, 8 tokens

Prints one JSON object on stdout and a table on stderr. Speedups are
TRL time / fp8rl time (or fp8rl tokens/s / TRL tokens/s): above 1 means
fp8rl is faster; the design target (docs/design.md section 9) is 3.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
               ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"),
               ("DISABLE_MLFLOW_INTEGRATION", "TRUE"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(_k, _v)

import torch

from fp8rl.allocator import keep_freed_memory
from fp8rl.fp8.backends import BACKENDS, fast_backend, resolve_backend

TARGET_SPEEDUP = 3.0

# Per model: prompts per step, group size, max new tokens.
DEFAULT_SHAPES = {
    "tiny-arith": (16, 8, 48),
    "smollm2-135m-instruct": (4, 4, 64),
}
QUICK_SHAPE = (2, 2, 8)


def require_trl() -> Any:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        sys.exit(
            f"benchmarks/vs_trl.py compares against Hugging Face TRL, which is not installed ({e}).\n"
            "Install it into the same environment as fp8rl:  pip install trl"
        )
    return trl


# ------------------------------------------------------------------------- helpers


class Timers:
    """Wall time spent inside wrapped callables, per label, reset per step."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        out, self.total = self.total, {}
        return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def problems_for(n: int) -> list:
    from fp8rl.tasks import make_task

    # exactly the stream fp8rl's Trainer reads with seed 0: step k uses problems [k*P, (k+1)*P)
    return list(itertools.islice(make_task("arith").train_problems(0), n))


# ------------------------------------------------------------------------- fp8rl


@contextlib.contextmanager
def patched_fp8rl_train(timers: Timers, trainer: Any):
    """Time the parts of `Trainer.train_step` by wrapping the functions it calls."""
    import fp8rl.train as ft

    names = ("generate", "score", "refresh_weights")
    saved = {n: getattr(ft, n) for n in names}
    score = saved["score"]
    timed_gen = timers.wrap("generate", saved["generate"])
    timed_refresh = timers.wrap("refresh_weights", saved["refresh_weights"])

    def timed_score(*args: Any, **kwargs: Any) -> Any:
        label = "train_forward" if torch.is_grad_enabled() else "behaviour_logp"
        return timers.wrap(label, score)(*args, **kwargs)

    opt_step = trainer.optimizer.step
    clip = torch.nn.utils.clip_grad_norm_
    backward = torch.Tensor.backward
    try:
        ft.generate, ft.score, ft.refresh_weights = timed_gen, timed_score, timed_refresh
        trainer.optimizer.step = timers.wrap("optimizer_step", opt_step)
        torch.nn.utils.clip_grad_norm_ = timers.wrap("grad_clip", clip)
        torch.Tensor.backward = timers.wrap("backward", backward)
        yield
    finally:
        for n, f in saved.items():
            setattr(ft, n, f)
        trainer.optimizer.step = opt_step
        torch.nn.utils.clip_grad_norm_ = clip
        torch.Tensor.backward = backward


def run_fp8rl(model_src: str, flow: str, backend: str, P: int, G: int, L: int, lr: float, steps: int,
              tmp: Path, overrides: dict[str, Any] | None = None, warmup: int = 1) -> dict:
    from fp8rl.config import RunConfig
    from fp8rl.train import Trainer

    cfg = RunConfig().replace(**{
        "model": model_src, "task": "arith", "flow": flow, "seed": 0, "out": str(tmp / f"fp8rl-{flow}"),
        "backend": backend,
        "rollout.prompts_per_step": P, "rollout.group_size": G, "rollout.max_new_tokens": L,
        "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0,
        "train.steps": warmup + steps, "train.micro_batches": 1, "train.lr": lr, "train.kl_coef": 0.0,
        "eval.n": 0, "checkpoint.every": 0, **(overrides or {}),
    })
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda s: None)
    setup_s = time.perf_counter() - t0
    backend = trainer.backend
    timers = Timers()
    with patched_fp8rl_train(timers, trainer):
        warm = [trainer.train_step().metrics for _ in range(warmup)]
        timers.take()
        timed, parts = [], []
        for _ in range(steps):
            timed.append(trainer.train_step().metrics)
            parts.append(timers.take())
    del trainer
    gc.collect()
    keys = ("time_step_s", "time_rollout_s", "time_train_s", "time_sync_s", "response_len_mean",
            "rollout_tokens_per_s", "reward_mean", "token_mult_prob_error")
    out = {k: mean([m[k] for m in timed]) for k in keys}
    out["step_s"] = out.pop("time_step_s")
    out["completion_tokens"] = out["response_len_mean"] * P * G
    out["step_tokens_per_s"] = out["completion_tokens"] / out["step_s"]
    part = {k: mean([p.get(k, 0.0) for p in parts])
            for k in ("generate", "behaviour_logp", "train_forward", "backward", "grad_clip", "optimizer_step",
                      "refresh_weights")}
    breakdown = {
        "generate_s": part["generate"],
        "rollout_other_s": out["time_rollout_s"] - part["generate"],  # tokenize, decode, rewards
        "behaviour_logp_s": part["behaviour_logp"],  # the no-grad forward TRL skips here
        "train_forward_s": part["train_forward"],
        "backward_s": part["backward"],
        "optimizer_step_s": part["optimizer_step"] + part["grad_clip"],
        "refresh_weights_s": part["refresh_weights"],  # requantize after the optimizer step
        "sync_s": out["time_sync_s"],
    }
    breakdown["other_s"] = out["step_s"] - sum(breakdown.values())  # advantages, mismatch metrics, losses
    out["breakdown"] = breakdown
    out["warmup_step_s"] = [m["time_step_s"] for m in warm]
    out["setup_s"] = setup_s
    out["steps_timed"] = steps
    out["backend"] = backend
    return out


# ------------------------------------------------------------------------- TRL


def run_trl(hf_dir: Path, prompt_texts: list[str], problems: list, P: int, G: int, L: int, lr: float,
            steps: int, tmp: Path, warmup: int = 1) -> dict:
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from fp8rl.tasks import make_task
    from fp8rl.tasks.rewards import batch_rewards

    threads = torch.get_num_threads()
    completion_tokens: list[int] = []
    timers = Timers()

    task = make_task("arith")

    def arith_reward(completions: list[str], idx: list[int], completion_ids: list[list[int]],
                     **_: Any) -> list[float]:
        """The reward fp8rl's Trainer gives: the task's own (which may also check the
        worked steps), else the final-answer check."""
        completion_tokens.append(sum(len(c) for c in completion_ids))
        if hasattr(task, "reward"):
            return [float(task.reward(c, problems[i])) for c, i in zip(completions, idx)]
        return batch_rewards(completions, [problems[i].answer for i in idx])

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t0 = self._opt0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            timers.take()
            self._t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self._opt0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            timers.total["optimizer_step"] = time.perf_counter() - self._opt0

        def on_step_end(self, args, state, control, **kw):
            row = {"step_s": time.perf_counter() - self._t0, **timers.take()}
            row["completion_tokens"] = completion_tokens[-1] if completion_tokens else 0
            self.steps.append(row)

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model.generate = timers.wrap("generate", model.generate)
    # plain-text prompts (already chat-templated for chat models): TRL tokenizes them as they are
    dataset = Dataset.from_dict({"prompt": prompt_texts, "idx": list(range(len(prompt_texts)))})
    args = GRPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=P * G,  # one generation batch = one optimizer step over P x G samples
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=L,
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
        max_steps=warmup + steps, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, log_completions=False,
        shuffle_dataset=False, seed=0, data_seed=0, dataloader_num_workers=0,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # it prints every log dict
    torch.set_num_threads(threads)  # keep both sides on the same thread count
    trainer._generate_and_score_completions = timers.wrap("generate_and_score", trainer._generate_and_score_completions)
    trainer.compute_loss = timers.wrap("loss_forward", trainer.compute_loss)
    trainer.accelerator.backward = timers.wrap("backward", trainer.accelerator.backward)
    trainer._clip_grad_norm = timers.wrap("grad_clip", trainer._clip_grad_norm)
    setup_s = time.perf_counter() - t0
    trainer.train()
    threads_after = torch.get_num_threads()
    del trainer, model
    gc.collect()

    if len(clock.steps) != warmup + steps:
        raise RuntimeError(f"TRL ran {len(clock.steps)} steps, expected {warmup + steps}")
    timed = clock.steps[warmup:]
    step_s = mean([r["step_s"] for r in timed])
    tokens = mean([r["completion_tokens"] for r in timed])
    parts = {k: mean([r.get(k, 0.0) for r in timed])
             for k in ("generate", "generate_and_score", "loss_forward", "backward", "grad_clip", "optimizer_step")}
    breakdown = {
        "generate_s": parts["generate"],
        "rollout_other_s": parts["generate_and_score"] - parts["generate"],  # tokenize, decode, rewards, advantages
        "loss_forward_s": parts["loss_forward"],
        "backward_s": parts["backward"],
        "optimizer_step_s": parts["optimizer_step"] + parts["grad_clip"],
    }
    breakdown["other_s"] = step_s - sum(breakdown.values())  # logging, bookkeeping
    return {
        "step_s": step_s,
        "time_rollout_s": parts["generate_and_score"],
        "time_train_s": step_s - parts["generate_and_score"],
        "completion_tokens": tokens,
        "response_len_mean": tokens / (P * G),
        "rollout_tokens_per_s": tokens / parts["generate_and_score"],
        "generate_tokens_per_s": tokens / parts["generate"],
        "step_tokens_per_s": tokens / step_s,
        "breakdown": breakdown,
        "warmup_step_s": [r["step_s"] for r in clock.steps[:warmup]],
        "setup_s": setup_s,
        "steps_timed": steps,
        "threads_after_train": threads_after,
    }


# ------------------------------------------------------------------------- one model


def rollout_benchers() -> tuple[Callable, Callable]:
    """transformers `generate` and fp8rl's engine at a fixed length, as benchmarks/rollout.py times them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rollout import bench_hf

    from fp8rl.bench import bench_rollout as bench_ours

    return bench_hf, bench_ours


def bench_model(model_src: str, backend_choice: str, P: int, G: int, L: int, flows: list[str], lr: float,
                steps: int, rollout: bool, log: Callable[[str], None], warmup: int = 1) -> dict:
    from fp8rl.model import export_hf, load
    from fp8rl.prompts import encode_prompts, format_prompt
    n_problems = (warmup + steps) * P
    problems = problems_for(n_problems)
    model, tok = load(model_src)
    backend = (fast_backend(model) if backend_choice == "fast" else resolve_backend(backend_choice, model)).name
    prompt_texts = [format_prompt(tok, p.question) for p in problems]
    prompt_ids = encode_prompts(tok, [p.question for p in problems])
    res: dict[str, Any] = {"model": model_src, "prompts_per_step": P, "group_size": G, "max_new_tokens": L,
                           "batch": P * G, "lr": lr, "backend": backend,
                           "n_params": sum(p.numel() for p in model.parameters()),
                           "prompt_len_mean": mean([len(x) for x in prompt_ids])}
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmpdir:
        tmp = Path(tmpdir)
        hf_dir = export_hf(model, tok, tmp / "hf", dtype=torch.float32)
        del model
        gc.collect()

        log(f"[{model_src}] TRL GRPOTrainer: {P} prompts x {G}, {L} tokens, {warmup} + {steps} steps")
        res["trl"] = run_trl(hf_dir, prompt_texts, problems, P, G, L, lr, steps, tmp, warmup)
        log(f"[{model_src}] TRL step {res['trl']['step_s']:.2f}s")
        res["fp8rl"] = {}
        for flow in flows:
            log(f"[{model_src}] fp8rl {flow}: {warmup} + {steps} steps")
            res["fp8rl"][flow] = run_fp8rl(model_src, flow, backend, P, G, L, lr, steps, tmp, warmup=warmup)
            log(f"[{model_src}] fp8rl {flow} step {res['fp8rl'][flow]['step_s']:.2f}s")

        if rollout:
            bench_hf, bench_ours = rollout_benchers()

            step_problems = problems[P:2 * P] if steps else problems[:P]
            ids = encode_prompts(tok, [p.question for p in step_problems])
            ids = [x for x in ids for _ in range(G)]
            log(f"[{model_src}] fixed-length rollout: batch {len(ids)}, {L} tokens")
            hf = bench_hf(hf_dir, ids, L, tok.pad_token_id)
            fixed = {"batch": len(ids), "max_new_tokens": L, "transformers": hf}
            for flow in flows:
                r = bench_ours(model_src, flow, backend, ids, L, tok.pad_token_id)
                r["speedup_vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
                fixed[flow] = r
            res["rollout_fixed_length"] = fixed

    trl = res["trl"]
    ratios: dict[str, float] = {}
    for flow, r in res["fp8rl"].items():
        ratios[f"{flow}_step_speedup"] = trl["step_s"] / r["step_s"]
        ratios[f"{flow}_step_per_token_speedup"] = (trl["step_s"] / trl["completion_tokens"]) / (
            r["step_s"] / r["completion_tokens"])
        ratios[f"{flow}_rollout_tokens_per_s_speedup"] = r["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"]
        ratios[f"{flow}_train_phase_speedup"] = trl["time_train_s"] / r["time_train_s"]
        if "rollout_fixed_length" in res:
            fixed = res["rollout_fixed_length"][flow]
            ratios[f"{flow}_fixed_rollout_speedup_vs_generate"] = fixed["speedup_vs_transformers"]
    res["speedups"] = ratios
    return res


# ------------------------------------------------------------------------- report


def print_table(report: dict, file: Any) -> None:
    p = lambda s="": print(s, file=file)  # noqa: E731
    m = report["machine"]
    p(f"\nfp8rl vs TRL {m['trl']} GRPOTrainer, {m['cpu']} ({m['cpus']} CPUs, {m['threads']} threads), {m['date']}")
    p("speedup = TRL / fp8rl time (or fp8rl / TRL tokens/s); > 1: fp8rl faster; target >= 3")
    for r in report["results"]:
        p(f"\n{r['model']}  ({r['n_params'] / 1e6:.1f}M params, {r['prompts_per_step']} prompts x "
          f"{r['group_size']}, max {r['max_new_tokens']} tokens, fp8rl backend {r['backend']})")
        p(f"{'side':<12}{'step s':>9}{'rollout s':>11}{'train s':>9}{'len':>7}{'tok/s step':>12}"
          f"{'rollout tok/s':>15}{'speedup':>9}{'per tok':>9}")
        trl = r["trl"]
        p(f"{'TRL':<12}{trl['step_s']:>9.2f}{trl['time_rollout_s']:>11.2f}{trl['time_train_s']:>9.2f}"
          f"{trl['response_len_mean']:>7.1f}{trl['step_tokens_per_s']:>12.1f}{trl['rollout_tokens_per_s']:>15.1f}"
          f"{1.0:>9.2f}{1.0:>9.2f}")
        for flow, f in r["fp8rl"].items():
            s = r["speedups"]
            p(f"{'fp8rl ' + flow:<12}{f['step_s']:>9.2f}{f['time_rollout_s']:>11.2f}{f['time_train_s']:>9.2f}"
              f"{f['response_len_mean']:>7.1f}{f['step_tokens_per_s']:>12.1f}{f['rollout_tokens_per_s']:>15.1f}"
              f"{s[flow + '_step_speedup']:>9.2f}{s[flow + '_step_per_token_speedup']:>9.2f}")
        p("where the step time goes (s):")
        for side, b in [("TRL", trl["breakdown"])] + [(f"fp8rl {f}", r["fp8rl"][f]["breakdown"]) for f in r["fp8rl"]]:
            p(f"  {side:<11}" + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in b.items()))
        fx = r.get("rollout_fixed_length")
        if fx:
            line = f"fixed-length rollout ({fx['batch']} x {fx['max_new_tokens']} tokens), tok/s: " \
                   f"transformers generate {fx['transformers']['tokens_per_s']:.1f}"
            for flow in r["fp8rl"]:
                line += f", fp8rl {flow} {fx[flow]['tokens_per_s']:.1f} ({fx[flow]['speedup_vs_transformers']:.2f}x)"
            p(line)
    p(f"\nstep-time target (>= {TARGET_SPEEDUP:g}x TRL) met by: "
      + (", ".join(report["target_met"]) if report["target_met"] else "none"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_SHAPES))
    ap.add_argument("--flows", default="bf16,jet")
    ap.add_argument("--prompts", type=int, help="prompts per step (default: per model, tiny 16, SmolLM2 4)")
    ap.add_argument("--group-size", type=int, help="samples per prompt (default: tiny 8, SmolLM2 4)")
    ap.add_argument("--max-new-tokens", type=int, help="completion budget (default: tiny 48, SmolLM2 64)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--backend", choices=("fast", "auto", *BACKENDS), default="fast",
                    help="fp8rl GEMM backend; fast (default): fast_backend's pick for each model on this CPU; "
                         "auto: what `fp8rl train` picks (the same, after its batch-invariance check on the "
                         "model)")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed steps per side, after the warm-up steps (the first timed ones may still grow the heap)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps per side first (2: both sides' heaps have reached their peak, the "
                         "steady state of a long run)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's default, all cores)")
    ap.add_argument("--no-rollout", action="store_true", help="skip the fixed-length rollout comparison")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny-arith only, 2 prompts x 2, 8 tokens")
    args = ap.parse_args()
    keep_freed_memory()  # as the fp8rl CLI runs (fp8rl/allocator.py); for every engine in this process

    trl = require_trl()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1")
    models = ["tiny-arith"] if args.quick else [m for m in args.models.split(",") if m]
    flows = [f for f in args.flows.split(",") if f]

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    datasets.disable_progress_bars()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = []
    t_all = time.perf_counter()
    # TRL and transformers print logs to stdout; keep stdout for the JSON report
    with contextlib.redirect_stdout(sys.stderr):
        for src in models:
            dP, dG, dL = QUICK_SHAPE if args.quick else DEFAULT_SHAPES.get(src, DEFAULT_SHAPES["tiny-arith"])
            P, G, L = args.prompts or dP, args.group_size or dG, args.max_new_tokens or dL
            results.append(bench_model(src, args.backend, P, G, L, flows, args.lr, args.steps, not args.no_rollout, log,
                                       args.warmup))

    from importlib.metadata import PackageNotFoundError, version

    try:
        fp8rl_version = version("fp8rl")
    except PackageNotFoundError:
        fp8rl_version = "?"
    report = {
        "benchmark": "vs_trl",
        "machine": {
            "cpu": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__,
            "fp8rl": fp8rl_version,
        },
        "target_speedup": TARGET_SPEEDUP,
        "warmup_steps": args.warmup, "steps_timed": args.steps,
        "results": results,
        "target_met": [f"{r['model']}:{flow}" for r in results for flow in r["fp8rl"]
                       if r["speedups"][f"{flow}_step_speedup"] >= TARGET_SPEEDUP],
        "wall_s": time.perf_counter() - t_all,
    }
    print(json.dumps(report, indent=2))
    print_table(report, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
