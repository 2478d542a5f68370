import json
import sys

import pytest
import torch

from fp8rl.runlog import RunLogger, read_metrics, write_summary
from fp8rl.plots import plot_compare, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_jsonl_roundtrip_keeps_every_float_bit(tmp_path):
    values = [0.1 + 0.2, 1 / 3, 1e-300, float(torch.tensor(0.7, dtype=torch.float32))]
    with RunLogger(tmp_path, use_tensorboard=False) as log:
        for step, v in enumerate(values, start=1):
            log.log_step(step, {"loss": v, "lr": torch.tensor(0.5), "n": 3, "flow": "jet"})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["loss"] == 0.30000000000000004
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["loss"] for r in recs] == values  # exact equality, not approx
    assert recs[0]["lr"] == 0.5 and recs[0]["n"] == 3 and recs[0]["flow"] == "jet"


def test_each_line_is_flushed_before_close(tmp_path):
    log = RunLogger(tmp_path, use_tensorboard=False)
    log.log_step(1, {"loss": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]
    log.close()


def test_truncate_after_resumes_without_duplicates(tmp_path):
    log = RunLogger(tmp_path, use_tensorboard=False)
    for step in range(1, 8):
        log.log_step(step, {"loss": float(step)})
    log.log_eval(5, {"accuracy": 0.5})
    log.log_eval(7, {"accuracy": 0.7})
    log.close()

    # a killed run checkpointed at step 6: a new process resumes
    log = RunLogger(tmp_path, use_tensorboard=False)
    with pytest.raises(ValueError, match="truncate_after"):
        log.log_step(7, {"loss": 70.0})
    log.truncate_after(6)
    log.log_step(7, {"loss": 70.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["loss"] == 70.0
    assert read_metrics(tmp_path / "eval.jsonl") == [{"step": 5, "accuracy": 0.5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl", "metrics.jsonl"]  # no temp files left


def test_torn_last_line_is_skipped_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    with RunLogger(tmp_path, use_tensorboard=False) as log:
        log.log_step(2, {"loss": 2.0})
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_write_summary_is_json(tmp_path):
    write_summary(tmp_path, {"final_accuracy": 0.25, "steps": 10, "flow": "jet"})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_accuracy": 0.25, "steps": 10, "flow": "jet"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_tensorboard_event_file_is_written(tmp_path):
    with RunLogger(tmp_path) as log:
        log.log_step(1, {"loss": 0.5, "flow": "jet"})
        log.log_eval(1, {"accuracy": 0.25})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_tensorboard_events_past_the_resumed_step_are_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path) as log:
        for step in range(1, 6):
            log.log_step(step, {"loss": float(step)})
    RunLogger(tmp_path, use_tensorboard=False).truncate_after(3)  # resume from the step-3 checkpoint
    with RunLogger(tmp_path) as log:
        log.log_step(4, {"loss": 40.0})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes `import tensorboard` fail
    with pytest.raises(ImportError, match="use_tensorboard=False"):
        RunLogger(tmp_path, use_tensorboard=True)
    RunLogger(tmp_path, use_tensorboard=False).close()


# --- plots -----------------------------------------------------------------------


def _fake_run(tmp_path, scale=1.0):
    with RunLogger(tmp_path, use_tensorboard=False) as log:
        for s in range(1, 6):
            log.log_step(s, {
                "reward_mean": 0.1 * s * scale, "accuracy": 0.05 * s, "token_mult_prob_error": 1.0 + 0.01 / s,
                "gen_kl": 1e-3 / s, "time_rollout_s": 2.0, "time_train_s": 1.0, "time_sync_s": 0.1,
                "time_step_s": 3.2,
            })
        log.log_eval(5, {"accuracy": 0.3})
    return read_metrics(tmp_path / "metrics.jsonl")


def test_plot_run_writes_three_pngs(tmp_path):
    _fake_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "plots/reward.png", "plots/mismatch.png", "plots/timing.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


def test_plot_run_of_empty_run_still_writes(tmp_path):
    assert all(p.stat().st_size > 0 for p in plot_run(tmp_path))


def test_plot_compare_single_runs_and_seed_lists(tmp_path):
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", scale=2.0)
    out = plot_compare({"bf16": a, "jet": [a, b]}, "reward_mean", tmp_path / "cmp" / "reward.png", ylabel="reward")
    assert out.read_bytes()[:8] == PNG_MAGIC
