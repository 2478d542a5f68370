"""The `fp8rl` command line (DESIGN section 8), driven in-process through
`fp8rl.cli.main(argv)`.

Every command has a `--help` that names its flags; `eval`, `mismatch`,
`export` and `train` print one JSON object with `--json` and write what the
contract says; user errors exit with code 2 and one `error: ...` line on
stderr that names the problem, never a traceback.

Everything runs on the built-in tiny policy with a handful of prompts and
tokens, so the whole file takes seconds on a CPU.

Tests marked `xfail(strict=True)` document known bugs: they fail today and
will turn into an XPASS error (a reminder to drop the mark) once fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8rl.cli import main

COMMANDS = ("train", "eval", "sft", "mismatch", "export", "compare")
COMMON = ("--config", "--model", "--task", "--flow", "--seed", "--out", "--json")
# DESIGN section 8's common flags, as far as they apply to each command
HELP_FLAGS = {
    "train": COMMON + ("--steps", "--resume", "--set", "--no-progress"),
    "eval": COMMON + ("--n", "--temperature", "--max-new-tokens", "--set"),
    "mismatch": COMMON + ("--prompts", "--samples", "--max-new-tokens", "--temperature", "--set"),
    "compare": COMMON + ("--flows", "--seeds", "--steps", "--set"),
    # sft trains fp32 from a fresh tiny policy or --model; it has no run config or flow
    "sft": ("--model", "--task", "--seed", "--out", "--json", "--steps"),
    # export turns one model into one folder: no task, flow, seed or run config
    "export": ("--model", "--out", "--json", "--format", "--overwrite"),
}
PRESET_NAMES = ("bf16", "fp8-rollout", "jet", "jet-e2e", "jet-kv", "fp8-grads")
MISMATCH_METRICS = ("token_mult_prob_error", "max_abs_logprob_diff", "mean_abs_logprob_diff", "gen_kl")

# the smallest train run the contract allows: 1 step of 2 prompts x 2 samples x 8 tokens, no eval
TRAIN_SMALL = (
    "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
    "--set", "rollout.max_new_tokens=8", "--set", "eval.n=0", "--no-progress", "--json",
)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `fp8rl ARGV` in-process; return (exit code, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    # a wide terminal: argparse would otherwise wrap "fp8-rollout" at its hyphen
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
        mp.setenv("COLUMNS", "1000")
        main([*argv, "--help"])
    assert exc.value.code == 0
    out, _ = capsys.readouterr()
    return out


def error_line(rc: int, err: str, *needles: str, one_line: bool = True) -> str:
    """Assert a clean user error: exit 2, exactly one `error:` line containing
    every needle, no traceback; with `one_line`, stderr is that line alone."""
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    if one_line:
        assert err.strip() == lines[0], f"stderr is more than one line:\n{err}"
    return lines[0]


@pytest.fixture
def bad_toml(tmp_path: Path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nbogus = 1\n")
    return path


# -- --help ------------------------------------------------------------------------------


def test_top_level_help_lists_every_command(capsys):
    text = help_text(capsys)
    assert "usage: fp8rl" in text
    for command in COMMANDS:
        assert command in text, command


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_names_its_flags(capsys, command):
    text = help_text(capsys, command)
    assert f"usage: fp8rl {command}" in text
    missing = [flag for flag in HELP_FLAGS[command] if flag not in text]
    assert not missing, f"fp8rl {command} --help does not mention {missing}"


@pytest.mark.parametrize("command", ("train", "eval", "mismatch", "compare"))
def test_flow_help_lists_presets(capsys, command):
    text = help_text(capsys, command)
    for name in PRESET_NAMES:
        assert name in text, name


@pytest.mark.parametrize("command", ("sft", "export"))
def test_every_command_takes_config(capsys, command):
    assert "--config" in help_text(capsys, command)


def test_bench_command_exists(capsys):
    help_text(capsys, "bench")


# -- eval --------------------------------------------------------------------------------


def test_eval_json(capsys):
    rc, out, err = cli(capsys, "eval", "--model", "tiny-arith", "--task", "arith", "--n", "10", "--json")
    assert rc == 0, err
    res = json.loads(out)  # stdout is exactly one JSON object
    assert isinstance(res, dict)
    assert res["n"] == 10
    assert isinstance(res["accuracy"], float) and 0.0 <= res["accuracy"] <= 1.0


def test_eval_is_greedy_and_deterministic(capsys):
    argv = ("eval", "--model", "tiny-arith", "--task", "arith", "--n", "4", "--max-new-tokens", "16", "--json")
    first = json.loads(cli(capsys, *argv)[1])
    second = json.loads(cli(capsys, *argv, "--seed", "123")[1])
    assert [s["completion"] for s in first["samples"]] == [s["completion"] for s in second["samples"]]
    assert first["accuracy"] == second["accuracy"]


# -- mismatch ----------------------------------------------------------------------------


def mismatch(capsys, flow: str) -> dict:
    rc, out, err = cli(
        capsys, "mismatch", "--model", "tiny-arith", "--flow", flow, "--task", "arith",
        "--prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--json",
    )
    assert rc == 0, err
    res = json.loads(out)
    for key in MISMATCH_METRICS:
        assert isinstance(res[key], float), (key, res.get(key))
    assert isinstance(res["n_tokens"], int) and 0 < res["n_tokens"] <= 2 * 2 * 8
    assert res["flow"] == flow
    return res


def test_mismatch_jet_is_exact(capsys):
    res = mismatch(capsys, "jet")
    assert res["token_mult_prob_error"] == 1.0
    assert res["max_abs_logprob_diff"] == 0.0 and res["mean_abs_logprob_diff"] == 0.0


def test_mismatch_fp8_rollout_differs(capsys):
    res = mismatch(capsys, "fp8-rollout")
    assert res["token_mult_prob_error"] > 1.0
    assert res["max_abs_logprob_diff"] > 0.0
    assert res["max_abs_logprob_diff"] >= res["mean_abs_logprob_diff"] > 0.0


# -- export ------------------------------------------------------------------------------


def test_export_fp8_block(capsys, tmp_path):
    out_dir = tmp_path / "fp8"
    rc, out, err = cli(capsys, "export", "--model", "tiny-arith", "--out", out_dir, "--format", "fp8-block", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["format"] == "fp8-block"
    assert "config.json" in res["files"] and "model.safetensors" in res["files"]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert (out_dir / "model.safetensors").is_file()

    from safetensors import safe_open

    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert torch.float8_e4m3fn in dtypes


def export_hf_and_load(capsys, out_dir: Path, *extra: str):
    from fp8rl.model import load

    rc, out, err = cli(capsys, "export", "--model", "tiny-arith", "--out", out_dir, "--format", "hf", *extra, "--json")
    assert rc == 0, err
    assert json.loads(out)["format"] == "hf"
    exported, tok = load(out_dir)
    original, _ = load("tiny-arith")
    assert tok is not None
    ids = torch.tensor([tok.encode("12 + 30 = 42")[:16]])
    return exported, original, ids


def test_export_hf_holds_the_bf16_weights(capsys, tmp_path):
    """The folder holds the model's weights rounded to bf16, nothing else changed."""
    exported, original, ids = export_hf_and_load(capsys, tmp_path / "hf", "--dtype", "bfloat16")
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(p.bfloat16().float())
        assert torch.equal(exported(ids), original(ids))


