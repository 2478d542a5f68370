"""Compiled CPU kernels: FP8 quantization, attention and sampling noise, each in few passes.

A decode step of a small batch is per-call overhead: each FP8 linear's input
quantization (``quant.quantize_dequantize``) is about 15 torch calls of a few
microseconds each on tensors of a few thousand elements. ``kernels.c`` does the
same arithmetic in one C loop per block, the same FP32 operations in the same
order, hence the same bits, in the same layout (tests/test_kernels.py and
tests/test_fp8_quant.py compare the two paths on every kind of block, scale
format and floor). The same goes for the weights' 2-D blocks, quantized once per
optimizer step (``quantize_blocks``), and for their dequantization to FP32 or BF16
(``dequantize_blocks``): SmolLM2-135M's 210 FP8 weights in about 0.27 s instead of
0.52-0.72 s here (benchmarks/compiled_quant.py).
Two more hot loops of the rollout: softmax attention over a BF16 KV cache
(``attention``, with ``rope_store`` writing it), and each decode step's sampling
noise (``uniform_rows``: torch.rand's numbers from every row's generator at once).
Under ``cpu`` and ``amx`` (``Backend.fused_pointwise``): RMSNorm, the SwiGLU gate and the
sampled tokens' log-probs (``token_logprobs``, forward and backward) in fixed orders of their
own; and AdamW's step (fp8rl/optim.py). Every kernel's 16-lane vectors and IEEE rounding give
the same bits whatever instruction set the library is built for (tests/test_logprob_kernel.py
builds it for SSE2 and AVX2 and compares).

The kernels are optional. ``library()`` builds ``kernels.c`` once per machine
with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a cache
folder (``cache_dir()``: ``$FP8RL_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8rl`` or ``~/.cache/fp8rl``),
keyed by the source, the compiler, the flags and the CPU, and loads it with ctypes:
about 5 s the first time, nothing after. Where there is no compiler or the build
fails, it warns once and returns None, and the callers run their torch code, more
slowly: the quantization's bits, attention in torch's arithmetic (``attention``
defines its own; rollout == training holds either way). ``FP8RL_KERNELS=0`` in the environment does the same
without the warning. Not ``torch.utils.cpp_extension``: anything that includes
torch's headers took 51 s to build on these 2 cores (benchmarks/README.md);
plain C with no headers but the C library builds in a fraction of a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
# IEEE semantics kept: no -ffast-math (reciprocals, reassociation), no FMA contraction (a kernel
# that needs a fused multiply-add says so with fmaf). errno is never read: without it sqrtf vectorizes.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-shared", "-fPIC")
# Tried first: the attention kernel's parallel loop. The library then needs libgomp.so.1, which
# torch's CPU wheels have loaded already (torch/lib/libgomp.so.1), so the loop runs on torch's
# own OpenMP threads (a second runtime's threads would fight torch's spinning workers for the
# cores). A compiler without OpenMP gets the plain flags: the same bits on one thread.
OPENMP_FLAGS = ("-fopenmp",)
ENV_SWITCH = "FP8RL_KERNELS"
CPU = torch.device("cpu")


def cache_dir() -> Path:
    """fp8rl's cache folder, for the compiled kernels (``kernels/``) and the built-in
    models converted on first use (fp8rl.model.load): ``$FP8RL_CACHE_DIR``, else
    ``$FP8RL_CACHE`` (the name the models' cache alone read until 2026-12-07), else
    ``$XDG_CACHE_HOME/fp8rl``, else ``~/.cache/fp8rl``."""
    for var in ("FP8RL_CACHE_DIR", "FP8RL_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fp8rl"


def _cpu_id() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (a home
    folder shared by machines with different CPUs gets one library per CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))  # each distinct line once (CPUs alike: one of each)


def _compiler() -> str | None:
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    return next((path for path in map(shutil.which, names) if path), None)


def _build(cc: str, flags: tuple[str, ...]) -> Path:
    """The library for this source, compiler, flags and CPU, built if not cached. Written
    to a temporary name and renamed, so processes building at once (ranks) never load a
    half-written file."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu_id().encode()]))
    folder = cache_dir() / "kernels"
    lib = folder / f"fp8rl-kernels-{key.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=lib.name + ".tmp-")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
            raise RuntimeError(f"{Path(cc).name} failed: {first[:200]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot be had (see the
    module docstring), with one warning saying why unless ``FP8RL_KERNELS=0``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    cc = _compiler()
    try:
        if cc is None:
            raise RuntimeError("no C compiler found (cc, gcc, clang; or set CC)")
        try:
            lib = ctypes.CDLL(str(_build(cc, CFLAGS + OPENMP_FLAGS)))
        except (OSError, RuntimeError, subprocess.SubprocessError):
            lib = ctypes.CDLL(str(_build(cc, CFLAGS)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"fp8rl: compiled CPU kernels unavailable ({e}); the FP8 quantization "
                      f"and attention run as torch ops instead (slower). {ENV_SWITCH}=0 silences this.",
                      RuntimeWarning, stacklevel=2)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fp8rl_qdq_rows.restype = ctypes.c_int
    lib.fp8rl_qdq_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.fp8rl_quantize_blocks.restype = ctypes.c_int
    lib.fp8rl_quantize_blocks.argtypes = [
        ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ptr, ptr, ctypes.c_int, ptr]
    lib.fp8rl_dequantize_blocks.restype = None
    lib.fp8rl_dequantize_blocks.argtypes = [ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr]
    lib.fp8rl_attention.restype = None
    lib.fp8rl_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, *[i64] * 6, ptr, *[i64] * 9,
                                    ctypes.c_float, ctypes.c_float, ptr, ptr, ctypes.c_int]
    lib.fp8rl_attention_work.restype = i64
    lib.fp8rl_attention_work.argtypes = [ctypes.c_int, i64, i64, i64]
    lib.fp8rl_rope_store.restype = None
    lib.fp8rl_rope_store.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, *[i64] * 5, ctypes.c_int, ptr,
                                     ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, i64,
                                     ctypes.c_int]
    lib.fp8rl_uniform_rows.restype = None
    lib.fp8rl_argmax_sum.restype = None
    lib.fp8rl_argmax_sum.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.fp8rl_uniform_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.fp8rl_rmsnorm_rows.restype = None
    lib.fp8rl_rmsnorm_rows.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr, i64, ptr, i64, i64, ctypes.c_int]
    lib.fp8rl_silu_mul_rows.restype = None
    lib.fp8rl_silu_mul_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.fp8rl_adamw.restype = None
    lib.fp8rl_adamw.argtypes = [ptr, ptr, ptr, ptr, i64, *[ctypes.c_float] * 7, ctypes.c_int]
    lib.fp8rl_token_logprobs.restype = None
    lib.fp8rl_token_logprobs.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
    lib.fp8rl_token_logprobs_backward.restype = None
    lib.fp8rl_token_logprobs_backward.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, ptr, ptr, i64,
                                                  ctypes.c_int]
    return lib


