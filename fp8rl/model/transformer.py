"""One decoder for Llama 3, Qwen2/2.5, Qwen3, SmolLM2 and their mixture-of-experts
forms (Qwen3-MoE, Qwen2-MoE, Mixtral).

Parameter names are exactly Hugging Face's (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads without renaming.

Two ways to call it, one code path:

* `model(input_ids)`: a plain causal forward (training, scoring, the reference).
* `model(input_ids, ctx)` with an `AttentionContext`: the batch lives in a static
  grid of `cache_len` key slots (left-padded prompts, gpt-fast style). Decoding
  writes K/V into a preallocated cache at `ctx.start`; the training forward pads
  its own K/V to the same `cache_len`. Every query row therefore sees the same
  key vector length, the same mask and the same reductions whether it is
  computed one token at a time (rollout) or all at once (training), which is
  what makes rollout and training log-probs bitwise equal.

Precision is set by `fp8rl.precision.apply_flow(model, flow)`: linears become
`FP8Linear`, each `Attention` gets an `attention_plan` (K/V, Q and P stored as
BF16 or FP8; the products on the plan's backend) and the model a `head_plan`
(BF16 operands, the backend's head GEMMs). A model with no flow applied is the
full-FP32 reference.

Mixture of experts (`SparseMoE`): the router stays FP32 under every flow (its
logits through the backend's batch-invariant `router_logits`), the experts are
ordinary linears, hence FP8 under a flow exactly like the dense ones. Tokens
are grouped by expert (one GEMM per expert on its tokens, vLLM style) and
each token's k expert outputs are summed in its own top-k order, so a token's
output never depends on which other tokens share its experts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from fp8rl.fp8 import kernels
from fp8rl.fp8.backends import Backend
from fp8rl.fp8.formats import E4M3_MAX
from fp8rl.fp8.linear import linears_of_one_input, rollout_linears
from fp8rl.fp8.quant import DerivedCache, dequantize_static
from fp8rl.precision import FULL_PRECISION_ATTENTION, FULL_PRECISION_HEAD, AttentionPlan, FlowPlan, HeadPlan
from .vector_math import initialize_vector_math

from .config import ModelConfig


class _StraightThrough(torch.autograd.Function):
    """Return `y` (a rounded copy of `x`) forward, pass gradients to `x` unchanged.

    Used for BF16/FP8 storage of Q, K, V and P: the forward value is exactly the
    stored value (no `x + (y - x).detach()` rounding), the backward is identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _HeadGrad(torch.autograd.Function):
    """Attach the lm_head's gradient to logits computed without a graph.

    Forward returns `out` (the logits already computed) unchanged; backward is
    the head plan's backend's `head_grads`. No FP32 copy of the logits is ever
    computed just to carry the graph."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, plan: HeadPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        ctx.plan = plan
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:  # type: ignore[override]
        h, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # [N, vocab]
        h2 = h.detach().reshape(-1, h.shape[-1])  # [N, D]
        dh, dw = ctx.plan.backend.head_grads(g2, h2, w.detach(), ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (dh.view_as(h) if dh is not None else None), dw, None, None


def store_heads(x: torch.Tensor, precision: str, scale: torch.Tensor | None) -> torch.Tensor:
    """Round per-head activations `x` [B, H, T, D] to their storage format.

    Returns the float32 value of `x` in that format (BF16-rounded; for fp8 the E4M3
    data times the scale, `quant.dequantize_static`), with a straight-through
    gradient to `x`: what attention multiplies and a KV cache holds. `scale` is per
    head [H] (fp8 only); values beyond `448 * scale` saturate, as static scales do.
    """
    if precision == "fp32":
        return x
    with torch.no_grad():
        data = x.detach() if x.requires_grad else x
        if precision == "bf16":
            value = data.to(torch.bfloat16).float()
        elif precision == "fp8":
            if scale is None:
                raise ValueError("FP8 storage of attention heads needs per-head scales")
            value = dequantize_static(data, scale.view(1, -1, 1, 1))
        else:
            raise ValueError(f"unknown attention storage precision {precision!r}")
    if x.requires_grad:
        value = _StraightThrough.apply(x, value)
    return value


class KVCacheLike(Protocol):
    """What the attention needs from a cache (fp8rl.rollout.kv_cache.KVCache)."""

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


@dataclass
class AttentionContext:
    """Where the current tokens sit in the static grid of key slots.

    positions: LongTensor[B, T]   RoPE position of each query token
    mask:      BoolTensor[B, 1, T, L]  True where query t may attend key slot l
    blocked:   BoolTensor[B, 1, T, L]  ~mask, made once for every layer's attention
    start:     int                 slot of the first query token (cache write offset)
    cache:     KV cache or None    None: keys/values are this call's own, padded to L
    amax:      dict or None        calibration: per layer, the per-token Q/K/V amax
    routing:   dict or None        MoE layers record the experts each token chose:
                                   layer -> [LongTensor[B, T, k]] (one per call, ascending ids)
    """

    positions: torch.Tensor
    mask: torch.Tensor
    blocked: torch.Tensor
    start: int
    cache: KVCacheLike | None = None
    amax: dict[int, dict[str, list[torch.Tensor]]] | None = None
    routing: dict[int, list[torch.Tensor]] | None = None
    _kernel_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def cache_len(self) -> int:
        return self.mask.shape[-1]

    def kernel_mask(self) -> torch.Tensor:
        """`blocked` in the fused attention kernel's form (`kernels.padded_mask`), made on
        first use and shared by every layer of the forward."""
        if self._kernel_mask is None:
            self._kernel_mask = kernels.padded_mask(self.blocked)
        return self._kernel_mask


def make_context(
    pad_left: torch.Tensor,
    start: int,
    n_tokens: int,
    cache_len: int,
    cache: KVCacheLike | None = None,
    amax: dict | None = None,
    routing: dict | None = None,
) -> AttentionContext:
    """Context for tokens in slots [start, start + n_tokens) of a left-padded grid.

    pad_left: LongTensor[B], the number of pad slots before row b's first token.
    Row b's token in slot s has position s - pad_left[b]. Query s may attend key
    slots pad_left[b] <= l <= s; a pad query attends only itself, so its (unused)
    output stays finite.
    """
    device = pad_left.device
    slots = torch.arange(start, start + n_tokens, device=device)  # [T]
    keys = torch.arange(cache_len, device=device)  # [L]
    positions = (slots[None, :] - pad_left[:, None]).clamp(min=0)  # [B, T]
    causal = keys[None, None, :] <= slots[None, :, None]  # [1, T, L]
    valid = keys[None, None, :] >= pad_left[:, None, None]  # [B, 1, L]
    own = keys[None, None, :] == slots[None, :, None]  # [1, T, L]
    mask = ((causal & valid) | own)[:, None]  # [B, 1, T, L]
    return AttentionContext(positions=positions, mask=mask, blocked=~mask, start=start, cache=cache, amax=amax,
                            routing=routing)


def fused_pointwise_on(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` (an RMSNorm, an MLP, or the Transformer for the log-probs of its
    logits) runs its pointwise arithmetic as kernels.c's
    loops: its flow's backend asks for them (`Backend.fused_pointwise`, set by
    fp8rl.precision.apply_flow) and the compiled kernels load for this CPU tensor."""
    return module.fused_pointwise and x.is_cpu and kernels.library() is not None


