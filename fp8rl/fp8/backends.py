"""GEMM backends: every product the model computes, one object per kind of arithmetic.

A backend owns the arithmetic of the flows (docs/design.md section 3):

- ``fp8_matmul(a, b)``: the block-scaled FP8 GEMM ``dequant(a) @ dequant(b).T``
  for QTensors ``a`` ``[M, K]`` and ``b`` ``[N, K]`` sharing the K block width
  (1x128 activations times 128x128 weights for fprop and dgrad, two 1x128
  operands for wgrad), computed DeepSeek-V3 style, block by block along K::

      partial_kb[i, j] = sum_{k in kb} a.data[i, k] * b.data[j, k]     (exact)
      out[i, j]       += partial_kb[i, j] * sa[i, kb] * sb[j, kb]      (promotion)

  Backends differ only in how the promotion and the sum are rounded.
- ``bf16_matmul(a, b)``: the BF16 GEMM of the flows' BF16 steps, ``a @ b.T``.
- ``head_logits`` / ``head_grads``: the LM head (BF16 operands) and its gradient.
- ``attention_scores`` / ``attention_values``: the two attention products.
- ``exact``: results are exact math rounded once (the reference);
  ``batch_invariant``: a row's result does not depend on the other rows of
  the call, which is what makes rollout (decode, a few rows) and training
  (all rows at once) agree bit for bit. By construction for ``reference``,
  by measurement on this machine's BLAS / oneDNN for ``cpu`` and ``amx``
  (tests/test_fp8_gemm.py checks every backend in ``BACKENDS``).

``BACKENDS`` is the one registry; ``choose_backend`` the one policy for
``backend = "auto"``. Nothing outside this file compares backend names.
Adding a backend is one class here plus one line in ``BACKENDS``.

``invariant=False`` (backward GEMMs, which nothing compares row by row) lets a
backend drop what it does only for batch invariance.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8rl.fp8.quant import QTensor, dequantize, fp8_to_float

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


# See _accumulate_k_blocks: small batches are padded to this many rows.
_MIN_ROWS = 16


def _k_blocks(x: torch.Tensor, bk: int, s: torch.Tensor | None = None) -> list[torch.Tensor]:
    """FP32 contiguous ``[rows, bk]`` slices of ``x`` along K, each times its per-row scale."""
    n = -(-x.shape[1] // bk)
    if s is None:
        return [x[:, j * bk : (j + 1) * bk].contiguous() for j in range(n)]
    return [x[:, j * bk : (j + 1) * bk] * s[:, j, None] for j in range(n)]


def _accumulate_k_blocks(
    a: torch.Tensor,
    b_blocks: list[torch.Tensor],
    bk: int,
    sa: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 ``sum_kb (a_kb * sa_kb) @ b_kb.T``, one BLAS call per K block, in K order.

    a: FP32 ``[M, K]``; b_blocks: ``_k_blocks`` of the FP32 ``[N, K]`` operand
    (its scales already applied); sa ``[M, ceil(K/bk)]`` optional per-row scales.

    Batch invariance: BLAS switches to other kernels (another summation order)
    for small M, so with MKL here rows of an M <= 5 product differed in the
    last bits from the same rows inside a larger batch. Padding ``a`` with zero
    rows to ``_MIN_ROWS`` and keeping each call's K at ``bk`` made every row
    independent of the batch size and of the thread count on this machine
    (full-K FP32 GEMMs were not: MKL splits long K across threads).
    """
    m, k = a.shape
    if m < _MIN_ROWS:
        a = torch.cat([a, a.new_zeros(_MIN_ROWS - m, k)])
        if sa is not None:
            sa = torch.cat([sa, sa.new_ones(_MIN_ROWS - m, sa.shape[1])])
    out = torch.zeros(a.shape[0], b_blocks[0].shape[0], dtype=torch.float32, device=a.device)
    for j, b_blk in enumerate(b_blocks):
        ks = slice(j * bk, (j + 1) * bk)
        a_blk = a[:, ks] if sa is None else a[:, ks] * sa[:, j, None]
        out.addmm_(a_blk, b_blk.T)
    return out[:m]


# Native BF16 GEMMs are called on exactly this many rows (see _native_rows):
# decode steps pay for the padding, long training GEMMs for the number of calls;
# 128 measured best overall for SmolLM2-135M at 16 rollouts (64: -12% training
# forward speed, 256: -25% decode speed).
_NATIVE_ROWS = 128


