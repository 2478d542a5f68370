"""Run configuration: frozen dataclasses, read from TOML, one source of truth.

A config file has top-level keys (`seed`, `task`, `flow`, `out`, `model`, ...)
and one table per section (`[rollout]`, `[train]`, `[eval]`, `[checkpoint]`,
`[calibration]`). Every key is optional; unknown keys are errors that name
them. The resolved config is printed at start and saved as `config.json` in
the run directory and beside every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 16  # distinct problems per step
    group_size: int = 8  # samples per problem (GRPO group)
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 80
    lr: float = 5e-5
    lr_schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    micro_batches: int = 2  # optimizer steps per rollout batch (PPO epochs over minibatches)
    grad_clip: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0  # k3 KL to the initial policy; 0 = no reference model
    normalize_std: bool = True
    correction: str = "tis"  # "none" | "tis" | "icepop" | "seq-mask-tis"
    is_cap: float = 2.0
    is_lo: float = 0.5
    is_hi: float = 2.0
    max_bad_steps: int = 3  # stop after this many NaN/Inf steps in a row


@dataclass(frozen=True)
class EvalConfig:
    every: int = 20  # steps; 0 = only before and after
    n: int = 200  # held-out problems
    temperature: float = 0.0
    max_new_tokens: int = 48
    batch_size: int = 100


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 20
    keep_last: int = 2


@dataclass(frozen=True)
class CalibrationSection:
    percentile: float = 99.9
    margin: float = 1.05


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny-arith"  # built-in name, HF folder or .gguf file
    task: str = "arith"  # "arith", "gsm8k:PATH", "reasoning-gym:NAME"
    flow: str = "jet"  # a preset of fp8rl.precision.PRESETS
    backend: str = "auto"  # GEMM backend: "auto", "reference" (exact), "cpu" (FP32 emulation), "amx" (native BF16)
    seed: int = 0
    out: str = "runs/default"
    system_prompt: str = ""  # chat models only
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    calibration: CalibrationSection = field(default_factory=CalibrationSection)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> "RunConfig":
        """Override with dotted keys: `cfg.replace(**{"train.lr": 1e-4, "flow": "bf16"})`."""
        return from_dict(_merge(self.to_dict(), _nest(overrides)))


_CHOICES = {
    "train.lr_schedule": ("constant", "cosine"),
    "train.correction": ("none", "tis", "icepop", "seq-mask-tis"),
    "backend": ("auto", "reference", "cpu", "amx"),
}


def validate(cfg: RunConfig) -> None:
    from fp8rl.precision import PRESETS

    if cfg.flow not in PRESETS:
        raise ValueError(f"unknown flow {cfg.flow!r}; valid presets: {', '.join(PRESETS)}")
    for key, allowed in _CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ValueError(f"config key {key} = {value!r} is not one of {', '.join(allowed)}")
    positive = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
                "train.micro_batches", "eval.batch_size", "eval.max_new_tokens")
    for key in positive:
        if _get(cfg, key) < 1:
            raise ValueError(f"config key {key} must be >= 1, got {_get(cfg, key)}")
    if cfg.train.steps < 0:
        raise ValueError(f"config key train.steps must be >= 0, got {cfg.train.steps}")
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if n % cfg.train.micro_batches:
        raise ValueError(
            f"train.micro_batches={cfg.train.micro_batches} must divide the rollout batch "
            f"(prompts_per_step x group_size = {n})"
        )


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"unknown config key {prefix}{unknown[0]}; valid keys{' in [' + where + ']' if where else ''}: "
            f"{', '.join(known)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = known[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ValueError(f"config key {key} must be a table, got {value!r}")
            kwargs[name] = _build(type(default), value, key)
        else:
            kwargs[name] = _coerce(key, value, default)
    return cls(**kwargs)


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check a value against its default's type (ints are accepted for floats)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"config key {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise ValueError(f"config key {key} must be a list of {len(default)} numbers, got {value!r}")
        return tuple(_coerce(key, v, d) for v, d in zip(value, default))
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key {key} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key {key} must be an integer, got {value!r}")
        return value
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"config key {key} must be a string, got {value!r}")
    return value


def from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, data, "")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing file or bad TOML is an error naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: invalid TOML: {e}") from e


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults, then the TOML file (if any), then dotted-key overrides."""
    cfg = from_dict(read_toml(path) if path is not None else {})
    return cfg.replace(**overrides) if overrides else cfg


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with a TOML value (`train.lr=1e-4`, `flow="bf16"` or `flow=bf16`)."""
    if "=" not in text:
        raise ValueError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    return key.strip(), value


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
