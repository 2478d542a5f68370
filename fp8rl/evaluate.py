"""Held-out accuracy: sample (greedy by default) on test problems, score the answers."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fp8rl.prompts import encode_prompts
from fp8rl.config import CalibrationConfig
from fp8rl.distributed import World
from fp8rl.rollout.engine import SamplingParams, generate, sample_seed
from fp8rl.tasks import Problem
from fp8rl.tasks.rewards import batch_rewards


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int = 48,
    temperature: float = 0.0,
    batch_size: int = 100,
    seed: int = 0,
    system_prompt: str = "",
    reward_fn: Callable[[str, Problem], float] | None = None,
    world: World | None = None,
) -> dict[str, Any]:
    """Returns {"accuracy" (final answer correct), "reward_mean" (the task's RL reward,
    `reward_fn`, e.g. arith also checks the worked steps; = accuracy without one), "n",
    "response_len_mean", "samples": the first few (question, completion, gold)}.
    Under data parallelism (`world`) the ranks take turns over the batches and
    every rank returns the whole result, the one-process numbers."""
    world = world or World()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    mine = []  # (start, rewards, task rewards, lengths, texts) of this rank's batches
    for b, start in enumerate(range(0, len(problems), batch_size)):
        if b % world.size != world.rank:
            continue
        chunk = problems[start : start + batch_size]
        prompts = encode_prompts(tokenizer, [p.question for p in chunk], system_prompt)
        out = generate(
            model, prompts, params,
            eos_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_token_id,
            seeds=[sample_seed(seed, 0, start + i) for i in range(len(chunk))],
        )
        texts = [tokenizer.decode(ids) for ids in out.completion_ids]
        correct = batch_rewards(texts, [p.answer for p in chunk])
        task = [reward_fn(t, p) for t, p in zip(texts, chunk)] if reward_fn else correct
        mine.append((start, correct, task, [len(ids) for ids in out.completion_ids], texts))
    batches = sorted(b for rank_batches in world.gather_objects(mine) for b in rank_batches)
    rewards = [r for b in batches for r in b[1]]
    task_rewards = [r for b in batches for r in b[2]]
    lengths = [n for b in batches for n in b[3]]
    texts = [t for b in batches for t in b[4]]
    samples = [{"question": p.question, "completion": t, "gold": p.answer} for p, t in zip(problems[:3], texts)]
    n = len(problems)
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / max(n, 1),
        "reward_mean": sum(task_rewards) / max(n, 1),
        "n": n,
        "response_len_mean": sum(lengths) / max(n, 1),
        "samples": samples,
    }


def measure_mismatch(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    system_prompt: str = "",
    calibration: CalibrationConfig = CalibrationConfig(),
    engine: Any = None,
) -> dict[str, Any]:
    """Sample with the rollout engine (fp8rl's, or `engine`: a VLLMEngine on the same
    weights), re-score the same tokens with the training
    forward, and compare: the section-6 mismatch metrics plus `n_tokens`, the
    sequence-level ones of `sequence_mismatch` and, for an MoE model,
    `routing_mismatch`.
    `model` must already be under its precision flow (apply_flow); FP8 Q/K/V
    scales are calibrated here on the prompts, as the trainer does at step 0."""
    from fp8rl.rl.metrics import mismatch_metrics, routing_mismatch, sequence_mismatch
    from fp8rl.rollout.calibrate import calibrate
    from fp8rl.rollout.engine import left_pad, routing_record, sampled_routing, score

    prompts = encode_prompts(tokenizer, [p.question for p in problems], system_prompt)
    prompts = [p for p in prompts for _ in range(samples)]
    plan = getattr(model, "flow_plan", None)
    if plan is not None and plan.flow.needs_calibration:
        tokens, pad_left = left_pad(prompts, tokenizer.pad_token_id)
        calibrate(model, tokens, pad_left, cfg=calibration)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    kw = dict(eos_ids=tokenizer.eos_token_ids, pad_id=tokenizer.pad_token_id,
              seeds=[sample_seed(seed, 0, i) for i in range(len(prompts))])
    out = engine.generate(prompts, params, **kw) if engine is not None else generate(model, prompts, params, **kw)
    routing = routing_record(model)
    with torch.inference_mode():  # read only: the metrics below
        logp_train, _ = score(model, out, params.logprob_temperature, routing=routing)
    metrics = mismatch_metrics(logp_train, out.logprobs, out.completion_mask)
    metrics["n_tokens"] = out.n_tokens
    if routing is not None:  # an MoE model: did rollout and training choose the same experts?
        train_routing = sampled_routing(routing, out.tokens.shape[1])
        metrics["routing_mismatch"] = routing_mismatch(train_routing, out.routing, out.completion_mask)
    metrics.update(sequence_mismatch(logp_train, out.logprobs, out.completion_mask))
    metrics["bitwise_equal"] = bool(torch.equal(logp_train[out.completion_mask], out.logprobs[out.completion_mask]))
    return metrics
