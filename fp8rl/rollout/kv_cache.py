"""A preallocated, static-shape KV cache (gpt-fast style), in FP32, BF16 or FP8.

Layout per layer: K and V as [B, n_kv_heads, cache_len, head_dim]. The stored
precision decides the numbers: BF16 values, or E4M3 values times the attention
module's per-KV-head FP32 scales (static during a rollout, recalibrated between
steps). Under a backend with the fused attention kernel (`fused`: `cpu` and `amx` where
the compiled kernels load) the cache holds K (transposed) and V in BF16, or FP8 as E4M3
codes (one byte each; the kernel applies the scales), and the kernel reads them directly.
Otherwise attention multiplies FP32 products, so the cache holds those values as FP32,
computed once for the slots written (`transformer.store_heads`) rather than for the
whole cache at every decode step (which was about a quarter of a tiny-arith decode step). `nbytes` is
the size in the stored format (FP8: 1 byte per element plus 2 x n_kv_heads
scales per layer, about half of BF16), what a kernel reading that format moves;
`resident_nbytes` is what this engine holds (the fused cache: `nbytes`).
"""

from __future__ import annotations

import torch


STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# What a fused cache holds per element: BF16 values, or the E4M3 codes of FP8 (`kernels.rope_store`
# writes these two; FP32 storage keeps the unfused layout).
FUSED_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        cache_len: int,
        head_dim: int,
        precision: str = "bf16",
        k_scales: list[torch.Tensor] | None = None,
        v_scales: list[torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        fused: bool = False,
    ) -> None:
        if precision not in STORAGE_DTYPES:
            raise ValueError(f"unknown KV cache precision {precision!r}; valid: {', '.join(STORAGE_DTYPES)}")
        if precision == "fp8" and (k_scales is None or v_scales is None):
            raise ValueError("an FP8 KV cache needs per-layer K and V scales")
        if fused and precision not in FUSED_DTYPES:
            raise ValueError(f"a fused KV cache stores {' or '.join(FUSED_DTYPES)}, not {precision!r}")
        self.precision = precision
        self.cache_len = cache_len
        self.shape = (batch, n_kv_heads, cache_len, head_dim)
        self.n_layers = n_layers
        self.fused = fused
        if fused:
            # The fused attention kernel's layout (fp8rl/fp8/kernels.py `attention`), in the stored
            # format: K transposed [B, H, D, cache_len rounded up to 16] (the kernel reads 16-slot
            # chunks) and V [B, H, cache_len, D], in BF16 or E4M3 (FUSED_DTYPES).
            dtype, slots = FUSED_DTYPES[precision], -(-cache_len // 16) * 16
            self.k = [torch.zeros(batch, n_kv_heads, head_dim, slots, dtype=dtype, device=device) for _ in range(n_layers)]
            self.v = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(n_layers)]
        else:
            # FP32 values of the stored K/V: [B, H, cache_len, D] per layer
            self.k = [torch.zeros(self.shape, dtype=torch.float32, device=device) for _ in range(n_layers)]
            self.v = [torch.zeros(self.shape, dtype=torch.float32, device=device) for _ in range(n_layers)]
        # the stored format's per-KV-head scales (counted in `nbytes`); the values written are
        # already E4M3 data times these scales (`transformer.store_heads`)
        self.k_scales = list(k_scales) if k_scales else None
        self.v_scales = list(v_scales) if v_scales else None

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, cache_len: int,
                  device: torch.device | str | None = None) -> "KVCache":
        """A cache matching `model`'s config and its attention storage precision, in the
        fused kernel's layout where its attention runs as that kernel; on `device`
        (default: the model's; "meta": its sizes without the memory)."""
        c = model.config
        attns = [layer.self_attn for layer in model.model.layers]
        plan = attns[0].attention_plan
        fp8 = plan.kv == "fp8"
        return cls(
            c.num_layers, batch, c.num_kv_heads, cache_len, c.head_dim, plan.kv,
            k_scales=[a.k_scale for a in attns] if fp8 else None,
            v_scales=[a.v_scale for a in attns] if fp8 else None,
            device=model.device if device is None else device,
            fused=plan.kv in FUSED_DTYPES and model.attention_fused(),
        )

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A cache that is not `fused`.) Write K/V [B, H, T, D] at slots [start, start+T): their FP32 values, already
        rounded to the cache's precision (`transformer.store_heads`: for FP8 the
        E4M3 data times the module's scales, which this cache's scales copy);
        return the whole cache of this layer as float32 values [B, H, cache_len, D]."""
        T = k.shape[2]
        if start + T > self.cache_len:
            raise ValueError(f"KV cache overflow: slots [{start}, {start + T}) exceed cache_len {self.cache_len}")
        self.k[layer][:, :, start : start + T] = k
        self.v[layer][:, :, start : start + T] = v
        return self.k[layer], self.v[layer]

    def fused_layer(self, layer: int, start: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused cache's layer, for `n_tokens` new slots from `start` (written by
        `kernels.rope_store`): K transposed [B, H, D, slots] and V [B, H, cache_len, D] (FUSED_DTYPES)."""
        if start + n_tokens > self.cache_len:
            raise ValueError(f"KV cache overflow: slots [{start}, {start + n_tokens}) exceed cache_len {self.cache_len}")
        return self.k[layer], self.v[layer]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (LongTensor, in their new order): finished
        sequences leave a running decode."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.shape = (len(rows), *self.shape[1:])

    @property
    def nbytes(self) -> int:
        """Bytes of the cache in its stored format: data plus scales."""
        elements = 2 * self.n_layers * self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        return elements * torch.empty((), dtype=STORAGE_DTYPES[self.precision]).element_size() + self._scale_bytes()

    @property
    def resident_nbytes(self) -> int:
        """Bytes this engine holds: the FP32 values (a fused cache: the stored format), plus scales."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + self._scale_bytes()

    def _scale_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in (self.k_scales or []) + (self.v_scales or []))


class PromptKV:
    """The keys and values of a training forward split in two calls (`engine.score`
    on rows that share prompts): the first call (slot 0) computes the prompt slots
    [0, P) once per distinct prompt, U rows; the second (slot P) computes the
    completion slots of all B rows, each reading its prompt's K/V through
    ``of_row`` (LongTensor[B], the row's prompt among the U).

    Returns what a one-call forward's attention sees, K/V padded with zeros to
    ``cache_len`` slots; built by concatenation, not written in place, so autograd
    differentiates it: the backward sums a shared prompt's K/V gradient over the
    rows that read it."""

    def __init__(self, of_row: torch.Tensor, cache_len: int) -> None:
        self.of_row = of_row
        self.cache_len = cache_len
        self.k: dict[int, torch.Tensor] = {}  # layer -> the prompts' K [U, H, P, D]
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if start == 0:
            self.k[layer], self.v[layer] = k, v
            parts_k, parts_v = [k], [v]
        else:
            if layer not in self.k or self.k[layer].shape[2] != start:
                raise ValueError(f"layer {layer}: the completion call starts at slot {start}, "
                                 f"not where the prompt call ended")
            parts_k = [rows_of_prompts(self.k[layer], self.of_row), k]
            parts_v = [rows_of_prompts(self.v[layer], self.of_row), v]
        free = self.cache_len - start - k.shape[2]
        if free < 0:
            raise ValueError(f"KV overflow: slots [{start}, {start + k.shape[2]}) exceed cache_len {self.cache_len}")
        zeros = k.new_zeros((*parts_k[-1].shape[:2], free, k.shape[3]))  # masked key slots, as F.pad's
        return torch.cat([*parts_k, zeros], dim=2), torch.cat([*parts_v, zeros], dim=2)


def rows_of_prompts(x: torch.Tensor, of_row: torch.Tensor) -> torch.Tensor:
    """Each row's prompt: x [U, ...] (one entry per distinct prompt), of_row
    LongTensor[B] -> ``x[of_row]`` [B, ...], as ``index_select``.

    Its backward (a ``scatter_add_`` into zeros in torch 2.13) adds a prompt's row
    gradients in row order, from zero, on any number of threads: the bits ``x[of_row]``'s
    backward gives on one thread. That backward (``index_put_`` accumulating) splits the
    sum between two threads, so a prompt whose rows fell on both sides of the split
    (3 prompts of 8 rows) got other bits, different from one run to the next (measured
    2026-12-07, torch 2.13, tests/test_shared_prompts.py); it was also 6-8x slower
    (a tiny-arith layer's K: 1215 against 188 us)."""
    return x.index_select(0, of_row)