def _native_rows(
    a: torch.Tensor, b_t: torch.Tensor, invariant: bool = True, scratch: dict | None = None
) -> torch.Tensor:
    """BF16 ``a [M, K] @ b_t [K, N]`` -> FP32 ``[M, N]`` on the CPU's native BF16 GEMM.

    Batch invariance: oneDNN picks its K blocking (hence the summation order)
    from M, so one row's result changed with the number of rows in the call
    (measured: most M between 28 and 256 disagree with M = 4096 somewhere).
    Every call here gets exactly ``_NATIVE_ROWS`` rows (the last chunk padded
    with zeros), so every row goes through the same kernel whatever the batch.
    ``invariant=False`` makes one call on all rows. ``scratch``: a dict owned
    by the weight where a decode step's padded input and output buffers live
    between calls (fresh ~128 KB buffers every call cost page faults: about a
    quarter of a SmolLM2 decode step when allocated per call).
    """
    if not invariant:
        return (a @ b_t).float()
    m = a.shape[0]
    if m <= _NATIVE_ROWS and scratch is not None:
        if "rows_in" not in scratch:
            scratch["rows_in"] = a.new_zeros(_NATIVE_ROWS, a.shape[1])
            scratch["rows_out"] = a.new_empty(_NATIVE_ROWS, b_t.shape[1])
        buf = scratch["rows_in"]
        buf[:m].copy_(a)
        buf[m:].zero_()
        torch.mm(buf, b_t, out=scratch["rows_out"])
        return scratch["rows_out"][:m].float()
    pad = -m % _NATIVE_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    out = torch.empty(a.shape[0], b_t.shape[1], dtype=a.dtype, device=a.device)
    for r in range(0, a.shape[0], _NATIVE_ROWS):
        torch.mm(a[r : r + _NATIVE_ROWS], b_t, out=out[r : r + _NATIVE_ROWS])
    return out[:m].float()


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

    def fp8_matmul(self, a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
        """``dequant(a) @ dequant(b).T`` -> ``[M, N]`` in ``out_dtype``; ``b`` is the
        weight-like operand whose converted forms may be kept in ``b.cache``."""
        raise NotImplementedError

    def bf16_matmul(self, a: torch.Tensor, b: torch.Tensor, cache: dict, invariant: bool = True) -> torch.Tensor:
        """``a [M, K] @ b [N, K].T`` with BF16-rounded operands -> FP32 ``[M, N]``.
        ``cache``: a dict owned by ``b`` (emptied by its owner when ``b`` changes).

        Default, the emulation of ``reference`` and ``cpu``: BF16-rounded operands
        (exact products in FP32), FP32 accumulation per ``bk``-wide K block like the
        FP8 GEMM, hence the same batch invariance."""
        if "fp32_blocks" not in cache:
            cache["fp32_blocks"] = _k_blocks(b.bfloat16().float(), self.bk)
        return _accumulate_k_blocks(a.bfloat16().float(), cache["fp32_blocks"], self.bk)

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
        """``q [..., T, D] @ k [..., L, D].T`` -> FP32 ``[..., T, L]``: float64 math on
        FP32 operands, rounded once, so a row's scores do not depend on how many
        query rows share the call (decode vs training)."""
        return (q.double() @ k.double().transpose(-1, -2)).float()

    def attention_values(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``p [..., T, L] @ v [..., L, D]`` -> FP32 ``[..., T, D]``, like ``attention_scores``."""
        return (p.double() @ v.double()).float()

    def __deepcopy__(self, memo: dict) -> "Backend":
        return self  # a singleton: a copied model keeps using the registry's object

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


class ReferenceBackend(Backend):
    """Exact: FP8 block sums in float64 (exact), float64 promotion, the scaled
    partials summed in float64 in ascending order, rounded once to FP32;
    the LM head in float64 on BF16 operands. Bitwise independent of batch size
    and K-block order by construction. Slow; the default for tiny models."""

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
        m, k = a.data.shape
        n, bk = b.data.shape[0], a.block[1]
        kb = -(-k // bk)
        if "reference" not in b.cache:  # a weight: converted once, reused by every call
            b.cache["reference"] = (fp8_to_float(b.data).double(), _row_scales(b).double())
        b64, sb = b.cache["reference"]
        sa = _row_scales(a).double()
        out = torch.empty(m, n, dtype=out_dtype, device=a.data.device)
        # Rows are independent; chunking only bounds the [rows, N, kb] buffer.
        rows = max(1, (1 << 24) // max(1, n * kb))
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            a64 = fp8_to_float(a.data[r0:r1]).double()
            parts = torch.empty(r1 - r0, n, kb, dtype=torch.float64, device=a.data.device)
            for j in range(kb):
                ks = slice(j * bk, (j + 1) * bk)
                block_sum = a64[:, ks] @ b64[:, ks].T  # exact
                parts[:, :, j] = block_sum * (sa[r0:r1, j, None] * sb[None, :, j])
            if kb > 1:
                parts = parts.sort(dim=-1).values
            acc = torch.zeros(r1 - r0, n, dtype=torch.float64, device=a.data.device)
            for j in range(kb):
                acc += parts[:, :, j]
            out[r0:r1] = acc.float().to(out_dtype)
        return out

    def head_logits(self, h: torch.Tensor, w: torch.Tensor, cache: dict) -> torch.Tensor:
        if "head64" not in cache:
            cache["head64"] = w.to(torch.bfloat16).double()
        return (h.to(torch.bfloat16).double() @ cache["head64"].T).float()


class CPUBackend(Backend):
    """FP32 emulation for any CPU: per K block, both operand slices dequantized
    to FP32 and accumulated ``out += a_blk @ b_blk.T`` in FP32.

    Chosen by measurement (benchmarks/fp8_gemm.py, 1 thread, AVX-512 CPU):
    ``torch._scaled_mm`` with row scales, one call per K block, is about 2x
    slower (its oneDNN FP8 kernel converts internally); one FP32 GEMM over the
    fully dequantized operands is about as fast but ~1.5x less accurate and
    not batch invariant. About 2e-7 relative Frobenius error against
    ``reference``; batch-invariant by measurement (rows padded to 16)."""

    name = "cpu"
    batch_invariant = True

    def fp8_matmul(self, a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
        bk = a.block[1]
        if "cpu_blocks" not in b.cache:  # a weight: dequantized once, reused by every call
            b.cache["cpu_blocks"] = _k_blocks(fp8_to_float(b.data), bk, _row_scales(b))
        out = _accumulate_k_blocks(fp8_to_float(a.data), b.cache["cpu_blocks"], bk, _row_scales(a))
        return out.to(out_dtype)


class AMXBackend(Backend):
    """The CPU's native BF16 matrix units (AMX, or AVX512-BF16) through oneDNN.

    FP8 operands are dequantized to BF16 (E4M3 values are exact in BF16;
    ``q * scale`` is exact for ue8m0 scales and rounded once, 2**-9 relative,
    for FP32 scales) and multiplied in one full-K BF16 GEMM with FP32
    accumulation and a BF16 output, as GPU BF16/FP8 GEMMs write theirs: about
    50 dB SQNR against ``reference``. Batch-invariant by measurement: every
    call runs on exactly ``_NATIVE_ROWS`` rows (``_native_rows``)."""

    name = "amx"
    batch_invariant = True

    def fp8_matmul(self, a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
        if "amx_t" not in b.cache:  # the weight side: dequantized and transposed once per quantization
            b.cache["amx_t"] = dequantize(b).bfloat16().T.contiguous()
        return _native_rows(dequantize(a).bfloat16(), b.cache["amx_t"], invariant, b.cache).to(out_dtype)

    def bf16_matmul(self, a: torch.Tensor, b: torch.Tensor, cache: dict, invariant: bool = True) -> torch.Tensor:
        if "amx_t" not in cache:
            cache["amx_t"] = b.bfloat16().T.contiguous()
        return _native_rows(a.bfloat16(), cache["amx_t"], invariant, cache)

    def head_grads(
        self, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, need_dh: bool, need_dw: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dh = self.bf16_matmul(grad, w.T, {}, invariant=False) if need_dh else None
        dw = self.bf16_matmul(grad.T, h.T, {}, invariant=False) if need_dw else None
        return dh, dw


BACKENDS: dict[str, Backend] = {b.name: b for b in (ReferenceBackend(), CPUBackend(), AMXBackend())}

# Models up to this many parameters run on the exact reference by default: it
# is cheap for them, and rollout == training then holds by construction.
SMALL_MODEL_PARAMS = 5_000_000


def get_backend(backend: Backend | str) -> Backend:
    """The registry's backend called ``backend`` (a Backend passes through)."""
    if isinstance(backend, Backend):
        return backend
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown GEMM backend {backend!r}; valid backends: {', '.join(BACKENDS)}") from None


def amx_available() -> bool:
    """True when this CPU has AMX tiles. AVX512-BF16 alone is not enough to make
    ``amx`` pay: on an AMD EPYC with AVX512-BF16 and no AMX, an 8 x 32 SmolLM2
    generation took 113.6 s on ``amx`` against 85.1 s on ``cpu``."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def choose_backend(device: torch.device, model: nn.Module | None = None) -> Backend:
    """The one policy for ``backend = "auto"``.

    Off the CPU: the exact reference (no GPU backend yet). On the CPU: the
    reference for models of at most ``SMALL_MODEL_PARAMS`` parameters, else
    ``amx`` where the CPU has AMX tiles, else ``cpu``.
    """
    if device.type != "cpu":
        return BACKENDS["reference"]
    if model is not None and sum(p.numel() for p in model.parameters()) <= SMALL_MODEL_PARAMS:
        return BACKENDS["reference"]
    return BACKENDS["amx"] if amx_available() else BACKENDS["cpu"]


def resolve_backend(backend: Backend | str, model: nn.Module) -> Backend:
    """``"auto"`` -> ``choose_backend(model's device, model)``; a name -> the registry's backend."""
    if backend == "auto":
        first = next(iter(model.parameters()), None)
        return choose_backend(first.device if first is not None else torch.device("cpu"), model)
    return get_backend(backend)


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