class _FusedRMSNorm(torch.autograd.Function):
    """`kernels.rmsnorm` with a graph: the kernel's forward bits; the gradient of the same
    function in torch ops, from x and the kernel's 1/rms of each row (nothing compares
    gradients bit for bit)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        inv = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
        out = kernels.rmsnorm(x, weight, eps, inv)
        ctx.save_for_backward(x, weight, inv)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, inv = ctx.saved_tensors  # inv [..., 1]: 1 / sqrt(mean(x^2) + eps)
        grad = grad.float()
        xhat = x.float() * inv
        # y = w * xhat: dx = inv * (gw - xhat * mean(gw * xhat)) with gw = grad * w; dw = sum of grad * xhat
        dw = (grad * xhat).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            gw = grad * weight
            dx = (inv * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused_pointwise = False  # kernels.c's loop instead of torch ops (apply_flow sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_pointwise_on(self, x):
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                return _FusedRMSNorm.apply(x, self.weight, self.eps)
            return kernels.rmsnorm(x, self.weight, self.eps)
        x32 = x if x.dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with llama3 long-context scaling if configured.
    Computed on the CPU whatever the default device (a model built on the meta device
    would otherwise run this arithmetic through torch's Python decompositions: 1 s of
    imports the first time)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = config.rope_scaling
    if rs is None or rs.get("rope_type") != "llama3":
        return inv_freq
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin_rot [B, 1, T, D] (`Transformer.rope`): the HF rotate-half
    convention, ``x * cos + cat(-x2, x1) * sin``, with the minus sign carried by the first
    half of ``sin_rot`` (``x2 * -s`` is ``-(x2 * s)`` exactly: the same bits, one pass fewer)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_rot


# E4M3 storage of P (in [0, 1]) uses this fixed scale.
P_SCALE = 1.0 / E4M3_MAX


def fused_attention_on(plan: AttentionPlan, head_dim: int) -> bool:
    """Whether attention under `plan` runs as the compiled fused kernel (the plan's backend
    asks for it, `Backend.fused_attention`, and the kernel runs here for this head size)."""
    return plan.backend.fused_attention and kernels.attention_available(head_dim)


class _FusedAttention(torch.autograd.Function):
    """`kernels.attention` with a graph: the kernel's forward bits; the backward is that of
    the same function in torch ops (`_attention_torch`), recomputed from q, k and v (nothing
    compares gradients row by row, and no [B, H, T, L] tensor is kept between the passes)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor, p_fp8: bool) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, blocked)
        ctx.p_fp8 = p_fp8
        return _fused_forward(q, k, v, mask, p_fp8)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, blocked = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            out = _attention_torch(*inputs, blocked, ctx.p_fp8)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p_fp8: bool) -> torch.Tensor:
    """The kernel on FP32 K/V [B, Hkv, L, D] (a forward without a KV cache): K transposed,
    its slot axis padded to whole 16-slot chunks (the kernel reads chunks; the padding is
    masked)."""
    L = k.shape[2]
    kt = F.pad(k.detach().transpose(-1, -2), (0, -L % 16)).contiguous()  # [B, Hkv, D, L16]
    return kernels.attention(q.detach(), kt, v.detach().contiguous(), mask, L, 1.0 / math.sqrt(q.shape[-1]),
                             p_scale=P_SCALE if p_fp8 else 0.0)


