"""FP8Linear: an nn.Linear whose three GEMMs follow a PrecisionFlow.

For ``y = x W^T + b`` with x ``[T, K]`` (T tokens, any leading dims folded in),
W ``[N, K]``, the three GEMMs of a linear layer are

    fprop  y  = x  @ W^T     [T, N]   FP8: quantize(x, 1x128) . qweight (128x128)
    dgrad  dx = dy @ W       [T, K]   FP8: quantize(dy, 1x128) . qweight.t()
    wgrad  dW = dy^T @ x     [N, K]   FP8: dy and x requantized along tokens (128x1)

Each runs in FP8 or BF16 as the flow says (fprop: ``flow.rollout_linear`` in
phase "rollout", ``flow.train_fprop`` in phase "train"; dgrad:
``flow.train_dgrad``; wgrad: ``flow.train_wgrad``). A BF16 GEMM is
``gemm.bf16_matmul`` on the layer's backend (BF16-rounded operands with FP32
arithmetic on ``reference``/``cpu``, the native BF16 GEMM on ``amx``); its
weight operand is the master weight rounded to BF16.

Weights are quantized once per optimizer step: ``refresh_weight()`` builds
``qweight`` (a 128x128-block QTensor) and ``weight_bf16`` from the master
weight, and the rollout forward and the training forward (and the FP8 dgrad)
all use that very ``qweight`` object. That is what makes the rollout graph a
subgraph of the training graph. The forward refreshes lazily when the master
weight changed since (``weight._version`` / storage moved), so forgetting to
call ``refresh_weight`` costs time, never correctness.

The wgrad GEMM requantizes the *saved high-precision* x and dy (not the fprop
FP8 x): its blocks run along the token axis, which the fprop tiles do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fp8rl.fp8.gemm import bf16_matmul, fp8_matmul
from fp8rl.fp8.quant import QTensor, dequantize, quantize

if TYPE_CHECKING:
    from fp8rl.precision import PrecisionFlow

PHASES: tuple[str, ...] = ("train", "rollout")


@dataclass(frozen=True)
class _Plan:
    """What one forward call (and its backward) runs; fixed at forward time so
    that the backward uses the weight caches the forward used."""

    fprop: str
    dgrad: str
    wgrad: str
    grad_transport: str
    scale_fmt: str
    backend: str | None
    qweight: QTensor | None
    weight_bf16: torch.Tensor | None
    bf16_caches: tuple[dict, dict]  # converted forms of weight_bf16 and of its transpose
    name: str


def _fprop(x: torch.Tensor, bias: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
    """The forward GEMM: x ``[..., K]`` -> y ``[..., N]`` in x's dtype. The one
    code path of rollout, scoring and the training forward."""
    x2 = x.reshape(-1, x.shape[-1])  # [T, K]
    if plan.fprop == "fp8":
        qx = quantize(x2, (1, 128), scale_fmt=plan.scale_fmt, name=f"{plan.name} input")
        y = fp8_matmul(qx, plan.qweight, backend=plan.backend)
    else:
        y = bf16_matmul(x2, plan.weight_bf16, plan.backend, plan.bf16_caches[0])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
        ctx.save_for_backward(x.reshape(-1, x.shape[-1]))
        ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = plan, x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return _fprop(x, bias, plan)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x2,) = ctx.saved_tensors
        plan: _Plan = ctx.plan
        dy2 = dy.reshape(-1, dy.shape[-1]).float()  # [T, N]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if plan.dgrad == "fp8":
                qdy = quantize(dy2, (1, 128), scale_fmt=plan.scale_fmt, name=f"{plan.name} grad_output")
                dx = fp8_matmul(qdy, plan.qweight.t(), backend=plan.backend, invariant=False)  # [T, N] . [K, N]^T
            else:
                dx = bf16_matmul(dy2, plan.weight_bf16.T, plan.backend, plan.bf16_caches[1], invariant=False)
            if plan.grad_transport == "fp8":
                # The gradient handed to the previous op travels as 1x128 FP8.
                dx = dequantize(quantize(dx, (1, 128), scale_fmt=plan.scale_fmt, name=f"{plan.name} grad_input"))
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if plan.wgrad == "fp8":
                # Blocks of 128 tokens: (128, 1) on [T, N] and [T, K], i.e. 1x128
                # rows of their transposes, from the high-precision tensors.
                qdy_t = quantize(dy2, (128, 1), scale_fmt=plan.scale_fmt, name=f"{plan.name} grad_output").t()
                qx_t = quantize(x2, (128, 1), scale_fmt=plan.scale_fmt, name=f"{plan.name} input").t()
                dw = fp8_matmul(qdy_t, qx_t, backend=plan.backend, invariant=False)  # [N, T] . [K, T]^T
            else:
                dw = bf16_matmul(dy2.T, x2.T, plan.backend, invariant=False)
            dw = dw.to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(ctx.b_dtype)  # FP32 sum over tokens
        return dx, dw, db, None


class FP8Linear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` (same parameters, same state_dict keys).

    weight: master weight Parameter ``[out_features, in_features]`` (shared
            with the nn.Linear it was made from, never copied)
    bias:   Parameter ``[out_features]`` or None
    phase:  "train" (fprop precision ``flow.train_fprop``) or "rollout"
            (``flow.rollout_linear``)
    qweight:     cached 128x128-block QTensor of ``weight`` (None when the flow
                 runs no FP8 GEMM with the weight)
    weight_bf16: cached BF16 copy of ``weight`` (None when no BF16 GEMM uses it)
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        flow: PrecisionFlow,
        backend: str | None = None,
        name: str = "linear",
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"{name}: weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
        self.weight = weight
        self.register_parameter("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.flow = flow
        self.backend = backend
        self.name = name
        self.phase = "train"
        self.qweight: QTensor | None = None
        self.weight_bf16: torch.Tensor | None = None
        self._bf16_caches: tuple[dict, dict] = ({}, {})
        self._cache_key: tuple | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, flow: PrecisionFlow, backend: str | None = None, name: str = "linear"
    ) -> "FP8Linear":
        """Wrap ``linear``'s own Parameter objects (no copy) in an FP8Linear."""
        return cls(linear.weight, linear.bias, flow, backend=backend, name=name)

    def _needs(self) -> tuple[bool, bool]:
        """(needs qweight, needs weight_bf16) under this flow: fprop in either phase, dgrad."""
        uses = (self.flow.rollout_linear, self.flow.train_fprop, self.flow.train_dgrad)
        return "fp8" in uses, "bf16" in uses

    def _key(self) -> tuple:
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape), self.flow)

    @torch.no_grad()
    def refresh_weight(self) -> None:
        """Requantize the weight caches from the master weight (once per optimizer step)."""
        need_fp8, need_bf16 = self._needs()
        w = self.weight.detach()
        self.qweight = (
            quantize(w, (128, 128), scale_fmt=self.flow.scale_fmt, name=f"{self.name}.weight") if need_fp8 else None
        )
        self.weight_bf16 = w.bfloat16() if need_bf16 else None
        self._bf16_caches = ({}, {})  # new dicts: a running backward keeps the old ones
        self._cache_key = self._key()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase not in PHASES:
            raise ValueError(f"{self.name}: phase must be one of {PHASES}, got {self.phase!r}")
        if self._cache_key != self._key():
            self.refresh_weight()
        fprop = self.flow.rollout_linear if self.phase == "rollout" else self.flow.train_fprop
        plan = _Plan(
            fprop=fprop,
            dgrad=self.flow.train_dgrad,
            wgrad=self.flow.train_wgrad,
            grad_transport=self.flow.grad_transport,
            scale_fmt=self.flow.scale_fmt,
            backend=self.backend,
            qweight=self.qweight,
            weight_bf16=self.weight_bf16,
            bf16_caches=self._bf16_caches,
            name=self.name,
        )
        if not torch.is_grad_enabled():  # rollout / scoring: no autograd node to build
            return _fprop(x, self.bias, plan)
        return _FP8LinearFn.apply(x, self.weight, self.bias, plan)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"flow={self.flow.name}, phase={self.phase}, backend={self.backend}"
        )
