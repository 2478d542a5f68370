"""FP8Linear: an nn.Linear whose three GEMMs follow a resolved LinearPlan.

For ``y = x W^T + b`` with x ``[T, K]`` (T tokens, any leading dims folded in),
W ``[N, K]``, the three GEMMs of a linear layer are

    fprop  y  = x  @ W^T     [T, N]   FP8: quantize(x, 1x128) . qweight (128x128)
    dgrad  dx = dy @ W       [T, K]   FP8: quantize(dy, 1x128) . qweight.t()
    wgrad  dW = dy^T @ x     [N, K]   FP8: dy and x requantized along tokens (128x1)

Each runs in FP8 or BF16 as the layer's ``plan`` says; the GEMMs themselves
are the plan's backend's (fp8rl/fp8/backends.py). The plan is resolved from a
precision flow by fp8rl/precision.py, which also swaps it between the rollout
and the training forward: this layer knows neither flows nor phases.

Weights are quantized once per optimizer step: ``refresh_weight()`` builds
the forms ``plan.weight_forms`` asks for, ``qweight`` (a 128x128-block
QTensor) and ``weight_bf16``, and every forward, whatever its plan, uses
those very objects (the FP8 dgrad too). That is what makes the rollout graph
a subgraph of the training graph. The forward refreshes lazily when the
master weight changed since (``weight._version`` / storage moved), so
forgetting to call ``refresh_weight`` costs time, never correctness.

The wgrad GEMM requantizes the *saved high-precision* x and dy (not the fprop
FP8 x): its blocks run along the token axis, which the fprop tiles do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fp8rl.fp8.backends import Backend
from fp8rl.fp8.formats import AMAX_FLOOR, get_format
from fp8rl.fp8.quant import DerivedCache, QTensor, dequantize, quantize

GEMM_PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
# The weight's FP8 blocks; their K width is also the forward input's 1 x 128 blocks.
WEIGHT_BLOCK = (128, 128)


@dataclass(frozen=True)
class LinearPlan:
    """What a linear layer computes, resolved from a flow (fp8rl.precision).

    fprop, dgrad, wgrad: "bf16" | "fp8", the precision of each GEMM
    grad_transport:      "bf16" | "fp8", dtype of the input gradient handed back
    scale_fmt:           "fp32" | "ue8m0", the FP8 scale format
    backend:             the Backend whose GEMMs run
    weight_forms:        the weight forms to keep ("fp8": ``qweight``, "bf16":
                         ``weight_bf16``); the same for every plan of a layer,
                         so that swapping plans never requantizes
    input_amax_floor:    amax floor of the FP8 forward's input quantization
                         (formats.AMAX_FLOORS: whose convention it follows)
    """

    fprop: str
    dgrad: str
    wgrad: str
    grad_transport: str
    scale_fmt: str
    backend: Backend
    weight_forms: frozenset[str]
    input_amax_floor: float = AMAX_FLOOR

    def __post_init__(self) -> None:
        for name in ("fprop", "dgrad", "wgrad", "grad_transport"):
            if getattr(self, name) not in GEMM_PRECISIONS:
                raise ValueError(f"LinearPlan.{name} must be one of {GEMM_PRECISIONS}, got {getattr(self, name)!r}")
        used = {self.fprop, self.dgrad}
        if not used <= self.weight_forms:
            raise ValueError(f"LinearPlan.weight_forms {sorted(self.weight_forms)} lacks {sorted(used)}")


@dataclass(frozen=True)
class _Call:
    """One forward call (and its backward): the plan and the weight forms it
    used, fixed at forward time so that the backward uses the same objects."""

    plan: LinearPlan
    qweight: QTensor | None
    weight_bf16: torch.Tensor | None
    bf16_caches: tuple[dict, dict]  # converted forms of weight_bf16 and of its transpose
    name: str
    transport_counts: torch.Tensor  # the layer's running TRANSPORT_COUNTS (an FP8 grad transport adds to it)


def _fprop(
    x: torch.Tensor, bias: torch.Tensor | None, call: _Call | None, xq: QTensor | torch.Tensor | None,
    product: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward GEMM: x ``[..., K]`` -> y ``[..., N]`` in x's dtype. The one
    code path of rollout, scoring and the training forward. ``xq``: x's FP8
    form (``_quantized_input``) if another linear of the same input made it;
    ``product``: the FP32 ``[T, N]`` GEMM result if a stacked call of the linears
    of this input made it (``Backend.fp8_linear_group``, the same bits; ``call``
    is then not read and may be None)."""
    if product is not None:
        y = product
    elif call is None:
        raise ValueError("_fprop needs the layer's call (plan and weight forms) to run its GEMM")
    elif call.plan.fprop == "fp8":
        plan = call.plan
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        y = plan.backend.fp8_linear(_quantized_input(x2, plan, call.name) if xq is None else xq, call.qweight)
    else:
        y = call.plan.backend.bf16_matmul(x.reshape(-1, x.shape[-1]), call.weight_bf16, call.bf16_caches[0])
    if bias is not None:
        y = y + bias.float()
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# What an FP8 gradient transport loses, summed over a layer's backward calls (float64 counts):
# entries sent, nonzero entries, nonzero entries flushed to zero (below half the smallest
# E4M3 subnormal of their block's scale), entries saturated (clamped to the block's largest
# FP8 value by more than rounding would move them: |x| / scale > max + half an ulp there;
# with amax-derived scales this stays 0, and is counted to show it).
TRANSPORT_COUNTS = ("entries", "nonzero", "flushed", "saturated")