def test_export_hf_round_trips(capsys, tmp_path):
    exported, original, ids = export_hf_and_load(capsys, tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(exported(ids), original(ids))


def test_export_overwrite_replaces_foreign_folder(capsys, tmp_path):
    out_dir = tmp_path / "busy"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    rc, _, err = cli(capsys, "export", "--model", "tiny-arith", "--out", out_dir, "--overwrite")
    assert rc == 0, err
    assert (out_dir / "model.safetensors").is_file() and not (out_dir / "notes.txt").exists()


def test_export_refuses_foreign_folder(capsys, tmp_path):
    out_dir = tmp_path / "busy"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("mine")
    try:
        rc, _, err = cli(capsys, "export", "--model", "tiny-arith", "--out", out_dir)
    except FileExistsError as e:
        pytest.fail(f"uncaught {e!r}")
    error_line(rc, err, str(out_dir), "--overwrite")
    assert (out_dir / "notes.txt").read_text() == "mine"


# -- train -------------------------------------------------------------------------------


def train(capsys, out_dir: Path, *extra: str) -> tuple[int, str, str]:
    return cli(capsys, "train", "--out", out_dir, *TRAIN_SMALL, *extra)


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def test_train_one_step(capsys, tmp_path):
    run = tmp_path / "run"
    rc, out, err = train(capsys, run, "--steps", "1")
    assert rc == 0, err
    summary = json.loads(out)  # the resolved config and the log go to stderr under --json
    assert summary["steps"] == 1 and summary["flow"] == "jet"
    rows = metrics_lines(run)
    assert len(rows) == 1 and rows[0]["step"] == 1
    assert "token_mult_prob_error" in rows[0]
    saved = json.loads((run / "config.json").read_text())
    assert saved["rollout"]["group_size"] == 2 and saved["train"]["steps"] == 1
    assert saved["out"] == str(run)
    assert (run / "summary.json").is_file()


def test_train_rerun_with_different_config_is_refused(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    rc, _, err = train(capsys, run, "--steps", "1", "--seed", "7")
    error_line(rc, err, str(run), "seed", one_line=False)
    assert len(metrics_lines(run)) == 1


def test_train_rerun_without_resume_asks_for_it(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    rc, _, err = train(capsys, run, "--steps", "1")
    error_line(rc, err, "--resume", one_line=False)
    assert len(metrics_lines(run)) == 1


def test_train_resume_continues(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    rc, out, err = train(capsys, run, "--steps", "2", "--resume")
    assert rc == 0, err
    assert json.loads(out)["steps"] == 2
    assert [r["step"] for r in metrics_lines(run)] == [1, 2]


def test_train_failed_start_does_not_poison_out_dir(capsys, tmp_path):
    run = tmp_path / "run"
    rc, _, err = train(capsys, run, "--steps", "1", "--model", tmp_path / "no-such-model")
    error_line(rc, err, "no-such-model", one_line=False)
    rc, _, err = train(capsys, run, "--steps", "1")
    assert rc == 0, err


# -- errors: exit 2 and one `error:` line ------------------------------------------------

SMALL = {
    "eval": ("--n", "2", "--max-new-tokens", "4"),
    "mismatch": ("--prompts", "1", "--samples", "1", "--max-new-tokens", "4"),
    "train": ("--steps", "1", "--no-progress"),
    "compare": ("--steps", "1", "--seeds", "0", "--flows", "bf16"),
}


@pytest.mark.parametrize("command", ("eval", "mismatch", "train", "compare"))
def test_unknown_flow(capsys, tmp_path, command):
    rc, _, err = cli(capsys, command, "--flow", "fp9", "--out", tmp_path / "o", *SMALL[command], "--json")
    line = error_line(rc, err, "fp9")
    for name in PRESET_NAMES:
        assert name in line, name
    assert not (tmp_path / "o").exists()


def test_compare_unknown_flow_in_flows(capsys, tmp_path):
    rc, _, err = cli(capsys, "compare", "--flows", "bf16,fp9", "--out", tmp_path / "o", "--steps", "1", "--json")
    line = error_line(rc, err, "fp9", "--flows")
    assert "fp8-rollout" in line


@pytest.mark.parametrize("command", ("eval", "mismatch", "train", "sft"))
def test_unknown_task(capsys, tmp_path, command):
    rc, _, err = cli(capsys, command, "--task", "nope", "--out", tmp_path / "o", *SMALL.get(command, ()), "--json")
    error_line(rc, err, "'nope'", one_line=False)


def test_unknown_task_error_is_one_line(capsys):
    rc, _, err = cli(capsys, "eval", "--task", "nope", "--n", "2")
    error_line(rc, err, "'nope'", "arith", "gsm8k:PATH", "reasoning-gym:NAME")


def test_unknown_task_file(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    rc, _, err = cli(capsys, "eval", "--task", f"gsm8k:{missing}", "--n", "2")
    error_line(rc, err, str(missing))


@pytest.mark.parametrize("command", ("eval", "mismatch", "train", "compare"))
def test_unknown_key_in_config_file(capsys, tmp_path, bad_toml, command):
    rc, _, err = cli(capsys, command, "--config", bad_toml, "--out", tmp_path / "o", *SMALL[command], "--json")
    error_line(rc, err, "train.bogus")
    assert not (tmp_path / "o").exists()


def test_invalid_toml(capsys, tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps = 1\n")
    rc, _, err = cli(capsys, "eval", "--config", path, "--n", "2")
    error_line(rc, err, str(path), "TOML")


def test_wrong_type_in_config_file(capsys, tmp_path):
    path = tmp_path / "typed.toml"
    path.write_text('[rollout]\ngroup_size = "eight"\n')
    rc, _, err = cli(capsys, "eval", "--config", path, "--n", "2")
    error_line(rc, err, "rollout.group_size", "integer")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("train.bogus=1", "train.bogus"),
        ("bogus=1", "bogus"),
        ("rollout.group_size=abc", "rollout.group_size"),
        ("train.correction=magic", "train.correction"),
        ("nokeyvalue", "--set"),
    ],
)
@pytest.mark.parametrize("command", ("eval", "train"))
def test_bad_set(capsys, tmp_path, command, setting, needle):
    rc, _, err = cli(capsys, command, "--set", setting, "--out", tmp_path / "o", *SMALL[command])
    error_line(rc, err, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ("eval", "mismatch", "train", "compare"))
def test_missing_config_file(capsys, tmp_path, command):
    missing = tmp_path / "nope.toml"
    rc, _, err = cli(capsys, command, "--config", missing, "--out", tmp_path / "o", *SMALL[command])
    error_line(rc, err, str(missing))


@pytest.mark.parametrize("command", ("eval", "mismatch", "train", "export", "sft"))
def test_missing_model(capsys, tmp_path, command):
    missing = tmp_path / "no-such-model"
    rc, _, err = cli(capsys, command, "--model", missing, "--out", tmp_path / "o", *SMALL.get(command, ()))
    # train prints the resolved config before it loads the model
    error_line(rc, err, str(missing), one_line=command != "train")


def test_model_folder_without_config(capsys, tmp_path):
    rc, _, err = cli(capsys, "eval", "--model", tmp_path, "--n", "2")
    error_line(rc, err, str(tmp_path), "config.json")


def test_argparse_errors_exit_2(capsys):
    assert main(["export", "--out", "x"]) == 2  # --model is required (flag or config key)
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2


def test_bench_reports_each_flow(capsys):
    rc, out, err = cli(capsys, "bench", "--model", "tiny-arith", "--flows", "bf16,jet-kv", "--batch", "2",
                       "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    rows = json.loads(out)["results"]
    assert [r["flow"] for r in rows] == ["bf16", "jet-kv"]
    assert all(r["tokens"] == 8 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["kv_ratio_vs_bf16"] <= 0.51


def test_sft_and_export_read_a_flat_toml_config(capsys, tmp_path):
    out_dir = tmp_path / "fp8"
    cfg = tmp_path / "export.toml"
    cfg.write_text(f'model = "tiny-arith"\nout = "{out_dir}"\nformat = "fp8-block"\n')
    rc, out, err = cli(capsys, "export", "--config", cfg, "--json")
    assert rc == 0, err
    assert json.loads(out)["format"] == "fp8-block" and (out_dir / "config.json").is_file()
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    rc, _, err = cli(capsys, "sft", "--config", bad, "--json")
    error_line(rc, err, "stepz", one_line=False)
