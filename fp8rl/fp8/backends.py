"""GEMM backends: every product the model computes, one object per kind of arithmetic.

A backend owns the arithmetic of the flows (docs/design.md section 3):

- ``fp8_matmul(a, b)``: the block-scaled FP8 GEMM ``dequant(a) @ dequant(b).T``
  for QTensors ``a`` ``[M, K]`` and ``b`` ``[N, K]`` sharing the K block width
  (1x128 activations times 128x128 weights for fprop and dgrad, two 1x128
  operands for wgrad), computed DeepSeek-V3 style, block by block along K::

      partial_kb[i, j] = sum_{k in kb} a.data[i, k] * b.data[j, k]     (exact)
      out[i, j]       += partial_kb[i, j] * sa[i, kb] * sb[j, kb]      (promotion)

  Backends differ only in how the promotion and the sum are rounded.
- ``linear_input(x)`` / ``fp8_linear(xq, w)``: a linear's forward, ``x`` quantized
  to 1x128 blocks then ``fp8_matmul`` (a backend may keep the quantized input in
  the form its GEMM multiplies); linears of one input (q/k/v, gate/up) share ``xq``,
  and ``fp8_linear_group(xq, ws)`` makes their GEMMs in one call where a backend has
  one measured to give each weight's own bits (``cpu``, ``amx``), else None.
- ``bf16_matmul(a, b)``: the BF16 GEMM of the flows' BF16 steps, ``a @ b.T``;
  ``bf16_linear_group(x, ws, cache)`` the BF16 forwards of one input in one call,
  the same way.
- ``head_logits`` / ``head_grads``: the LM head (BF16 operands) and its gradient.
- ``attention_scores`` / ``attention_values``: the two attention products.
- ``router_logits``: the FP32 product of a mixture-of-experts router (and gate).
- ``exact``: results are exact math rounded once (the reference);
  ``batch_invariant``: a row's result does not depend on the other rows of
  the call, which is what makes rollout (decode, a few rows) and training
  (all rows at once) agree bit for bit. By construction for ``reference``;
  for ``cpu`` and ``amx`` by row tiles measured per shape on the CPU at hand
  (``_measure_row_tiles``, ``_attention_tiles``), checked for a whole model by
  ``batch_invariance_failures`` (tests/test_backends.py runs it on every
  backend in ``BACKENDS``).

``BACKENDS`` is the one registry; ``choose_backend`` the one policy for
``backend = "auto"``. Nothing outside this file compares backend names.
Adding a backend is one class here plus one line in ``BACKENDS``.

``invariant=False`` (backward GEMMs, which nothing compares row by row) lets a
backend drop what it does only for batch invariance.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from fp8rl.fp8.formats import AMAX_FLOOR
from fp8rl.fp8.quant import (
    DerivedCache, QTensor, dequantize, fp8_to_float, quantize, quantize_dequantize, quantize_dequantize_blocks,
)

# --- shared pieces ---------------------------------------------------------------------


def _row_scales(q: QTensor) -> torch.Tensor:
    """FP32 ``[rows, ceil(K/bk)]``: the scale of every row in every K block."""
    bm = q.block[0]
    s = q.scale
    if bm > 1:
        s = s.repeat_interleave(bm, dim=0)[: q.data.shape[0]]
    return s


def check_operands(a: QTensor, b: QTensor) -> None:
    """``a @ b.T`` operands: 2-D, same K, same K block width (ValueError otherwise)."""
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(f"fp8_matmul needs 2-D QTensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_matmul computes a @ b.T: K mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if a.block[1] != b.block[1]:
        raise ValueError(f"fp8_matmul needs the same K block width, got a.block={a.block}, b.block={b.block}")


# Attention products fall back to this many rows per call (see _attention_tiles).
_MIN_ROWS = 16
# The largest row tile of the row-tiled GEMMs (see _measure_row_tiles): 128
# measured best overall for SmolLM2-135M at 16 rollouts with torch.mm (64: -12%
# training forward speed, 256: -25% decode speed).
_NATIVE_ROWS = 128


def _k_blocks(x: torch.Tensor, bk: int, s: torch.Tensor | None = None) -> list[torch.Tensor]:
    """FP32 ``[rows, bk]`` slices of ``x`` along K (contiguous copies), each times its
    per-row scale ``s [rows, ceil(K/bk)]`` if given."""
    n = -(-x.shape[1] // bk)
    if s is None:
        return [x[:, j * bk : (j + 1) * bk].contiguous() for j in range(n)]
    return [x[:, j * bk : (j + 1) * bk] * s[:, j, None] for j in range(n)]


def _block_scaled(x: torch.Tensor, s: torch.Tensor, bk: int) -> torch.Tensor:
    """FP32 ``x [rows, K]`` times its per-row block scales ``s [rows, ceil(K/bk)]``,
    each element the product ``_k_blocks`` makes (the same bits), in one tensor."""
    return x * s.float().repeat_interleave(bk, dim=1)[:, : x.shape[1]]


def _full_k(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A backward GEMM (``invariant=False``): FP32 ``a [M, K] @ b [N, K].T`` in one BLAS
    call over the whole K, on operands whose block scales are already applied. The
    same products as the K-block calls of the forward, summed in BLAS's order:
    nothing compares a backward GEMM's rows across batches, and one call instead
    of one per 128 of K (the token axis of a weight gradient) saves most of its
    per-call overhead."""
    return a @ b.T


def _accumulate_tile(a: torch.Tensor, b_blocks: list[torch.Tensor], bk: int) -> torch.Tensor:
    """One BLAS call per K block, in K order: FP32 ``sum_kb a_kb @ b_kb.T``.

    a: FP32 ``[M, K]`` (one call per K block on all its rows) or ``[tiles, rows, K]``
    (one batched call per K block: every tile is its own GEMM of ``rows`` rows, which
    costs one call instead of one per tile); b_blocks: ``_k_blocks`` ``[N, <=bk]``."""
    if a.dim() == 3 and a.shape[0] == 1:
        return _accumulate_tile(a[0], b_blocks, bk)[None]
    out = None
    for j, b_blk in enumerate(b_blocks):
        x = a if a.shape[-1] <= bk else a[..., j * bk : (j + 1) * bk]  # one block: the whole of a
        w = b_blk.T
        if a.dim() == 3:
            w = w.expand(a.shape[0], *w.shape)
            out = torch.bmm(x, w) if out is None else out.baddbmm_(x, w)
        else:
            out = x @ w if out is None else out.addmm_(x, w)
    return out


def _accumulate_k_blocks(
    a: torch.Tensor, b_blocks: list[torch.Tensor], bk: int, sa: torch.Tensor | None = None
) -> torch.Tensor:
    """FP32 ``sum_kb (a_kb * sa_kb) @ b_kb.T``, one BLAS call per K block, in K order.

    a: FP32 ``[M, K]``; b_blocks: ``_k_blocks`` of the FP32 ``[N, K]`` operand
    (its scales already applied); sa ``[M, ceil(K/bk)]`` optional per-row scales.

    Batch invariance: BLAS picks its kernel (another summation order) from the
    shape: with MKL here rows of an M <= 5 product differed in the last bits
    from the same rows inside a larger batch, and with MKL limited to AVX2 a
    row's position in a 128-row call mattered. So calls get exactly the row
    counts of ``_fp32_row_tiles`` (measured per shape; all tiles of a long input
    in one batched call where measured to give each tile's own bits), and each
    call's K is ``bk`` (full-K FP32 GEMMs were not invariant: MKL splits long K
    across threads). Backward GEMMs take ``_full_k`` instead.
    """
    if sa is not None:  # a_kb * sa_kb, elementwise as the product of the block would be
        a = _block_scaled(a, sa, bk)
    gemm = functools.partial(_accumulate_tile, b_blocks=b_blocks, bk=bk)
    return _tiled_rows(a, _fp32_row_tiles(bk, b_blocks[0].shape[0]), gemm)


