"""Run configuration: frozen dataclasses, read from TOML, one source of truth.

A config file has top-level keys (`seed`, `task`, `flow`, `out`, `model`, ...)
and one table per section: the training run's (`[rollout]`, `[train]`,
`[eval]`, `[checkpoint]`, `[calibration]`) and one per other command
(`[mismatch]`, `[sft]`, `[export]`, `[bench]`, `[compare]`). Every command
reads the same file, with one precedence: dataclass defaults < the command's
own defaults < the TOML file < `--set KEY=VALUE` < flags. Every key is
optional; unknown keys are errors that name them. The resolved config is
printed at start and saved as `config.json` in the run directory and beside
every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

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
    # who samples: "fp8rl" (the built-in engine, every flow) or "vllm" (a vLLM engine in
    # this process, refit with the policy's weights every step; BF16 flows for now)
    engine: str = "fp8rl"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 80
    lr: float = 5e-5
    lr_schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    micro_batches: int = 2  # optimizer steps per rollout batch (PPO epochs over minibatches)
    # behaviour log-probs of the later micro-batches' rows: "all" = the training forward re-scores
    # every row; "verified" = the rollout's, in a step where the first micro-batch's re-scored
    # log-probs (and experts) equal the rollout's bit for bit, else re-scored as with "all"
    rescore: str = "verified"
    # backward passes per micro-batch (whole prompt groups each); its gradient is their exact
    # float64 sum, and data-parallel ranks split them: N ranks need a multiple of N
    grad_chunks: int = 1
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
class CalibrationConfig:
    """Static FP8 Q/K/V scales: percentile of the per-token amax, times margin, / 448."""

    percentile: float = 99.9
    margin: float = 1.05

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"calibration percentile must be in (0, 100], got {self.percentile}")
        if self.margin <= 0:
            raise ValueError(f"calibration margin must be > 0, got {self.margin}")


@dataclass(frozen=True)
class MismatchConfig:
    prompts: int = 16  # held-out problems
    samples: int = 4  # samples per problem
    max_new_tokens: int = 64
    temperature: float = 1.0


@dataclass(frozen=True)
class SFTConfig:
    """`fp8rl sft`; its seed is the top-level `seed`."""

    steps: int = 230
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    # Share of training solutions whose final line answers with the first step's
    # result instead of the last one ("stopping early"): a bad habit, learned on
    # purpose by the built-in tiny policy so that RL has something clear to fix.
    early_answer_noise: float = 0.0
    eval_n: int = 500  # held-out problems evaluated at the end
    # Backend of the attention products while training: "reference" (float64, how the
    # built-in policies were made) or a batch-invariant FP32 one ("cpu", "amx"), for long
    # solutions (tiny-chain's, up to ~330 tokens), where float64 attention dominates a step.
    attention_backend: str = "reference"
    max_new_tokens: int = 48  # generation budget of that evaluation
    # tiny-policy architecture (used only when building from scratch)
    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    # 0: the dense Llama-style policy (tiny-arith); N > 0: a Mixtral-style mixture of
    # N experts (each `intermediate_size` wide, `num_experts_per_tok` per token) in
    # every layer (the built-in tiny-moe)
    num_experts: int = 0
    num_experts_per_tok: int = 2


@dataclass(frozen=True)
class ExportConfig:
    format: str = "hf"  # "hf" | "fp8-block"
    scale_fmt: str = "fp32"  # fp8-block scales: "fp32" | "ue8m0"
    dtype: str = "float32"  # hf tensors: "float32" (an exact copy) | "bfloat16"


@dataclass(frozen=True)
class BenchConfig:
    flows: tuple[str, ...] = ("bf16", "jet", "jet-kv")
    batch: int = 32  # sequences per rollout
    max_new_tokens: int = 48  # tokens per sequence


@dataclass(frozen=True)
class CompareConfig:
    flows: tuple[str, ...] = ("bf16", "fp8-rollout", "jet", "jet-e2e", "jet-kv", "fp8-grads")  # every preset
    seeds: tuple[int, ...] = (0, 1, 2)
    # A swept knob: each entry is a label, then the settings that differ at that point
    # ("long task=chain:min_times=24,max_times=32 rollout.max_new_tokens=352"); the
    # flows x seeds grid runs once per entry, into `out`/<label>. Empty: one grid.
    sweep: tuple[str, ...] = ()


# Sections that configure one command other than `train`; they never change a
# training run (a run directory's identity is the rest of its config).
COMMAND_SECTIONS: tuple[str, ...] = ("mismatch", "sft", "export", "bench", "compare")


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny-arith"  # built-in name, HF folder or .gguf file
    task: str = "arith"  # "arith", "gsm8k:PATH", "reasoning-gym:NAME"
    flow: str = "jet"  # a preset of fp8rl.precision.PRESETS
    backend: str = "auto"  # GEMM backend: "auto" or a name from fp8rl.fp8.backends.BACKENDS
    seed: int = 0
    out: str = "runs/default"
    system_prompt: str = ""  # chat models only
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> "RunConfig":
        """Override with dotted keys: `cfg.replace(**{"train.lr": 1e-4, "flow": "bf16"})`."""
        return from_dict(_merge(self.to_dict(), _nest(overrides)))


# Keys with a fixed set of values (the CLI gives these to argparse as `choices`).
# `backend` is checked against the backend registry instead, in `validate`.
CHOICES: dict[str, tuple[str, ...]] = {
    "rollout.engine": ("fp8rl", "vllm"),
    "train.lr_schedule": ("constant", "cosine"),
    "train.correction": ("none", "tis", "icepop", "seq-mask-tis"),
    "train.rescore": ("all", "verified"),
    "export.format": ("hf", "fp8-block"),
    "export.scale_fmt": ("fp32", "ue8m0"),
    "export.dtype": ("float32", "bfloat16"),
}


_FLOAT32_MAX = 3.4028234663852886e38


def _finite(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX  # values land in float32 tensors


# Value ranges checked when a config is built, so a bad value fails before any
# file is written: key -> (the rule in words, the check).
RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "rollout.group_size": (">= 2 (GRPO compares the samples of a group; one sample has advantage 0)",
                           lambda v: v >= 2),
    "rollout.temperature": ("a finite number >= 0 (0 = greedy)", lambda v: _finite(v) and v >= 0),
    "rollout.top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "rollout.top_k": (">= 0 (0 = off)", lambda v: v >= 0),
    "train.steps": (">= 0", lambda v: v >= 0),
    "train.lr": ("a positive number that fits float32", lambda v: _finite(v) and v > 0),
    "train.warmup_steps": (">= 0", lambda v: v >= 0),
    "train.weight_decay": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "train.betas": ("two numbers in [0, 1)", lambda v: all(0 <= b < 1 for b in v)),
    "train.grad_clip": ("a finite number > 0", lambda v: _finite(v) and v > 0),
    "train.eps_low": ("in [0, 1)", lambda v: 0 <= v < 1),
    "train.eps_high": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "train.kl_coef": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "train.is_cap": ("a finite number > 0", lambda v: _finite(v) and v > 0),
    "train.is_lo": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "train.is_hi": ("a finite number > 0", lambda v: _finite(v) and v > 0),
    "train.max_bad_steps": (">= 1", lambda v: v >= 1),
    "eval.every": (">= 0 (0 = only before and after)", lambda v: v >= 0),
    "eval.n": (">= 0 (0 = no evaluation)", lambda v: v >= 0),
    "eval.temperature": ("a finite number >= 0 (0 = greedy)", lambda v: _finite(v) and v >= 0),
    "checkpoint.every": (">= 0 (0 = only at the end)", lambda v: v >= 0),
    "checkpoint.keep_last": (">= 1 (the last checkpoint is what --resume continues from)", lambda v: v >= 1),
    "mismatch.temperature": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
}


def validate(cfg: RunConfig) -> None:
    from fp8rl.fp8.backends import BACKENDS  # lazily: the registry imports torch
    from fp8rl.precision import PRESETS

    if cfg.flow not in PRESETS:
        raise ValueError(f"unknown flow {cfg.flow!r}; valid presets: {', '.join(PRESETS)}")
    for key in ("bench.flows", "compare.flows"):
        flows = _get(cfg, key)
        if not flows:
            raise ValueError(f"config key {key} (--flows) names no flow; valid presets: {', '.join(PRESETS)}")
        unknown = [f for f in flows if f not in PRESETS]
        if unknown:
            raise ValueError(f"unknown flow {unknown[0]!r} in {key} (--flows); valid presets: {', '.join(PRESETS)}")
    if not cfg.compare.seeds:
        raise ValueError("config key compare.seeds (--seeds) names no seed")
    labels = [label for label, _ in sweep_points(cfg.compare.sweep)]
    if len(set(labels)) < len(labels):
        raise ValueError(f"config key compare.sweep: labels repeat: {labels}")
    backends = ("auto", *BACKENDS)
    for key, allowed in (*CHOICES.items(), ("backend", backends), ("sft.attention_backend", tuple(BACKENDS))):
        value = _get(cfg, key)
        if value not in allowed:
            raise ValueError(f"config key {key} = {value!r} is not one of {', '.join(allowed)}")
    positive = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
                "train.micro_batches", "train.grad_chunks", "eval.batch_size", "eval.max_new_tokens",
                "mismatch.prompts", "mismatch.samples", "mismatch.max_new_tokens",
                "sft.steps", "sft.batch_size", "sft.max_new_tokens", "bench.batch", "bench.max_new_tokens")
    for key in positive:
        if _get(cfg, key) < 1:
            raise ValueError(f"config key {key} must be >= 1, got {_get(cfg, key)}")
    for key, (rule, ok) in RANGES.items():
        value = _get(cfg, key)
        if not ok(value):
            raise ValueError(f"config key {key} must be {rule}, got {value!r}")
    step_size = cfg.train.lr / (1 - cfg.train.betas[0])  # AdamW's first step size, computed in float32
    if not _finite(step_size):
        raise ValueError(
            f"config key train.lr = {cfg.train.lr!r} is too large: AdamW's first step size "
            f"lr / (1 - betas[0]) = {step_size:.3g} overflows float32"
        )
    if cfg.train.is_lo > cfg.train.is_hi:
        raise ValueError(f"config keys train.is_lo = {cfg.train.is_lo} and train.is_hi = {cfg.train.is_hi}: need is_lo <= is_hi")
    if cfg.rollout.prompts_per_step % cfg.train.micro_batches:
        # micro-batches and gradient chunks hold whole prompt groups (docs/design.md section 11)
        raise ValueError(
            f"train.micro_batches={cfg.train.micro_batches} must divide the rollout batch's prompt groups "
            f"(rollout.prompts_per_step = {cfg.rollout.prompts_per_step})"
        )
    if (cfg.rollout.prompts_per_step // cfg.train.micro_batches) % cfg.train.grad_chunks:
        raise ValueError(
            f"train.grad_chunks={cfg.train.grad_chunks} must divide a micro-batch's prompt groups "
            f"(rollout.prompts_per_step / train.micro_batches = {cfg.rollout.prompts_per_step // cfg.train.micro_batches})"
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
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(known))
    if unknown and not where:
        _suggest_section(unknown[0])
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
            kwargs[name] = _coerce(key, value, default, hints[name])
    return cls(**kwargs)


def _suggest_section(key: str) -> None:
    """A top-level key that is a section's key (the old flat sft/export files had
    `steps = 300`, `format = "fp8-block"`): say where it lives now."""
    homes = [f.name for f in fields(RunConfig)
             if f.default_factory is not dataclasses.MISSING and key in {g.name for g in fields(f.default_factory)}]
    if homes:
        where = " or ".join(f"{s}.{key} ([{s}] section)" for s in homes)
        raise ValueError(f"unknown config key {key}; did you mean {where}?")


def _coerce(key: str, value: Any, default: Any, hint: Any = None) -> Any:
    """Check a value against its default's type (ints are accepted for floats);
    `tuple[X, ...]` fields take a list of any length."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"config key {key} must be true or false, got {value!r}")
        return value
    args = typing.get_args(hint)
    if isinstance(default, tuple) and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key {key} must be a list, got {value!r}")
        return tuple(_coerce(key, v, args[0]()) for v in value)  # args[0]() is a default of the element type
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


