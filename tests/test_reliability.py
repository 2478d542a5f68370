"""Bad runs and damaged run directories get a one-line error before anything
is written, and nothing is lost (docs/design.md section 10). Driven through
the command line in-process, on the built-in tiny policy with tiny budgets."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from fp8rl.cli import main
from fp8rl.runlog import read_metrics
from fp8rl.train import diverged_warning

SMALL = ["--no-progress", "--json", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
         "--set", "rollout.max_new_tokens=8", "--set", "eval.n=0", "--set", "checkpoint.every=1"]


def train(capsys: pytest.CaptureFixture, out: Path | str, *args: str) -> tuple[int, str, str]:
    rc = main(["train", "--out", str(out), *SMALL, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("setting", [
    "rollout.temperature=-1", "rollout.top_p=2", "rollout.top_k=-5", "rollout.group_size=1",
    "checkpoint.keep_last=0", "checkpoint.every=-1", "eval.every=-2", "eval.n=-1", "train.lr=1e38",
    "train.lr=0", "train.grad_clip=0", "train.is_lo=3",
])
def test_bad_values_fail_before_anything_is_written(capsys, tmp_path, setting):
    run = tmp_path / "run"
    rc, _, err = train(capsys, run, "--steps", "1", "--set", setting)
    assert rc == 2
    assert setting.split("=")[0] in one_line_error(err)
    assert not run.exists()
    # ...so the corrected command then just works in the same place
    rc, _, err = train(capsys, run, "--steps", "1")
    assert rc == 0, err


def test_resume_needs_a_run_and_out_must_be_a_directory(capsys, tmp_path):
    rc, _, err = train(capsys, tmp_path / "nothing", "--steps", "1", "--resume")
    assert rc == 2 and "holds no fp8rl run" in one_line_error(err)
    assert not (tmp_path / "nothing").exists()
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    rc, _, err = train(capsys, a_file, "--steps", "1")
    assert rc == 2 and "is a file" in one_line_error(err)
    assert a_file.read_text() == "keep me"


def test_the_run_is_its_directory_however_out_is_spelled(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train(capsys, "runs/x", "--steps", "1")[0] == 0
    rc, _, err = train(capsys, tmp_path / "runs" / "x", "--steps", "2", "--resume")  # absolute
    assert rc == 0, err
    (tmp_path / "runs" / "x").rename(tmp_path / "moved")
    rc, _, err = train(capsys, tmp_path / "moved", "--steps", "3", "--resume")  # moved
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "moved" / "metrics.jsonl")] == [1, 2, 3]


def test_killed_before_the_first_checkpoint_resumes_from_step_0(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "2", "--set", "checkpoint.every=0")[0] == 0
    straight = read_metrics(run / "metrics.jsonl")
    # as a kill after the first metrics line and before any checkpoint leaves it
    for ckpt in (run / "checkpoints").iterdir():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0])
    rc, _, err = train(capsys, run, "--steps", "2", "--set", "checkpoint.every=0", "--resume")
    assert rc == 0, err
    timing = {k for k in straight[0] if k.startswith("time") or k in ("rollout_tokens_per_s", "peak_mem_bytes")}
    again = read_metrics(run / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k not in timing} for r in again] == \
           [{k: v for k, v in r.items() if k not in timing} for r in straight]


def test_damaged_checkpoint_is_refused_with_a_way_out(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "2", "--set", "checkpoint.keep_last=2")[0] == 0
    model_file = run / "checkpoints" / "step_2" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-100:] = b"\xff" * 100
    model_file.write_bytes(bytes(data))
    before = (run / "metrics.jsonl").read_text()
    rc, _, err = train(capsys, run, "--steps", "3", "--resume")
    line = one_line_error(err)
    assert rc == 2 and "step_2/model.safetensors: SHA-256 differs" in line and "step_1" in line
    assert (run / "metrics.jsonl").read_text() == before  # nothing lost
    # the way out it names works: drop the damaged checkpoint, resume from step_1
    for f in model_file.parent.iterdir():
        f.unlink()
    model_file.parent.rmdir()
    rc, _, err = train(capsys, run, "--steps", "3", "--resume")
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("meta", ["{}", '{"step": 1}', '{"step": "x", "attention_scales": {}}', "[1]", "{"])
def test_bad_checkpoint_meta_gets_one_line_naming_the_file(capsys, tmp_path, meta):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    ckpt = run / "checkpoints" / "step_1"
    (ckpt / "meta.json").write_text(meta)
    (ckpt / "manifest.json").unlink()  # as an old checkpoint without checksums: meta.json is read
    rc, _, err = train(capsys, run, "--steps", "2", "--resume")
    assert rc == 2 and "step_1/meta.json" in one_line_error(err)


def test_a_run_that_diverges_says_so(capsys, tmp_path, monkeypatch):
    import fp8rl.train as ft

    top = math.log(384)
    assert "diverged" in diverged_warning([{"entropy": 0.1}] * 3 + [{"entropy": top * 0.97}] * 5, 384)
    assert diverged_warning([{"entropy": 0.4}] * 5, 384) is None
    assert diverged_warning([{"entropy": top}] * 2 + [{"entropy": 0.4}] * 5, 384) is None  # recovered
    # the warning reaches summary.json and the terminal (a real lr=1e6 run takes minutes)
    seen = []
    monkeypatch.setattr(ft, "diverged_warning", lambda rows, vocab: seen.append((len(rows), vocab)) or "diverged!")
    rc, out, err = train(capsys, tmp_path / "run", "--steps", "1")
    assert rc == 0, err
    assert seen == [(1, 384)] and json.loads(out)["warnings"] == ["diverged!"]
    assert "warning: diverged!" in err


def test_config_json_is_written_atomically(capsys, tmp_path, monkeypatch):
    import fp8rl.runlog as runlog

    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    saved = (run / "config.json").read_text()

    original = runlog.atomic_write_text

    def torn(path, text):  # writing config.json dies after half the bytes
        if Path(path).name != "config.json":
            return original(path, text)
        with open(str(path) + ".part", "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(runlog, "atomic_write_text", torn)
    with pytest.raises(KeyboardInterrupt):
        train(capsys, run, "--steps", "2", "--resume")
    assert (run / "config.json").read_text() == saved
    assert os.path.exists(str(run / "config.json") + ".part")


@pytest.mark.parametrize("command", [
    ["sft", "--set", "sft.steps=1"],
    ["export", "--model", "tiny-arith"],
    ["compare", "--flows", "bf16", "--seeds", "0", "--steps", "1"],
])
def test_every_command_refuses_an_output_path_that_is_a_file_first(capsys, tmp_path, command):
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    rc = main([*command, "--out", str(a_file)])
    captured = capsys.readouterr()
    assert rc == 2 and "file" in one_line_error(captured.err)
    assert "sft loss" not in captured.err + captured.out  # refused before any work
    assert a_file.read_text() == "keep me"