def transport_losses(x: torch.Tensor, sent: torch.Tensor, q: QTensor) -> torch.Tensor:
    """float64 [4] of TRANSPORT_COUNTS for ``x`` [T, K] (FP32) sent as ``q``
    (1x128 blocks; ``sent`` = dequantize(q))."""
    f = get_format(q.fmt)
    top = f.max + 2.0 ** math.floor(math.log2(f.max)) * torch.finfo(f.dtype).eps / 2  # 464 for E4M3
    nonzero = x != 0
    limit = (q.scale * top).repeat_interleave(q.block[1], dim=-1)[..., : x.shape[-1]]
    return torch.stack([
        torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
        nonzero.sum().double(),
        (nonzero & (sent == 0)).sum().double(),
        (x.abs() > limit).sum().double(),
    ])


def _quantized_input(x2: torch.Tensor, plan: LinearPlan, name: str) -> QTensor | torch.Tensor:
    """The FP8 forward's input ``x2`` ``[T, K]`` quantized to 1x128 blocks, in the form
    the plan's backend multiplies (``Backend.linear_input``)."""
    return plan.backend.linear_input(x2, WEIGHT_BLOCK[1], plan.scale_fmt, f"{name} input", plan.input_amax_floor)


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: _Call,
        xq: QTensor | torch.Tensor | None, product: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x.reshape(-1, x.shape[-1]))
        ctx.call, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = call, x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return _fprop(x, bias, call, xq, product)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x2,) = ctx.saved_tensors
        call: _Call = ctx.call
        plan, backend, fmt = call.plan, call.plan.backend, call.plan.scale_fmt
        dy2 = dy.reshape(-1, dy.shape[-1]).float()  # [T, N]
        # Every backend's BF16 GEMM rounds its operands to BF16 first: dy is rounded once for
        # both (the same bits), not once per GEMM (a [T, N] pass each, per linear).
        dy_bf16 = dy2.bfloat16() if "bf16" in (plan.dgrad, plan.wgrad) else None
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if plan.dgrad == "fp8":
                qdy = backend.grad_operand(dy2, (1, 128), fmt, f"{call.name} grad_output")
                dx = backend.fp8_matmul(qdy, call.qweight.t(), torch.float32, invariant=False)  # [T, N] . [K, N]^T
            else:
                dx = backend.bf16_matmul(dy_bf16, call.weight_bf16.T, call.bf16_caches[1], invariant=False)
            if plan.grad_transport == "fp8":
                # The gradient handed to the previous op travels as 1x128 FP8.
                qdx = quantize(dx, (1, 128), scale_fmt=fmt, name=f"{call.name} grad_input")
                sent = dequantize(qdx)
                call.transport_counts.add_(transport_losses(dx, sent, qdx))
                dx = sent
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if plan.wgrad == "fp8":
                # Blocks of 128 tokens: (128, 1) on [T, N] and [T, K], i.e. 1x128
                # rows of their transposes, from the high-precision tensors.
                qdy_t = backend.grad_operand(dy2, (128, 1), fmt, f"{call.name} grad_output").t()
                qx_t = backend.grad_operand(x2, (128, 1), fmt, f"{call.name} input").t()
                dw = backend.fp8_matmul(qdy_t, qx_t, torch.float32, invariant=False)  # [N, T] . [K, T]^T
            else:
                dw = backend.bf16_matmul(dy_bf16.T, x2.T, {}, invariant=False)
            dw = dw.to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(ctx.b_dtype)  # FP32 sum over tokens
        return dx, dw, db, None, None, None


