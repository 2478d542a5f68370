"""The GRPO trainer with the unified precision flow.

One step (`Trainer.train_step`), data flowing one way, one method per stage:

    _rollout    problems -> sampled completions (the flow's rollout plan,
                weights quantized once per optimizer step)
    _reward     completions -> task rewards, final-answer correctness,
                group advantages
    _score      behaviour log-probs: the training forward on the same tokens
                (same quantized weights, same KV scales; `train.rescore`: the
                rollout's where verified bit for bit); the KL reference's
    _correct    mismatch metrics and importance weights vs the rollout log-probs
    _optimize   `micro_batches` optimizer steps, each: training forward, PPO
                loss, backward, clip, AdamW on FP32 master weights, quantize
                the weights once
    _calibrate  recalibrate the Q/K/V FP8 scales (FP8 KV / attention flows)
    _metrics    the step's metrics line (docs/design.md section 6)

Everything random is derived from (seed, step, row): a run resumed from a
checkpoint repeats an uninterrupted run number for number.

Under torchrun each rank runs this same step on its share of the prompt
groups (fp8rl/distributed.py): rows are rank-local from `_rollout` to
`_optimize`; metrics, mismatch and IS weights are computed on the gathered
global batch, so every number is the one-process run's. Rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fp8rl.checkpoint import (
    CHECKPOINTS_DIR,
    SHARDED_OPTIMIZER,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
    save_sharded_optimizer,
)
from fp8rl.config import COMMAND_SECTIONS, RunConfig, from_dict, save_config
from fp8rl.distributed import (
    GradientSum,
    backward_groups,
    backward_modules,
    ShardedMaster,
    World,
    clip_,
    gather_global,
    global_row_order,
    group_rows,
    rank_groups,
)
from fp8rl.evaluate import evaluate
from fp8rl.fp8 import NonFiniteError
from fp8rl.fp8.linear import released_weights_memo
from fp8rl.runlog import RunLogger, read_metrics, write_summary
from fp8rl.model.transformer import Transformer
from fp8rl.optim import AdamW
from fp8rl.precision import (
    apply_flow,
    fp8_linears,
    grad_transport_stats,
    refresh_weights,
    take_grad_transport_counts,
)
from fp8rl.prompts import encode_prompts
from fp8rl.rl.correction import importance_weights
from fp8rl.rl.grpo import group_advantages, policy_loss
from fp8rl.rl.metrics import (
    METRIC_NAMES, MISMATCH_METRICS, ROUTING_METRICS, SEQUENCE_METRICS, mismatch_metrics, routing_mismatch,
    sequence_mismatch,
)
from fp8rl.rollout.calibrate import calibrate
from fp8rl.rollout.engine import (
    Rollout, SamplingParams, generate, left_pad, routing_record, sample_seed, sampled_routing, score,
)
from fp8rl.rollout.vllm_engine import VLLMEngine, check_engine_supported
from fp8rl.tasks import Problem, Task, make_task
from fp8rl.tasks.rewards import batch_rewards


class TrainingError(RuntimeError):
    pass


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kb * (1 if sys.platform == "darwin" else 1024))


def _checked_meta(meta: dict[str, Any], ckpt: Path, n_layers: int) -> tuple[int, dict[str, list[float]]]:
    """(step, attention scales) of a checkpoint's meta.json; CheckpointError naming
    the file and the key when one is missing or malformed."""
    where = ckpt / "meta.json"
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    if step != int(ckpt.name.removeprefix("step_")):
        raise CheckpointError(f"{where}: 'step' is {step} but the directory is {ckpt.name}")
    scales = meta.get("attention_scales")
    keys = [f"{i}.{n}" for i in range(n_layers) for n in ("q", "k", "v")]
    if not isinstance(scales, dict) or any(not isinstance(scales.get(k), list) for k in keys):
        raise CheckpointError(f"{where}: 'attention_scales' must hold a list for each of {keys[0]} .. {keys[-1]}")
    return step, scales


def diverged_warning(rows: list[dict[str, Any]], vocab_size: int, last: int = 5) -> str | None:
    """A warning when the policy ended near-uniform: mean entropy of the last
    `last` steps above 90% of its maximum ln(vocab_size). Such a run "finishes"
    but has learned nothing usable (e.g. a far too large learning rate)."""
    tail = [r["entropy"] for r in rows[-last:] if math.isfinite(r.get("entropy", math.nan))]
    if not tail:
        return None
    mean, top = sum(tail) / len(tail), math.log(vocab_size)
    if mean < 0.9 * top:
        return None
    return (f"training diverged: the policy's entropy over the last {len(tail)} steps is {mean:.2f}, "
            f"{mean / top:.0%} of the maximum ln({vocab_size}) = {top:.2f} (a near-uniform policy); "
            f"lower train.lr or check the reward")


def lr_at(cfg: RunConfig, step: int) -> float:
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "cosine":
        progress = (step - t.warmup_steps) / max(t.steps - t.warmup_steps, 1)
        return t.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return t.lr


@dataclass
class StepResult:
    metrics: dict[str, float]
    rollout: Rollout


@dataclass
class Scored:
    """`_score`'s output (this rank's rows): the behaviour log-probs `old_logp`
    [b, S]; the training forward's own `logp` (carries the graph) and `entropy`
    [rows, S] of each gradient chunk of the first micro-batch, reused by
    `_optimize`; the KL reference's `ref_logp` [b, S] if any; for an MoE model
    the experts the behaviour forward chose, `routing` [b, S, L, k]
    (`Rollout.routing`'s form); `rescored_rows`: how many of the step's rows the
    training forward scored (the others' are the rollout's, `train.rescore`)."""

    old_logp: torch.Tensor
    logp: list[torch.Tensor]
    entropy: list[torch.Tensor]
    ref_logp: torch.Tensor | None
    routing: torch.Tensor | None = None
    rescored_rows: int = 0  # rows (all ranks) whose `old_logp` the training forward computed


@dataclass
class Optimized:
    """`_optimize`'s per-micro-batch numbers, averaged into the step's metrics
    (each over the whole micro-batch, all ranks)."""

    lr: float
    losses: list[float]
    grad_norms: list[float]
    clip_fracs: list[float]
    entropies: list[float]
    grad_transport: dict[str, float]  # `grad_transport_stats` of the step (empty unless gradients travel in FP8)


def _as_saved(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as its config.json holds it (tuples become lists)."""
    return json.loads(json.dumps(cfg.to_dict()))


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run config with the keys added to fp8rl since filled with their
    defaults (as the run used them), so that a newer fp8rl continues an older run.
    A config that no longer parses is compared as it is (and then differs)."""
    try:
        return _as_saved(from_dict(saved))
    except (ValueError, TypeError):
        return saved


class Trainer:
    """Owns the model, optimizer, task stream and run directory of one GRPO run."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: Transformer | None = None,
        tokenizer: Any = None,
        resume: bool = False,
        log: Callable[[str], None] = print,
        world: World | None = None,
    ) -> None:
        self.cfg = cfg
        self.world = world or World()
        self.log = log if self.world.is_main else (lambda _msg: None)
        self.run_dir = Path(cfg.out)
        r, t = cfg.rollout, cfg.train
        # Refused on every rank before anything is loaded or written.
        self.world.check_same(json.dumps(cfg.to_dict(), sort_keys=True), "the resolved config")
        self.my_groups = rank_groups(r.prompts_per_step, t.micro_batches, t.grad_chunks, self.world)
        self.my_rows = group_rows(self.my_groups, r.group_size)  # global rows of the local rows
        self.row_order = global_row_order(r.prompts_per_step, r.group_size, t.micro_batches, t.grad_chunks, self.world)
        self._check_run_dir(resume)
        if model is None:
            from fp8rl.model import load

            model, tokenizer = load(cfg.model)
        if tokenizer is None:
            raise ValueError(f"model {cfg.model!r} has no tokenizer; RL needs one to read answers")
        self.tokenizer = tokenizer
        self.model = model
        # Data-parallel ranks quantize each linear as they release its FP32 weight (below):
        # a rank never holds every FP32 weight next to every quantized form.
        self.plan = apply_flow(model, cfg.flow, backend=cfg.backend, quantize=self.world.size == 1)
        self.flow = self.plan.flow
        self.backend = self.plan.backend.name
        if r.engine == "vllm":  # refused before anything is written
            check_engine_supported(self.flow, model)
        self.sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        adamw = {"lr": t.lr, "betas": t.betas, "weight_decay": t.weight_decay}
        # One process: AdamW on the model's own FP32 weights. Several: on FSDP2
        # shards of a master copy, pulled back into the model after each step; the
        # model then keeps only its linears' quantized weights (vLLM's refit reads
        # the FP32 weights, so with vLLM they stay).
        self.master = ShardedMaster(model, adamw, release=r.engine != "vllm") if self.world.size > 1 else None
        self.optimizer = self.master.optimizer if self.master else AdamW(self.params, **adamw)
        if self.master:
            freed = self.master.release()  # before anything runs the model or copies it
            if freed:
                self.log(f"FP32 weights of the linears released on every rank, {freed / 2**20:.1f} MiB each: "
                         f"the FSDP2 shards hold them, the forward reads the quantized forms")
        self.task: Task = make_task(cfg.task)
        self.test_problems = self.task.test_problems(cfg.eval.n) if cfg.eval.n > 0 else []
        if self.flow.needs_calibration:
            self._initial_calibration()
        # The KL reference: the initial policy under the same flow, weights and
        # scales, so its k3 KL to the policy is exactly 0 at step 0.
        self.ref_model = self._frozen_copy(model) if t.kl_coef > 0 else None
        self.step = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        if resume:
            self._resume()
        self.stream = self._problem_stream(self.step)
        # vLLM samples the rollouts: started on the current weights, refit before every rollout.
        self.engine = VLLMEngine(model, tokenizer, model.config.max_position_embeddings, cfg.seed) if (
            r.engine == "vllm") else None
        # Under data parallelism the gradient sum passes the head and each decoder layer
        # as soon as the backward of a rank's last chunk has finished it (`GradientSum.stream`).
        self.grad_groups = backward_groups(model, self.params)
        self._grad_sum: GradientSum | None = None
        self._group_calls = [0] * len(self.grad_groups)  # per group: forward calls whose backward is to come
        self._watched = backward_modules(model) if self.world.size > 1 else []  # see _watching_group_inputs
        # only now that model and task loaded: a failed start leaves no stale run behind
        self.world.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.json")

    # -- setup -------------------------------------------------------------------------

    def _check_run_dir(self, resume: bool) -> None:
        """Refuse, before anything is written, an output path that is a file, a
        directory holding another run or unrelated files, a finished-or-not run
        without --resume, and --resume where there is no run."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise TrainingError(f"output path {self.run_dir} is a file, not a directory; choose another --out")
        cfg_path = self.run_dir / "config.json"
        if cfg_path.exists():
            try:
                saved = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TrainingError(f"{cfg_path}: invalid JSON ({e}); this is not a run fp8rl can continue") from e
            if not isinstance(saved, dict):
                raise TrainingError(f"{cfg_path}: expected a JSON object; this is not a run fp8rl can continue")
            mine, saved = _as_saved(self.cfg), _with_defaults(saved)
            # The step budget may grow on resume; the other commands' sections never
            # change a run (and runs saved before a section existed lack it); the run
            # is the directory, however `out` spells it (relative, absolute, moved).
            ignored = {"train", "out", *COMMAND_SECTIONS}
            diff = sorted(k for k in set(saved) | set(mine) if k not in ignored and saved.get(k) != mine.get(k))
            train_diff = sorted(
                k for k in set(saved.get("train", {})) | set(mine["train"])
                if k != "steps" and saved.get("train", {}).get(k) != mine["train"].get(k)
            )
            if diff or train_diff:
                keys = diff + [f"train.{k}" for k in train_diff]
                raise TrainingError(
                    f"output directory {self.run_dir} holds a different run (config differs in: "
                    f"{', '.join(keys)}); choose another --out or delete it"
                )
            if not resume:
                raise TrainingError(
                    f"output directory {self.run_dir} already holds this run; pass --resume to continue it "
                    f"or choose another --out"
                )
        elif resume:
            raise TrainingError(
                f"--resume: {self.run_dir} holds no fp8rl run (no config.json); drop --resume to start one there"
            )
        elif self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise TrainingError(f"output directory {self.run_dir} is not empty and holds no fp8rl run")

    @staticmethod
    def _frozen_copy(model: Transformer) -> Transformer:
        """The KL reference: a copy that never changes, so its linears keep only
        their quantized weights (no FP32 copy of them). A data-parallel rank's model
        has released them already: the copy then never holds them at all."""
        ref = copy.deepcopy(model, released_weights_memo(model))
        for p in ref.parameters():
            p.requires_grad_(False)
        for layer in fp8_linears(ref):
            layer.release_weight()
        return ref

    def _problem_stream(self, start_step: int):
        """Problems for steps >= start_step: the stream replayed from its start, so a
        resumed run sees exactly the problems an uninterrupted one would."""
        stream = self.task.train_problems(self.cfg.seed)
        skip = start_step * self.cfg.rollout.prompts_per_step
        return itertools.islice(stream, skip, None)

    def _initial_calibration(self) -> None:
        """First Q/K/V scales, from the prompts of step 0 (no completions exist yet).
        Also on resume: the KL reference model copies them; the policy's own are
        then replaced by the checkpoint's."""
        first = list(itertools.islice(self.task.train_problems(self.cfg.seed), self.cfg.rollout.prompts_per_step))
        prompts = encode_prompts(self.tokenizer, [p.question for p in first], self.cfg.system_prompt)
        tokens, pad_left = left_pad(prompts, self.tokenizer.pad_token_id)
        calibrate(self.model, tokens, pad_left, cfg=self.cfg.calibration)

    def _resume(self) -> None:
        """Continue from the last checkpoint; a run killed before its first
        checkpoint starts again from step 0 (the initial policy is the state of
        step 0). Log lines past the resumed step are dropped, so the continued
        run repeats an uninterrupted one number for number."""
        ckpt = latest_checkpoint(self.run_dir)
        self.world.barrier()  # every rank has found the checkpoint before rank 0 tidies up
        if self.world.is_main:
            remove_leftovers(self.run_dir / CHECKPOINTS_DIR)  # what a killed save or prune left behind
        if ckpt is None:
            if self.world.is_main:
                RunLogger(self.run_dir, use_tensorboard=False).truncate_after(0)
            self.log(f"{self.run_dir}: no checkpoint was written yet; starting again from step 0")
            return
        # Optimizer state written by one process: loaded whole (then sharded here);
        # by data-parallel ranks: read as shards of any world size.
        one_process = not (ckpt / SHARDED_OPTIMIZER).is_dir()
        full_opt = AdamW(self.params, lr=self.cfg.train.lr) if self.master and one_process else None
        if self.master:
            self.master.restore()  # the checkpoint's weights need somewhere to go; released again below
        try:
            if full_opt is not None:
                meta = load_checkpoint(ckpt, self.model, full_opt)
            else:
                meta = load_checkpoint(ckpt, self.model, self.optimizer,
                                       optimizer_module=self.master.master if self.master else None)
            self.step, scales = _checked_meta(meta, ckpt, len(self.model.model.layers))
        except CheckpointError as e:
            earlier = [p.name for p in sorted(ckpt.parent.iterdir()) if p != ckpt and p.name.startswith("step_")]
            fallback = f"delete {ckpt} to resume from an earlier one ({', '.join(earlier)})" if earlier else (
                f"delete {ckpt} to start again from step 0")
            raise TrainingError(f"{e}; {fallback}") from e
        self.bad_steps = int(meta.get("bad_steps", 0))
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.model.set_attention_scales(scales)
        if self.master:
            self.master.push()
            if full_opt is not None:
                self.master.load_full_optimizer(full_opt)
            self.master.release()  # quantizes each loaded weight, then frees it
        for layer in fp8_linears(self.model):
            layer.ensure_fresh()  # the loaded weights quantized (a released one was, as it was freed)
        if self.world.is_main:
            RunLogger(self.run_dir, use_tensorboard=False).truncate_after(self.step)
        self.log(f"resumed from {ckpt} at step {self.step}")

    def save(self) -> Path | None:
        """Write the checkpoint: rank 0 the weights (gathered from the master shards
        where the ranks keep only quantized forms) and metadata; under data parallelism every rank its optimizer shards
        (torch.distributed.checkpoint, readable at any world size), into the
        unpublished checkpoint rank 0 then publishes."""
        model_state = self.master.model_state() if self.master else None  # every rank gathers, rank 0 keeps
        if self.master and not self.world.is_main:
            unpublished = self.world.gather_objects(None)[0]  # rank 0's tmp directory
            save_sharded_optimizer(Path(unpublished) / SHARDED_OPTIMIZER, self.master.master, self.optimizer)
            self.world.barrier()
            return None

        def write_shards(unpublished: Path) -> None:
            self.world.gather_objects(str(unpublished))
            save_sharded_optimizer(unpublished / SHARDED_OPTIMIZER, self.master.master, self.optimizer)

        meta = {
            "step": self.step,
            "bad_steps": self.bad_steps,
            "skipped_steps": self.skipped_steps,
            "attention_scales": self.model.attention_scales(),
            "flow": self.flow.name,
            "config": self.cfg.to_dict(),
        }
        path = save_checkpoint(
            checkpoint_path(self.run_dir, self.step),
            model_state=model_state if self.master else self.model.state_dict(),
            optimizer=None if self.master else self.optimizer,
            meta=meta,
            keep_last=self.cfg.checkpoint.keep_last,
            extra_json={"config.json": self.cfg.to_dict()},  # inside the checkpoint before it is published
            write_shards=write_shards if self.master else None,
        )
        self.world.barrier()
        return path

    # -- one step, in data-flow order ---------------------------------------------------

    def train_step(self) -> StepResult:
        t_start = time.perf_counter()
        problems = list(itertools.islice(self.stream, self.cfg.rollout.prompts_per_step))
        out = self._rollout(problems)
        rewards, correct, adv = self._reward(out, [problems[g] for g in self.my_groups])
        t_rollout = time.perf_counter() - t_start

        t0 = time.perf_counter()
        with self._watching_group_inputs():
            scored = self._score(out)
            mask = self._global(out.completion_mask)  # [B, S] the whole step's, one-process order
            weights, mismatch, is_stats = self._correct(scored, out, mask)
            opt = self._optimize(out, adv, scored, weights, mask)
        t_train = time.perf_counter() - t0

        t0 = time.perf_counter()
        self._calibrate(out)
        t_sync = time.perf_counter() - t0
        self.step += 1
        times = {"time_rollout_s": t_rollout, "time_train_s": t_train, "time_sync_s": t_sync,
                 "time_step_s": time.perf_counter() - t_start}
        return StepResult(self._metrics(out, rewards, correct, mismatch, is_stats, opt, times, scored.rescored_rows), out)

    def _global(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows [b, ...] -> the step's global batch [B, ...], one-process order."""
        return gather_global(local, self.row_order, self.world)

    @contextlib.contextmanager
    def _watching_group_inputs(self) -> Iterator[None]:
        """`_watch_group_input` as a forward pre-hook of each `backward_modules` module
        (data parallelism only) for the training phase, whose forwards have a graph. The
        rollout's and the evaluation's forwards then meet no hook and run the model's
        rollout layers (`Transformer.rollout_layers`: a hook runs only through a module call)."""
        handles = [module.register_forward_pre_hook(functools.partial(self._watch_group_input, group))
                   for group, module in enumerate(self._watched)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _watch_group_input(self, group: int, _module: torch.nn.Module, args: tuple) -> None:
        """A forward pre-hook of a `backward_modules` module (the final norm, a decoder
        layer): in a forward with a graph, a hook on the gradient of the module's
        input, which the backward computes only after every gradient of the group's
        parameters from that call is accumulated (for the norm's group, the LM
        head's too: the head reads the norm's output). A forward that shares prompts
        calls each layer twice (`forward_shared_prompts`): `group` is final once
        the input gradients of all its calls are in."""
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            self._group_calls[group] += 1
            x.register_hook(functools.partial(self._group_input_done, group))

    def _group_input_done(self, group: int, _grad: torch.Tensor) -> None:
        self._group_calls[group] -= 1
        if self._group_calls[group] == 0 and self._grad_sum is not None:
            self._grad_sum.stream(group)

    def _units(self, micro_batch: int) -> list[range]:
        """Local rows of each of this rank's gradient chunks in `micro_batch`
        (`train.grad_chunks` per micro-batch, whole prompt groups): the terms of
        the gradient sum, one backward each."""
        G, t = self.cfg.rollout.group_size, self.cfg.train
        share = len(self.my_groups) // t.micro_batches  # this rank's groups per micro-batch
        per = self.cfg.rollout.prompts_per_step // t.micro_batches // t.grad_chunks  # groups per chunk
        return [range((micro_batch * share + j) * G, (micro_batch * share + j + per) * G) for j in range(0, share, per)]

    def _rollout(self, problems: list[Problem]) -> Rollout:
        """Sample `group_size` completions per problem of this rank (a problem's
        group contiguous), on the step's global grid: prompts padded to the
        longest of all `problems`, the grid to the longest rank's."""
        G = self.cfg.rollout.group_size
        encoded = encode_prompts(self.tokenizer, [p.question for p in problems], self.cfg.system_prompt)
        prompts = [encoded[g] for g in self.my_groups for _ in range(G)]
        kw = dict(eos_ids=self.tokenizer.eos_token_ids, pad_id=self.tokenizer.pad_token_id,
                  seeds=[sample_seed(self.cfg.seed, self.step, row) for row in self.my_rows.tolist()],
                  prompt_len=max(len(p) for p in encoded), decode=self.tokenizer.decode)
        if self.engine is not None:
            self.engine.refit(self.model)  # this step's weights, audited
            out = self.engine.generate(prompts, self.sampling, **kw)
        else:
            out = generate(self.model, prompts, self.sampling, **kw)
        width = self.world.max_int(out.tokens.shape[1])
        return out if width == out.tokens.shape[1] else out.padded_to(width, self.tokenizer.pad_token_id)

    def _reward(
        self, out: Rollout, problems: list[Problem]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Task rewards [b], final-answer correctness [b] (they differ when the task's
        reward also checks the worked steps) and group advantages [b] of this
        rank's rows (whole groups: no communication)."""
        G = self.cfg.rollout.group_size
        targets = [p for p in problems for _ in range(G)]
        texts = [self.tokenizer.decode(ids) for ids in out.completion_ids]
        rewards = torch.tensor([self.task.reward(t, p) for t, p in zip(texts, targets)], dtype=torch.float32)
        correct = torch.tensor(batch_rewards(texts, [p.answer for p in targets]), dtype=torch.float32)
        adv = group_advantages(rewards, G, self.cfg.train.normalize_std)
        return rewards, correct, adv

    def _score(self, out: Rollout) -> Scored:
        """The training forward's log-probs of the sampled tokens, on the weights
        that sampled: the behaviour log-probs. Each gradient chunk of the first
        micro-batch is scored with a graph, which its backward reuses (no second
        forward of the same rows on the same weights); the other rows without
        one, or, with `train.rescore = "verified"`, not at all in a step where the
        first micro-batch's log-probs came out the rollout's bit for bit
        (`_rollout_verified`): then the rollout's log-probs are the behaviour
        log-probs. The backends are batch-invariant, so scoring rows apart or
        together gives the same bits."""
        temp = self.sampling.logprob_temperature
        # Forwards without a graph run in inference mode (fewer dispatch steps per op, as in the
        # rollout); what they return is only read, or indexed into normal tensors, by the loss.
        with torch.inference_mode():
            ref_logp = score(self.ref_model, out, temp)[0] if self.ref_model is not None else None
        logps, entropies, routings = [], [], []

        def scored(rows, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
            routing = routing_record(self.model)  # MoE: the experts this forward chose
            logp, entropy = score(self.model, out.select(rows), temp, with_entropy=with_entropy, routing=routing)
            routings.append(sampled_routing(routing, out.tokens.shape[1]))
            return logp, entropy

        for unit in self._units(0):
            logp, entropy = scored(unit, with_entropy=True)
            logps.append(logp)
            entropies.append(entropy)
        old_logp = torch.cat([lp.detach() for lp in logps])
        routing = None if out.routing is None else torch.cat(routings)  # the first micro-batch's so far
        b, first = out.tokens.shape[0], old_logp.shape[0]
        rescored = b
        if first < b:
            if self.cfg.train.rescore == "verified" and self._rollout_verified(out, old_logp, routing):
                rest = out.logprobs[first:]  # the same bits the training forward would give
                rest_routing = None if routing is None else out.routing[first:]
                rescored = first
            else:
                with torch.inference_mode():
                    rest, _ = scored(range(first, b), with_entropy=False)
                rest_routing = None if routing is None else routings[-1]
            old_logp = torch.cat([old_logp, rest])  # a normal tensor: made outside inference mode
            routing = None if routing is None else torch.cat([routing, rest_routing])
        # Every rank holds as many rows and takes the same decision (`_rollout_verified`): no collective.
        return Scored(old_logp, logps, entropies, ref_logp, routing, rescored_rows=rescored * self.world.size)

    def _rollout_verified(self, out: Rollout, first_logp: torch.Tensor, first_routing: torch.Tensor | None) -> bool:
        """Whether, on every rank, the training forward's log-probs of the first micro-batch's
        rows `first_logp` [f, S] equal the rollout's bit for bit on every completion token
        (and, for an MoE model, its experts `first_routing` the rollout's): then the same
        quantized weights, scales and batch-invariant kernels gave the rollout's log-probs,
        and those of the other rows are taken as the behaviour log-probs (`train.rescore`)."""
        f = first_logp.shape[0]
        mask = out.completion_mask[:f]
        same = torch.equal(first_logp.float().view(torch.int32)[mask],
                           out.logprobs[:f].float().view(torch.int32)[mask])
        if same and first_routing is not None:
            same = routing_mismatch(first_routing.to(torch.int32), out.routing[:f].to(torch.int32), mask) == 0.0
        return not self.world.any(not same)

    def _correct(
        self, scored: Scored, out: Rollout, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """Mismatch metrics and importance weights of the behaviour vs the rollout
        log-probs, computed on the global batch (`mask` its completion mask); the
        weights [b, S] of this rank's rows."""
        t = self.cfg.train
        old, rollout = self._global(scored.old_logp), self._global(out.logprobs)
        mismatch = mismatch_metrics(old, rollout, mask)
        seq = sequence_mismatch(old, rollout, mask)
        mismatch.update({k: seq[k] for k in SEQUENCE_METRICS})
        if out.routing is None:
            mismatch["routing_mismatch"] = 0.0
        else:  # int32: what every gather backend carries
            mismatch["routing_mismatch"] = routing_mismatch(
                self._global(scored.routing.to(torch.int32)), self._global(out.routing.to(torch.int32)), mask)
        weights, is_stats = importance_weights(old, rollout, mask, t.correction, cap=t.is_cap, lo=t.is_lo, hi=t.is_hi)
        return weights[self.my_rows], mismatch, is_stats

    def _optimize(
        self, out: Rollout, adv: torch.Tensor, scored: Scored, weights: torch.Tensor, mask: torch.Tensor
    ) -> Optimized:
        """`micro_batches` optimizer steps over consecutive blocks of prompt
        groups, the weights requantized after each. A micro-batch's gradient is
        the float64 sum of its `grad_chunks` chunks' gradients in chunk order,
        rounded once (`GradientSum`, the running sum passed from rank to rank),
        so it does not depend on which rank computed which chunk."""
        t = self.cfg.train
        lr = lr_at(self.cfg, self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        G, P, M = self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step, t.micro_batches
        rows_per_mb = P // M * G
        res = Optimized(lr, [], [], [], [], {})
        grads = GradientSum(self.params, self.world, groups=self.grad_groups)
        self._grad_sum = grads
        for i in range(M):
            n_tokens = int(mask[i * rows_per_mb:(i + 1) * rows_per_mb].sum())
            units = []  # per chunk: (loss, clipped tokens, entropy sum), in local order
            finite = True
            units_i = self._units(i)
            for j, unit in enumerate(units_i):
                sub = out.select(unit)
                if i == 0:
                    logp, ent = scored.logp[j], scored.entropy[j]
                else:
                    logp, ent = score(self.model, sub, self.sampling.logprob_temperature, with_entropy=True)
                rows = torch.as_tensor(unit)
                loss, stats = policy_loss(
                    logp, scored.old_logp[rows], adv[rows], sub.completion_mask,
                    eps_low=t.eps_low, eps_high=t.eps_high, is_weights=weights[rows],
                    ref_logp=scored.ref_logp[rows] if scored.ref_logp is not None else None, kl_coef=t.kl_coef,
                    n_normalize=n_tokens,
                )
                grads.streaming = j == len(units_i) - 1  # this rank's last chunk: pass groups as they finish
                finite = finite and self._backward(loss)
                grads.add()
                ent_sum = float(torch.where(sub.completion_mask, ent.detach(), 0).double().sum())
                units.append((float(loss.detach()), stats["n_clipped"], ent_sum))
            summed, norm = grads.reduce()
            self._group_calls = [0] * len(self.grad_groups)  # a skipped chunk's backward never comes
            grad_norm = self._clip_and_step(summed, norm, finite and not self.world.any(not finite))
            if not self.master:  # (under data parallelism `pull()` has requantized)
                refresh_weights(self.model)  # quantize once per optimizer step
            every = [u for rank_units in self.world.gather_objects(units) for u in rank_units]
            res.losses.append(math.fsum(u[0] for u in every))
            res.grad_norms.append(float(grad_norm))
            res.clip_fracs.append(math.fsum(u[1] for u in every) / max(n_tokens, 1))
            res.entropies.append(math.fsum(u[2] for u in every) / max(n_tokens, 1))
        res.grad_transport = grad_transport_stats(self.world.gather_objects(take_grad_transport_counts(self.model)))
        return res

    def _backward(self, loss: torch.Tensor) -> bool:
        """One gradient chunk's backward; False when its loss or an FP8 backward GEMM
        met a NaN/Inf (the micro-batch's optimizer step is then skipped)."""
        if not torch.isfinite(loss):
            return False
        try:
            loss.backward()
        except NonFiniteError:  # an FP8 backward GEMM met a NaN/Inf gradient
            return False
        return True

    def _clip_and_step(self, grads: list[torch.Tensor], norm: torch.Tensor, finite: bool) -> torch.Tensor:
        """Clip the reduced gradient (`grads`: this rank's part of it, `norm`: the
        whole's) and step AdamW; a non-finite loss or gradient on any rank skips
        the step (and `max_bad_steps` of them in a row stop the run). Returns the
        grad norm, the one-process norm on every rank."""
        if finite and torch.isfinite(norm):
            self.bad_steps = 0
            clip_(grads, norm, self.cfg.train.grad_clip)
            if self.master:
                self.master.step(grads)
            else:
                for p, g in zip(self.params, grads, strict=True):
                    p.grad = g
                self.optimizer.step()
                for p in self.params:
                    p.grad = None
            return norm
        self.bad_steps += 1
        self.skipped_steps += 1
        self.log(f"step {self.step}: non-finite loss or gradient, optimizer step skipped")
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingError(f"{self.bad_steps} non-finite optimizer steps in a row; stopping")
        return norm if finite else torch.tensor(float("nan"))

    def _calibrate(self, out: Rollout) -> None:
        """Recalibrate the FP8 Q/K/V scales on this step's sequences of all ranks
        (FP8 KV / attention flows)."""
        if self.flow.needs_calibration:
            calibrate(self.model, out.tokens, out.pad_left, out.cache_len, self.cfg.calibration,
                      gather=self.world.gather_varying, prompt_len=out.prompt_len)

    def _metrics(
        self, out: Rollout, rewards: torch.Tensor, correct: torch.Tensor, mismatch: dict[str, float],
        is_stats: dict[str, float], opt: Optimized, times: dict[str, float], rescored_rows: int,
    ) -> dict[str, float]:
        """One metrics.jsonl line: every name of METRIC_NAMES, over the global batch
        (times and memory are this rank's), `skipped_steps` and `rescored_rows`."""
        rewards, correct = self._global(rewards), self._global(correct)
        n_tok = int(mismatch["n_tokens"])
        metrics: dict[str, float] = {
            **{k: mismatch[k] for k in MISMATCH_METRICS + SEQUENCE_METRICS + ROUTING_METRICS},
            **is_stats,
            "reward_mean": float(rewards.mean()),
            "accuracy": float(correct.mean()),
            "response_len_mean": n_tok / rewards.shape[0],
            "entropy": sum(opt.entropies) / len(opt.entropies),
            "loss": sum(opt.losses) / len(opt.losses),
            "grad_norm": sum(opt.grad_norms) / len(opt.grad_norms),
            "lr": opt.lr,
            "ppo_clip_frac": sum(opt.clip_fracs) / len(opt.clip_fracs),
            **times,
            "rollout_tokens_per_s": n_tok / max(times["time_rollout_s"], 1e-9),
            "peak_mem_bytes": peak_memory_bytes(self.model.device),
            "skipped_steps": self.skipped_steps,
            "rescored_rows": rescored_rows,
            **opt.grad_transport,
        }
        missing = set(METRIC_NAMES) - set(metrics)
        if missing:
            raise RuntimeError(f"metrics missing: {sorted(missing)}")
        return metrics

    def evaluate(self) -> dict[str, Any]:
        e = self.cfg.eval
        return evaluate(
            self.model, self.tokenizer, self.test_problems, max_new_tokens=e.max_new_tokens,
            temperature=e.temperature, batch_size=e.batch_size, seed=self.cfg.seed,
            system_prompt=self.cfg.system_prompt, reward_fn=self.task.reward, world=self.world,
        )

    # -- the loop ----------------------------------------------------------------------

    def run(self, progress: bool = True) -> dict[str, Any]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = self.cfg
        main = self.world.is_main
        t_run = time.perf_counter()
        logger = RunLogger(self.run_dir) if main else None
        evals = {int(r["step"]): r for r in read_metrics(self.run_dir / "eval.jsonl")} if (self.run_dir / "eval.jsonl").exists() else {}
        self.log(f"flow {self.flow.name} on backend {self.backend}"
                 + (" (auto: this CPU's fastest batch-invariant backend)" if cfg.backend == "auto" else "")
                 + (f", {self.world.size} data-parallel ranks" if self.world.size > 1 else ""))
        try:
            if self.step == 0 and self.test_problems and 0 not in evals:
                ev = self._evaluate_and_log(0, logger, evals)
                self.log(f"held-out accuracy before training: {ev['accuracy']:.3f} (n={ev['n']})")
            columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[info]}")]
            with Progress(*columns, disable=not (progress and main), transient=False) as bar:
                task_id = bar.add_task("train", total=cfg.train.steps, completed=self.step, info="")
                while self.step < cfg.train.steps:
                    result = self.train_step()
                    m = result.metrics
                    if logger:
                        logger.log_step(self.step, m)
                    bar.update(task_id, completed=self.step, info=(
                        f"reward {m['reward_mean']:.3f}  mismatch {m['token_mult_prob_error']:.5f}  "
                        f"len {m['response_len_mean']:.1f}  {m['time_step_s']:.1f}s/step"))
                    at_end = self.step == cfg.train.steps
                    if self.test_problems and ((cfg.eval.every and self.step % cfg.eval.every == 0) or at_end):
                        self._evaluate_and_log(self.step, logger, evals)
                    if (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or at_end:
                        self.save()
        finally:
            if logger:
                logger.close()
        if not main:
            return {}
        return self.finish(evals, time.perf_counter() - t_run)

    def _evaluate_and_log(self, step: int, logger: RunLogger | None, evals: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Held-out evaluation, the ranks taking turns over its batches; rank 0 logs it."""
        ev = self.evaluate()
        evals[step] = {"accuracy": ev["accuracy"]}
        if logger:
            logger.log_eval(step, {"accuracy": ev["accuracy"], "reward_mean": ev["reward_mean"], "n": ev["n"]})
        return ev

    def finish(self, evals: dict[int, dict[str, Any]], wall_s: float) -> dict[str, Any]:
        from fp8rl.plots import plot_run

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        acc = {s: e["accuracy"] for s, e in sorted(evals.items())}
        summary: dict[str, Any] = {
            "flow": self.flow.name,
            "model": self.cfg.model,
            "task": self.cfg.task,
            "backend": self.backend,
            "steps": self.step,
            "eval_accuracy_before": acc.get(0),
            "eval_accuracy_after": acc[max(acc)] if acc else None,
            "eval_accuracy": acc,
            "reward_mean_first": rows[0]["reward_mean"] if rows else None,
            "reward_mean_last5": sum(r["reward_mean"] for r in rows[-5:]) / max(len(rows[-5:]), 1) if rows else None,
            "token_mult_prob_error_mean": sum(r["token_mult_prob_error"] for r in rows) / len(rows) if rows else None,
            "token_mult_prob_error_max": max(r["token_mult_prob_error"] for r in rows) if rows else None,
            "time_step_s_mean": sum(r["time_step_s"] for r in rows) / len(rows) if rows else None,
            "skipped_steps": self.skipped_steps,
            "wall_time_s": wall_s,
            "converted_linears": len(self.plan.converted),
            "warnings": [w for w in [diverged_warning(rows, self.model.config.vocab_size)] if w],
        }
        for warning in summary["warnings"]:
            self.log(f"warning: {warning}")
        write_summary(self.run_dir, summary)
        summary["plots"] = [str(p) for p in plot_run(self.run_dir)]
        return summary
