"""Run config: TOML loading, overrides, and errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.config import RunConfig, load_config, parse_override

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
        ("[train]\nmicro_batches = 3", "must divide the rollout batch"),
        ("seed = ", "invalid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, message: str):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
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
