"""End to end: the GRPO trainer on the built-in tiny policy.

A few steps of the default flow change every trainable parameter and write
every contract metric; each preset runs a step; a resumed run equals an
uninterrupted one number for number; a fixed-seed golden check pins the first
steps' reward and loss; bad inputs fail with clear messages.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from fp8rl.config import RunConfig
from fp8rl.runlog import read_metrics
from fp8rl.model import load
from fp8rl.rl.metrics import METRIC_NAMES
from fp8rl.train import Trainer, TrainingError

TIMING = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes"}


def small_cfg(out: Path, **kw) -> RunConfig:
    base = {
        "out": str(out), "seed": 0,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 32,
        "train.steps": 2, "train.micro_batches": 2, "train.lr": 1e-3,
        "eval.n": 8, "eval.every": 0, "eval.max_new_tokens": 32,
        "checkpoint.every": 1, "checkpoint.keep_last": 2,
    }
    base.update(kw)
    return RunConfig().replace(**base)


def test_default_flow_end_to_end(tmp_path: Path):
    cfg = small_cfg(tmp_path / "run")
    model, tok = load(cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    summary = Trainer(cfg, model=model, tokenizer=tok, log=lambda s: None).run(progress=False)
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = set(METRIC_NAMES) - set(r)
        assert not missing, missing
        for k in METRIC_NAMES:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r[k])
        # the unified flow on the exact backend: rollout and training agree bit for bit
        assert r["token_mult_prob_error"] == 1.0 and r["max_abs_logprob_diff"] == 0.0
    run = tmp_path / "run"
    for f in ("config.json", "summary.json", "eval.jsonl", "plots/reward.png", "plots/mismatch.png"):
        assert (run / f).is_file(), f
    assert list((run / "tb").glob("events.out.tfevents*"))
    assert (run / "checkpoints" / "step_2" / "model.safetensors").is_file()
    assert summary["steps"] == 2 and summary["eval_accuracy_before"] is not None


@pytest.mark.parametrize("flow", ["bf16", "fp8-rollout", "jet-e2e", "jet-kv", "fp8-grads"])
def test_each_preset_runs_a_step(tmp_path: Path, flow: str):
    cfg = small_cfg(tmp_path / flow, flow=flow, **{"train.steps": 1, "eval.n": 0, "rollout.prompts_per_step": 2})
    Trainer(cfg, log=lambda s: None).run(progress=False)
    (row,) = read_metrics(tmp_path / flow / "metrics.jsonl")
    assert all(math.isfinite(row[k]) for k in METRIC_NAMES)
    if flow == "fp8-rollout":  # the off-policy recipe: rollout and training disagree
        assert row["token_mult_prob_error"] > 1.0
    else:
        assert row["token_mult_prob_error"] == 1.0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_native_bf16_backend_trains_on_policy(tmp_path: Path, micro_batches: int):
    # "amx" on the tiny policy; with one micro-batch the training forward's
    # log-probs double as the old ones (no separate behaviour forward).
    cfg = small_cfg(tmp_path / "amx", backend="amx", **{
        "train.steps": 2, "train.micro_batches": micro_batches, "eval.n": 0, "checkpoint.every": 0})
    model, tok = load(cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert trainer.backend == "amx"
    trainer.run(progress=False)
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    for row in read_metrics(tmp_path / "amx" / "metrics.jsonl"):
        assert row["token_mult_prob_error"] == 1.0 and row["max_abs_logprob_diff"] == 0.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def _numbers(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(path)]


def test_resume_equals_uninterrupted(tmp_path: Path):
    straight = small_cfg(tmp_path / "a", **{"train.steps": 4, "checkpoint.every": 2, "eval.n": 0})
    Trainer(straight, log=lambda s: None).run(progress=False)
    half = small_cfg(tmp_path / "b", **{"train.steps": 2, "checkpoint.every": 2, "eval.n": 0})
    Trainer(half, log=lambda s: None).run(progress=False)
    rest = small_cfg(tmp_path / "b", **{"train.steps": 4, "checkpoint.every": 2, "eval.n": 0})
    Trainer(rest, resume=True, log=lambda s: None).run(progress=False)
    a, b = _numbers(tmp_path / "a" / "metrics.jsonl"), _numbers(tmp_path / "b" / "metrics.jsonl")
    assert len(a) == len(b) == 4
    assert a == b


# Golden: the first three steps of the default flow at seed 0 on the shipped tiny
# policy (reference backend: exact FP8 GEMMs, float64 attention). A silent
# numerical change anywhere in rollout, reward, loss or optimizer fails here.
GOLDEN_KEYS = ("reward_mean", "accuracy", "response_len_mean", "loss", "entropy", "grad_norm")
GOLDEN: list[dict[str, float]] = [
    {"reward_mean": 0.09375, "accuracy": 0.125, "response_len_mean": 17.59375, "loss": 0.011575759097468108,
     "entropy": 0.3712456077337265, "grad_norm": 1.0046212077140808},
    {"reward_mean": 0.3125, "accuracy": 0.3125, "response_len_mean": 14.96875, "loss": -0.0017483329400418413,
     "entropy": 0.26618607342243195, "grad_norm": 1.7380912899971008},
    {"reward_mean": 0.0, "accuracy": 0.03125, "response_len_mean": 17.75, "loss": 0.0,
     "entropy": 0.37017975747585297, "grad_norm": 0.0},
]


def test_golden_first_steps(tmp_path: Path):
    cfg = small_cfg(tmp_path / "g", **{"eval.n": 0, "checkpoint.every": 0, "train.steps": 3,
                                      "rollout.group_size": 8, "train.lr": 1e-4})
    Trainer(cfg, log=lambda s: None).run(progress=False)
    rows = read_metrics(tmp_path / "g" / "metrics.jsonl")
    got = [{k: r[k] for k in GOLDEN_KEYS} for r in rows]
    print(json.dumps(got))
    assert len(got) == len(GOLDEN) == 3
    for g, want in zip(got, GOLDEN):
        for k in ("reward_mean", "accuracy", "response_len_mean"):
            assert g[k] == want[k], (k, g[k], want[k])
        for k in ("loss", "entropy", "grad_norm"):
            assert g[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), (k, g[k], want[k])


def test_output_dir_with_a_different_run_is_refused(tmp_path: Path):
    cfg = small_cfg(tmp_path / "r", **{"train.steps": 0, "eval.n": 0})
    Trainer(cfg, log=lambda s: None)
    with pytest.raises(TrainingError, match="holds a different run .*flow"):
        Trainer(cfg.replace(flow="bf16"), log=lambda s: None)
    with pytest.raises(TrainingError, match="pass --resume"):
        Trainer(cfg, log=lambda s: None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(TrainingError, match="not empty"):
        Trainer(small_cfg(tmp_path / "other"), log=lambda s: None)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_malformed_data_line_names_file_and_line(tmp_path: Path):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})
    data.write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(ValueError, match=r"data\.jsonl.*line 3|line 3.*data\.jsonl"):
        Trainer(small_cfg(tmp_path / "r", task=f"gsm8k:{data}"), log=lambda s: None)


def test_unknown_task_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="nope"):
        Trainer(small_cfg(tmp_path / "r", task="nope"), log=lambda s: None)


@pytest.mark.parametrize("flow", ["jet", "jet-kv"])
def test_kl_reference_is_the_initial_policy_under_the_same_flow(tmp_path: Path, flow: str):
    """The KL reference model is taken after the flow (and the first Q/K/V
    calibration): same numerics as the policy, so at step 0 its log-probs are
    the policy's bit for bit and the k3 KL is exactly 0."""
    from fp8rl.rl.grpo import k3_kl, masked_mean

    cfg = small_cfg(tmp_path / "kl", flow=flow, **{"train.kl_coef": 0.1, "train.micro_batches": 1, "eval.n": 0})
    trainer = Trainer(cfg, log=lambda s: None)
    assert trainer.ref_model is not None and trainer.ref_model.flow_plan.flow.name == flow
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    problems = list(itertools.islice(trainer.task.train_problems(0), 4))  # an endless stream
    out = trainer._rollout(problems)
    scored = trainer._score(out)
    mask = out.completion_mask
    assert torch.equal(scored.ref_logp[mask], scored.old_logp[mask])
    assert float(masked_mean(k3_kl(scored.ref_logp - scored.old_logp), mask)) == 0.0
    with torch.no_grad():  # the policy moves (an optimizer step), the reference does not
        for p in trainer.params:
            p.mul_(1.01)
    scored = trainer._score(out)
    assert not torch.equal(scored.ref_logp[mask], scored.old_logp[mask])
