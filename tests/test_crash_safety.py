"""Fault injection: a training process killed (SIGKILL) at many points of a
run, then resumed with `--resume` until it finishes, ends exactly where an
uninterrupted run ends: the same metrics (timings aside), evaluations and
final weights, bit for bit (docs/design.md section 10).

Each kill point is a function of fp8rl wrapped by tests/killpoint.py in the
training subprocess; the point names say where the process dies. A few run in
the default suite; the whole matrix is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.runlog import read_metrics

HERE = Path(__file__).resolve().parent
TIMING = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes"}
STEPS = 4
# Checkpoints at steps 2 and 4, one kept: the save at step 4 prunes step_2.
# On the exact reference backend, as before 2026-12-01 when `auto` picked it for the
# tiny policy: this matrix tests exact resumption. On `amx`, a killed-and-resumed run
# showed token_mult_prob_error 1.0011 at its first step in about 1 of 6 attempts
# (never in 12 uninterrupted runs); that open defect is recorded in docs/design.md
# section 3 ("Known defect") and is not what these tests are about.
RUN_ARGS = [
    "--steps", str(STEPS), "--no-progress", "--json", "--backend", "reference",
    "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=8",
    "--set", "eval.n=2", "--set", "eval.every=2", "--set", "eval.max_new_tokens=8",
    "--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=1", "--set", "train.lr=1e-3",
]

# name -> (function, call number, before/after): where the process dies.
KILL_POINTS = {
    "after the run's config.json": ("fp8rl.train:save_config", 1, "after"),
    "after the step-0 evaluation": ("fp8rl.runlog:RunLogger.log_eval", 1, "after"),
    "after the first metrics line, before any checkpoint": ("fp8rl.runlog:RunLogger.log_step", 1, "after"),
    "mid-rollout of step 3": ("fp8rl.train:generate", 3, "before"),
    "between rollout and optimizer of step 2": ("fp8rl.train:Trainer._optimize", 2, "before"),
    "writing the first checkpoint's tensors": ("fp8rl.checkpoint:_save_tensors", 1, "after"),
    "first checkpoint whole, not yet renamed": ("fp8rl.checkpoint:_publish", 1, "before"),
    "first checkpoint renamed": ("fp8rl.checkpoint:_publish", 1, "after"),
    "pruning: old checkpoint renamed away, not deleted": ("fp8rl.checkpoint:_remove_dir", 1, "before"),
    "pruning: mid-delete of the old checkpoint": ("os:unlink", 3, "after"),
    "during the step-2 evaluation": ("fp8rl.train:Trainer.evaluate", 2, "before"),
    "after the last checkpoint, before summary.json": ("fp8rl.train:write_summary", 1, "before"),
    "after summary.json, before the plots": ("fp8rl.plots:plot_run", 1, "before"),
}
DEFAULT_SUITE = ("after the first metrics line, before any checkpoint",)  # ~20 s; the rest: -m slow


def fp8rl_train(out: Path, *extra: str, kill: tuple[str, int, str] | None = None) -> subprocess.CompletedProcess:
    never = ("os:getpid", 0, "after")  # call 0 never comes: an uninterrupted run
    cmd = [sys.executable, str(HERE / "killpoint.py"), *map(str, kill or never), "--"]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    return subprocess.run([*cmd, "train", "--out", str(out), *RUN_ARGS, *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def outcome(run: Path) -> dict:
    """What must not depend on kills: metrics (timings aside), evaluations, final weights."""
    metrics = [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]
    final = load_file(str(run / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    summary = json.loads((run / "summary.json").read_text())
    return {"metrics": metrics, "eval": read_metrics(run / "eval.jsonl"), "weights": final,
            "summary": {k: summary[k] for k in ("steps", "eval_accuracy", "reward_mean_last5", "skipped_steps")}}


def same(a: dict, b: dict) -> bool:
    return (a["metrics"] == b["metrics"] and a["eval"] == b["eval"] and a["summary"] == b["summary"]
            and a["weights"].keys() == b["weights"].keys()
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = tmp_path_factory.mktemp("crash") / "straight"
    done = fp8rl_train(run)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    return outcome(run)


def killed_then_resumed(run: Path, *kills: tuple[str, int, str]) -> list[str]:
    """Run with each kill in turn (each resuming the last), then resume until done;
    returns what each killed attempt left in the checkpoints folder."""
    seen = []
    for i, kill in enumerate(kills):
        died = fp8rl_train(run, *(["--resume"] if i else []), kill=kill)
        assert died.returncode == -9, f"the kill point {kill} was never reached:\n{died.stderr[-2000:]}"
        ckpts = run / "checkpoints"
        seen.append(",".join(sorted(p.name.split(".tmp-")[0] + (".tmp" if ".tmp-" in p.name else "")
                                    for p in ckpts.iterdir())) if ckpts.exists() else "")
    done = fp8rl_train(run, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    return seen


def kill_and_compare(name: str, tmp_path: Path, uninterrupted: dict) -> None:
    run = tmp_path / "run"
    killed_then_resumed(run, KILL_POINTS[name])
    assert same(outcome(run), uninterrupted), name
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step_{STEPS}"], ckpts  # keep_last=1, no leftovers once a save completed


@pytest.mark.parametrize("name", DEFAULT_SUITE)
def test_killed_run_resumes_exactly(name: str, tmp_path: Path, uninterrupted: dict):
    kill_and_compare(name, tmp_path, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in KILL_POINTS if n not in DEFAULT_SUITE])
def test_killed_run_resumes_exactly_everywhere(name: str, tmp_path: Path, uninterrupted: dict):
    kill_and_compare(name, tmp_path, uninterrupted)


@pytest.mark.slow
def test_killed_twice_including_while_resuming(tmp_path: Path, uninterrupted: dict):
    run = tmp_path / "run"
    left = killed_then_resumed(
        run,
        KILL_POINTS["after the first metrics line, before any checkpoint"],
        KILL_POINTS["first checkpoint whole, not yet renamed"],  # the resumed process dies too
        KILL_POINTS["pruning: mid-delete of the old checkpoint"],
    )
    assert left[1] == "step_2.tmp"  # a whole but unpublished checkpoint is not a checkpoint
    assert same(outcome(run), uninterrupted)