def released_weights_memo(module: nn.Module) -> dict[int, nn.Parameter]:
    """A ``copy.deepcopy`` memo for ``module`` that gives each released FP8Linear weight
    (``FP8Linear.release_weight``) a released Parameter of its shape in the copy: copying
    the weight itself would read its values from storage that holds none. The copied
    layer keeps the copied quantized forms (its ``release_weight()`` adopts them)."""
    memo: dict[int, nn.Parameter] = {}
    for layer in module.modules():
        if isinstance(layer, FP8Linear) and layer.weight_released:
            w = layer.weight
            twin = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=w.device), requires_grad=w.requires_grad)
            twin.untyped_storage().resize_(0)  # never written, so never resident
            memo[id(w)] = twin
    return memo


class FP8Linear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` (same parameters, same state_dict keys).

    weight: master weight Parameter ``[out_features, in_features]`` (shared
            with the nn.Linear it was made from, never copied)
    bias:   Parameter ``[out_features]`` or None
    plan:   the LinearPlan the next forward runs (set by fp8rl.precision)
    qweight:     cached 128x128-block QTensor of ``weight`` (None unless
                 ``plan.weight_forms`` holds "fp8")
    weight_bf16: cached BF16 copy of ``weight`` (None unless it holds "bf16")
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, plan: LinearPlan, name: str = "linear") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"{name}: weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
        self.weight = weight
        self.register_parameter("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.plan = plan
        self.name = name
        self.qweight: QTensor | None = None
        self.weight_bf16: torch.Tensor | None = None
        self._bf16_caches: tuple[dict, dict] = (DerivedCache(), DerivedCache())
        self._cache_key: tuple | None = None
        self.transport_counts = torch.zeros(len(TRANSPORT_COUNTS), dtype=torch.float64, device=weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan: LinearPlan, name: str = "linear") -> "FP8Linear":
        """Wrap ``linear``'s own Parameter objects (no copy) in an FP8Linear."""
        return cls(linear.weight, linear.bias, plan, name=name)

    def _key(self) -> tuple:
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape), self.plan.weight_forms, self.plan.scale_fmt)

    @torch.no_grad()
    def refresh_weight(self) -> None:
        """Requantize the weight caches from the master weight (once per optimizer step)."""
        if self.weight_released:
            raise RuntimeError(
                f"{self.name}: its FP32 weight was released (only its quantized forms are kept), so it "
                f"cannot be requantized; restore_weight() and fill the weight first"
            )
        forms = self.plan.weight_forms
        w = self.weight.detach()
        self.qweight = (
            quantize(w, WEIGHT_BLOCK, scale_fmt=self.plan.scale_fmt, name=f"{self.name}.weight") if "fp8" in forms else None
        )
        self.weight_bf16 = w.bfloat16() if "bf16" in forms else None
        self._bf16_caches = (DerivedCache(), DerivedCache())  # new dicts: a running backward keeps the old ones
        self._cache_key = self._key()

    @property
    def weight_released(self) -> bool:
        """True between ``release_weight()`` and ``restore_weight()``."""
        return self.weight.untyped_storage().nbytes() == 0 and self.weight.numel() > 0

    @torch.no_grad()
    def release_weight(self) -> None:
        """Free the FP32 weight's memory and keep only its quantized forms
        (``qweight`` / ``weight_bf16``), which are all that the forward and the
        backward of every plan read; the Parameter keeps its shape, so autograd
        still gives it a gradient. For a copy whose weights another tensor holds
        (a data-parallel rank's compute model: the FSDP2 master shards) or never
        changes (the frozen KL reference). Quantizes first if the forms are stale. A weight
        released already keeps the forms it has: they came from it before its release (or,
        in a deep copy of a released layer, from the weight it copies)."""
        if not self.weight_released:
            self.ensure_fresh()
            self.weight.untyped_storage().resize_(0)
        self._cache_key = self._key()  # the released weight is the one these forms came from

    @torch.no_grad()
    def restore_weight(self) -> None:
        """Give a released weight its memory back (uninitialized: the caller fills
        it, then ``refresh_weight()``). Its quantized forms are dropped (the next
        forward or release quantizes the new values), so they are not held next to it."""
        if self.weight_released:
            w = self.weight
            w.untyped_storage().resize_(w.numel() * w.element_size())
            self.qweight = self.weight_bf16 = None
            self._cache_key = None

    def ensure_fresh(self) -> None:
        """Requantize if the master weight changed since the last quantization
        (an optimizer step, a load): what every forward does first."""
        if self._cache_key != self._key():
            self.refresh_weight()

    def input_key(self) -> tuple | None:
        """What this layer's FP8 input quantization depends on besides the input
        (backend, scale format, amax floor): linears of one input with equal keys
        quantize it to the same bits. None for a BF16 forward."""
        p = self.plan
        return None if p.fprop != "fp8" else (p.backend.name, p.scale_fmt, p.input_amax_floor)

    def group_key(self) -> tuple:
        """Linears of one input with equal keys share work in ``linears_of_one_input``:
        FP8 forwards the input's quantization (``input_key``) and a stacked GEMM, BF16
        forwards of one backend a stacked GEMM."""
        key = self.input_key()
        return ("fp8", *key) if key is not None else ("bf16", self.plan.backend.name)

    def quantized_input(self, x: torch.Tensor) -> QTensor | torch.Tensor:
        """``x`` ``[..., K]`` quantized as this layer's FP8 forward would, for ``forward(x, xq)``
        of the linears with the same ``input_key`` (values only: no graph)."""
        if not torch.is_grad_enabled():  # a rollout step: nothing to detach from
            return _quantized_input(x.reshape(-1, x.shape[-1]), self.plan, self.name)
        with torch.no_grad():  # the backward requantizes from the saved x
            return _quantized_input(x.detach().reshape(-1, x.shape[-1]), self.plan, self.name)

    def forward(
        self, x: torch.Tensor, xq: QTensor | torch.Tensor | None = None, product: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``xq``: ``quantized_input(x)`` of a linear with the same ``input_key``, when
        one was made for another linear of this input; ``product``: this layer's FP32
        GEMM result ``[T, N]`` from their stacked call (both by ``linears_of_one_input``;
        the backward is this layer's own either way)."""
        grad = torch.is_grad_enabled()
        if product is not None and not grad:  # a rollout step: the group's GEMM ran on fresh weights
            return _fprop(x, self.bias, None, xq, product)
        self.ensure_fresh()
        call = _Call(self.plan, self.qweight, self.weight_bf16, self._bf16_caches, self.name, self.transport_counts)
        if not grad:  # rollout / scoring: no autograd node to build
            return _fprop(x, self.bias, call, xq, product)
        return _FP8LinearFn.apply(x, self.weight, self.bias, call, xq, product)

    def extra_repr(self) -> str:
        p = self.plan
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fprop={p.fprop}, dgrad={p.dgrad}, wgrad={p.wgrad}, backend={p.backend.name}"
        )


def linears_of_one_input(x: torch.Tensor, layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``, the same bits, with the FP8 input
    quantization done once for all the FP8Linears that quantize ``x`` alike
    (q/k/v, gate/up): one quantization per input instead of one per linear,
    the most frequent small work of a decode step; and their GEMMs in one
    stacked call where the backend has one measured to give each layer's bits
    (``Backend.fp8_linear_group``; ``Backend.bf16_linear_group`` for FP8Linears
    with a BF16 forward, which share the stacked GEMM only). Every layer is still
    called as a module (its hooks run; a layer with a forward pre-hook, which may
    change its input, gets its own GEMM). Other modules (an ``nn.Linear``) are
    called as they are."""
    groups: dict[tuple, list[int]] = {}  # group_key -> positions of the layers that share it
    for i, layer in enumerate(layers):
        if isinstance(layer, FP8Linear):
            groups.setdefault(layer.group_key(), []).append(i)
    shared: dict[int, tuple[QTensor | torch.Tensor | None, torch.Tensor | None]] = {}  # position -> (xq, product)
    for members in groups.values():
        first = layers[members[0]]
        fp8 = first.plan.fprop == "fp8"
        xq = first.quantized_input(x) if fp8 else None
        products: list[torch.Tensor] | None = None
        if len(members) > 1 and not any(layers[i]._forward_pre_hooks for i in members):
            for i in members:
                layers[i].ensure_fresh()
            backend = first.plan.backend
            with torch.no_grad():
                if fp8:
                    products = backend.fp8_linear_group(xq, [layers[i].qweight for i in members])
                else:
                    products = backend.bf16_linear_group(
                        x.detach().reshape(-1, x.shape[-1]), [layers[i].weight_bf16 for i in members],
                        first._bf16_caches[0],
                    )
        for j, i in enumerate(members):
            shared[i] = (xq, None if products is None else products[j])
    return [layer(x, *shared[i]) if i in shared else layer(x) for i, layer in enumerate(layers)]


def rollout_linears(layers: Sequence[nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    """``linears_of_one_input`` without a graph, resolved once for the layers' current weight
    forms: a function ``x [..., K]`` -> ``[layer(x) for layer in layers]`` as ``[T, N_i]``
    (T: x's rows), the same bits (the same backend calls on the same objects: the input's
    quantization once, the stacked GEMM where the backend has one, each bias, the cast to
    x's dtype), without the per-call dispatch (group keys, freshness checks, module calls),
    which costs a decode step of few rows more than its arithmetic. Built for one rollout
    (the rollout phase's plans, weights quantized here if stale) and valid until the weights
    are requantized. None where the layers are not FP8Linears of one group key, or one has a
    forward hook (which only a module call runs)."""
    if not layers or not all(isinstance(layer, FP8Linear) for layer in layers):
        return None
    if any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers):
        return None
    if len({layer.group_key() for layer in layers}) != 1:
        return None
    for layer in layers:
        layer.ensure_fresh()
    first = layers[0]
    plan, backend, name = first.plan, first.plan.backend, first.name
    biases = [layer.bias for layer in layers]
    if plan.fprop == "fp8":
        qweights = [layer.qweight for layer in layers]

        def products(x2: torch.Tensor) -> list[torch.Tensor]:
            xq = _quantized_input(x2, plan, name)
            got = backend.fp8_linear_group(xq, qweights) if len(layers) > 1 else None
            return got if got is not None else [backend.fp8_linear(xq, w) for w in qweights]
    else:
        weights = [layer.weight_bf16 for layer in layers]
        caches = [layer._bf16_caches[0] for layer in layers]

        def products(x2: torch.Tensor) -> list[torch.Tensor]:
            got = backend.bf16_linear_group(x2, weights, caches[0]) if len(layers) > 1 else None
            return got if got is not None else [backend.bf16_matmul(x2, w, c) for w, c in zip(weights, caches)]

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        x2 = x.reshape(-1, x.shape[-1])
        return [_fprop(x2, bias, None, None, y) for y, bias in zip(products(x2), biases)]  # bias, cast

    return run
