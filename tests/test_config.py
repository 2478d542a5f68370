"""Run config: TOML loading, overrides, and errors that name the bad key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp8rl.config import RunConfig, from_dict, load_config, parse_override

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_shipped_configs_load():
    assert RunConfig().flow == "jet"
    for path in sorted((REPO / "configs").glob("*.toml")):
        cfg = load_config(path)
        assert cfg.rollout.group_size >= 1, path


def test_toml_and_overrides(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text('flow = "bf16"\nseed = 3\n[train]\nlr = 1\nbetas = [0.8, 0.9]\n[rollout]\ngroup_size = 4\n')
    cfg = load_config(p, {"train.steps": 7, "rollout.temperature": 0.5})
    assert (cfg.flow, cfg.seed, cfg.train.lr, cfg.train.betas) == ("bf16", 3, 1.0, (0.8, 0.9))
    assert (cfg.train.steps, cfg.rollout.temperature, cfg.rollout.group_size) == (7, 0.5, 4)
    assert RunConfig().replace(**{"eval.n": 5}).eval.n == 5


@pytest.mark.parametrize(
    "text, message",
    [
        ("colour = 1", "unknown config key colour"),
        ("[train]\nlearning_rate = 1", "unknown config key train.learning_rate"),
        ("[bogus]\nx = 1", "unknown config key bogus"),
        ('flow = "fp9"', "unknown flow 'fp9'; valid presets: bf16, fp8-rollout, jet"),
        ("[train]\nsteps = 'ten'", "train.steps must be an integer"),
        ("[train]\ncorrection = 'magic'", "train.correction = 'magic' is not one of"),
        ("[rollout]\ngroup_size = 0", "rollout.group_size must be >= 1"),
        ("[train]\nmicro_batches = 3", "must divide the rollout batch's prompt groups"),
        ("[train]\ngrad_chunks = 3", "train.grad_chunks=3 must divide a micro-batch's prompt groups"),
        ("[train]\ngrad_chunks = 0", "train.grad_chunks must be >= 1"),
        ("seed = ", "invalid TOML"),
        # old flat sft/export keys: the error says which section they live in now
        ("steps = 300",
         "unknown config key steps; did you mean train.steps ([train] section) or sft.steps ([sft] section)?"),
        ('format = "fp8-block"', "did you mean export.format ([export] section)?"),
        ("early_answer_noise = 0.4", "did you mean sft.early_answer_noise ([sft] section)?"),
        ("[sft]\nseed = 1", "unknown config key sft.seed"),  # sft uses the top-level seed
        ("[sft]\nsteps = 0", "sft.steps must be >= 1"),
        ("[mismatch]\nsamples = 0", "mismatch.samples must be >= 1"),
        ('[export]\nformat = "gguf"', "export.format = 'gguf' is not one of hf, fp8-block"),
        ('[export]\nscale_fmt = "e8"', "export.scale_fmt = 'e8' is not one of fp32, ue8m0"),
        ('[compare]\nflows = ["bf16", "fp9"]', "unknown flow 'fp9' in compare.flows (--flows); valid presets: bf16,"),
        ('[bench]\nflows = ["jet", "fp9"]', "unknown flow 'fp9' in bench.flows"),
        ("[compare]\nflows = []", "compare.flows (--flows) names no flow"),
        ('[compare]\nseeds = "0,1"', "compare.seeds must be a list"),
        ('[compare]\nseeds = [0, "one"]', "compare.seeds must be an integer"),
        ('backend = "magic"', "config key backend = 'magic' is not one of auto, reference"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, message: str):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(p)


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_parse_override():
    assert parse_override("train.lr=1e-4") == ("train.lr", 1e-4)
    assert parse_override("flow=bf16") == ("flow", "bf16")
    assert parse_override('flow="jet"') == ("flow", "jet")
    assert parse_override("train.normalize_std=false") == ("train.normalize_std", False)
    with pytest.raises(ValueError, match="key=value"):
        parse_override("train.lr")


def test_command_sections(tmp_path: Path):
    """Every command's settings live in the one config, with the CLI's defaults."""
    cfg = RunConfig()
    assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.max_new_tokens) == (200, 0.0, 48)
    assert (cfg.mismatch.prompts, cfg.mismatch.samples, cfg.mismatch.max_new_tokens, cfg.mismatch.temperature) == (
        16, 4, 64, 1.0)
    assert (cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr, cfg.sft.eval_n, cfg.sft.max_new_tokens) == (
        230, 64, 3e-3, 500, 48)
    assert (cfg.export.format, cfg.export.scale_fmt, cfg.export.dtype) == ("hf", "fp32", "float32")
    assert (cfg.bench.flows, cfg.bench.batch, cfg.bench.max_new_tokens) == (("bf16", "jet", "jet-kv"), 32, 48)
    from fp8rl.precision import PRESETS

    assert cfg.compare.flows == tuple(PRESETS) and cfg.compare.seeds == (0, 1, 2)
    p = tmp_path / "c.toml"
    p.write_text('[compare]\nflows = ["bf16", "jet"]\nseeds = [3]\n'
                 '[sft]\nsteps = 5\n[export]\nformat = "fp8-block"\n')
    cfg = load_config(p)
    assert (cfg.compare.flows, cfg.compare.seeds, cfg.sft.steps, cfg.export.format) == (("bf16", "jet"), (3,), 5, "fp8-block")


def test_sft_config_is_the_sft_section():
    from fp8rl import config, sft

    assert sft.SFTConfig is config.SFTConfig
    assert "seed" not in config.SFTConfig.__dataclass_fields__  # sft takes the top-level seed


def test_backend_choices_come_from_the_registry():
    from fp8rl.fp8.backends import BACKENDS

    for name in ("auto", *BACKENDS):
        assert RunConfig(backend=name).backend == name


def test_precedence_defaults_file_overrides(tmp_path: Path):
    """dataclass defaults < a command's defaults < the file < overrides."""
    p = tmp_path / "c.toml"
    p.write_text('out = "file"\n[eval]\nn = 3\n')
    command = {"out": "command", "model": "", "eval.max_new_tokens": 7}
    assert load_config(None, None, command).out == "command"
    cfg = load_config(p, None, command)
    assert (cfg.out, cfg.model, cfg.eval.n, cfg.eval.max_new_tokens, cfg.seed) == ("file", "", 3, 7, 0)
    cfg = load_config(p, {"out": "flag", "eval.n": 4}, command)
    assert (cfg.out, cfg.eval.n) == ("flag", 4)