def _threads() -> int:
    """The thread count a kernel's OpenMP loop asks for: torch's own (OPENMP_FLAGS)."""
    return max(1, torch.get_num_threads())


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """``x [..., N]`` as FP32 rows ``[R, N]`` with unit column stride and one row stride:
    a view where the leading axes merge (a split of a stacked GEMM's output), else a copy."""
    x = x.float()
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, inv: torch.Tensor | None = None
) -> torch.Tensor:
    """``fp8rl_rmsnorm_rows`` (kernels.c, its own fixed order of the sum of squares) of
    ``x [..., D]`` with the FP32 weight ``[D]`` -> FP32 ``[..., D]``; ``inv``: an FP32
    tensor of x's rows that receives each row's ``1 / sqrt(mean(x^2) + eps)``. Call only
    where ``library()`` loads and ``x`` is on the CPU."""
    rows = _row_view(x)
    w = weight.detach().float().contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    library().fp8rl_rmsnorm_rows(rows.data_ptr(), rows.stride(0), w.data_ptr(), eps, out.data_ptr(), rows.shape[1],
                                 None if inv is None else inv.data_ptr(), rows.shape[0], rows.shape[1], _threads())
    return out


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``fp8rl_silu_mul_rows`` (kernels.c): ``silu(g) * u`` for ``g, u [..., N]`` (same
    shape) -> FP32 ``[..., N]``, in the kernel's own exp. Call only where ``library()``
    loads and the tensors are on the CPU."""
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: gate and up must have one shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    gr, ur = _row_view(g), _row_view(u)
    out = torch.empty(g.shape, dtype=torch.float32)
    n = gr.shape[1]
    library().fp8rl_silu_mul_rows(gr.data_ptr(), gr.stride(0), ur.data_ptr(), ur.stride(0), out.data_ptr(), n,
                                  gr.shape[0], n, _threads())
    return out


def adamw_(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, decay: float, weight: float,
    beta2: float, bias_correction2_sqrt: float, eps: float, neg_step: float,
) -> None:
    """``fp8rl_adamw`` (kernels.c): one AdamW step of the FP32 weights ``p`` with gradient
    ``g`` and moments ``m``, ``v`` (contiguous CPU tensors of one shape), in place. The
    scalars are torch's single-tensor AdamW's, as Python floats (rounded to FP32 here, as
    torch rounds a Python scalar for an FP32 op). Call only where ``library()`` loads."""
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == p.shape for t in (p, g, m, v)):
        raise ValueError("adamw_: p, g, m and v must be contiguous FP32 tensors of one shape")
    library().fp8rl_adamw(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), decay, weight,
                          beta2, 1.0 - beta2, bias_correction2_sqrt, eps, neg_step, _threads())


def _logit_rows(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 CPU ``logits [N, V]`` with unit column stride (a copy where the view has another)
    and ``target [N]`` as contiguous int64, checked: an out-of-range token raises here, as
    torch's gather would, instead of reading outside the row."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu:
        raise ValueError("token_logprobs: logits must be FP32 CPU rows [N, V]")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    target = target.to(torch.long).contiguous()
    if target.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs: {target.numel()} targets for {logits.shape[0]} rows")
    if target.numel() and not (0 <= int(target.min()) and int(target.max()) < logits.shape[1]):
        raise IndexError(f"token_logprobs: a target outside the vocabulary of {logits.shape[1]}")
    return logits, target


def token_logprobs(
    logits: torch.Tensor, target: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``fp8rl_token_logprobs`` (kernels.c): ``log_softmax(logits / temperature)`` at each
    row's target token, in the kernel's own fixed order -> (logp [N], stats [N, 2]: each
    row's max and log of its sum of exponentials, for `token_logprobs_backward`; the
    entropy [N] or None). Call only where ``library()`` loads."""
    logits, target = _logit_rows(logits, target)
    N, V = logits.shape
    logp = torch.empty(N, dtype=torch.float32)
    stats = torch.empty(N, 2, dtype=torch.float32)
    entropy = torch.empty(N, dtype=torch.float32) if with_entropy else None
    library().fp8rl_token_logprobs(logits.data_ptr(), logits.stride(0), target.data_ptr(), N, V, temperature,
                                   logp.data_ptr(), stats.data_ptr(),
                                   None if entropy is None else entropy.data_ptr(), _threads())
    return logp, stats, entropy