def _attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, p_fp8: bool) -> torch.Tensor:
    """The fused kernel's function in plain torch ops (its backward): q [B, H, T, D], k, v
    [B, Hkv, L, D], blocked [B, 1, T, >=L] -> [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, (H // Hkv) * T, D)
    scores = (qg @ k.transpose(-1, -2)).reshape(B, H, T, L) * (1.0 / math.sqrt(D))
    p = torch.softmax(scores.masked_fill(blocked[..., :L], float("-inf")), dim=-1)
    if p_fp8:
        p = store_heads(p, "fp8", torch.full((H,), P_SCALE, device=p.device))
    return (p.reshape(B, Hkv, (H // Hkv) * T, L) @ v).reshape(B, H, T, D)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, plan: AttentionPlan,
    kernel_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention over a static number of key slots, with grouped KV heads.

    q [B, H, T, D]; k, v [B, Hkv, L, D] (query head h reads KV head h // (H/Hkv));
    blocked [B, 1, T, L] (True: query t may not attend key slot l) -> [B, H, T, D].
    The two products are the plan's backend's (`attention_scores`,
    `attention_values`): batch-invariant, so the result does not depend on how
    many query rows share the call (decode vs training). The G = H/Hkv query
    heads that share a KV head are stacked as G*T rows of one product against
    it (no copy of K/V per query head; a decode step then has G rows, not 1).
    `plan.qp == "fp8"` stores P in E4M3 with the fixed scale 1/448 (P is in [0, 1]).

    Where `fused_attention_on(plan, D)`, all of it is instead the compiled kernel's one
    pass per row (`kernels.attention`; `kernel_mask`: `blocked` in its form, made here if
    not given), the arithmetic the rollout's decode runs on its KV cache
    (`Attention.forward`); keys may then stop at any slot past the last one attended.
    """
    B, H, T, D = q.shape
    if fused_attention_on(plan, D):
        mask = kernel_mask if kernel_mask is not None else kernels.padded_mask(blocked)
        p_fp8 = plan.qp == "fp8"
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _FusedAttention.apply(q, k, v, blocked, mask, p_fp8)
        return _fused_forward(q, k, v, mask, p_fp8)
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, (H // Hkv) * T, D)  # query heads of a group, then tokens
    scale = 1.0 / math.sqrt(D)
    L = k.shape[-2]
    scores = plan.backend.attention_scores(qg, k).reshape(B, H, T, L)  # [B, H, T, L], a new tensor
    # Scaled and masked in place: at long T these [T, L] products are the forward's largest
    # tensors, and a fresh one costs more in page faults than the arithmetic (the same bits).
    scores.mul_(scale).masked_fill_(blocked, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if plan.qp == "fp8":
        p = store_heads(p, "fp8", torch.full((p.shape[1],), P_SCALE, device=p.device))
    out = plan.backend.attention_values(p.reshape(B, Hkv, (H // Hkv) * T, L), v)  # [B, Hkv, G*T, D]
    return out.reshape(B, H, T, D)


# A decode step reads the first `KEY_SLOT_STEP * n` key slots that hold its live keys (see
# `key_slots`); the multiple keeps the key axis's vectorised reductions free of a scalar tail.
KEY_SLOT_STEP = 16


@functools.lru_cache(maxsize=None)
def key_prefix_exact(
    plan: AttentionPlan, head_dim: int, cache_len: int, group: int, prefix: int, queries: int = 1
) -> bool:
    """Whether `attend` over the first `prefix` key slots gives, bit for bit, what it
    gives over all `cache_len` slots, for every count of keys in use that
    `Transformer.key_slots` gives `prefix` for (prefix - KEY_SLOT_STEP + 1 up to
    prefix, at least `queries`; the slots after them blocked): `queries` query tokens
    in the last slots in use, each attending causally (1: a decode step; a prompt's
    length: the prefill), `group` query heads per KV head, this plan's storage and
    backend. Measured on the CPU at hand the first
    time a step needs it, like the row tiles (fp8rl/fp8/backends.py): key
    slots whose probability is exactly 0 add exact zeros to the softmax sum and to
    the P @ V dot products, but a BLAS kernel chosen from the longer shape can sum
    the rest in another order. Keys and values beyond `prefix` are nonzero here (a
    decode's cache holds zeros there, the training forward too).

    The data must let a change of summation order show: small Q and K (scores of
    order 1, so P spreads over the keys in use; large scores make P nearly one-hot
    and the P @ V sums trivial, which passed prefixes that real rollouts then
    failed), V over a wide range of magnitudes (sums that round differently in
    another order). With this data the exact prefixes of 384 slots here came out
    the same for three seeds: 16 to 192."""
    g = torch.Generator().manual_seed(head_dim * 1009 + cache_len * 17 + group * 7 + prefix + (queries - 1) * 31)

    def spread(lo: int, hi: int, *shape: int) -> torch.Tensor:  # magnitudes 2**lo .. 2**(hi-1) times N(0, 1)
        return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g).float())

    B, Hkv = 2, 2
    q = spread(-3, 1, B, Hkv * group, queries, head_dim) * 0.3
    k = spread(-3, 1, B, Hkv, cache_len, head_dim) * 0.3
    v = spread(-8, 9, B, Hkv, cache_len, head_dim)
    slots = torch.arange(cache_len)
    for live in range(max(prefix - KEY_SLOT_STEP + 1, queries), prefix + 1):  # keys in use: the first `live`
        query_slots = torch.arange(live - queries, live)  # query i sees the keys up to its own slot
        blocked = (slots[None, :] > query_slots[:, None]).expand(B, 1, queries, cache_len)
        full = attend(q, k, v, blocked, plan)
        part = attend(q, k[:, :, :prefix], v[:, :, :prefix], blocked[..., :prefix].contiguous(), plan)
        if not torch.equal(full, part):
            return False
    return True


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        # Storage of K/V, Q and P and the backend of the products (fp8rl.precision.apply_flow sets it).
        self.attention_plan: AttentionPlan = FULL_PRECISION_ATTENTION
        self.init_buffers()

    def init_buffers(self) -> None:
        """The static FP8 scales at 1, recalibrated each step (fp8rl.rollout.calibrate);
        not checkpoint state."""
        for name, n in (("q_scale", self.n_heads), ("k_scale", self.n_kv_heads), ("v_scale", self.n_kv_heads)):
            self.register_buffer(name, torch.ones(n), persistent=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = linears_of_one_input(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if getattr(ctx.cache, "fused", False) and ctx.amax is None:  # a rollout step on the fused kernel's cache
            out = self._attend_fused_cache(q, k, v, cos, sin, ctx)
        else:
            out = self._attend(q, k, v, cos, sin, ctx)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Attention of q [B, T, H, D], k, v [B, T, Hkv, D] (before RoPE) -> [B, H, T, D]: the
        training forward's and every step whose cache is not the fused kernel's."""
        T = q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.amax is not None:  # per-token, per-head amax for scale calibration
            rec = ctx.amax.setdefault(self.layer_idx, {"q": [], "k": [], "v": []})
            for name, t in (("q", q), ("k", k), ("v", v)):
                rec[name].append(t.detach().abs().amax(dim=-1).transpose(1, 2).reshape(-1, t.shape[1]))
        plan = self.attention_plan
        q_val = store_heads(q, plan.qp, self.q_scale)
        k_val = store_heads(k, plan.kv, self.k_scale)
        v_val = store_heads(v, plan.kv, self.v_scale)
        L = ctx.cache_len
        if fused_attention_on(plan, self.head_dim) and ctx.cache is None:
            if ctx.start != 0:
                raise ValueError("a forward without a KV cache must start at slot 0")
            return attend(q_val, k_val, v_val, ctx.blocked, plan, ctx.kernel_mask())  # keys past T: never read
        if ctx.cache is not None:
            k_all, v_all = ctx.cache.update(self.layer_idx, ctx.start, k_val, v_val)
            if k_all.shape[2] != L:  # a decode step reads only the slots its context covers (`key_slots`)
                k_all, v_all = k_all[:, :, :L], v_all[:, :, :L]
        else:
            if ctx.start != 0:
                raise ValueError("a forward without a KV cache must start at slot 0")
            k_all = F.pad(k_val, (0, 0, 0, L - T))  # zero keys beyond T are masked
            v_all = F.pad(v_val, (0, 0, 0, L - T))
        return attend(q_val, k_all, v_all, ctx.blocked, plan, ctx.kernel_mask() if ctx.cache is not None else None)

    def _attend_fused_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """`_attend` of a rollout step (no graph) on a cache that holds K (transposed) and V in
        BF16 or as E4M3 codes, in two compiled calls: `kernels.rope_store` (RoPE, Q's storage
        rounding, K/V written as BF16, or as E4M3 codes under FP8 storage, with `_attend`'s bits)
        and the attention kernel reading the cache directly (applying FP8 K/V's per-head
        scales as `store_heads` does). The same bits as `_attend` on the stored FP32 values
        (the training forward)."""
        plan = self.attention_plan
        fp8 = plan.kv == "fp8"
        kt_all, v_all = ctx.cache.fused_layer(self.layer_idx, ctx.start, q.shape[1])
        q_val = kernels.rope_store(
            q, k, v, cos, sin, plan.qp, self.q_scale, self.k_scale if fp8 else None, self.v_scale if fp8 else None,
            kt_all, v_all, ctx.start,
        )
        return kernels.attention(
            q_val, kt_all, v_all, ctx.kernel_mask(), ctx.cache_len, 1.0 / math.sqrt(self.head_dim),
            k_scale=self.k_scale if fp8 else None, v_scale=self.v_scale if fp8 else None,
            p_scale=P_SCALE if plan.qp == "fp8" else 0.0,
        )


# Projection names of a gated MLP: (gate, up, down). Mixtral's experts call them w1, w3, w2.
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class _FusedSiluMul(torch.autograd.Function):
    """`kernels.silu_mul` with a graph: the kernel's forward bits; the gradient of
    ``silu(g) * u`` in torch ops, from g and u."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(g, u)
        return kernels.silu_mul(g, u)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        g, u = ctx.saved_tensors
        g32, grad = g.float(), grad.float()
        # torch's own silu backward (one fused pass): what autograd of F.silu(g) * u runs
        dg = torch.ops.aten.silu_backward(grad * u, g32) if ctx.needs_input_grad[0] else None
        du = grad * F.silu(g32) if ctx.needs_input_grad[1] else None
        return (None if dg is None else dg.to(g.dtype)), (None if du is None else du.to(u.dtype))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; `names` are the checkpoint's names
    of the three projections."""

    def __init__(self, hidden_size: int, intermediate_size: int, names: tuple[str, str, str] = MLP_NAMES) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, up, nn.Linear(hidden_size, intermediate_size, bias=False))
        setattr(self, down, nn.Linear(intermediate_size, hidden_size, bias=False))
        self.fused_pointwise = False  # silu(g) * u as kernels.c's loop (apply_flow sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        g, u = linears_of_one_input(x, (gate, up))
        return down(self.gated(g, u))

    def gated(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gate, ``silu(g) * u``: kernels.c's loop where `fused_pointwise_on`, else torch's ops."""
        if not fused_pointwise_on(self, g):
            return F.silu(g) * u
        if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
            return _FusedSiluMul.apply(g, u)
        return kernels.silu_mul(g, u)


class Router(nn.Module):
    """An FP32 linear map without bias, ``x [N, D] -> x . weight^T [N, out]``: the
    MoE router (out = experts) and Qwen2-MoE's shared-expert gate (out = 1).

    Never converted to FP8 (it is not an nn.Linear): routing decisions are
    discrete, and a rounding that flips a top-k choice changes a token's whole
    computation. Under a flow the product is the backend's batch-invariant
    `router_logits` (`router_backend`, set by fp8rl.precision.apply_flow), so a
    token routes the same in a one-token decode step and in the training
    forward; with no flow, a plain FP32 `F.linear` (the reference)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.router_backend: Backend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        if self.router_backend is None:
            return F.linear(x.float(), w)
        return self.router_backend.router_logits(x.float(), w)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: logits FP32 [N, E] -> (weights FP32 [N, k], experts Long [N, k]).

    softmax over all experts, then the k most probable, in descending
    probability; ties go to the lower expert id (a stable sort), so the choice
    is a function of the logits' bits alone. `normalize`: the k weights divided
    by their sum (Mixtral; Qwen's `norm_topk_prob`)."""
    probs = torch.softmax(logits, dim=-1)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :k], experts[:, :k]
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP: router `gate`, `experts`, and for Qwen2-MoE a
    `shared_expert` every token goes through, scaled by sigmoid(`shared_expert_gate`).

    x [B, T, D] -> [B, T, D]. Dispatch is grouped by expert: the (token, slot)
    pairs are sorted by expert (stable: token order within an expert), each
    expert runs one forward on its gathered tokens (experts no token chose are
    skipped), and the results go back to their (token, slot) places. Each
    token's output is then ``sum_j w_j * expert_j(x)`` over its slots j = 0..k-1
    in that order: elementwise, so a token's bits depend on its own routing only.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.top_k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob
        names = MIXTRAL_EXPERT_NAMES if c.architecture == "MixtralForCausalLM" else MLP_NAMES
        self.gate = Router(c.hidden_size, c.num_experts)
        self.experts = nn.ModuleList(MLP(c.hidden_size, c.moe_intermediate_size, names) for _ in range(c.num_experts))
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(c.hidden_size, 1)

    def forward(self, x: torch.Tensor, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`routing`: if given, this call's experts are appended to it, Long [B, T, k]
        in ascending expert id (the token's expert set)."""
        B, T, D = x.shape
        k = self.top_k
        x2 = x.reshape(-1, D)  # [N, D]
        weights, experts = route(self.gate(x2), k, self.normalize)  # [N, k] each
        if routing is not None:
            routing.append(experts.sort(dim=-1).values.view(B, T, k))
        flat = experts.reshape(-1)  # [N*k] the expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        gathered = x2[order // k].split(counts)  # per expert: its tokens' inputs
        outs = [expert(xe) for expert, xe in zip(self.experts, gathered) if xe.shape[0] > 0]
        grouped = torch.cat(outs)  # [N*k, D] in expert order
        per_slot = grouped[torch.argsort(order)].view(-1, k, D)  # back to (token, slot) order
        out = per_slot[:, 0] * weights[:, :1].to(x.dtype)
        for j in range(1, k):
            out = out + per_slot[:, j] * weights[:, j : j + 1].to(x.dtype)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x2)).to(x.dtype) * self.shared_expert(x2)
        return out.view(B, T, D)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            moe = SparseMoE(config)
            # Mixtral's checkpoints call the MoE block `block_sparse_moe`, Qwen's `mlp`.
            self.moe_name = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
            setattr(self, self.moe_name, moe)
        else:
            self.moe_name = None
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        if self.moe_name is None:
            return x + self.mlp(h)
        routing = None if ctx.routing is None else ctx.routing.setdefault(self.layer_idx, [])
        return x + getattr(self, self.moe_name)(h, routing)


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook would run on ``module`` or any module inside it (hooks run only
    through module calls; a global one on every module)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


class RolloutLayer:
    """A dense decoder layer's forward in a rollout step, without the module dispatch:
    `DecoderLayer.forward` (with `Attention.forward` and `MLP.forward`) step for step, the
    same kernels and backend calls on the same objects in the same order, hence the same
    bits, with the linears resolved once per rollout (`fp8rl.fp8.linear.rollout_linears`).
    A decode step of few rows spends more time in that dispatch (module calls, group keys,
    freshness checks) than in its small tensors' arithmetic. A call with a graph, without
    the fused kernels' KV cache or with scale calibration runs the layer's module forward."""

    def __init__(self, layer: DecoderLayer, qkv: Callable, o: Callable, gate_up: Callable, down: Callable) -> None:
        self.layer, self.qkv, self.o, self.gate_up, self.down = layer, qkv, o, gate_up, down

    @classmethod
    def of(cls, layer: DecoderLayer) -> "RolloutLayer | None":
        """The layer's rollout form for its current weights, or None (a mixture-of-experts
        layer, a hooked module, linears that do not resolve: `rollout_linears`)."""
        if layer.moe_name is not None or _hooked(layer):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        gate, up, down = (getattr(mlp, n) for n in mlp.names)
        linears = [rollout_linears(group) for group in
                   ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (gate, up), (down,))]
        return None if any(f is None for f in linears) else cls(layer, *linears)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        layer = self.layer
        if torch.is_grad_enabled() or not getattr(ctx.cache, "fused", False) or ctx.amax is not None:
            return layer(x, cos, sin, ctx)
        attn, mlp = layer.self_attn, layer.mlp
        B, T, _ = x.shape
        q, k, v = self.qkv(layer.input_layernorm.forward(x))  # [B * T, N] each
        q = q.view(B, T, attn.n_heads, attn.head_dim)
        k = k.view(B, T, attn.n_kv_heads, attn.head_dim)
        v = v.view(B, T, attn.n_kv_heads, attn.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
        out = attn._attend_fused_cache(q, k, v, cos, sin, ctx)  # [B, H, T, D]
        (o,) = self.o(out.transpose(1, 2).reshape(B, T, attn.n_heads * attn.head_dim))
        x = x + o.reshape(B, T, -1)
        g, u = self.gate_up(layer.post_attention_layernorm.forward(x))
        (y,) = self.down(mlp.gated(g, u))
        return x + y.reshape(B, T, -1)


class _Body(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        initialize_vector_math()  # before any forward: MKL's first calls race between threads (model/vector_math.py)
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()
        # lm_head numerics (fp8rl.precision.apply_flow sets them) and the converted head weight.
        self.head_plan: HeadPlan = FULL_PRECISION_HEAD
        self._head_cache: tuple[tuple, dict] | None = None
        self.flow_plan: FlowPlan | None = None  # the resolved flow, once apply_flow ran
        # The log-probs of its logits (rollout/engine.py token_logprobs) as kernels.c's loop (apply_flow sets it).
        self.fused_pointwise = False

    def init_buffers(self) -> None:
        """The non-persistent buffers as a new model has them (the RoPE inverse
        frequencies, every attention's FP8 scales at 1), on the current default device:
        what a model built on the meta device (`fp8rl.model.load.model_from_state`) lacks."""
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        for module in self.modules():
            if isinstance(module, Attention):
                module.init_buffers()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def attention_scales(self) -> dict[str, list[float]]:
        """The FP8 Q/K/V scales, ``{"<layer>.<q|k|v>": [per head]}`` (as checkpoints store them)."""
        return {f"{i}.{name}": getattr(layer.self_attn, f"{name}_scale").tolist()
                for i, layer in enumerate(self.model.layers) for name in ("q", "k", "v")}

    def set_attention_scales(self, scales: dict[str, list[float]]) -> None:
        """Set the FP8 Q/K/V scales from ``attention_scales()``'s form."""
        for i, layer in enumerate(self.model.layers):
            for name in ("q", "k", "v"):
                getattr(layer.self_attn, f"{name}_scale").copy_(torch.tensor(scales[f"{i}.{name}"]))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_rot [B, 1, T, head_dim] for integer positions [B, T] (elementwise, so
        the same position always gets the same bits), as `apply_rope` takes them: made
        once per forward, for every layer (sin_rot: sin with its first half negated)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()  # of the whole [B, T, D], as before: which elements a vector kernel takes is unchanged
        half = sin.shape[-1] // 2
        return emb.cos()[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]

    def attention_fused(self) -> bool:
        """Whether every layer's attention runs as the compiled fused kernel (`fused_attention_on`),
        whose rows read no key slot past their last live one."""
        return all(fused_attention_on(layer.self_attn.attention_plan, self.config.head_dim)
                   for layer in self.model.layers)

    def key_slots(self, n_live: int, cache_len: int, queries: int = 1) -> int:
        """How many leading key slots a step of `queries` new tokens (1: a decode step;
        the prompt length: the prefill) whose keys sit in the first `n_live` slots
        attends over: the smallest multiple of KEY_SLOT_STEP that holds them
        where that count was measured to give the bits of all `cache_len` slots for
        such a step (`key_prefix_exact`, every layer's plan), else `cache_len`. (Not
        a longer measured prefix: on a 2-core AMD EPYC with AVX2, 368 of 384 slots gave
        other bits for 239 keys in use, though the right ones for 353 to 368.) The
        training forward attends over all `cache_len`; a short prefix spares a decode
        step the masked slots (the keys of the tokens not sampled yet)."""
        prefix = -(-n_live // KEY_SLOT_STEP) * KEY_SLOT_STEP
        if prefix >= cache_len:
            return cache_len
        c = self.config
        group = c.num_heads // c.num_kv_heads
        plans = {layer.self_attn.attention_plan for layer in self.model.layers}
        exact = all(key_prefix_exact(p, c.head_dim, cache_len, group, prefix, queries) for p in plans)
        return prefix if exact else cache_len

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head logits [..., vocab]. Under a flow: BF16 operands and the head
        plan's backend's batch-invariant `head_logits`, so a row's logits do not
        depend on the batch around it; the gradient is the backend's `head_grads`."""
        w = self.lm_head.weight
        plan = self.head_plan
        if plan.precision == "fp32":
            return F.linear(h, w)
        version = (w._version, w.data_ptr(), plan)
        if self._head_cache is None or self._head_cache[0] != version:
            self._head_cache = (version, DerivedCache())  # the backend keeps its converted weight here
        h2 = h.detach().reshape(-1, h.shape[-1])
        with torch.no_grad():
            out = plan.backend.head_logits(h2, w.detach(), self._head_cache[1])
        out = out.view(*h.shape[:-1], out.shape[-1])
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            out = _HeadGrad.apply(h, w, out, plan)
        return out

    def rollout_layers(self) -> list[RolloutLayer] | None:
        """The decoder layers' rollout forms (`RolloutLayer`) for the current weights, for
        ``forward(..., layers=...)`` in the steps of one rollout: build them in the rollout
        phase (fp8rl.precision.phase) and drop them when it ends. None (run the modules)
        for a model without a flow or with a layer that has no such form. (The embeddings,
        the final norm and the head stay module calls: their hooks run.)"""
        if self.flow_plan is None:
            return None
        layers = [RolloutLayer.of(layer) for layer in self.model.layers]
        return None if any(layer is None for layer in layers) else layers

    def hidden(
        self, input_ids: torch.Tensor, ctx: AttentionContext | None = None, layers: Sequence[Callable] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> the last decoder layer's output [B, T, hidden] (before
        the final norm); `ctx` as for `forward`; `layers`: what runs instead of the
        decoder layers, each ``(x, cos, sin, ctx) -> x`` (`rollout_layers`)."""
        B, T = input_ids.shape
        if ctx is None:
            ctx = make_context(torch.zeros(B, dtype=torch.long, device=input_ids.device), 0, T, T)
        if ctx.start + T > ctx.cache_len:
            raise ValueError(f"tokens [{ctx.start}, {ctx.start + T}) do not fit {ctx.cache_len} key slots")
        cos, sin = self.rope(ctx.positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers if layers is None else layers:
            x = layer(x, cos, sin, ctx)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., hidden] (`hidden`'s) -> logits [..., vocab]: final norm, then the head."""
        return self.head(self.model.norm(x))

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: AttentionContext | None = None,
        n_last: int | None = None,
        head_span: tuple[int, int] | None = None,
        layers: Sequence[Callable] | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] (float32); with `n_last`, only
        the logits of the last n_last positions [B, n_last, vocab]; with
        `head_span = (start, stop)`, only those of positions start..stop-1;
        `layers` as for `hidden` (a rollout's `rollout_layers`)."""
        T = input_ids.shape[1]
        x = self.hidden(input_ids, ctx, layers)
        if n_last is not None:
            x = x[:, T - n_last :]
        elif head_span is not None:
            x = x[:, head_span[0] : head_span[1]]
        return self.logits(x)