def test_to_dict_round_trips():
    cfg = RunConfig().replace(**{"compare.seeds": (5,), "bench.flows": ("jet",), "sft.steps": 3})
    saved = json.loads(json.dumps(cfg.to_dict()))  # as config.json holds it: tuples become lists
    assert from_dict(saved) == cfg
    assert {"mismatch", "sft", "export", "bench", "compare"} <= set(saved)


def test_compare_default_flows_are_every_preset():
    from fp8rl.config import CompareConfig
    from fp8rl.precision import PRESETS

    assert CompareConfig().flows == tuple(PRESETS)


def test_sft_attention_backend_is_checked_against_the_registry():
    with pytest.raises(ValueError, match="sft.attention_backend = 'fast-please' is not one of reference"):
        from_dict({"sft": {"attention_backend": "fast-please"}})
    assert from_dict({"sft": {"attention_backend": "cpu"}}).sft.attention_backend == "cpu"


def test_sft_attention_backend_runs_the_training_and_leaves_no_plan_behind(monkeypatch):
    import torch

    from fp8rl.config import SFTConfig
    from fp8rl.fp8.backends import BACKENDS
    from fp8rl.model import load
    from fp8rl.precision import FULL_PRECISION_ATTENTION
    from fp8rl.sft import run_sft
    from fp8rl.tasks import make_task

    import fp8rl.model.transformer as transformer

    cpu = BACKENDS["cpu"]
    calls = []
    original = cpu.attention_scores
    monkeypatch.setattr(cpu, "attention_scores", lambda q, k: calls.append(q.shape) or original(q, k))
    fused = transformer._fused_forward  # `cpu`'s attention where the compiled kernels load
    monkeypatch.setattr(transformer, "_fused_forward", lambda q, *a: calls.append(q.shape) or fused(q, *a))
    losses = {}
    for backend in ("reference", "cpu"):
        calls.clear()
        model, tok = load("tiny-arith")
        cfg = SFTConfig(steps=1, batch_size=4, lr=0.0, attention_backend=backend)
        losses[backend] = run_sft(model, tok, make_task("chain:min_times=2,max_times=3"), cfg, seed=0)[0]
        assert len(calls) == (model.config.num_layers if backend == "cpu" else 0)  # one forward, every layer
        assert all(layer.self_attn.attention_plan is FULL_PRECISION_ATTENTION for layer in model.model.layers)
    # FP32 products instead of float64 ones: the same loss up to FP32 rounding
    assert losses["cpu"] == pytest.approx(losses["reference"], rel=1e-5)
    assert torch.isfinite(torch.tensor(losses["cpu"]))
