"""Block-scaled FP8 GEMM: ``fp8_matmul(a, b) = dequant(a) @ dequant(b).T``.

Operands are 2-D QTensors ``a`` ``[M, K]`` and ``b`` ``[N, K]`` that share the
K block width ``bk`` (128 in the library). Their row blocks may differ: a
(1, 128) activation times a (128, 128) weight for fprop and dgrad, two
(1, 128) operands for wgrad. The product is computed block by block along K,
DeepSeek-V3 style: for every K block ``kb``

    partial_kb[i, j] = sum_{k in kb} a.data[i, k] * b.data[j, k]     (exact)
    out[i, j]       += partial_kb[i, j] * sa[i, kb] * sb[j, kb]      (promotion)

which is exactly ``dequant(a) @ dequant(b).T`` up to the rounding of the
promotion. Backends differ only in that rounding; every backend is tested
against ``reference``.

Backends (the one dispatch point is ``fp8_matmul``; GPU paths plug in there):
- ``reference``: exact block sums in float64, promotion in float64, blocks
  summed in float64 in a canonical order, rounded once to FP32. Bitwise
  independent of batch size and of the order of the K blocks.
- ``cpu``: FP32 emulation for any CPU (default for CPU tensors), FP32
  promotion and FP32 accumulation across blocks; within 1e-6 relative
  Frobenius error of ``reference``.
- ``amx``: the CPU's native BF16 matrix units (AMX / AVX512-BF16, through
  oneDNN). FP8 operands are dequantized to BF16 (E4M3 values are exact in
  BF16; ``q * scale`` is exact for ue8m0 scales and rounded once, 2**-9
  relative, for FP32 scales) and multiplied in one full-K BF16 GEMM with FP32
  accumulation and a BF16 output, as GPU BF16/FP8 GEMMs write theirs. Several
  times faster than FP32 on such CPUs, about 50 dB SQNR against ``reference``.

``bf16_matmul`` is the BF16 GEMM of the flows' BF16 steps, with the same
backend names: BF16-rounded operands with FP32 math per 128-wide K block on
``reference`` / ``cpu``, a native BF16 GEMM on ``amx``.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8rl.fp8.quant import QTensor, dequantize, fp8_to_float


def _row_scales(q: QTensor) -> torch.Tensor:
    """FP32 ``[rows, ceil(K/bk)]``: the scale of every row in every K block."""
    bm = q.block[0]
    s = q.scale
    if bm > 1:
        s = s.repeat_interleave(bm, dim=0)[: q.data.shape[0]]
    return s


def _check_operands(a: QTensor, b: QTensor) -> None:
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(f"fp8_matmul needs 2-D QTensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_matmul computes a @ b.T: K mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if a.block[1] != b.block[1]:
        raise ValueError(f"fp8_matmul needs the same K block width, got a.block={a.block}, b.block={b.block}")


def _reference(a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
    """Exact block products, float64 promotion, canonical float64 block sum.

    Exactness: an E4M3 x E4M3 product is a multiple of 2**-18 below 2**17.6,
    so a float64 sum of up to 2**17 of them is exact in any order; each block
    sum ``partial_kb`` is therefore exact whatever the float64 GEMM does.
    ``sa * sb`` (two FP32 numbers) is exact in float64; ``partial_kb * (sa*sb)``
    is rounded once, at float64 precision. (E5M2 operands have more dynamic
    range; their block sums are exact only when they fit 53 bits.)

    Across blocks, DESIGN.md section 3 asks for two things at once: "summing
    the blocks in FP32 in a fixed order" and a reference "independent of
    summation order". FP32 accumulation in K order changes bits when the K
    blocks are permuted (most outputs, in the test's example), so this
    reference keeps the per-block promotion but sums the scaled partials of
    each output in float64, in ascending order of value, and rounds once to
    FP32 (then to a narrower ``out_dtype``, as GPU kernels round their FP32
    accumulators). Sorting makes the result a function of the multiset of
    partials: permuting the K blocks of both operands, or changing the batch
    (the other rows of ``a``), cannot change a bit. The error is the final
    rounding plus at most ``ceil(K/bk)`` float64 roundings.
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
    b: torch.Tensor | list[torch.Tensor],
    bk: int,
    sa: torch.Tensor | None = None,
    sb: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 ``sum_kb (a_kb * sa_kb) @ (b_kb * sb_kb).T``, one BLAS call per K block, in K order.

    a: FP32 ``[M, K]``, b: FP32 ``[N, K]``; sa ``[M, ceil(K/bk)]`` and sb
    ``[N, ceil(K/bk)]`` optional per-row scales of each K block.

    Batch invariance: BLAS switches to other kernels (another summation order)
    for small M, so with MKL here rows of an M <= 5 product differed in the
    last bits from the same rows inside a larger batch. Padding ``a`` with zero
    rows to ``_MIN_ROWS`` and keeping each call's K at ``bk`` made every row
    independent of the batch size and of the thread count on this machine
    (full-K FP32 GEMMs were not: MKL splits long K across threads). Decode
    steps then match the training forward bit for bit. A property of the BLAS,
    checked by the tests, not a guarantee; ``reference`` guarantees it.
    """
    m, k = a.shape
    if m < _MIN_ROWS:
        a = torch.cat([a, a.new_zeros(_MIN_ROWS - m, k)])
        if sa is not None:
            sa = torch.cat([sa, sa.new_ones(_MIN_ROWS - m, sa.shape[1])])
    b_blocks = b if isinstance(b, list) else _k_blocks(b, bk, sb)
    out = torch.zeros(a.shape[0], b_blocks[0].shape[0], dtype=torch.float32, device=a.device)
    for j, b_blk in enumerate(b_blocks):
        ks = slice(j * bk, (j + 1) * bk)
        a_blk = a[:, ks] if sa is None else a[:, ks] * sa[:, j, None]
        out.addmm_(a_blk, b_blk.T)
    return out[:m]


def _cpu(a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
    """Per K block: dequantize both operand slices to FP32 and accumulate
    ``out += a_blk @ b_blk.T`` in FP32 (``_accumulate_k_blocks``).

    Chosen by measurement (benchmarks/fp8_gemm.py, 1 thread, AVX-512 CPU):
    ``torch._scaled_mm`` with row scales, one call per K block, is about 2x
    slower (its oneDNN FP8 kernel converts internally); one FP32 GEMM over the
    fully dequantized operands is about as fast but ~1.5x less accurate and
    not batch invariant. Dequantizing ``data * scale`` rounds once in FP32,
    the FP32 accumulation adds the usual GEMM error: about 2e-7 relative
    Frobenius error against ``reference``, inside the 1e-6 the tests allow.
    """
    bk = a.block[1]
    if "cpu_blocks" not in b.cache:  # a weight: dequantized once, reused by every call
        b.cache["cpu_blocks"] = _k_blocks(fp8_to_float(b.data), bk, _row_scales(b))
    out = _accumulate_k_blocks(fp8_to_float(a.data), b.cache["cpu_blocks"], bk, _row_scales(a))
    return out.to(out_dtype)


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
    with zeros), so every row goes through the same kernel whatever the batch:
    decode steps match the training forward bit for bit. A property of oneDNN
    checked by the tests, not a guarantee; ``reference`` guarantees it.
    ``invariant=False`` (backward GEMMs, which nothing compares row by row)
    makes one call on all rows. ``scratch``: a dict owned by the weight where
    a decode step's padded input and output buffers live between calls
    (fresh ~128 KB buffers every call cost page faults: about a quarter of a
    SmolLM2 decode step when allocated per call).
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


def _amx(a: QTensor, b: QTensor, out_dtype: torch.dtype, invariant: bool = True) -> torch.Tensor:
    """Dequantize both operands to BF16, one native BF16 GEMM (``_native_rows``).

    The weight side is dequantized and transposed once per quantization."""
    if "amx_t" not in b.cache:
        b.cache["amx_t"] = dequantize(b).bfloat16().T.contiguous()
    return _native_rows(dequantize(a).bfloat16(), b.cache["amx_t"], invariant, b.cache).to(out_dtype)


def bf16_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    backend: str | None = None,
    b_cache: dict | None = None,
    bk: int = 128,
    invariant: bool = True,
) -> torch.Tensor:
    """``a @ b.T`` as a BF16 GEMM: a ``[M, K]``, b ``[N, K]`` -> FP32 ``[M, N]``.

    ``reference`` / ``cpu`` (BF16 emulated): operands rounded to BF16 (exact
    products in FP32), FP32 accumulation per ``bk``-wide K block like the FP8
    GEMM, hence the same batch invariance; FP32 output. ``amx``: a native
    BF16 GEMM with FP32 accumulation and a BF16 output (``_native_rows``).
    ``b_cache``: a dict owned by a weight, where the converted ``b`` is kept
    between calls; the owner empties it when the weight changes.
    ``invariant=False`` lets a backend drop what it does only to make rows
    independent of the batch (backward GEMMs).
    """
    name = _resolve_backend(backend, a.device)
    key = "amx_t" if name == "amx" else "fp32_blocks"
    cache = {} if b_cache is None else b_cache
    if key not in cache:
        cache[key] = b.bfloat16().T.contiguous() if name == "amx" else _k_blocks(b.bfloat16().float(), bk)
    if name == "amx":
        return _native_rows(a.bfloat16(), cache[key], invariant, cache)
    return _accumulate_k_blocks(a.bfloat16().float(), cache[key], bk)


_BACKENDS: dict[str, Callable[[QTensor, QTensor, torch.dtype, bool], torch.Tensor]] = {
    "reference": _reference,
    "cpu": _cpu,
    "amx": _amx,
}
BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def native_bf16_available() -> bool:
    """True when this CPU multiplies BF16 natively (AMX tiles or AVX512-BF16),
    which is what makes the ``amx`` backend fast."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe() for probe in probes if probe is not None)


def default_backend(device: torch.device) -> str:
    """The backend ``fp8_matmul`` uses when none is given.

    GPU backends ("cuda": ``torch._scaled_mm`` block recipes on sm90, "triton")
    plug in here; until then non-CPU devices use the exact reference.
    """
    return "cpu" if device.type == "cpu" else "reference"


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend name a GEMM runs on: ``backend``, or the device's default."""
    name = default_backend(device) if backend is None else backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    return name


def fp8_matmul(
    a: QTensor,
    b: QTensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    invariant: bool = True,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for QTensors ``a`` ``[M, K]``, ``b`` ``[N, K]``.

    Both must be 2-D with the same K block width. Returns ``[M, N]`` in
    ``out_dtype``. ``backend``: one of ``BACKENDS``, or None for
    ``default_backend(a.data.device)``. ``invariant=False`` (backward GEMMs)
    lets a backend skip what it does only for batch invariance; ``reference``
    and ``cpu`` are invariant either way.
    """
    _check_operands(a, b)
    return _BACKENDS[_resolve_backend(backend, a.data.device)](a, b, out_dtype, invariant)