def _bmm_tiled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a [..., T, K] @ b [..., K, N]`` as calls of exactly the row counts of
    ``_attention_tiles(K, N)`` (the last zero-padded), so that every row goes
    through the same BLAS kernel whatever T is. Differentiable; the backward
    (which nothing compares row by row) is two plain batched GEMMs."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _TiledBmm.apply(a, b)
    return _tiled_rows(a, _attention_tiles(a.shape[-1], b.shape[-1]), lambda rows: rows @ b)


class _TiledBmm(torch.autograd.Function):
    """``_bmm_tiled`` with a graph: the tiled forward without autograd's record
    of every tile (whose backward zero-fills a full-size gradient per tile)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return _bmm_tiled(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        da = grad @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        db = a.transpose(-1, -2) @ grad if ctx.needs_input_grad[1] else None
        return da, db


@functools.lru_cache(maxsize=None)
def _attention_tiles(k: int, n: int) -> RowTiles:
    """Row tiles (``_measure_row_tiles``, candidates 128 down to 8) of the FP32
    batched attention products ``[rows, k] @ [k, n]``, measured once per shape
    on this CPU, plus a check that a row's bits do not depend on how many
    matrices share the batched call. BLAS picks its kernel from the shape: a
    one-row call (a decode step's query) takes a matrix-vector kernel, and with
    MKL limited to AVX2 a 68-row call summed differently from 64-row calls.
    A decode step has only the few query heads of a KV group as rows (2 for
    tiny-arith, 3 for SmolLM2), hence the small tiles down to 2 rows (on a
    2-core AMD EPYC with AVX2, 4-row calls gave the 128-row bits, 2-row ones
    did not); the training forward gets the big one."""
    g = torch.Generator().manual_seed(k * 100_003 + n)
    a = order_sensitive_rows(4 * 192, k, g).view(4, 192, k)
    b = order_sensitive_cols(4 * n, k, g).view(4, n, k).transpose(1, 2)
    tiles = _measure_row_tiles(lambda rows: rows @ b[: rows.shape[0]], a, (128, 64, 32, 16, 8, 4, 2))
    if tiles is None:
        return RowTiles((_MIN_ROWS,))
    for t in tiles.sizes:
        if not torch.equal(a[:2, :t] @ b[:2], (a[:, :t] @ b)[:2]):  # 2 vs 4 matrices per call
            return RowTiles((_MIN_ROWS,))
    return tiles


def order_sensitive_rows(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """FP32 ``[rows, k]`` test rows whose dot products with ``order_sensitive_cols``
    nearly cancel, so that any change in summation order shows in the result
    (random data hides most order changes in the final rounding). Half the
    rows are plain Gaussian. BF16-exact values."""
    half = k // 2
    u = torch.randn(rows, half, generator=generator) * torch.exp2(
        torch.randint(-6, 7, (rows, half), generator=generator).float()
    )
    x = torch.zeros(rows, k)
    x[:, :half], x[:, half : 2 * half] = u, u
    x[::2] = torch.randn(x[::2].shape, generator=generator)
    return x.bfloat16().float()


def order_sensitive_cols(cols: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """FP32 ``[cols, k]``: ``[v, -v * (1 + 2**-7)]`` per row (see ``order_sensitive_rows``)."""
    half = k // 2
    v = torch.randn(cols, half, generator=generator)
    x = torch.zeros(cols, k)
    x[:, :half], x[:, half : 2 * half] = v, -v * (1 + 2**-7)
    return x.bfloat16().float()


@functools.lru_cache(maxsize=None)
def _prepacked_available() -> bool:
    """Whether this torch build runs oneDNN's linear on a prepacked BF16 weight
    (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
    inductor uses on CPU). Private ops: where a build lacks or refuses them the
    plain ``torch.mm`` path is used."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=torch.bfloat16), _NATIVE_ROWS)
        torch.ops.mkldnn._linear_pointwise(torch.ones(_NATIVE_ROWS, 32, dtype=torch.bfloat16), w, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _row_gemm(w: torch.Tensor, cache: dict):
    """``x [rows, K] -> x @ w.T`` (BF16) for the BF16 weight ``w [N, K]``: oneDNN's
    linear on ``w`` prepacked once into its blocked layout where available
    (1.7-1.9x faster than ``torch.mm`` on 128-row SmolLM2 GEMMs here, up to 2x
    at decode sizes), else ``torch.mm``. The packed form lives in ``cache``."""
    if _prepacked_available():
        if "amx_packed" not in cache:
            cache["amx_packed"] = torch.ops.mkldnn._reorder_linear_weight(w, _NATIVE_ROWS)
        packed, linear = cache["amx_packed"], torch.ops.mkldnn._linear_pointwise.default  # the overload: no lookup per call
        return lambda x: linear(x, packed, None, "none", [], "")
    if "amx_t" not in cache:
        cache["amx_t"] = w.T.contiguous()
    w_t = cache["amx_t"]
    return lambda x: torch.mm(x, w_t)


@dataclass(frozen=True)
class RowTiles:
    """Rows per GEMM call that keep each row's result independent of the batch:
    ``sizes`` (ascending) were each measured to compute the same bits as the
    largest, ``big``, which long inputs are cut into (the last call zero-padded);
    an input of at most ``big`` rows takes the smallest size that holds it (a
    decode step: its running rows). ``batched``: the GEMM takes all tiles of a
    long input in one call (a leading tile dimension) and was measured to
    compute each tile's own bits there."""

    sizes: tuple[int, ...]
    batched: bool = False  # a long input's tiles in one call of the GEMM (``[tiles, rows, K]``)

    @property
    def big(self) -> int:
        return self.sizes[-1]

    @property
    def small(self) -> int:
        return self.sizes[0]

    def tile_for(self, rows: int) -> int:
        """The call size for an input of ``rows`` rows."""
        return next((t for t in self.sizes if t >= rows), self.big)


_TILE_CANDIDATES = (128, 64, 32, 16)


def _measure_row_tiles(
    gemm: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, candidates: tuple[int, ...] = _TILE_CANDIDATES
) -> RowTiles | None:
    """Row tiles for ``gemm`` (``[..., rows, K] -> [..., rows, N]``), measured with
    the 192-row order-sensitive ``a`` (``order_sensitive_rows``: any change of
    summation order shows; a kernel's choice depends on the shape, not on the
    values).

    A tile of T rows is usable when, in T-row calls, a row's result depends
    neither on its position in the call nor on the other rows (zero padding
    included): with MKL limited to AVX2 and two threads, rows in the second
    half of a 128-row call summed differently from the same rows in the first
    half. ``big``: the largest usable tile (fewest calls); ``sizes``: the
    usable tiles whose rows equal ``big``'s (oneDNN's kernel for <= 32 rows
    sums in another order than for more rows at K = 576 here).
    None when no tile is usable."""
    usable = {}
    for t in candidates:
        first = gemm(a[..., :t, :])
        shifted = gemm(a[..., t // 2 : t // 2 + t, :])  # rows t/2.. at positions 0..
        agree = torch.equal(first[..., t // 2 :, :], shifted[..., : t - t // 2, :])
        for real in (r for r in (1, 3) if r <= t):  # a decode step: a few rows, the rest zeros
            padded = a.new_zeros(*a.shape[:-2], t, a.shape[-1])
            padded[..., :real, :] = a[..., t - real : t, :]
            agree = agree and torch.equal(gemm(padded)[..., :real, :], first[..., t - real :, :])
        if agree:
            usable[t] = first
    if not usable:
        return None
    big = max(usable)
    return RowTiles(tuple(sorted(t for t in usable if torch.equal(usable[t], usable[big][..., :t, :]))))


# Where no tile is usable, calls still get this fixed shape, and
# batch_invariance_failures reports the backend.
_FALLBACK_TILES = RowTiles((_NATIVE_ROWS,))


# oneDNN's BF16 linear sums in one order for more than 32 rows and in others for 2 to 32
# (measured 2026-12-06 on a 2-core Intel Xeon with AMX: every M from 33 to 64 gave the
# 128-row bits at K = 576, from 37 at K = 1536), and a call's cost grows with its 16-row
# AMX tiles: 33-40 rows cost little more than 16 (the 30 layers' GEMMs of SmolLM2 14.4 ms
# against 21.7 ms at 64 rows and 12.9 ms at 16). Hence the candidates just above 32.
_NATIVE_TILE_CANDIDATES = (128, 64, 48, 40, 36, 33, 32, 16)


# Tiles longer than 128 rows for long inputs (a prefill, the training forward): a call
# streams its weight from memory once, so fewer, longer calls read it fewer times. Whether
# a length gives the 128-row bits depends on the shape (measured 2026-12-07 on a 2-core
# Xeon with AMX: 160-192 rows everywhere in SmolLM2, 256-768 at some shapes only), and
# whether it is faster too (gate/up 1.6x at 384 rows, q/k/v 1.9x; down_proj's K = 1536 and
# the LM head's 49,152 outputs fastest at 128-192): both are measured per shape.
_NATIVE_LONG_CANDIDATES = (192, 256, 384, 512, 768)


@functools.lru_cache(maxsize=None)
def _native_row_tiles(k: int, n: int) -> RowTiles:
    """``_measure_row_tiles`` of ``_row_gemm`` for a BF16 ``[N=n, K=k]`` weight,
    measured once per shape on this CPU (``_NATIVE_TILE_CANDIDATES``), then
    widened by ``_long_tiles``."""
    g = torch.Generator().manual_seed(k * 100_003 + n)
    a = order_sensitive_rows(192, k, g).bfloat16()
    gemm = _row_gemm(order_sensitive_cols(n, k, g).bfloat16(), {})
    tiles = _measure_row_tiles(gemm, a, _NATIVE_TILE_CANDIDATES)
    return _FALLBACK_TILES if tiles is None else _long_tiles(gemm, tiles, k, g)


def _long_tiles(gemm: Callable[[torch.Tensor], torch.Tensor], tiles: RowTiles, k: int,
                generator: torch.Generator, repeats: int = 3) -> RowTiles:
    """``tiles`` with the longer sizes (``_NATIVE_LONG_CANDIDATES``) that compute a row
    faster than ``tiles.big`` (timed: the best of ``repeats`` calls per size), are usable
    (``_measure_row_tiles``) and give every row the bits of ``tiles.big``'s calls. The
    fastest of them becomes ``big``, which a long input is cut into; the others serve
    the inputs that fit them. Timing first spares the bit checks of the sizes too slow
    to matter (the LM head's 49,152 outputs: 0.3 s instead of 1.3 s). Two processes may
    pick different lengths, never different bits: every size kept computes the same bits."""
    if not _NATIVE_LONG_CANDIDATES:
        return tiles
    a = order_sensitive_rows(3 * max(_NATIVE_LONG_CANDIDATES) // 2, k, generator).bfloat16()

    def seconds_per_row(t: int) -> float:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            gemm(a[:t])
            best = min(best, time.perf_counter() - start)
        return best / t

    speed = {t: seconds_per_row(t) for t in (tiles.big, *_NATIVE_LONG_CANDIDATES)}
    equal = [t for t in _NATIVE_LONG_CANDIDATES
             if speed[t] < speed[tiles.big]
             and _measure_row_tiles(gemm, a, (t,)) is not None
             and torch.equal(gemm(a[:t]), _tiled_rows(a[:t], tiles, gemm))]
    if not equal:
        return tiles
    fastest = min(equal, key=speed.__getitem__)
    return RowTiles((*tiles.sizes, *(t for t in equal if t <= fastest)), tiles.batched)


@functools.lru_cache(maxsize=None)
def _fp32_row_tiles(bk: int, n: int) -> RowTiles:
    """``_measure_row_tiles`` of ``_accumulate_tile`` (one ``bk``-wide K block,
    ``n`` outputs), measured once per shape on this CPU, ``batched`` where three
    tiles in one batched call compute what each computes alone."""
    g = torch.Generator().manual_seed(bk * 100_003 + n)
    blocks = [order_sensitive_cols(n, bk, g)]
    a = order_sensitive_rows(3 * _NATIVE_ROWS, bk, g)
    gemm = functools.partial(_accumulate_tile, b_blocks=blocks, bk=bk)
    tiles = _measure_row_tiles(gemm, a[:192])
    if tiles is None:
        return _FALLBACK_TILES
    batched = all(
        torch.equal(gemm(a[: 3 * t].view(3, t, bk)), torch.stack([gemm(a[i * t : (i + 1) * t]) for i in range(3)]))
        for t in tiles.sizes
    )
    return RowTiles(tiles.sizes, batched)


def _stacked_blocks(per_weight: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """``_k_blocks`` of several ``[N_i, K]`` weights -> the K blocks of their ``[sum N_i, K]`` stack."""
    return [torch.cat(blocks) for blocks in zip(*per_weight, strict=True)]


@functools.lru_cache(maxsize=None)
def _group_gemm_exact(bk: int, k: int, ns: tuple[int, ...]) -> bool:
    """Whether ``_accumulate_k_blocks`` against weights of ``ns`` outputs stacked along N
    gives every weight's columns the bits of that weight's own call, measured once
    per shape on this CPU with order-sensitive data (``order_sensitive_rows``) at the
    row counts of a decode step (1, 3, every row tile of the stack and of each
    weight) and of a long input (two big tiles and a padded one). The linears of
    one input take the stacked call where it holds (one BLAS call and one pass of
    Python instead of one per linear, the same bits); MKL computes an output
    column the same whatever N around it on a 2-core AMD EPYC with AVX2 (every
    shape of tiny-arith and SmolLM2-135M)."""
    g = torch.Generator().manual_seed(k * 100_003 + sum(ns) * 7 + len(ns))
    per_weight = [_k_blocks(order_sensitive_cols(n, k, g), bk) for n in ns]
    stacked = _stacked_blocks(per_weight)
    tiles = [_fp32_row_tiles(bk, n) for n in (sum(ns), *ns)]
    rows = {1, 3, 2 * tiles[0].big + 5, *(t for tile in tiles for t in tile.sizes)}
    for m in sorted(rows):
        x = order_sensitive_rows(m, k, g)
        alone = torch.cat([_accumulate_k_blocks(x, blocks, bk) for blocks in per_weight], dim=1)
        if not torch.equal(_accumulate_k_blocks(x, stacked, bk), alone):
            return False
    return True


def _stacked_once(cache: dict, key: str, others: Sequence[object], make: Callable[[], object]) -> object:
    """The stacked form of a group of weights (``make()``), kept in ``cache`` (the first
    weight's) with the other weights it was made of and made again when one of them
    is another object (requantized). The first weight itself is not kept there: a
    reference cycle would hold every optimizer step's weights until Python's cyclic
    garbage collector ran."""
    made = cache.get(key)
    if made is None or len(made[0]) != len(others) or any(a is not b for a, b in zip(made[0], others)):
        made = (tuple(others), make())
        cache[key] = made
    return made[1]


def _packed_stack(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, DerivedCache]:
    """BF16 weights ``[N_i, K]`` stacked along N for ``_native_rows``: a stand-in of the
    stack's shape that holds no memory, and the cache with the GEMM's own form of the
    stack (``_row_gemm``'s packed or transposed copy), which is all a forward call reads.
    Keeping the stack itself would hold those weights once more (SmolLM2-135M: 140 MB)."""
    stacked, cache = torch.cat(list(weights)), DerivedCache()
    _row_gemm(stacked, cache)
    return torch.zeros((), dtype=stacked.dtype, device=stacked.device).expand(stacked.shape), cache



def _native_group(
    x: torch.Tensor, ws: Sequence[QTensor | torch.Tensor], cache: dict, bf16_weights: Callable[[], list[torch.Tensor]]
) -> list[torch.Tensor] | None:
    """``amx``'s stacked forward GEMM of the linears of one input: ``x [T, K]`` times the
    BF16 weights ``bf16_weights()`` (made only when the stack is made) stacked along N,
    packed once and kept in ``cache`` (the first weight's), split back per weight; None
    where ``_native_group_exact`` did not measure that to give each weight its own bits."""
    ns = tuple(w.shape[0] for w in ws)
    if len(ws) < 2 or not _native_group_exact(x.shape[-1], ns):
        return None
    stacked, stacked_cache = _stacked_once(cache, "amx_group", ws[1:], lambda: _packed_stack(bf16_weights()))
    return list(_native_rows(x, stacked, True, stacked_cache).split(ns, dim=1))


@functools.lru_cache(maxsize=None)
def _native_group_exact(k: int, ns: tuple[int, ...]) -> bool:
    """Whether ``_native_rows`` on BF16 weights of ``ns`` outputs stacked along N gives
    every weight's columns the bits of that weight's own call, measured once per
    shape on this CPU like ``_group_gemm_exact`` (order-sensitive data; the row counts
    of a decode step, every row tile of the stack and of each weight, and a long
    input). oneDNN sums each output over K in an order it picks from the shape, so
    this is measured, not assumed; where it holds, the q/k/v and gate/up GEMMs of a
    layer are one call each (one kernel launch and one pass of Python instead of
    three or two)."""
    g = torch.Generator().manual_seed(k * 100_003 + sum(ns) * 7 + len(ns) + 1)
    ws = [order_sensitive_cols(n, k, g).bfloat16() for n in ns]
    stacked, stacked_cache = torch.cat(ws), {}
    caches: list[dict] = [{} for _ in ws]
    tiles = [_native_row_tiles(k, n) for n in (sum(ns), *ns)]
    rows = {1, 3, 2 * tiles[0].big + 5, *(t for tile in tiles for t in tile.sizes)}
    for m in sorted(rows):
        x = order_sensitive_rows(m, k, g)
        alone = torch.cat([_native_rows(x, w, True, c) for w, c in zip(ws, caches)], dim=1)
        if not torch.equal(_native_rows(x, stacked, True, stacked_cache), alone):
            return False
    return True


def _tiled_rows(
    a: torch.Tensor, tiles: RowTiles, gemm: Callable[[torch.Tensor], torch.Tensor], out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``gemm`` over the rows (dim -2) of ``a`` in calls of exactly ``tiles.tile_for``
    rows (an input that fits one) or ``tiles.big`` rows, zero-padded; the result in
    ``out_dtype`` (default: ``gemm``'s). ``tiles.batched``: one call on
    ``[..., tiles, rows, K]``; else one call per tile, each written once into the
    result, and only the last tile is copied to be padded (a long attention
    operand, ``[..., T, T]``, is not)."""
    m = a.shape[-2]
    tile = tiles.tile_for(m)
    if tiles.batched:
        pad = -m % tile
        if pad:
            a = torch.cat([a, a.new_zeros(*a.shape[:-2], pad, a.shape[-1])], dim=-2)
        if a.dim() == 2 and a.shape[0] == tile:  # one tile: the 2-D call the batched one makes of it
            out = gemm(a)
        else:
            out = gemm(a.unflatten(-2, (-1, tile))).flatten(-3, -2)
        out = out[..., :m, :] if pad else out
        return out if out_dtype is None else out.to(out_dtype)

    def rows_from(r: int) -> torch.Tensor:  # the call's input: rows r .. r + tile, zero-padded
        x = a[..., r : r + tile, :]
        n = x.shape[-2]
        return x if n == tile else torch.cat([x, x.new_zeros(*x.shape[:-2], tile - n, x.shape[-1])], dim=-2)

    first = gemm(rows_from(0))
    if m <= tile:
        out = first[..., :m, :] if m < tile else first
        return out if out_dtype is None else out.to(out_dtype)
    out = first.new_empty(*first.shape[:-2], m, first.shape[-1], dtype=out_dtype or first.dtype)
    out[..., :tile, :] = first
    for r in range(tile, m, tile):
        n = min(tile, m - r)
        out[..., r : r + n, :] = gemm(rows_from(r))[..., :n, :]
    return out


def _native_rows(a: torch.Tensor, w: torch.Tensor, invariant: bool, cache: dict) -> torch.Tensor:
    """BF16 ``a [M, K] @ w [N, K].T`` -> FP32 ``[M, N]`` on the CPU's native BF16 GEMM
    (``a`` in any float dtype, rounded to BF16 on the way in; ``w`` BF16;
    ``cache`` a dict owned by ``w`` for its packed form and scratch buffer).

    Batch invariance: oneDNN picks its kernel and K blocking (hence the
    summation order) from M, so one row's result changed with the number of
    rows in the call (measured: most M between 28 and 256 disagree with
    M = 4096 somewhere). Calls get exactly the row counts of
    ``_native_row_tiles`` (measured per shape), so every row goes through the
    same arithmetic whatever the batch. ``invariant=False`` makes one call on
    all rows. A decode step's padded input lives in ``cache`` between calls
    (fresh buffers every call cost page faults).
    """
    if not invariant:
        if "amx_t" not in cache:
            cache["amx_t"] = w.T.contiguous()
        return (a.to(w.dtype) @ cache["amx_t"]).float()
    entry = cache.get("amx_rows")  # what every call on this weight reads: made once
    if entry is None:
        entry = cache["amx_rows"] = (_row_gemm(w, cache), _native_row_tiles(w.shape[1], w.shape[0]))
    gemm, tiles = entry
    m = a.shape[0]
    if m > tiles.small:
        return _tiled_rows(a.to(w.dtype), tiles, gemm, torch.float32)
    buf = cache.get("rows_in")
    if buf is None:
        # A normal tensor even when made in the rollout's inference mode: the training
        # forward (with a graph, outside it) writes into it too.
        with torch.inference_mode(False):
            buf = cache["rows_in"] = w.new_zeros(tiles.small, w.shape[1])
        cache["rows_used"] = 0
    buf[:m].copy_(a)
    used = cache["rows_used"]  # rows past this are zero already: only the last call's rest is zeroed
    if used > m:
        buf[m:used].zero_()
    cache["rows_used"] = m
    return gemm(buf)[:m].float()


def _sorted_block_sums(
    a: torch.Tensor, sa: torch.Tensor, b64: torch.Tensor, sb: torch.Tensor, bk: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """``sum_kb partial_kb * sa[:, kb] * sb[:, kb]`` for ``a [M, K]`` (FP32 values),
    ``b64 [N, K]`` (float64), float64 per-row block scales ``sa [M, KB]``,
    ``sb [N, KB]``: each block's partial sum in float64, scaled (rounded once),
    the partials of each output summed in float64 in ascending order of value
    and rounded once to FP32, then to ``out_dtype``. A function of the multiset
    of the partials: no BLAS summation order, thread count or batch can show."""
    m, k = a.shape
    n, kb = b64.shape[0], -(-k // bk)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    # Rows are independent; chunking only bounds the [rows, N, kb] buffer.
    rows = max(1, (1 << 24) // max(1, n * kb))
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        a64 = a[r0:r1].double()
        parts = torch.empty(r1 - r0, n, kb, dtype=torch.float64, device=a.device)
        for j in range(kb):
            ks = slice(j * bk, (j + 1) * bk)
            parts[:, :, j] = (a64[:, ks] @ b64[:, ks].T) * (sa[r0:r1, j, None] * sb[None, :, j])
        if kb > 1:
            parts = parts.sort(dim=-1).values
        acc = torch.zeros(r1 - r0, n, dtype=torch.float64, device=a.device)
        for j in range(kb):
            acc += parts[:, :, j]
        out[r0:r1] = acc.float().to(out_dtype)
    return out


# --- the backends ----------------------------------------------------------------------


class Backend:
    """One kind of arithmetic. Subclasses implement the FP8 GEMM; the BF16 GEMM,
    the LM head and the attention products have defaults they may override.

    Backend objects are stateless singletons (per-weight caches live in dicts
    owned by the weights), so copying a model keeps the same objects.
    """

    name: str = ""
    exact: bool = False
    batch_invariant: bool = False
    # K block width of the emulated BF16 GEMM (matches the FP8 recipe's 128).
    bk: int = 128
    # Attention as kernels.c's fused pass (fp8rl/fp8/kernels.py `attention`) where the compiled
    # kernels load: decode steps and the training forward run that one arithmetic, row by row,
    # and a decode reads a BF16 KV cache directly. Elsewhere (and for `reference`, the float64
    # definition) the products `attention_scores` / `attention_values` around torch's softmax.
    fused_attention: bool = False
    # RMSNorm and the MLP's silu(gate) * up as kernels.c's loops (their own fixed arithmetic, which
    # every forward under this backend runs: a decode step's rows and the training forward's get
    # the same bits) where the compiled kernels load; elsewhere (and for `reference`) torch's ops.
    fused_pointwise: bool = False
    # What an FP8 backward GEMM's operands are made as (`grad_operand`): None, the QTensor of
    # `quantize`; a dtype, for a backend that multiplies dequantized values, those values.
    grad_operand_dtype: torch.dtype | None = None

    def fp8_matmul(self, a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
        """``dequant(a) @ dequant(b).T`` -> ``[M, N]`` in ``out_dtype``; ``b`` is the
        weight-like operand whose converted forms may be kept in ``b.cache``."""
        raise NotImplementedError

    def grad_operand(self, x: torch.Tensor, block: tuple[int, int], scale_fmt: str, name: str) -> QTensor | torch.Tensor:
        """An FP8 backward GEMM's operand ``x [M, K]`` (a gradient or a saved input, high
        precision) quantized to E4M3 ``block``s, in the form this backend's ``fp8_matmul``
        (``invariant=False``) multiplies; ``.t()`` transposes either form: the QTensor of
        ``quantize``, or with ``grad_operand_dtype`` the dequantized values in that dtype
        (``quantize_dequantize_blocks``: the same numbers in one pass instead of quantize,
        dequantize and a rounding)."""
        if self.grad_operand_dtype is None:
            return quantize(x, block, scale_fmt=scale_fmt, name=name)
        return quantize_dequantize_blocks(x, block, self.grad_operand_dtype, scale_fmt, name)

    def linear_input(
        self, x: torch.Tensor, bk: int, scale_fmt: str, name: str, amax_floor: float = AMAX_FLOOR
    ) -> QTensor | torch.Tensor:
        """A linear's forward input ``x [T, K]`` (high precision) quantized to 1 x ``bk``
        blocks (``amax_floor``: the engine convention, formats.AMAX_FLOORS), in the
        form this backend's ``fp8_linear`` multiplies. ``name`` names ``x`` in a
        NaN/Inf error. Default: the QTensor of ``quantize``; a backend that
        multiplies dequantized values returns them (``quantize_dequantize``: the
        same numbers in fewer passes)."""
        return quantize(x, (1, bk), scale_fmt=scale_fmt, name=name, amax_floor=amax_floor)

    def fp8_linear(self, xq: QTensor | torch.Tensor, w: QTensor) -> torch.Tensor:
        """A linear's forward FP8 GEMM: ``xq`` (``linear_input`` with ``w``'s K block
        width) times the block-quantized weight ``w [N, K]`` -> FP32 ``[T, N]``,
        batch-invariant, the bits of ``fp8_matmul(quantize(x), w)``."""
        return self.fp8_matmul(xq, w, torch.float32)

    def fp8_linear_group(self, xq: QTensor | torch.Tensor, ws: Sequence[QTensor]) -> list[torch.Tensor] | None:
        """The forward GEMMs of several linears of one input (q/k/v, gate/up) in one call:
        ``[fp8_linear(xq, w) for w in ws]``, the same bits, or None where this backend
        has no such call or it was not measured to give those bits on this CPU (the
        caller then makes one call per weight). Default: None."""
        return None

    def bf16_matmul(self, a: torch.Tensor, b: torch.Tensor, cache: dict, invariant: bool = True) -> torch.Tensor:
        """``a [M, K] @ b [N, K].T`` with BF16-rounded operands -> FP32 ``[M, N]``.
        ``cache``: a dict owned by ``b`` (emptied by its owner when ``b`` changes).

        Default, the emulation of ``reference`` and ``cpu``: BF16-rounded operands
        (exact products in FP32), FP32 accumulation per ``bk``-wide K block like the
        FP8 GEMM, hence the same batch invariance; a backward GEMM (``invariant=False``)
        in one full-K call (``_full_k``)."""
        if not invariant:
            if "fp32_full" not in cache:
                cache["fp32_full"] = b.bfloat16().float()
            return _full_k(a.bfloat16().float(), cache["fp32_full"])
        if "fp32_blocks" not in cache:
            cache["fp32_blocks"] = _k_blocks(b.bfloat16().float(), self.bk)
        return _accumulate_k_blocks(a.bfloat16().float(), cache["fp32_blocks"], self.bk)

    def bf16_linear_group(self, x: torch.Tensor, ws: Sequence[torch.Tensor], cache: dict) -> list[torch.Tensor] | None:
        """The BF16 forward GEMMs of several linears of one input in one call:
        ``[bf16_matmul(x, w, cache_of_w) for w in ws]``, the same bits, or None as for
        ``fp8_linear_group``. ``cache``: a dict owned by ``ws[0]``, emptied when it
        changes. Default: None."""
        return None

    def head_logits(self, h: torch.Tensor, w: torch.Tensor, cache: dict) -> torch.Tensor:
        """LM-head logits ``h [N, D] @ w [V, D].T`` on BF16 operands -> FP32, batch-invariant."""
        return self.bf16_matmul(h, w, cache)

    def head_grads(
        self, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, need_dh: bool, need_dw: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``head_logits``: grad ``[N, V]``, h ``[N, D]``, w ``[V, D]`` ->
        (dh ``[N, D]``, dw ``[V, D]``), those of an FP32 linear on the BF16-rounded operands."""
        dh = grad @ w.to(torch.bfloat16).float() if need_dh else None
        dw = grad.T @ h.to(torch.bfloat16).float() if need_dw else None
        return dh, dw

    def attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q [..., T, D] @ k [..., L, D].T`` -> FP32 ``[..., T, L]``, batch-invariant.

        FP32 batched GEMMs on query rows in calls of exactly the row counts of
        ``_attention_tiles`` (zero-padded): a single query row (a decode step)
        would take BLAS's matrix-vector kernel, and other row counts other
        kernels, each summing in its own order. With measured row counts,
        each score is the same FP32 dot product, summed in that kernel's fixed
        K order, whether its row is computed alone (rollout) or among all of
        the sequence's rows (training). Checked on the CPU at hand by
        ``batch_invariance_failures`` before ``auto`` picks a backend."""
        return _bmm_tiled(q.float(), k.float().transpose(-1, -2))

    def attention_values(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``p [..., T, L] @ v [..., L, D]`` -> FP32 ``[..., T, D]``, like ``attention_scores``."""
        return _bmm_tiled(p.float(), v.float())

    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A router's logits ``x [N, D] @ w [E, D].T`` -> FP32 ``[N, E]``, FP32 operands,
        batch-invariant the way ``attention_scores`` is (measured row tiles): a
        token chooses the same experts in a decode step and in the training forward."""
        return _bmm_tiled(x.float(), w.float().T)

    def __deepcopy__(self, memo: dict) -> "Backend":
        return self  # a singleton: a copied model keeps using the registry's object

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


class ReferenceBackend(Backend):
    """Exact: FP8 (and BF16) block sums in float64 (exact), float64 promotion,
    the scaled partials summed in float64 in ascending order, rounded once to
    FP32; the LM head in float64 on BF16 operands; attention products in
    float64. Bitwise independent of batch size, K-block order and the CPU's
    BLAS kernels by construction. Slow: the numerics' reference, and what
    ``auto`` falls back to where a fast backend fails the batch-invariance check."""

    name = "reference"
    exact = True
    batch_invariant = True

    def fp8_matmul(self, a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
        """Exactness: an E4M3 x E4M3 product is a multiple of 2**-18 below 2**17.6,
        so a float64 sum of up to 2**17 of them is exact in any order; each block
        sum ``partial_kb`` is therefore exact whatever the float64 GEMM does.
        ``sa * sb`` (two FP32 numbers) is exact in float64; ``partial_kb * (sa*sb)``
        is rounded once. (E5M2 operands have more range; their block sums are
        exact only when they fit 53 bits.) FP32 accumulation in K order would
        change bits when the K blocks are permuted, so the scaled partials of
        each output are summed in float64 in ascending order of value and
        rounded once to FP32 (then to a narrower ``out_dtype``): the result is a
        function of the multiset of partials. The error is the final rounding
        plus at most ``ceil(K/bk)`` float64 roundings.
        """
        if "reference" not in b.cache:  # a weight: converted once, reused by every call
            b.cache["reference"] = (fp8_to_float(b.data).double(), _row_scales(b).double())
        b64, sb = b.cache["reference"]
        return _sorted_block_sums(fp8_to_float(a.data), _row_scales(a).double(), b64, sb, a.block[1], out_dtype)

    def bf16_matmul(self, a: torch.Tensor, b: torch.Tensor, cache: dict, invariant: bool = True) -> torch.Tensor:
        """The BF16 GEMM the same way: BF16 x BF16 products are exact in float64
        and so is a block sum of 128 of them as long as the block's products
        span less than 2**29 in magnitude (53 bits minus 16 for the products and
        7 for 128 terms); beyond that, the smallest are rounded in float64, 2**-53
        relative. Then the sorted sum, rounded once to FP32. Backward GEMMs
        (``invariant=False``) take the FP32 emulation of the base class."""
        if not invariant:
            return super().bf16_matmul(a, b, cache, invariant)
        if "reference_bf16" not in cache:
            cache["reference_bf16"] = b.bfloat16().double()
        b64 = cache["reference_bf16"]
        ones_a = torch.ones(a.shape[0], -(-a.shape[1] // self.bk), dtype=torch.float64, device=a.device)
        ones_b = torch.ones(b64.shape[0], ones_a.shape[1], dtype=torch.float64, device=a.device)
        return _sorted_block_sums(a.bfloat16().float(), ones_a, b64, ones_b, self.bk, torch.float32)

    def head_logits(self, h: torch.Tensor, w: torch.Tensor, cache: dict) -> torch.Tensor:
        if "head64" not in cache:
            cache["head64"] = w.to(torch.bfloat16).double()
        return (h.to(torch.bfloat16).double() @ cache["head64"].T).float()

    def attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Float64 math on FP32 operands (each product exact), rounded once to FP32."""
        return (q.double() @ k.double().transpose(-1, -2)).float()

    def attention_values(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (p.double() @ v.double()).float()

    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Float64 math on FP32 operands (each product exact), rounded once to FP32."""
        return (x.double() @ w.double().T).float()


class CPUBackend(Backend):
    """FP32 emulation for any CPU: per K block, both operand slices dequantized
    to FP32 and accumulated ``out += a_blk @ b_blk.T`` in FP32.

    Chosen by measurement (benchmarks/fp8_gemm.py, 1 thread, AVX-512 CPU):
    ``torch._scaled_mm`` with row scales, one call per K block, is about 2x
    slower (its oneDNN FP8 kernel converts internally); one FP32 GEMM over the
    fully dequantized operands is about as fast but ~1.5x less accurate and
    not batch invariant. About 2e-7 relative Frobenius error against
    ``reference``; batch-invariant by measured row tiles (``_accumulate_k_blocks``)."""

    name = "cpu"
    batch_invariant = True
    fused_attention = True
    fused_pointwise = True
    grad_operand_dtype = torch.float32  # the FP8 backward multiplies FP32 values

    def fp8_matmul(
        self, a: QTensor | torch.Tensor, b: QTensor | torch.Tensor, out_dtype: torch.dtype, invariant: bool = True
    ) -> torch.Tensor:
        """A backward GEMM (``invariant=False``) also takes ``grad_operand``'s FP32 values
        for a QTensor: the same numbers in the same layout, hence the same call."""
        if not invariant:  # a backward GEMM: the same scaled operands, one full-K call
            if isinstance(a, QTensor):
                a = _block_scaled(fp8_to_float(a.data), _row_scales(a), a.block[1])
            if isinstance(b, QTensor):
                if "cpu_full" not in b.cache:  # the dgrad's weight: once per quantization
                    b.cache["cpu_full"] = _block_scaled(fp8_to_float(b.data), _row_scales(b), b.block[1])
                b = b.cache["cpu_full"]
            return _full_k(a, b).to(out_dtype)
        bk = a.block[1]
        return _accumulate_k_blocks(fp8_to_float(a.data), self._weight_blocks(b), bk, _row_scales(a)).to(out_dtype)

    def linear_input(
        self, x: torch.Tensor, bk: int, scale_fmt: str, name: str, amax_floor: float = AMAX_FLOOR
    ) -> torch.Tensor:
        """``quantize_dequantize``: the values ``fp8_matmul`` multiplies, ``q * scale``,
        in fewer passes and without the FP8 round trip."""
        return quantize_dequantize(x, bk, scale_fmt, name, amax_floor)

    def fp8_linear(self, xq: torch.Tensor, w: QTensor) -> torch.Tensor:
        """The dequantized input into the same K-block GEMMs as ``fp8_matmul``: the
        same operands, hence the same bits."""
        return _accumulate_k_blocks(xq, self._weight_blocks(w), w.block[1])

    def fp8_linear_group(self, xq: torch.Tensor, ws: Sequence[QTensor]) -> list[torch.Tensor] | None:
        """The weights' dequantized K blocks stacked along N (made once per quantization,
        kept in the first weight's cache) in one ``_accumulate_k_blocks`` call, where
        ``_group_gemm_exact`` measured that to give each weight's own bits."""
        bk, ns = ws[0].block[1], tuple(w.shape[0] for w in ws)
        if len(ws) < 2 or any(w.block[1] != bk for w in ws) or not _group_gemm_exact(bk, xq.shape[-1], ns):
            return None
        blocks = _stacked_once(
            ws[0].cache, "cpu_group", ws[1:], lambda: _stacked_blocks([self._weight_blocks(w) for w in ws])
        )
        return list(_accumulate_k_blocks(xq, blocks, bk).split(ns, dim=1))

    def bf16_linear_group(self, x: torch.Tensor, ws: Sequence[torch.Tensor], cache: dict) -> list[torch.Tensor] | None:
        """``bf16_matmul``'s K-block GEMMs (the emulation of the base class) on the BF16
        weights stacked along N, where ``_group_gemm_exact`` measured that to give each
        weight's own bits: the arithmetic of ``fp8_linear_group`` on other values."""
        ns = tuple(w.shape[0] for w in ws)
        if len(ws) < 2 or not _group_gemm_exact(self.bk, x.shape[-1], ns):
            return None
        blocks = _stacked_once(
            cache, "cpu_group", ws[1:], lambda: _stacked_blocks([_k_blocks(w.bfloat16().float(), self.bk) for w in ws])
        )
        return list(_accumulate_k_blocks(x.bfloat16().float(), blocks, self.bk).split(ns, dim=1))

    @staticmethod
    def _weight_blocks(b: QTensor) -> list[torch.Tensor]:
        """The weight's dequantized FP32 K blocks, made once per quantization."""
        if "cpu_blocks" not in b.cache:
            b.cache["cpu_blocks"] = _k_blocks(fp8_to_float(b.data), b.block[1], _row_scales(b))
        return b.cache["cpu_blocks"]


class AMXBackend(Backend):
    """The CPU's native BF16 matrix units (AMX, or AVX512-BF16) through oneDNN.

    FP8 operands are dequantized to BF16 (E4M3 values are exact in BF16;
    ``q * scale`` is exact for ue8m0 scales and rounded once, 2**-9 relative,
    for FP32 scales) and multiplied in one full-K BF16 GEMM with FP32
    accumulation and a BF16 output, as GPU BF16/FP8 GEMMs write theirs: about
    50 dB SQNR against ``reference``. Weights are prepacked for oneDNN once per
    quantization. Batch-invariant by measurement: every call runs on exactly one of
    the row counts measured per shape to give the same bits (``_native_rows``)."""

    name = "amx"
    batch_invariant = True
    fused_attention = True
    fused_pointwise = True
    grad_operand_dtype = torch.bfloat16  # the FP8 backward multiplies BF16 values

    def fp8_matmul(
        self, a: QTensor | torch.Tensor, b: QTensor | torch.Tensor, out_dtype: torch.dtype, invariant: bool = True
    ) -> torch.Tensor:
        """A QTensor operand dequantized to BF16; a BF16 one (``grad_operand``'s) as it is,
        in the row-major layout the dequantization would have (the same GEMM call)."""
        a = a.contiguous() if isinstance(a, torch.Tensor) else dequantize(a, torch.bfloat16)
        if isinstance(b, torch.Tensor):
            return _native_rows(a, b, invariant, {}).to(out_dtype)
        return _native_rows(a, self._bf16_form(b), invariant, b.cache).to(out_dtype)

    def linear_input(
        self, x: torch.Tensor, bk: int, scale_fmt: str, name: str, amax_floor: float = AMAX_FLOOR
    ) -> torch.Tensor:
        """``quantize_dequantize``: the same values as quantize + dequantize, in fewer passes."""
        return quantize_dequantize(x, bk, scale_fmt, name, amax_floor)

    def fp8_linear(self, xq: torch.Tensor, w: QTensor) -> torch.Tensor:
        """The dequantized input into the native GEMM."""
        return _native_rows(xq, self._bf16_form(w), True, w.cache)

    def bf16_matmul(self, a: torch.Tensor, b: torch.Tensor, cache: dict, invariant: bool = True) -> torch.Tensor:
        if "amx_w" not in cache:
            cache["amx_w"] = b.bfloat16()
        return _native_rows(a, cache["amx_w"], invariant, cache)

    def fp8_linear_group(self, xq: torch.Tensor, ws: Sequence[QTensor]) -> list[torch.Tensor] | None:
        """The weights' BF16 forms stacked along N in one native GEMM (``_native_group``),
        dequantized for the stack only: no per-weight BF16 form is kept for the forward."""
        return _native_group(xq, ws, ws[0].cache, lambda: [dequantize(w, torch.bfloat16) for w in ws])

    def bf16_linear_group(self, x: torch.Tensor, ws: Sequence[torch.Tensor], cache: dict) -> list[torch.Tensor] | None:
        """The BF16 weights stacked along N in one native GEMM (``_native_group``)."""
        return _native_group(x, ws, cache, lambda: [w.bfloat16() for w in ws])

    @staticmethod
    def _bf16_form(w: QTensor) -> torch.Tensor:
        """The weight dequantized to BF16 (exact for E4M3 data with ue8m0 scales), once per quantization."""
        if "amx_w" not in w.cache:
            w.cache["amx_w"] = dequantize(w, torch.bfloat16)
        return w.cache["amx_w"]

    def head_grads(
        self, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, need_dh: bool, need_dw: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grad = grad.bfloat16()  # what both GEMMs round it to: once, not once each ([N, vocab])
        dh = self.bf16_matmul(grad, w.T, {}, invariant=False) if need_dh else None
        dw = self.bf16_matmul(grad.T, h.T, {}, invariant=False) if need_dw else None
        return dh, dw


BACKENDS: dict[str, Backend] = {b.name: b for b in (ReferenceBackend(), CPUBackend(), AMXBackend())}

def get_backend(backend: Backend | str) -> Backend:
    """The registry's backend called ``backend`` (a Backend passes through)."""
    if isinstance(backend, Backend):
        return backend
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown GEMM backend {backend!r}; valid backends: {', '.join(BACKENDS)}") from None


def amx_available() -> bool:
    """True when this CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def avx512_bf16_available() -> bool:
    """True when this CPU has AVX512-BF16 dot products (AMD Zen 4 and later, Intel
    Cooper Lake and later): oneDNN's BF16 GEMMs are native there, not emulated."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe is not None and probe())


def native_bf16_available() -> bool:
    """True when oneDNN's BF16 GEMMs (``amx``) are native on this CPU: AMX tiles or
    AVX512-BF16. Elsewhere (AVX2 only) they are emulated, 11-12x slower than ``cpu``."""
    return amx_available() or avx512_bf16_available()


# The narrowest mixture-of-experts model (the smallest input width of its linears, i.e.
# its hidden size) for which `amx` beats `cpu` on a CPU with AVX512-BF16 but no AMX
# tiles; a dense model takes `amx` at every width. Measured on a 2-core AMD EPYC (Zen 4),
# GRPO steps of benchmarks/backends.py (benchmarks/README.md). 2026-12-07: dense, amx
# 1.26x / 1.07x faster than cpu at width 128 (tiny-arith, bf16 / jet; the default run 33
# s against 38 s, two alternated runs each), 1.58x / 1.26x for tiny-chain (128), 1.42-1.64x
# at 192; mixtures of experts, cpu 1.21x / 1.37x faster at 128 (tiny-moe: 4 experts 128
# wide, top 2, a few rows per expert GEMM), amx 1.29-1.42x at 192, 1.33-1.48x at 256,
# 1.35-1.68x at 384. (On 2026-12-03, before the fused kernels of `amx`, cpu had won for
# the dense tiny policy too: the threshold then applied to every model.)
AVX512_BF16_MIN_MOE_WIDTH = 192


def model_width(model: nn.Module) -> int:
    """The smallest input width of ``model``'s linears (LM head excluded): a decoder's
    hidden size. 0 for a model without linears."""
    return min((k for _, k in _linear_shapes(model)), default=0)


def fast_backend(model: nn.Module | None = None) -> Backend:
    """The fastest CPU backend for ``model`` by the measured rule (benchmarks/README.md,
    ``benchmarks/backends.py``), without the batch-invariance check of
    ``choose_backend``: ``amx`` where the CPU has AMX tiles (fastest for every model size
    measured); ``amx`` where it has AVX512-BF16 without AMX, except for a mixture of
    experts (a model with routers) narrower than ``AVX512_BF16_MIN_MOE_WIDTH``, which
    takes ``cpu`` (``model=None``: a dense model); else ``cpu`` (on an AVX2-only CPU
    ``amx``'s BF16 GEMMs are emulated, 11-12x slower)."""
    if amx_available():
        return BACKENDS["amx"]
    if avx512_bf16_available() and (
        model is None or not _router_shapes(model) or model_width(model) >= AVX512_BF16_MIN_MOE_WIDTH
    ):
        return BACKENDS["amx"]
    return BACKENDS["cpu"]


def _linear_shapes(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Distinct ``(out_features, in_features)`` of the model's linears, LM head excluded."""
    head = getattr(model, "lm_head", None)
    shapes = {
        tuple(m.weight.shape) for m in model.modules()
        if hasattr(m, "in_features") and m is not head and getattr(m, "weight", None) is not None
    }
    return tuple(sorted(shapes))


def _router_shapes(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Distinct ``(out, in)`` weight shapes of the model's MoE routers and gates."""
    return tuple(sorted({tuple(m.weight.shape) for m in model.modules() if hasattr(m, "router_backend")}))


def batch_invariance_failures(backend: Backend, model: nn.Module) -> list[str]:
    """Measure, on this CPU, what rollout == training rests on: for every GEMM
    shape of ``model`` (its linears in FP8 and BF16, its LM head, its attention
    products, its MoE routers), rows computed alone or in groups must equal the
    same rows computed inside a 1,573-row call, bit for bit. Inputs are made so that any
    change in summation order shows (``order_sensitive_rows``). Returns one
    line per disagreeing product (empty: invariant). Measured once per backend
    and set of shapes in a process: about 1.6 s for SmolLM2-135M on `amx`, its row tiles
    measured on the way (2-core Xeon with AMX, 2026-12-07)."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    return list(_invariance_probe(
        backend,
        _linear_shapes(model),
        tuple(head.weight.shape) if head is not None else None,
        (config.num_heads, config.head_dim) if config is not None else None,
        _router_shapes(model),
    ))


@functools.lru_cache(maxsize=None)
def _invariance_probe(
    backend: Backend, linears: tuple, head_shape: tuple | None, attention: tuple | None, routers: tuple = ()
) -> tuple[str, ...]:
    """``batch_invariance_failures`` on shapes (hashable, hence cached)."""
    g = torch.Generator().manual_seed(0)
    # More than two of the longest row tiles (_long_tiles), so that a row's position in its
    # tile varies and the parts run on other tile lengths than the whole.
    rows = 2 * max(_NATIVE_LONG_CANDIDATES, default=_NATIVE_ROWS) + 37
    subsets = [slice(0, 1), slice(17, 18), slice(150, 151), slice(rows - 1, rows), slice(8, 24), slice(100, 200),
               slice(700, 900)]
    failures = []

    def check(what: str, full: torch.Tensor, part) -> None:
        for sl in subsets:
            if not torch.equal(part(sl), full[sl]):
                failures.append(f"{what}: rows {sl.start}..{sl.stop - 1} differ when computed apart")
                return

    for n, k in linears:
        x, w = order_sensitive_rows(rows, k, g), order_sensitive_cols(n, k, g)
        qw = quantize(w, (128, 128))
        check(f"fp8 GEMM {n}x{k}", backend.fp8_matmul(quantize(x), qw, torch.float32),
              lambda sl: backend.fp8_matmul(quantize(x[sl]), qw, torch.float32))
        cache: dict = {}
        check(f"bf16 GEMM {n}x{k}", backend.bf16_matmul(x, w, cache), lambda sl: backend.bf16_matmul(x[sl], w, cache))
    if head_shape is not None:
        n, k = head_shape
        x, w, cache = order_sensitive_rows(rows, k, g), order_sensitive_cols(n, k, g), {}
        check(f"LM head {n}x{k}", backend.head_logits(x, w, cache), lambda sl: backend.head_logits(x[sl], w, cache))
    if attention is not None:
        (heads, d), slots = attention, 64
        q = order_sensitive_rows(2 * heads * rows, d, g).view(2, heads, rows, d)
        kk = order_sensitive_cols(2 * heads * slots, d, g).view(2, heads, slots, d)
        scores = backend.attention_scores(q, kk)
        check(f"attention scores (head_dim {d})", scores.transpose(0, 2),
              lambda sl: backend.attention_scores(q[:, :, sl], kk).transpose(0, 2))
        p = torch.softmax(scores, dim=-1)
        v = torch.randn(2, heads, slots, d, generator=g)
        check(f"attention values (head_dim {d})", backend.attention_values(p, v).transpose(0, 2),
              lambda sl: backend.attention_values(p[:, :, sl], v).transpose(0, 2))
    for n, k in routers:
        x, w = order_sensitive_rows(rows, k, g), order_sensitive_cols(n, k, g)
        check(f"router {n}x{k}", backend.router_logits(x, w), lambda sl: backend.router_logits(x[sl], w))
    return tuple(failures)


def choose_backend(device: torch.device, model: nn.Module | None = None) -> Backend:
    """The one policy for ``backend = "auto"``: the fastest batch-invariant backend.

    Off the CPU: the exact reference (no GPU backend yet). On the CPU:
    ``fast_backend(model)`` (``amx`` with AMX tiles; with AVX512-BF16 alone, ``amx``
    but for mixtures of experts narrower than ``AVX512_BF16_MIN_MOE_WIDTH``; else
    ``cpu``: measured on each of these CPUs, benchmarks/README.md). Given a model, the pick is first
    checked with ``batch_invariance_failures`` on the model's own shapes; where it
    fails (a BLAS whose kernels depend on the batch in a way not seen here), the
    exact ``reference`` is used instead, with a warning that says why.
    """
    if device.type != "cpu":
        return BACKENDS["reference"]
    fast = fast_backend(model)
    if model is None:
        return fast
    failures = batch_invariance_failures(fast, model)
    if failures:
        warnings.warn(
            f"backend {fast.name!r} is not batch-invariant on this CPU ({failures[0]}); "
            "using the exact 'reference' backend, which is slower",
            stacklevel=2,
        )
        return BACKENDS["reference"]
    return fast


def resolve_backend(backend: Backend | str, model: nn.Module) -> Backend:
    """``"auto"`` -> ``choose_backend(model's device, model)``; a name -> the registry's
    backend, with a warning when it is ``amx`` on a CPU without native BF16 GEMMs
    (neither AMX tiles nor AVX512-BF16)."""
    if backend == "auto":
        first = next(iter(model.parameters()), None)
        return choose_backend(first.device if first is not None else torch.device("cpu"), model)
    chosen = get_backend(backend)
    if chosen.name == "amx" and not native_bf16_available():
        warnings.warn(
            "backend 'amx' on a CPU without AMX tiles or AVX512-BF16: its BF16 GEMMs are emulated there "
            "(11-12x slower than 'cpu' for the tiny policy on an AVX2-only AMD EPYC, 2026-12-01); "
            "'auto' picks the fast backend",
            stacklevel=2,
        )
    return chosen


def fp8_matmul(
    a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32, backend: Backend | str = "reference",
    invariant: bool = True,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for QTensors ``a`` ``[M, K]``, ``b`` ``[N, K]`` on ``backend``."""
    check_operands(a, b)
    return get_backend(backend).fp8_matmul(a, b, out_dtype, invariant)


def bf16_matmul(
    a: torch.Tensor, b: torch.Tensor, backend: Backend | str = "reference", cache: dict | None = None,
    invariant: bool = True,
) -> torch.Tensor:
    """``a [M, K] @ b [N, K].T`` as ``backend``'s BF16 GEMM -> FP32 ``[M, N]``."""
    return get_backend(backend).bf16_matmul(a, b, {} if cache is None else cache, invariant)
