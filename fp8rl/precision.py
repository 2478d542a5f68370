"""Precision flows: which GEMMs and tensors run in FP8 (DESIGN.md section 4).

A ``PrecisionFlow`` names the precision of every place where the rollout and
the training step could quantize. The six presets reproduce the published
recipes side by side:

    preset       rollout  fprop  dgrad/wgrad  grads between ops  KV / attention
    bf16         bf16     bf16   bf16         bf16               bf16
    fp8-rollout  fp8      bf16   bf16         bf16               bf16
    jet          fp8      fp8    bf16         bf16               bf16   (default)
    jet-e2e      fp8      fp8    fp8          bf16               bf16
    jet-kv       fp8      fp8    fp8          bf16               fp8
    fp8-grads    fp8      fp8    fp8          fp8                bf16

``convert_linears`` puts an ``FP8Linear`` in place of every ``nn.Linear`` of a
model (every flow, ``bf16`` included, goes through that one code path);
``set_phase`` / ``phase`` switch the layers between rollout and training
precision; ``refresh_weights`` requantizes the weights once per optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

import torch.nn as nn

from fp8rl.fp8.formats import SCALE_FORMATS
from fp8rl.fp8.linear import PHASES, FP8Linear

PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
PRECISION_FIELDS: tuple[str, ...] = (
    "rollout_linear", "train_fprop", "train_dgrad", "train_wgrad", "grad_transport", "kv_cache", "attention",
)

# Multiple of 16: what FP8 tensor-core GEMMs (cuBLASLt, DeepGEMM) need of
# every dimension. CPU paths handle any shape (partial blocks), but a layer the
# GPU kernels could not run is better left in BF16 everywhere, so that a flow
# means the same on every device.
DIM_MULTIPLE = 16


@dataclass(frozen=True)
class PrecisionFlow:
    """Precision of every quantization point; field defaults are the ``jet`` preset.

    rollout_linear, train_fprop, train_dgrad, train_wgrad: "bf16" | "fp8"
    grad_transport: "bf16" | "fp8", dtype of activation gradients between ops
    kv_cache, attention: "bf16" | "fp8"
    scale_fmt: "fp32" | "ue8m0"
    high_precision: substrings of module names kept in BF16 (never converted)
    """

    name: str = "jet"
    rollout_linear: str = "fp8"
    train_fprop: str = "fp8"
    train_dgrad: str = "bf16"
    train_wgrad: str = "bf16"
    grad_transport: str = "bf16"
    kv_cache: str = "bf16"
    attention: str = "bf16"
    scale_fmt: str = "fp32"
    high_precision: tuple[str, ...] = field(default=("embed_tokens", "lm_head", "norm"))

    def __post_init__(self) -> None:
        for f in PRECISION_FIELDS:
            _check_choice(f, getattr(self, f), PRECISIONS)
        _check_choice("scale_fmt", self.scale_fmt, SCALE_FORMATS)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"PrecisionFlow.name must be a non-empty string, got {self.name!r}")
        hp = self.high_precision
        if isinstance(hp, str) or not all(isinstance(s, str) and s for s in hp):
            raise ValueError(f"PrecisionFlow.high_precision must be a sequence of non-empty strings, got {hp!r}")
        object.__setattr__(self, "high_precision", tuple(hp))  # lists from TOML become tuples

    def replace(self, **changes) -> "PrecisionFlow":
        """A copy with ``changes`` applied and validated (the name is kept unless given)."""
        return dataclasses.replace(self, **changes)


def _check_choice(field_name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"PrecisionFlow.{field_name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


_JET = PrecisionFlow(name="jet")
_E2E = _JET.replace(name="jet-e2e", train_dgrad="fp8", train_wgrad="fp8")

PRESETS: dict[str, PrecisionFlow] = {
    "bf16": _JET.replace(name="bf16", rollout_linear="bf16", train_fprop="bf16"),
    "fp8-rollout": _JET.replace(name="fp8-rollout", train_fprop="bf16"),
    "jet": _JET,
    "jet-e2e": _E2E,
    "jet-kv": _E2E.replace(name="jet-kv", kv_cache="fp8", attention="fp8"),
    "fp8-grads": _E2E.replace(name="fp8-grads", grad_transport="fp8"),
}


def get_flow(name: str) -> PrecisionFlow:
    """The preset called ``name``; ValueError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown precision flow {name!r}; valid presets: {', '.join(PRESETS)}") from None


