"""The `fp8rl` command line (docs/design.md section 8), driven in-process through
`fp8rl.cli.main(argv)`.

Every command has a `--help` that names its flags; `eval`, `mismatch`,
`export` and `train` print one JSON object with `--json` and write what the
contract says; user errors exit with code 2 and one `error: ...` line on
stderr that names the problem, never a traceback. Every command reads the
same TOML config, with one precedence: dataclass defaults < the command's own
defaults < the file < `--set` < flags.

Everything runs on the built-in tiny policy with a handful of prompts and
tokens, so the whole file takes seconds on a CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8rl.cli import main
from fp8rl.config import RunConfig

REPO = Path(__file__).resolve().parents[1]

COMMANDS = ("train", "eval", "sft", "mismatch", "export", "compare", "bench")
COMMON = ("--config", "--model", "--task", "--flow", "--backend", "--seed", "--out", "--set", "--json")
# docs/design.md section 8's common flags, as far as they apply to each command
HELP_FLAGS = {
    "train": COMMON + ("--steps", "--resume", "--no-progress"),
    "eval": COMMON + ("--n", "--temperature", "--max-new-tokens"),
    "mismatch": COMMON + ("--prompts", "--samples", "--max-new-tokens", "--temperature"),
    "compare": COMMON + ("--flows", "--seeds", "--steps"),
    # sft trains fp32 from a fresh tiny policy or the config's model: no flow or backend
    "sft": ("--config", "--model", "--task", "--seed", "--out", "--set", "--json", "--steps", "--batch-size",
            "--lr", "--early-answer-noise", "--eval-n", "--max-new-tokens"),
    # export turns one model into one folder: no task, flow or seed
    "export": ("--config", "--model", "--out", "--set", "--json", "--format", "--scale-fmt", "--dtype", "--overwrite"),
    "bench": ("--config", "--model", "--backend", "--set", "--json", "--flows", "--batch", "--max-new-tokens"),
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


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_config(capsys, command):
    text = help_text(capsys, command)
    assert "--config" in text and "--set" in text


def test_bench_command_exists(capsys):
    help_text(capsys, "bench")


def test_help_and_argument_errors_do_not_import_torch():
    """`fp8rl --help` and argparse errors answer at once: importing torch takes about a
    second, so only `fp8rl CMD --help` (which lists the registries' names) and the
    commands themselves may. A fresh interpreter, since this one has torch already."""
    argvs = [["--help"], ["nonsense"], ["train", "--bogus"], ["eval", "--n", "many"], ["export", "--format", "onnx"]]
    code = (
        "import sys, fp8rl.cli as c\n"
        f"for argv in {argvs!r}:\n"
        "    try:\n"
        "        c.main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, 2), (argv, e.code)\n"
        "    else:\n"
        "        raise AssertionError(f'{argv} did not exit')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage: fp8rl" in run.stdout and "invalid int value: 'many'" in run.stderr


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


def test_bench_rollout_repeats_report_the_median():
    """benchmarks/rollout.py --repeats N: N timed rollouts after the warm-up, the median reported."""
    from fp8rl.bench import bench_rollout

    r = bench_rollout("tiny-arith", "bf16", "cpu", [[5, 6, 7], [8, 9]], 3, 0, repeats=3)
    assert len(r["all_seconds"]) == 3 and r["seconds"] == sorted(r["all_seconds"])[1]
    assert r["tokens_per_s"] == r["tokens"] / r["seconds"]
    with pytest.raises(ValueError, match="repeats"):
        bench_rollout("tiny-arith", "bf16", "cpu", [[5]], 1, 0, repeats=0)


def test_bench_reports_each_flow(capsys):
    rc, out, err = cli(capsys, "bench", "--model", "tiny-arith", "--flows", "bf16,jet-kv", "--batch", "2",
                       "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    rows = json.loads(out)["results"]
    assert [r["flow"] for r in rows] == ["bf16", "jet-kv"]
    assert all(r["tokens"] == 8 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["kv_ratio_vs_bf16"] <= 0.51


# -- one config for every command -------------------------------------------------------


def toml(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def resolved(*argv) -> RunConfig:
    """The config a command line resolves to, without running the command."""
    from fp8rl.cli import _run_config, build_parser

    return _run_config(build_parser().parse_args([str(a) for a in argv]))


def test_flags_beat_set_beat_file_beat_command_defaults(tmp_path):
    # compare's own default out sits between the dataclass default and the file
    assert resolved("compare").out == "runs/compare"
    assert resolved("train").out == "runs/default"
    cfg_file = toml(tmp_path, 'out = "from-file"\nflow = "bf16"\n[eval]\nn = 3\n[compare]\nseeds = [7]\n')
    cfg = resolved("compare", "--config", cfg_file)
    assert (cfg.out, cfg.flow, cfg.eval.n, cfg.compare.seeds) == ("from-file", "bf16", 3, (7,))
    cfg = resolved("compare", "--config", cfg_file, "--set", "out=from-set", "--set", "compare.seeds=[8, 9]",
                   "--set", "eval.n=4")
    assert (cfg.out, cfg.compare.seeds, cfg.eval.n) == ("from-set", (8, 9), 4)
    cfg = resolved("compare", "--config", cfg_file, "--set", "out=from-set", "--set", "compare.seeds=[8, 9]",
                   "--out", "from-flag", "--seeds", "1,2", "--flows", "jet,jet-kv", "--steps", "5")
    assert (cfg.out, cfg.compare.seeds, cfg.compare.flows, cfg.train.steps) == (
        "from-flag", (1, 2), ("jet", "jet-kv"), 5)
    cfg = resolved("eval", "--config", cfg_file, "--set", "eval.n=4", "--n", "5", "--flow", "jet")
    assert (cfg.eval.n, cfg.flow) == (5, "jet")


def test_each_flag_sets_its_config_key():
    cfg = resolved("eval", "--n", "3", "--temperature", "0.5", "--max-new-tokens", "9")
    assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.max_new_tokens) == (3, 0.5, 9)
    cfg = resolved("mismatch", "--prompts", "2", "--samples", "3", "--max-new-tokens", "4", "--temperature", "0.7")
    assert cfg.mismatch.__dict__ == {"prompts": 2, "samples": 3, "max_new_tokens": 4, "temperature": 0.7}
    cfg = resolved("sft", "--steps", "3", "--batch-size", "4", "--lr", "0.1", "--early-answer-noise", "0.4",
                   "--eval-n", "5", "--max-new-tokens", "6", "--seed", "2")
    s = cfg.sft
    assert (s.steps, s.batch_size, s.lr, s.early_answer_noise, s.eval_n, s.max_new_tokens, cfg.seed) == (
        3, 4, 0.1, 0.4, 5, 6, 2)
    assert cfg.train.steps == RunConfig().train.steps  # sft's --steps is sft.steps
    cfg = resolved("export", "--format", "fp8-block", "--scale-fmt", "ue8m0", "--dtype", "bfloat16")
    assert cfg.export.__dict__ == {"format": "fp8-block", "scale_fmt": "ue8m0", "dtype": "bfloat16"}
    cfg = resolved("bench", "--flows", "jet", "--batch", "2", "--max-new-tokens", "3", "--backend", "cpu")
    assert (cfg.bench.flows, cfg.bench.batch, cfg.bench.max_new_tokens, cfg.backend) == (("jet",), 2, 3, "cpu")


def test_sft_model_default_builds_from_scratch_unless_the_config_names_one(tmp_path):
    assert resolved("sft").model == "" and resolved("sft").out == "runs/sft"
    assert resolved("sft", "--config", REPO / "configs" / "default.toml").model == "tiny-arith"
    assert resolved("export").out == "" and resolved("export").model == ""


def test_eval_reads_the_config_flow_and_eval_section(capsys, tmp_path):
    cfg_file = toml(tmp_path, 'flow = "bf16"\n[eval]\nn = 3\nmax_new_tokens = 4\n')
    rc, out, err = cli(capsys, "eval", "--config", cfg_file, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert (res["n"], res["flow"]) == (3, "bf16")
    assert all(len(s["completion"]) <= 4 * 8 for s in res["samples"])
    rc, out, err = cli(capsys, "eval", "--config", cfg_file, "--set", "eval.n=2", "--flow", "jet", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert (res["n"], res["flow"]) == (2, "jet")


def test_eval_runs_under_the_flow(capsys, tmp_path):
    """Without --flow, eval runs the config's flow (default jet), as training does."""
    rc, out, err = cli(capsys, "eval", "--n", "2", "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    assert json.loads(out)["flow"] == RunConfig().flow == "jet"


def test_mismatch_reads_its_section(capsys, tmp_path):
    cfg_file = toml(tmp_path, 'flow = "fp8-rollout"\n[mismatch]\nprompts = 1\nsamples = 2\nmax_new_tokens = 3\n')
    rc, out, err = cli(capsys, "mismatch", "--config", cfg_file, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["flow"] == "fp8-rollout" and 0 < res["n_tokens"] <= 1 * 2 * 3
    from fp8rl.fp8.backends import choose_backend
    from fp8rl.model import load

    # "auto", resolved by apply_flow for the config's model (tiny-arith)
    assert res["backend"] == choose_backend(torch.device("cpu"), load("tiny-arith")[0]).name


def test_bench_reads_its_section(capsys, tmp_path):
    cfg_file = toml(tmp_path, '[bench]\nflows = ["jet"]\nbatch = 2\nmax_new_tokens = 3\n')
    rc, out, err = cli(capsys, "bench", "--config", cfg_file, "--json")
    assert rc == 0, err
    rows = json.loads(out)["results"]
    from fp8rl.fp8.backends import choose_backend
    from fp8rl.model import load

    picked = choose_backend(torch.device("cpu"), load("tiny-arith")[0]).name
    assert [(r["flow"], r["tokens"], r["backend"]) for r in rows] == [("jet", 6, picked)]


def test_export_reads_the_export_section(capsys, tmp_path):
    out_dir = tmp_path / "fp8"
    cfg_file = toml(tmp_path, f'model = "tiny-arith"\nout = "{out_dir}"\n[export]\nformat = "fp8-block"\n')
    rc, out, err = cli(capsys, "export", "--config", cfg_file, "--json")
    assert rc == 0, err
    assert json.loads(out)["format"] == "fp8-block" and (out_dir / "config.json").is_file()
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_export_needs_out(capsys, tmp_path):
    rc, _, err = cli(capsys, "export", "--config", toml(tmp_path, 'model = "tiny-arith"\n'))
    error_line(rc, err, "--out")


def sft_small(capsys, *argv) -> dict:
    rc, out, err = cli(capsys, "sft", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_sft_reads_the_sft_section_and_fine_tunes_the_config_model(capsys, tmp_path):
    from fp8rl.model import load

    out_dir = tmp_path / "ft"
    cfg_file = toml(tmp_path, f'model = "tiny-arith"\nout = "{out_dir}"\nseed = 3\n'
                              "[sft]\nsteps = 1\nbatch_size = 2\nlr = 0.0\neval_n = 2\nmax_new_tokens = 4\n")
    info = sft_small(capsys, "--config", cfg_file)
    assert info["out"] == str(out_dir)
    assert info["eval"]["n"] == 2
    assert {k: info["sft_config"][k] for k in ("steps", "batch_size", "lr", "seed")} == {
        "steps": 1, "batch_size": 2, "lr": 0.0, "seed": 3}
    # lr 0: the saved model is the config's model (tiny-arith), not a fresh tiny policy
    tuned, _ = load(out_dir)
    original, _ = load("tiny-arith")
    for (name, a), b in zip(tuned.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name


def test_sft_without_a_model_builds_from_scratch(capsys, tmp_path):
    from fp8rl.model import load

    out_dir = tmp_path / "scratch"
    info = sft_small(capsys, "--out", out_dir, "--steps", "1", "--batch-size", "2", "--lr", "0",
                     "--eval-n", "2", "--max-new-tokens", "4")
    assert info["sft_config"]["steps"] == 1
    fresh, _ = load(out_dir)
    original, _ = load("tiny-arith")
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), original.state_dict().values()))


def test_sft_refuses_to_replace_a_run_directory(capsys, tmp_path):
    """With a shared config, `out` may be a training run: sft must not replace it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    cfg_file = toml(tmp_path, f'out = "{run}"\n[sft]\nsteps = 1\nbatch_size = 2\neval_n = 1\n')
    rc, _, err = cli(capsys, "sft", "--config", cfg_file, "--json")
    error_line(rc, err, str(run), "--out")
    assert (run / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize(
    ("command", "text", "needles"),
    [
        ("sft", "steps = 300\n", ("unknown config key steps", "sft.steps", "[sft]")),
        ("sft", "early_answer_noise = 0.4\n", ("sft.early_answer_noise", "[sft]")),
        ("export", 'format = "fp8-block"\n', ("unknown config key format", "export.format", "[export]")),
        ("sft", "stepz = 3\n", ("stepz",)),
    ],
)
def test_old_flat_keys_say_where_they_live_now(capsys, tmp_path, command, text, needles):
    rc, _, err = cli(capsys, command, "--config", toml(tmp_path, text), "--out", tmp_path / "o", "--json")
    error_line(rc, err, *needles)
    assert not (tmp_path / "o").exists()


def test_compare_flows_from_the_config_are_checked(capsys, tmp_path):
    cfg_file = toml(tmp_path, '[compare]\nflows = ["bf16", "fp9"]\n')
    rc, _, err = cli(capsys, "compare", "--config", cfg_file, "--out", tmp_path / "o", "--steps", "1")
    error_line(rc, err, "fp9", "compare.flows", "fp8-rollout")
    assert not (tmp_path / "o").exists()


def test_compare_uses_the_config_out(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a wrong default (runs/compare) would land here
    out_dir = tmp_path / "from-config"
    cfg_file = toml(tmp_path, f'out = "{out_dir}"\n'
                              "[rollout]\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 8\n"
                              "[train]\nsteps = 1\n[eval]\nn = 2\nmax_new_tokens = 4\n"
                              '[compare]\nflows = ["bf16"]\nseeds = [0]\n')
    rc, out, err = cli(capsys, "compare", "--config", cfg_file, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert (report["flows"], report["seeds"]) == (["bf16"], [0])
    assert (out_dir / "report.md").is_file() and (out_dir / "runs").is_dir()
    assert not (tmp_path / "runs").exists()


def test_run_saved_before_the_command_sections_still_resumes(capsys, tmp_path):
    run = tmp_path / "run"
    assert train(capsys, run, "--steps", "1")[0] == 0
    saved = json.loads((run / "config.json").read_text())
    for section in ("mismatch", "sft", "export", "bench", "compare"):
        del saved[section]  # as a run directory written before they existed
    (run / "config.json").write_text(json.dumps(saved))
    rc, out, err = train(capsys, run, "--steps", "2", "--resume")
    assert rc == 0, err
    assert json.loads(out)["steps"] == 2


def test_compare_rerun_with_another_flow_resumes_its_runs(capsys, tmp_path):
    cfg_file = toml(tmp_path, "[rollout]\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 8\n"
                              "[train]\nsteps = 1\n[eval]\nn = 2\nmax_new_tokens = 4\n[compare]\nseeds = [0]\n")
    out_dir = tmp_path / "cmp"
    assert cli(capsys, "compare", "--config", cfg_file, "--flows", "bf16", "--out", out_dir, "--json")[0] == 0
    rc, out, err = cli(capsys, "compare", "--config", cfg_file, "--flows", "bf16,jet", "--out", out_dir, "--json")
    assert rc == 0, err
    assert [r["label"] for r in json.loads(out)["rows"]] == ["bf16", "jet"]


SWEEP = ('[compare]\nflows = ["bf16"]\nseeds = [0]\nsweep = [\n'
         '  "short task=chain:min_times=1,max_times=2 rollout.max_new_tokens=6",\n'
         '  "long task=chain:min_times=3,max_times=4 rollout.max_new_tokens=10",\n]\n')


def test_compare_sweep_runs_the_grid_per_point_and_reports_across_them(capsys, tmp_path):
    cfg_file = toml(tmp_path, "[rollout]\nprompts_per_step = 2\ngroup_size = 2\n"
                              "[train]\nsteps = 1\n[eval]\nn = 2\nmax_new_tokens = 4\n" + SWEEP)
    out_dir = tmp_path / "sweep"
    rc, out, err = cli(capsys, "compare", "--config", cfg_file, "--out", out_dir, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert list(report["sweep"]) == ["short", "long"]
    for label, budget in (("short", 6), ("long", 10)):
        run = out_dir / label / "runs" / "bf16-seed0"
        saved = json.loads((run / "config.json").read_text())
        assert saved["task"].startswith("chain:") and saved["rollout"]["max_new_tokens"] == budget
        assert saved["compare"]["sweep"] == []  # a point's runs are plain runs
        row = report["sweep"][label]["rows"][0]
        assert row["response_len_mean"] <= budget and row["seq_log_ratio_abs_mean"] == 0.0
        assert row["grad_flushed_frac"] is None  # bf16 sends no FP8 gradient
    md = (out_dir / "report.md").read_text()
    assert "## short: chain:min_times=1" in md and "## long: chain:min_times=3" in md
    assert (out_dir / "length_accuracy.png").is_file() and (out_dir / "length_mismatch.png").is_file()
    # the same command again reuses the finished runs (resumes them at their last step)
    assert cli(capsys, "compare", "--config", cfg_file, "--out", out_dir, "--json")[0] == 0
    assert len((out_dir / "long" / "runs" / "bf16-seed0" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("sweep,message", [
    ('["a task=chain", "a task=arith"]', "labels repeat"),
    ('["only-a-label"]', "sets nothing"),
    ('["x=1 task=chain"]', "must start with a label"),
    ('["bad rollout.max_new_token=3"]', "max_new_token"),
])
def test_compare_sweep_mistakes_are_named_before_any_run(capsys, tmp_path, sweep, message):
    cfg_file = toml(tmp_path, f"[train]\nsteps = 1\n[compare]\nflows = [\"bf16\"]\nsweep = {sweep}\n")
    rc, _, err = cli(capsys, "compare", "--config", cfg_file, "--out", tmp_path / "o", "--json")
    error_line(rc, err, message)
    assert not (tmp_path / "o").exists()


def test_sft_refuses_an_evaluation_budget_beyond_the_context_before_training(capsys, tmp_path, monkeypatch):
    import fp8rl.sft

    monkeypatch.setattr(fp8rl.sft, "run_sft", lambda *a, **k: pytest.fail("trained before the check"))
    out_dir = tmp_path / "too-long"
    rc, _, err = cli(capsys, "sft", "--model", "tiny-arith", "--out", out_dir, "--max-new-tokens", "250", "--json")
    error_line(rc, err, "exceeds the model's context of 256 positions", "lower sft.max_new_tokens", one_line=False)
    assert not out_dir.exists()


def test_sft_saves_the_policy_before_its_evaluation(capsys, tmp_path, monkeypatch):
    import fp8rl.evaluate

    def broken(*args, **kwargs):
        raise RuntimeError("evaluation crashed")

    monkeypatch.setattr(fp8rl.evaluate, "evaluate", broken)
    out_dir = tmp_path / "kept"
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        cli(capsys, "sft", "--model", "tiny-arith", "--out", out_dir, "--steps", "1", "--batch-size", "2",
            "--eval-n", "2", "--max-new-tokens", "4", "--json")
    info = json.loads((out_dir / "sft.json").read_text())
    assert info["eval"] == {} and (out_dir / "model.safetensors").is_file()


def test_bench_rollout_reports_the_kv_bytes_stored_and_held():
    """jet-kv's FP8 K/V: half of bf16's bytes in the stored format; on `cpu` / `amx` with
    the compiled kernels (the fused kernel's cache: BF16, or E4M3 codes) the bytes held are
    the stored ones, else the FP32 values of the unfused cache."""
    from fp8rl.bench import bench_rollout
    from fp8rl.fp8.kernels import attention_available

    rows = {f: bench_rollout("tiny-arith", f, "cpu", [[5, 6, 7], [8, 9]], 3, 0) for f in ("bf16", "jet-kv")}
    assert rows["jet-kv"]["kv_bytes"] < 0.6 * rows["bf16"]["kv_bytes"]
    fused = attention_available(32)  # tiny-arith's head size
    for flow, row in rows.items():
        if fused:
            assert row["kv_resident_bytes"] == row["kv_bytes"], flow
        else:
            assert row["kv_resident_bytes"] > row["kv_bytes"], flow