def token_logprobs_backward(
    logits: torch.Tensor, target: torch.Tensor, temperature: float, stats: torch.Tensor, grad_logp: torch.Tensor
) -> torch.Tensor:
    """The gradient of `token_logprobs`' logp with respect to ``logits``: FP32 ``[N, V]``,
    row r ``grad_logp[r] * (onehot(target[r]) - softmax(logits[r] / temperature)) / temperature``
    (``fp8rl_token_logprobs_backward``, from the forward's ``stats``)."""
    logits, target = _logit_rows(logits, target)
    N, V = logits.shape
    g = grad_logp.to(torch.float32).contiguous()
    grad = torch.empty(N, V, dtype=torch.float32)
    library().fp8rl_token_logprobs_backward(logits.data_ptr(), logits.stride(0), target.data_ptr(), N, V,
                                            temperature, stats.data_ptr(), g.data_ptr(), grad.data_ptr(), V,
                                            _threads())
    return grad


def qdq_rows(x: torch.Tensor, bk: int, ue8m0: bool, amax_floor: float) -> torch.Tensor | None:
    """``quant.quantize_dequantize`` of a CPU tensor ``x [..., K]`` (1 x ``bk`` E4M3 blocks)
    as FP32 ``[..., K]`` by ``fp8rl_qdq_rows``; None (the caller runs its torch code) for a
    tensor off the CPU, an empty one, or where the kernels are unavailable.
    Raises ValueError if ``x`` holds NaN or Inf (the caller names the tensor)."""
    if not x.is_cpu or x.numel() == 0:
        return None
    lib = library()
    if lib is None:
        return None
    k = x.shape[-1]
    # Rows of K: a 2-D tensor with unit column stride as it is, anything else contiguous FP32.
    # (Views and reshapes cost microseconds each: this runs ~120 times a decode step.)
    if x.dtype != torch.float32 or not (x.is_contiguous() or (x.dim() == 2 and x.stride(-1) == 1 and x.stride(0) >= k)):
        x = x.float().contiguous()
    ldx = x.stride(0) if x.dim() == 2 else k
    # The torch code's layout too: a ragged K is the first K columns of whole blocks, so that
    # whatever reads the result (a BLAS call choosing its kernel from the strides) sees the same.
    padded = -(-k // bk) * bk
    out = torch.empty(*x.shape[:-1], padded, dtype=torch.float32)
    if lib.fp8rl_qdq_rows(x.data_ptr(), ldx, out.data_ptr(), padded, x.numel() // k, k, bk, amax_floor, ue8m0,
                          _threads()):
        raise ValueError("NaN or Inf")
    return out if padded == k else out[..., :k]


def quantize_blocks(
    x: torch.Tensor, bm: int, bk: int, ue8m0: bool, amax_floor: float, dequantized: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quant.quantize`` of a 2-D CPU tensor ``x [M, K]`` into E4M3 ``bm x bk`` blocks by
    ``fp8rl_quantize_blocks``: (codes ``float8_e4m3fn [M, K]``, FP32 scales ``[ceil(M/bm),
    ceil(K/bk)]``), the torch code's bits; with ``dequantized`` (FP32 or BF16), that dtype's
    ``[M, K]`` in place of the codes: their ``quant.dequantize``, bit for bit (signs of zero
    included). None (the caller runs its torch code) off the CPU, for an empty or non-2-D
    tensor, another ``dequantized`` dtype, or without the kernels. Raises ValueError if ``x``
    holds NaN or Inf (the caller names the tensor)."""
    if x.device != CPU or x.dim() != 2 or x.numel() == 0 or dequantized not in (None, torch.float32, torch.bfloat16):
        return None
    lib = library()
    if lib is None:
        return None
    m, k = x.shape
    if x.dtype != torch.float32 or (x.stride(1) != 1 and k > 1) or x.stride(0) < k:
        x = x.float().contiguous()
    out = torch.empty(m, k, dtype=dequantized or torch.uint8)
    scales = torch.empty(-(-m // bm), -(-k // bk), dtype=torch.float32)
    codes, values = (None, out.data_ptr()) if dequantized else (out.data_ptr(), None)
    if lib.fp8rl_quantize_blocks(x.data_ptr(), x.stride(0), m, k, bm, bk, amax_floor, ue8m0,
                                 codes, values, dequantized == torch.bfloat16, scales.data_ptr()):
        raise ValueError("NaN or Inf")
    return (out if dequantized else out.view(torch.float8_e4m3fn)), scales


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, bm: int, bk: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """``quant.dequantize`` of 2-D E4M3 CPU ``codes [M, K]`` with ``scales`` (``bm x bk``
    blocks) as ``dtype`` (FP32, or BF16: the FP32 product rounded to nearest even) by
    ``fp8rl_dequantize_blocks``, in one pass; None off the CPU, for another layout or
    format, or without the kernels."""
    if (codes.device != CPU or codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn or codes.numel() == 0
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    lib = library()
    if lib is None:
        return None
    codes, scales = codes.contiguous(), scales.float().contiguous()
    m, k = codes.shape
    out = torch.empty(m, k, dtype=dtype)
    lib.fp8rl_dequantize_blocks(codes.data_ptr(), scales.data_ptr(), m, k, bm, bk, dtype == torch.bfloat16,
                                out.data_ptr())
    return out


def attention_available(head_dim: int) -> bool:
    """Whether ``attention`` runs here for heads of ``head_dim`` (the kernel's D is a
    multiple of 16), so that callers pick one arithmetic for a whole model."""
    return head_dim % 16 == 0 and library() is not None


def padded_mask(blocked: torch.Tensor) -> torch.Tensor:
    """``blocked`` BoolTensor[B, 1, T, L] -> uint8 [B, T, L rounded up to 16], the padding
    blocked: the mask ``attention`` reads (made once per forward, shared by its layers)."""
    L = blocked.shape[-1]
    m = blocked[:, 0].view(torch.uint8)
    return torch.nn.functional.pad(m, (0, -L % 16), value=1).contiguous()


# The attention kernel's K/V storage (kernels.c KV_F32, KV_BF16, KV_E4M3: the codes, as bytes).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


def attention(
    q: torch.Tensor,
    kt: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    length: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    p_scale: float = 0.0,
) -> torch.Tensor:
    """``fp8rl_attention`` (kernels.c: its arithmetic, row by row): softmax attention of
    ``q`` FP32 [B, H, T, D] over the first ``length`` key slots of ``kt`` [B, Hkv, D, >=length]
    (keys transposed, slot axis contiguous) and ``v`` [B, Hkv, >=length, D], both FP32, BF16
    or E4M3 (``torch.float8_e4m3fn``, read as bytes: half of BF16's memory traffic; each
    times its per-KV-head FP32 scale [Hkv], ``k_scale`` and ``v_scale``, which only E4M3 takes);
    ``mask`` from ``padded_mask`` (True/1: not attended); ``p_scale`` > 0 stores P in E4M3
    at that scale. -> FP32 [B, H, T, D]. A row's result does not depend on the other rows,
    on ``length`` beyond its live slots, or on the storage (FP32, BF16, E4M3) of the same
    values. Call only where ``attention_available(D)``."""
    lib = library()
    B, H, T, D = q.shape
    Hkv = kt.shape[1]
    if kt.dtype != v.dtype or kt.dtype not in KV_KINDS:
        raise ValueError(f"attention: keys and values must both be FP32, BF16 or float8_e4m3fn, "
                         f"got {kt.dtype} and {v.dtype}")
    fp8 = kt.dtype == torch.float8_e4m3fn
    if (k_scale is not None) != fp8 or (v_scale is not None) != fp8:
        raise ValueError(f"attention: float8_e4m3fn keys and values take both scales, {kt.dtype} ones none")
    if q.numel() == 0:  # no query rows (an empty tensor's strides are arbitrary): nothing to attend
        return torch.empty(q.shape, dtype=torch.float32)
    chunks = -(-length // 16) * 16  # the kernel reads keys and mask in whole 16-slot chunks
    if kt.stride(-1) != 1 or v.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("attention: keys, values and mask need a contiguous last axis")
    if kt.shape[-1] < chunks or mask.shape[-1] < chunks or v.shape[-2] < length or kt.shape[-2] != D:
        raise ValueError(f"attention: {length} key slots need keys and a mask of {chunks} slots and values of "
                         f"{length}, head size {D}; got {tuple(kt.shape)}, {tuple(mask.shape)}, {tuple(v.shape)}")
    q = q.float().contiguous()
    out = torch.empty_like(q)
    kind = KV_KINDS[kt.dtype]
    scales = [s.float().contiguous() if s is not None else None for s in (k_scale, v_scale)]
    args = (q.data_ptr(), kt.data_ptr(), v.data_ptr(), kind,
            *[s.data_ptr() if s is not None else None for s in scales],
            kt.stride(0), kt.stride(1), kt.stride(2), v.stride(0), v.stride(1), v.stride(2),
            mask.data_ptr(), mask.stride(0), mask.stride(1))
    threads = _threads()
    # The kernel's scratch per thread: 4 rows of scores, and where several groups of query rows
    # read BF16 or E4M3 keys and values, the item's keys and values widened once to FP32.
    work = torch.empty(threads * _attention_work(kind, (H // Hkv) * T, D, chunks))
    lib.fp8rl_attention(*args, 0, B, H, Hkv, T, D, length, scale, p_scale, out.data_ptr(), work.data_ptr(),
                        threads)
    return out


@functools.lru_cache(maxsize=None)
def _attention_work(kind: int, rows: int, head_dim: int, chunks: int) -> int:
    """``fp8rl_attention_work``: floats of scratch one thread of ``attention`` needs
    (asked of the C code once per shape, not on every decode step's call)."""
    return library().fp8rl_attention_work(kind, rows, head_dim, chunks)


# How `rope_store` stores the query heads (transformer.store_heads's precisions).
Q_MODES = {"fp32": 0, "bf16": 1, "fp8": 2}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` as FP32 rows ``[B * T, H * D]`` with D contiguous (a view where it can be)."""
    B, T, H, D = x.shape
    x = x.float()
    if x.stride(-1) != 1 or x.stride(-2) != D or x.stride(0) != T * x.stride(1):
        x = x.contiguous()
    return x.view(B * T, H * D) if x.is_contiguous() else x.as_strided((B * T, H * D), (x.stride(1), 1))


def rope_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor,
    q_precision: str, q_scale: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    kt: torch.Tensor, v_cache: torch.Tensor, start: int,
) -> torch.Tensor:
    """``fp8rl_rope_store`` (kernels.c): the rotary embedding of ``q [B, T, H, D]`` and
    ``k [B, T, Hkv, D]`` (``cos``, ``sin_rot`` ``[B, 1, T, D]``, ``Transformer.rope``'s),
    ``q`` stored in ``q_precision`` at its per-head ``q_scale`` (FP8) and returned as FP32
    ``[B, H, T, D]``; the rotated ``k`` and ``v [B, T, Hkv, D]`` written at slots
    ``[start, start + T)`` of a fused KV cache layer (``kt`` ``[B, Hkv, D, *]``, ``v_cache``
    ``[B, Hkv, *, D]``): a BF16 cache gets their BF16 values; a ``float8_e4m3fn`` cache, with
    ``k_scale`` and ``v_scale``, the E4M3 codes of their values at those per-head scales. The
    bits of transformer.py's torch code (``apply_rope``, ``store_heads``,
    ``quant.e4m3_values``) in one call. Call only where ``attention_available(D)``."""
    lib = library()
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    fp8 = k_scale is not None
    want = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if kt.dtype != want or v_cache.dtype != want or (v_scale is not None) != fp8 or D > 1024:
        raise ValueError(f"rope_store: a BF16 cache, or a float8_e4m3fn one with K and V scales, and a head size "
                         f"up to 1024; got {kt.dtype}, {v_cache.dtype}, scales {fp8}, D={D}")
    if kt.stride(-1) != 1 or v_cache.stride(-1) != 1 or start + T > v_cache.shape[2]:
        raise ValueError(f"rope_store: slots [{start}, {start + T}) do not fit the cache {tuple(v_cache.shape)}")
    qr, kr, vr = _rows(q), _rows(k), _rows(v)
    cos, sin_rot = cos.float().contiguous(), sin_rot.float().contiguous()
    if cos.numel() != B * T * D or sin_rot.numel() != B * T * D:
        raise ValueError(f"rope_store: cos and sin need {B} x {T} x {D} values, got {tuple(cos.shape)}")
    scales = [s.float().contiguous() if s is not None else None for s in (q_scale, k_scale, v_scale)]
    out = torch.empty(B, H, T, D)
    lib.fp8rl_rope_store(qr.data_ptr(), kr.data_ptr(), vr.data_ptr(), qr.stride(0), kr.stride(0), vr.stride(0),
                         cos.data_ptr(), sin_rot.data_ptr(), B, T, H, Hkv, D, Q_MODES[q_precision],
                         scales[0].data_ptr(), int(fp8), *[s.data_ptr() if s is not None else None for s in scales[1:]],
                         out.data_ptr(), kt.data_ptr(), kt.stride(0), kt.stride(1), kt.stride(2),
                         v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), start,
                         _threads())
    return out


def _draw_rows(lib: ctypes.CDLL, generators: list[torch.Generator], steps: int, width: int) -> torch.Tensor:
    """``fp8rl_uniform_rows`` on the generators' states, which then go back to them."""
    states = [g.get_state() for g in generators]  # fresh ByteTensors, updated in place by the kernel
    out = torch.empty(steps, len(generators), width)
    pointers = (ctypes.c_void_p * len(states))(*[s.data_ptr() for s in states])
    lib.fp8rl_uniform_rows(pointers, len(states), steps, width, out.data_ptr(), _threads())
    for g, s in zip(generators, states):
        g.set_state(s)
    return out


@functools.lru_cache(maxsize=None)
def _uniform_exact() -> bool:
    """Whether ``fp8rl_uniform_rows`` reproduces torch.rand on this torch: the generator
    state's layout is torch's (``CPUGeneratorImpl``'s legacy one), so it is checked, not
    assumed: draws across several refills of the Mersenne state, and the numbers torch
    draws afterwards from the generators the kernel has moved on."""
    lib = library()
    if lib is None or torch.Generator().get_state().numel() < 24 + 624 * 8:
        return False
    for seed in (0, 1234567):
        ours = [torch.Generator().manual_seed(seed + r) for r in range(3)]
        theirs = [torch.Generator().manual_seed(seed + r) for r in range(3)]
        for steps, width in ((1, 5), (3, 1000), (2, 623)):
            drawn = _draw_rows(lib, ours, steps, width)
            if not torch.equal(drawn, torch.stack([torch.rand(steps, width, generator=g) for g in theirs], dim=1)):
                return False
        if not all(torch.equal(torch.rand(7, generator=a), torch.rand(7, generator=b)) for a, b in zip(ours, theirs)):
            return False
    return True


def uniform_rows(generators: list[torch.Generator], steps: int, width: int) -> torch.Tensor | None:
    """``torch.stack([torch.rand(steps, width, generator=g) for g in generators], dim=1)``,
    FP32 ``[steps, R, width]``: the same numbers, and every generator left where torch.rand
    leaves it, by ``fp8rl_uniform_rows`` (the generators in parallel, on torch's threads; a
    sampling step's noise over SmolLM2's 49,152 logits for 16 rows took about 2.8 ms in
    torch's serial loop here). None (the caller draws with torch) for generators off the
    CPU, without the kernels, or where ``_uniform_exact`` found another state layout."""
    if not generators or any(g.device != CPU for g in generators) or not _uniform_exact():
        return None
    return _draw_rows(library(), generators, steps, width)


def argmax_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``(a + b).argmax(dim=-1)`` of FP32 CPU tensors ``[R, V]`` (last axis contiguous) in
    one pass, without the sum's tensor (``fp8rl_argmax_sum``: the same FP32 sums, torch's
    argmax order: the first maximum, the first NaN above any number): a sampling step's
    Gumbel-max. None (the caller runs torch's ops) for other tensors or without the kernels."""
    if (a.dim() != 2 or a.shape != b.shape or a.dtype != torch.float32 or b.dtype != torch.float32
            or not a.is_cpu or not b.is_cpu or a.stride(-1) != 1 or b.stride(-1) != 1 or a.numel() == 0):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(a.shape[0], dtype=torch.long)
    lib.fp8rl_argmax_sum(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a.shape[0], a.shape[1],
                         out.data_ptr(), _threads())
    return out