def sweep_points(entries: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """`compare.sweep` entries -> [(label, {dotted key: value})]: the first word of
    an entry is its label (a folder name), the rest `key=value` words (TOML values,
    as `--set` takes them). The keys are checked when a point's config is built."""
    points = []
    for entry in entries:
        label, *words = entry.split()
        if not label or "=" in label or "/" in label or label.startswith("."):
            raise ValueError(f"config key compare.sweep: entry {entry!r} must start with a label (a folder name)")
        if not words:
            raise ValueError(f"config key compare.sweep: entry {entry!r} sets nothing after its label")
        points.append((label, dict(parse_override(w) for w in words)))
    return points


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


def load_config(
    path: str | Path | None,
    overrides: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> RunConfig:
    """Dataclass defaults < `defaults` (a command's own, dotted keys) < the TOML
    file (if any) < `overrides` (dotted keys). Validated once, as a whole."""
    data = _nest(defaults or {})
    if path is not None:
        data = _merge(data, read_toml(path))
    return from_dict(_merge(data, _nest(overrides or {})))


def default_values() -> dict[str, Any]:
    """Every config key (dotted) with its dataclass default, without building
    (and so validating, which imports torch) a RunConfig: for flag help texts."""
    out: dict[str, Any] = {}
    for f in fields(RunConfig):
        if f.default_factory is dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out.update({f"{f.name}.{k}": v for k, v in dataclasses.asdict(f.default_factory()).items()})
    return out


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
    """Write `cfg` as JSON atomically: a reader (or a resume after a kill) sees the
    old file or the new one, never a part."""
    from fp8rl.runlog import atomic_write_text

    atomic_write_text(Path(path), json.dumps(cfg.to_dict(), indent=2) + "\n")