@dataclass
class ConversionReport:
    """What ``convert_linears`` did.

    converted: qualified names of the nn.Linear modules now FP8Linear, in
               module order
    skipped:   qualified name -> reason, for the nn.Linear modules left as they are
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _skip_reason(name: str, linear: nn.Linear, flow: PrecisionFlow) -> str | None:
    for keep in flow.high_precision:
        if keep in name:
            return f"high_precision: name contains {keep!r}"
    for dim in ("in_features", "out_features"):
        size = getattr(linear, dim)
        if size % DIM_MULTIPLE != 0 or size == 0:
            return f"{dim}={size} is not a positive multiple of {DIM_MULTIPLE} (FP8 GEMM kernels need that)"
    return None


def convert_linears(module: nn.Module, flow: PrecisionFlow, backend: str | None = None) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` inside ``module`` by an ``FP8Linear``
    sharing its parameters.

    Left alone (reported in ``skipped`` with the reason): layers whose qualified
    name contains one of ``flow.high_precision``, layers with a dimension that
    is not a positive multiple of 16, and subclasses of nn.Linear. Any other
    shape works, partial 128-blocks included (SmolLM2: 576 = 4.5 x 128).
    ``module`` itself is never replaced (a bare nn.Linear has no parent to put
    the new layer into).
    """
    report = ConversionReport()
    # Collect first: swapping children while iterating named_modules is unsafe.
    targets = []
    for parent_name, parent in module.named_modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                qual = f"{parent_name}.{child_name}" if parent_name else child_name
                targets.append((parent, child_name, qual, child))
    for parent, child_name, qual, linear in targets:
        reason = _skip_reason(qual, linear, flow)
        if reason is None and type(linear) is not nn.Linear:
            # A subclass may have its own forward (or, like MultiheadAttention's
            # out_proj, be read as weights by its parent): leave it alone.
            reason = f"{type(linear).__name__} is a subclass of nn.Linear, not nn.Linear"
        if reason is not None:
            report.skipped[qual] = reason
            continue
        setattr(parent, child_name, FP8Linear.from_linear(linear, flow, backend=backend, name=qual))
        report.converted.append(qual)
    return report


def fp8_linears(module: nn.Module) -> Iterator[FP8Linear]:
    """Every FP8Linear inside ``module`` (itself included)."""
    return (m for m in module.modules() if isinstance(m, FP8Linear))


def set_phase(module: nn.Module, phase: str) -> int:
    """Set ``.phase`` ("train" or "rollout") on every FP8Linear; returns how many."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(map(repr, PHASES))}; got {phase!r}")
    n = 0
    for layer in fp8_linears(module):
        layer.phase = phase
        n += 1
    return n


@contextlib.contextmanager
def phase(module: nn.Module, name: str) -> Iterator[nn.Module]:
    """``with phase(model, "rollout"): ...`` runs the block in that phase and
    restores every layer's previous phase afterwards (also on error)."""
    if name not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(map(repr, PHASES))}; got {name!r}")
    previous = [(layer, layer.phase) for layer in fp8_linears(module)]
    try:
        for layer, _ in previous:
            layer.phase = name
        yield module
    finally:
        for layer, old in previous:
            layer.phase = old


def refresh_weights(module: nn.Module) -> int:
    """Requantize every FP8Linear's weight from its master weight (call once
    after each optimizer step); returns how many layers were refreshed."""
    n = 0
    for layer in fp8_linears(module):
        layer.refresh_weight()
        n += 1
    return n
