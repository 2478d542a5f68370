"""Precision flows: which GEMMs and tensors run in FP8 (docs/design.md section 4).

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

A flow is resolved once, by ``resolve_plan``, into a ``FlowPlan``: per phase
("rollout", "train") the ``LinearPlan`` of every converted linear (each GEMM's
precision, the gradient transport, the scale format, the backend, the weight
forms to keep), the ``AttentionPlan`` (K/V storage, Q/P storage) and the
``HeadPlan`` of the LM head. ``apply_flow`` puts a model under a flow:
``convert_linears`` swaps every ``nn.Linear`` for an ``FP8Linear`` (every flow,
``bf16`` included, goes through that one code path), and the attention and
head modules get their plans. ``phase`` switches the linears between the
rollout and the training plan; ``refresh_weights`` requantizes the weights
once per optimizer step. This is the only place that reads a flow's fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch.nn as nn

from fp8rl.fp8.backends import BACKENDS, Backend, get_backend, resolve_backend
from fp8rl.fp8.formats import AMAX_FLOORS, SCALE_FORMATS
from fp8rl.fp8.linear import TRANSPORT_COUNTS, FP8Linear, LinearPlan

PHASES: tuple[str, ...] = ("train", "rollout")

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
    quantizer: whose convention the FP8 linears' input quantization follows:
        "fp8rl" (amax floor 1e-4) or "vllm" (2**-9: vLLM's activation quantizer,
        bit for bit; fp32 scales only), for a rollout engine that quantizes
        activations itself (formats.AMAX_FLOORS)
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
    quantizer: str = "fp8rl"
    high_precision: tuple[str, ...] = field(default=("embed_tokens", "lm_head", "norm"))

    def __post_init__(self) -> None:
        for f in PRECISION_FIELDS:
            _check_choice(f, getattr(self, f), PRECISIONS)
        _check_choice("scale_fmt", self.scale_fmt, SCALE_FORMATS)
        _check_choice("quantizer", self.quantizer, tuple(AMAX_FLOORS))
        if self.quantizer == "vllm" and self.scale_fmt != "fp32":
            raise ValueError(
                "PrecisionFlow.quantizer 'vllm' needs scale_fmt 'fp32': vLLM's UE8M0 activation scales are "
                "rounded up before its floor, which no amax floor reproduces"
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"PrecisionFlow.name must be a non-empty string, got {self.name!r}")
        hp = self.high_precision
        if isinstance(hp, str) or not all(isinstance(s, str) and s for s in hp):
            raise ValueError(f"PrecisionFlow.high_precision must be a sequence of non-empty strings, got {hp!r}")
        object.__setattr__(self, "high_precision", tuple(hp))  # lists from TOML become tuples

    @property
    def needs_calibration(self) -> bool:
        """True when Q/K/V are stored in FP8 (FP8 KV cache or FP8 attention), whose
        static scales are calibrated before the first rollout and after every step."""
        return self.kv_cache == "fp8" or self.attention == "fp8"

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


# --- the resolved plan -------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """Attention numerics of every layer.

    kv: storage of K and V (the KV cache, and the training forward's own K/V):
        "fp32" (no flow), "bf16" or "fp8" (E4M3 with calibrated per-head scales)
    qp: storage of Q and of the softmax probabilities P: "fp32", "bf16", or
        "fp8" (Q with its calibrated scale, P with the fixed scale 1/448)
    backend: whose attention products run
    """

    kv: str
    qp: str
    backend: Backend


@dataclass(frozen=True)
class HeadPlan:
    """LM head numerics: precision "fp32" (a plain FP32 linear, no flow) or "bf16"
    (BF16 operands, the backend's batch-invariant head GEMMs)."""

    precision: str
    backend: Backend


# A model with no flow applied: the full-precision reference.
FULL_PRECISION_ATTENTION = AttentionPlan("fp32", "fp32", BACKENDS["reference"])
FULL_PRECISION_HEAD = HeadPlan("fp32", BACKENDS["reference"])


@dataclass(frozen=True)
class FlowPlan:
    """A flow resolved for one backend, plus what ``apply_flow`` converted.

    linear:    phase ("train" | "rollout") -> the LinearPlan of every converted linear
    attention: the AttentionPlan of every attention layer
    head:      the HeadPlan of the LM head
    converted: qualified names of the nn.Linear modules now FP8Linear, in module order
    skipped:   qualified name -> reason, for the nn.Linear modules left as they are
    """

    flow: PrecisionFlow
    backend: Backend
    linear: dict[str, LinearPlan]
    attention: AttentionPlan
    head: HeadPlan
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def resolve_plan(flow: PrecisionFlow, backend: Backend | str) -> FlowPlan:
    """Resolve ``flow`` on ``backend`` (a Backend or a registry name; "auto"
    needs a model to choose for: ``convert_linears`` / ``apply_flow`` resolve it)."""
    b = get_backend(backend)
    fprop = {"rollout": flow.rollout_linear, "train": flow.train_fprop}
    forms = frozenset((flow.rollout_linear, flow.train_fprop, flow.train_dgrad))
    linear = {
        ph: LinearPlan(fprop[ph], flow.train_dgrad, flow.train_wgrad, flow.grad_transport, flow.scale_fmt, b, forms,
                       AMAX_FLOORS[flow.quantizer])
        for ph in PHASES
    }
    attention = AttentionPlan(flow.kv_cache, "fp8" if flow.attention == "fp8" else "bf16", b)
    return FlowPlan(flow, b, linear, attention, HeadPlan("bf16", b))


def _skip_reason(name: str, linear: nn.Linear, flow: PrecisionFlow) -> str | None:
    for keep in flow.high_precision:
        if keep in name:
            return f"high_precision: name contains {keep!r}"
    for dim in ("in_features", "out_features"):
        size = getattr(linear, dim)
        if size % DIM_MULTIPLE != 0 or size == 0:
            return f"{dim}={size} is not a positive multiple of {DIM_MULTIPLE} (FP8 GEMM kernels need that)"
    return None


def convert_linears(module: nn.Module, flow: PrecisionFlow | str, backend: Backend | str = "auto") -> FlowPlan:
    """Replace, in place, every ``nn.Linear`` inside ``module`` by an ``FP8Linear``
    sharing its parameters, under the training plan of ``flow``; returns the
    plan with ``converted`` and ``skipped`` filled in, and records it as
    ``module.flow_plan`` (what ``phase`` reads).

    Left alone (reported in ``skipped`` with the reason): layers whose qualified
    name contains one of ``flow.high_precision``, layers with a dimension that
    is not a positive multiple of 16, and subclasses of nn.Linear. Any other
    shape works, partial 128-blocks included (SmolLM2: 576 = 4.5 x 128).
    ``module`` itself is never replaced (a bare nn.Linear has no parent to put
    the new layer into). ``backend="auto"``: ``choose_backend`` for this module.
    """
    flow = get_flow(flow) if isinstance(flow, str) else flow
    plan = resolve_plan(flow, resolve_backend(backend, module))
    converted: list[str] = []
    skipped: dict[str, str] = {}
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
            skipped[qual] = reason
            continue
        setattr(parent, child_name, FP8Linear.from_linear(linear, plan.linear["train"], name=qual))
        converted.append(qual)
    plan = dataclasses.replace(plan, converted=converted, skipped=skipped)
    module.flow_plan = plan
    return plan


def apply_flow(
    model: nn.Module, flow: PrecisionFlow | str, backend: Backend | str = "auto", quantize: bool = True
) -> FlowPlan:
    """Put ``model`` under a precision flow, in place, and return the resolved plan.

    ``flow``: a PrecisionFlow or a preset name; ``backend``: "auto"
    (``choose_backend``), a registry name or a Backend. Linears (except
    ``flow.high_precision`` ones) become FP8Linear; every submodule with an
    ``attention_plan`` attribute (the attention layers) gets the flow's
    AttentionPlan, every one with a ``head_plan`` (the model) its HeadPlan,
    every one with a ``router_backend`` (MoE routers, kept in FP32) the backend,
    every one with ``fused_pointwise`` (RMSNorm, MLP) the backend's choice of kernels.
    The weights are quantized here, once; with ``quantize=False`` each linear's on first
    use instead (its forward, or ``FP8Linear.release_weight``), so that a data-parallel
    rank, which releases the FP32 weights one linear at a time, never holds all of them
    and all their quantized forms at once.
    """
    if getattr(model, "flow_plan", None) is not None:
        raise ValueError(f"a precision flow ({model.flow_plan.flow.name}) is already applied to this model")
    plan = convert_linears(model, flow, backend)
    for m in model.modules():
        if hasattr(m, "attention_plan"):
            m.attention_plan = plan.attention
        if hasattr(m, "head_plan"):
            m.head_plan = plan.head
        if hasattr(m, "router_backend"):  # MoE routers stay FP32, on the backend's invariant product
            m.router_backend = plan.backend
        if hasattr(m, "fused_pointwise"):  # RMSNorm, MLP: kernels.c's loops or torch's ops
            m.fused_pointwise = plan.backend.fused_pointwise
    if quantize:
        refresh_weights(model)
    return plan


def fp8_linears(module: nn.Module) -> Iterator[FP8Linear]:
    """Every FP8Linear inside ``module`` (itself included)."""
    return (m for m in module.modules() if isinstance(m, FP8Linear))


@contextlib.contextmanager
def phase(module: nn.Module, name: str) -> Iterator[nn.Module]:
    """``with phase(model, "rollout"): ...`` runs the block with every FP8Linear
    on that phase's plan and restores each layer's previous plan afterwards
    (also on error). A module with no flow applied runs as it is."""
    if name not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(map(repr, PHASES))}; got {name!r}")
    plan: FlowPlan | None = getattr(module, "flow_plan", None)
    previous = [(layer, layer.plan) for layer in fp8_linears(module)]
    if plan is None and previous:
        raise ValueError("this module holds FP8Linear layers but no flow_plan; convert it with apply_flow")
    try:
        for layer, _ in previous:
            layer.plan = plan.linear[name]
        yield module
    finally:
        for layer, old in previous:
            layer.plan = old


def refresh_weights(module: nn.Module) -> int:
    """Requantize every FP8Linear's weight from its master weight (call once
    after each optimizer step); returns how many layers were refreshed."""
    n = 0
    for layer in fp8_linears(module):
        layer.refresh_weight()
        n += 1
    return n


def take_grad_transport_counts(module: nn.Module) -> dict[str, list[float]]:
    """The TRANSPORT_COUNTS of every decoder layer's FP8Linears since the last
    call, ``{"layer{i}": [entries, nonzero, flushed, saturated]}`` (the gradient
    leaving layer i's linears; other linears under ``"other"``), then the counts
    restart. Empty when no gradient travelled in FP8 (only ``fp8-grads`` sends
    it so). Plain lists, so ranks can gather them for ``grad_transport_stats``."""
    per_linear = []
    for layer in fp8_linears(module):
        counts = layer.transport_counts.tolist()
        layer.transport_counts.zero_()
        if counts[0]:
            found = re.search(r"layers\.(\d+)\.", layer.name)
            per_linear.append({f"layer{found.group(1)}" if found else "other": counts})
    return _summed(per_linear)


def _summed(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Count lists added key by key."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, counts in part.items():
            out[key] = [a + b for a, b in zip(out.get(key, [0.0] * len(counts)), counts)]
    return out


def grad_transport_stats(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Metrics of the ranks' ``take_grad_transport_counts`` (summed over ranks):
    ``grad_flushed_frac``, the share of nonzero gradient entries that arrived
    as zero (below the smallest E4M3 subnormal of their 1x128 block's scale:
    the underflow that makes FP8 gradients stall or collapse training);
    ``grad_saturated_frac``, the share of all entries sent that were clamped to
    their block's largest FP8 value; ``grad_flushed_frac.layer{i}`` per layer.
    Empty when nothing was counted."""
    counts = _summed(per_rank)
    if not counts:
        return {}
    entries, nonzero, flushed, saturated = map(sum, zip(*counts.values()))
    stats = {"grad_flushed_frac": flushed / max(nonzero, 1.0), "grad_saturated_frac": saturated / max(entries, 1.0)}
    for key in sorted(counts, key=lambda k: (k == "other", int(k[5:]) if k != "other" else 0)):
        stats[f"grad_flushed_frac.{key}"] = counts[key][2] / max(counts[key][1], 1.0)
    return stats
