"""Batched sampling with a static KV cache, and the training-forward scorer.

The batch is a left-padded grid (gpt-fast style): row b's prompt ends at column
`prompt_len`, completions grow to the right, and every forward sees the same
`cache_len` key slots. `generate` runs the rollout side of the precision flow
(the flow's rollout plan, `phase(model, "rollout")`); `score` re-scores the same
grid with the training forward (phase "train"). Under the unified `jet*` flows both run the same
quantizers on the same quantized weights and KV scales, so their log-probs
agree bit for bit on the exact `reference` backend.

Log-probs are those of the sampling policy with temperature applied exactly as
the trainer applies it: `log_softmax(logits / temperature)`. top-k / top-p only
restrict which tokens can be drawn; they do not renormalise the recorded
log-prob (the trainer cannot reproduce a truncated distribution's gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fp8rl.fp8 import kernels
from fp8rl.model.transformer import KEY_SLOT_STEP, Transformer, fused_pointwise_on, make_context
from fp8rl.precision import phase

from .kv_cache import KVCache, PromptKV, rows_of_prompts


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy (log-probs then at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def logprob_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Rollout:
    """Sampled sequences in the left-padded grid.

    tokens:          LongTensor[B, S]   pads, prompt, completion, pads after a finish
    pad_left:        LongTensor[B]      pad slots before each prompt
    prompt_len:      int                column where completions start (= longest prompt)
    cache_len:       int                key slots every forward attends over
    completion_mask: BoolTensor[B, S]   True at sampled tokens (the EOS token included)
    logprobs:        FloatTensor[B, S]  sampling-policy log-prob of each sampled token, 0 elsewhere
    finish_reasons:  "stop" (EOS or stop string) or "length", per row
    routing:         ShortTensor[B, S, n_moe_layers, k] or None (dense models): for the
                     token in column s, the experts (ascending ids) each MoE layer chose
                     at the position whose logits sampled it (column s - 1); -1 in column 0
    """

    tokens: torch.Tensor
    pad_left: torch.Tensor
    prompt_len: int
    cache_len: int
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    finish_reasons: list[str]
    completion_ids: list[list[int]] = field(default_factory=list)
    routing: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def padded_to(self, width: int, pad_id: int) -> "Rollout":
        """The grid right-padded to `width` columns as a longer rollout leaves a
        row that finished early: pad tokens, no mask, log-prob 0 (data-parallel
        ranks share the step's widest grid)."""
        B, S = self.tokens.shape
        if width < S:
            raise ValueError(f"cannot pad a rollout of {S} columns to {width}")
        extra = width - S
        return Rollout(
            tokens=torch.cat([self.tokens, self.tokens.new_full((B, extra), pad_id)], 1),
            pad_left=self.pad_left,
            prompt_len=self.prompt_len,
            cache_len=self.cache_len,
            completion_mask=torch.cat([self.completion_mask, self.completion_mask.new_zeros((B, extra))], 1),
            logprobs=torch.cat([self.logprobs, self.logprobs.new_zeros((B, extra))], 1),
            finish_reasons=self.finish_reasons,
            completion_ids=self.completion_ids,
            routing=None if self.routing is None else torch.cat(
                [self.routing, self.routing.new_full((B, extra, *self.routing.shape[2:]), -1)], 1),
        )

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Rollout":
        """A sub-batch (for optimizer micro-batches); rows keep their grid layout."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return Rollout(
            tokens=self.tokens[idx],
            pad_left=self.pad_left[idx],
            prompt_len=self.prompt_len,
            cache_len=self.cache_len,
            completion_mask=self.completion_mask[idx],
            logprobs=self.logprobs[idx],
            finish_reasons=[self.finish_reasons[i] for i in idx.tolist()],
            completion_ids=[self.completion_ids[i] for i in idx.tolist()] if self.completion_ids else [],
            routing=None if self.routing is None else self.routing[idx],
        )


def routing_record(model: Transformer) -> dict[int, list[torch.Tensor]] | None:
    """An empty `AttentionContext.routing` record for a model with MoE layers, else None."""
    return {} if model.config.num_experts else None


def _widen_routing(record: dict[int, list[torch.Tensor]], rows: torch.Tensor, batch: int) -> None:
    """Make the last call's routing of every MoE layer, Long [R, T, k] for the running
    ``rows``, a grid-wide [batch, T, k] (rows not running: -1)."""
    for calls in record.values():
        last = calls[-1]
        calls[-1] = last.new_full((batch, *last.shape[1:]), -1).index_copy_(0, rows, last)


def _rows_of_prompts(record: dict[int, list[torch.Tensor]] | None, of_row: torch.Tensor) -> None:
    """Make the last call's routing of every MoE layer, Long [U, T, k] for the U distinct
    prompts of `prompt_groups`, that of every row, [B, T, k]."""
    for calls in (record or {}).values():
        calls[-1] = calls[-1][of_row]


def sampled_routing(record: dict[int, list[torch.Tensor]] | None, width: int) -> torch.Tensor | None:
    """A filled routing record -> `Rollout.routing`'s form, ShortTensor[B, width, L, k]:
    column s gets the experts of position s - 1 (the one whose logits sampled
    column s), column 0 gets -1. Each of the L MoE layers' calls are
    concatenated along the sequence in call order (prefill, then decode steps)."""
    if not record:
        return None
    per_position = torch.stack([torch.cat(record[i], dim=1) for i in sorted(record)], dim=2)  # [B, T, L, k]
    first = torch.full((per_position.shape[0], 1, *per_position.shape[2:]), -1, dtype=torch.int16,
                       device=per_position.device)
    return torch.cat([first, per_position[:, : width - 1].to(torch.int16)], dim=1)


def sample_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of row ``row`` at step ``step`` of a run seeded ``seed``:
    distinct and reproducible for every (seed, step, row), so a resumed run
    draws exactly the samples an uninterrupted one would."""
    return (seed * 1_000_003 + step) * 100_003 + row


def token_entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each distribution: logp ``[..., V]`` (log-softmax) -> ``[...]``.

    ``-sum p * logp``; entries with p == 0 (logp = -inf after top-k filtering)
    contribute 0, not NaN."""
    p = logp.exp()
    # -inf -> the lowest finite value, whose product with p == 0 is 0 (one pass, not a mask and a select)
    return -(p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


# Rows per pass of `token_logprobs`: a chunk's vocabulary-sized temporaries stay near
# 8 MiB, small enough to be reused from the heap (fp8rl/allocator.py) instead of mapped
# and page-faulted afresh, and to stay in cache between the passes over them.
LOGPROB_CHUNK_BYTES = 8 << 20


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs`' forward and backward: kernels.c's loops (``fused``), else torch's
    ops one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float,
                with_entropy: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        N, V = logits.shape
        ctx.temperature, ctx.fused = temperature, fused
        if fused:
            logp, stats, entropy = kernels.token_logprobs(logits, target, temperature, with_entropy)
            if entropy is None:
                entropy = logp.new_empty(0)
            ctx.save_for_backward(logits, target, stats)
            ctx.mark_non_differentiable(entropy)
            return logp, entropy
        logp = torch.empty(N, dtype=logits.dtype, device=logits.device)
        entropy = torch.empty(N if with_entropy else 0, dtype=logits.dtype, device=logits.device)
        for rows in _row_chunks(N, V, logits.element_size()):
            ls = _log_softmax(logits[rows], temperature)
            logp[rows] = ls.gather(-1, target[rows, None])[:, 0]
            if with_entropy:
                entropy[rows] = token_entropy(ls)
        ctx.save_for_backward(logits, target)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        if ctx.fused:
            logits, target, stats = ctx.saved_tensors
            grad = kernels.token_logprobs_backward(logits, target, ctx.temperature, stats, grad_logp)
            return grad, None, None, None, None
        # torch's own backward of log_softmax -> gather (-> / temperature), row by row:
        # the log-softmax is recomputed per chunk (same bits) instead of kept [N, V].
        # Each chunk's one-hot gradient lives in one zero buffer (its entries set, then
        # reset to zero), and the chunk's gradient is written in place: no vocabulary-sized
        # zero fill or copy per chunk.
        logits, target = ctx.saved_tensors
        N, V = logits.shape
        grad = torch.empty_like(logits)
        one_hot = None
        for rows in _row_chunks(N, V, logits.element_size()):
            ls = _log_softmax(logits[rows], ctx.temperature)
            if one_hot is None:  # the first chunk is the largest
                one_hot = torch.zeros_like(ls)
            g_ls, at = one_hot[: ls.shape[0]], target[rows, None]
            g_ls.scatter_add_(-1, at, grad_logp[rows, None])  # 0 + g, as on a fresh zero tensor
            out = grad[rows]
            torch.ops.aten._log_softmax_backward_data.out(g_ls, ls, -1, ls.dtype, out=out)
            g_ls.scatter_(-1, at, 0.0)
            if ctx.temperature != 1.0:
                out.div_(ctx.temperature)
        return grad, None, None, None, None


def _row_chunks(n: int, width: int, itemsize: int) -> list[slice]:
    step = max(1, LOGPROB_CHUNK_BYTES // (width * itemsize))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def token_logprobs(
    logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, *, with_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token and (optionally) each distribution's entropy:
    logits [N, V] float, target [N] long -> (logp [N], entropy [N] or None).

    ``logp[i] = log_softmax(logits[i] / temperature)[target[i]]``. ``fused`` (the
    model's backend asks for kernels.c's loops: `logprobs_fused`): computed by
    ``fp8rl_token_logprobs`` in its own fixed order (the same bits on every CPU), from
    two passes over each row that write nothing vocabulary-sized, with a one-pass
    gradient from each row's saved max and log-sum. Otherwise bit for bit what
    ``log_softmax(...).gather(...)`` over all rows gives (the log-softmax of a row
    does not depend on the other rows), its gradient torch's backward of those ops,
    in chunks of about LOGPROB_CHUNK_BYTES rows so that no [N, V] log-softmax,
    entropy temporary or one-hot gradient is allocated; the backward recomputes each
    chunk's log-softmax. Either way `sample_next` records what this returns for the
    same logits. The entropy (`token_entropy`, a metric) carries no graph."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"token_logprobs wants logits [N, V] and target [N], got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    fused = fused and logits.dtype == torch.float32 and logits.is_cpu and kernels.library() is not None
    logp, entropy = _TokenLogprobs.apply(logits, target, float(temperature), with_entropy, fused)
    return logp, entropy if with_entropy else None


def logprobs_fused(model: Transformer, logits: torch.Tensor) -> bool:
    """Whether `token_logprobs` of ``model``'s logits runs kernels.c's loops: the model's
    backend asks for them (`fused_pointwise_on`). The rollout and the training forward
    both ask here, so they record and score the same bits."""
    return fused_pointwise_on(model, logits)


def default_cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """Key slots for a rollout: rounded up to a multiple of KEY_SLOT_STEP (16) so
    vectorised reductions over the key axis never take a scalar tail path."""
    return -(-(prompt_len + max_new_tokens) // KEY_SLOT_STEP) * KEY_SLOT_STEP


def prompt_groups(prompt_tokens: torch.Tensor, pad_left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with the same prompt (a GRPO group's samples): prompt_tokens [B, P]
    (left-padded), pad_left [B] -> (first [U], of_row [B]): the first row of each
    distinct prompt in row order, and each row's prompt as an index into `first`.
    None when no two rows share a prompt.

    Used to compute a shared prompt once: the backends are batch-invariant, so a
    prompt's K/V and logits have the same bits computed for one row or for all
    of its group's rows."""
    keys = torch.cat([pad_left[:, None], prompt_tokens], dim=1).tolist()
    index: dict[tuple[int, ...], int] = {}
    of_row = [index.setdefault(tuple(key), len(index)) for key in keys]
    if len(index) == len(keys):
        return None
    first = [0] * len(index)
    for b in reversed(range(len(keys))):
        first[of_row[b]] = b
    device = prompt_tokens.device
    return torch.tensor(first, device=device), torch.tensor(of_row, device=device)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts -> (tokens [B, width], pad_left [B]) with prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = width or max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    pad_left = torch.empty(len(prompts), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        pad_left[b] = width - len(p)
    return tokens, pad_left


class RowNoise:
    """The uniform noise of each running row's next decode steps, drawn from the
    row's own generator `chunk` steps at a time.

    `torch.rand(chunk, V, generator=g)` draws the numbers that `chunk` successive
    `torch.rand(V, generator=g)` calls draw (a CPU generator fills a tensor
    serially; tests/test_engine.py checks it), so a row's samples are those of one
    draw per step, for 1/chunk of the calls (the default run's rollout: 2,182 calls
    of `uniform_` -> 183 under torch.profiler). The chunk keeps the buffer under
    `max_floats` (a large vocabulary draws a step at a time, where the draw
    itself outweighs the call). On the CPU the compiled kernel draws the same
    numbers for all rows at once (`kernels.uniform_rows`: SmolLM2's 49,152-logit
    noise for 16 rows was about 2.8 ms a step in torch's serial loop, 5% of a
    decode step)."""

    def __init__(self, generators: Sequence[torch.Generator], vocab: int, steps: int, device: torch.device,
                 max_floats: int = 1 << 22) -> None:
        self.generators, self.vocab, self.steps, self.device = list(generators), vocab, steps, device
        self.chunk = max(1, min(16, max_floats // max(1, len(self.generators) * vocab)))
        self.buffer = torch.empty(0, len(self.generators), vocab, device=device)  # [chunk, R, V]
        self.t = 0  # decode steps drawn so far

    def next(self) -> torch.Tensor:
        """The next step's noise, FP32 [R, V] in [0, 1), contiguous."""
        i = self.t % self.chunk
        if i == 0:
            n = min(self.chunk, self.steps - self.t)
            drawn = kernels.uniform_rows(self.generators, n, self.vocab)
            self.buffer = drawn if drawn is not None else torch.stack(
                [torch.rand(n, self.vocab, generator=g, device=self.device) for g in self.generators], dim=1)
        self.t += 1
        return self.buffer[i]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the running rows) go on."""
        self.generators = [self.generators[i] for i in rows.tolist()]
        self.buffer = self.buffer[:, rows]


def sample_next(
    logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None, *, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [B, V] float32, noise [B, V] uniform in [0, 1)
    (None: greedy) -> (tokens [B], logprobs [B]).

    Gumbel-max on each row's own uniform noise (`RowNoise`: drawn from the row's
    own generator), so a sample depends only on its seed, not on the rest of the
    batch. The recorded log-prob is `token_logprobs` of the drawn token (``fused``:
    `logprobs_fused`), what the training forward scores."""
    temp = params.logprob_temperature
    if params.temperature == 0:
        tok = logits.argmax(dim=-1)
        return tok, token_logprobs(logits, tok, temp, fused=fused)[0]
    logp = torch.log_softmax(logits / temp if temp != 1.0 else logits, dim=-1)  # x / 1.0 == x: skip the pass
    filtered = logp  # masked below out of place: logp itself is returned unchanged
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_logp.exp()
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    gumbel = noise.clamp(min=1e-20).log_().neg_().log_().neg_()  # -log(-log(u)), in one new tensor
    tok = kernels.argmax_sum(filtered, gumbel)  # one pass, no sum tensor: the same sums, the same argmax
    if tok is None:
        tok = gumbel.add_(filtered).argmax(dim=-1)  # filtered + gumbel: the same sum
    if fused:
        return tok, token_logprobs(logits, tok, temp, fused=True)[0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    generators: Sequence[torch.Generator] | None = None,
    seeds: Sequence[int] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    cache_len: int | None = None,
    prompt_len: int | None = None,
) -> Rollout:
    """Sample a completion for every prompt (token id lists) with the rollout flow.

    Give either per-sample `generators` or `seeds`; `decode` (ids -> text) is
    needed for stop strings; `prompt_len` widens the prompt columns beyond the
    longest prompt (a data-parallel rank uses the whole step's longest). Raises
    if a prompt does not fit the context."""
    B = len(prompts)
    if generators is None:
        if seeds is None:
            raise ValueError("generate needs per-sample generators or seeds")
        generators = [torch.Generator(device=model.device).manual_seed(int(s)) for s in seeds]
    if len(generators) != B:
        raise ValueError(f"{len(generators)} generators for {B} prompts")
    if params.stop_strings and decode is None:
        raise ValueError("stop strings need a decode function (a tokenizer)")
    P = max(len(p) for p in prompts)
    if prompt_len is not None:
        if prompt_len < P:
            raise ValueError(f"prompt_len {prompt_len} < the longest prompt's {P} tokens")
        P = prompt_len
    max_ctx = model.config.max_position_embeddings
    if P + params.max_new_tokens > max_ctx:
        longest = max(range(B), key=lambda b: len(prompts[b]))
        raise ValueError(
            f"prompt {longest} has {P} tokens; with max_new_tokens={params.max_new_tokens} it exceeds "
            f"the model's context of {max_ctx} positions"
        )
    L = cache_len or default_cache_len(P, params.max_new_tokens)
    if L < P + params.max_new_tokens:
        raise ValueError(f"cache_len {L} < prompt_len {P} + max_new_tokens {params.max_new_tokens}")
    device = model.device
    prompt_tokens, pad_left = left_pad(prompts, pad_id, P)
    tokens = torch.full((B, P + params.max_new_tokens), pad_id, dtype=torch.long)
    tokens[:, :P] = prompt_tokens
    tokens, pad_left = tokens.to(device), pad_left.to(device)
    logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=device)
    mask = torch.zeros(tokens.shape, dtype=torch.bool, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    reasons = ["length"] * B
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    routing = routing_record(model)  # MoE: the experts chosen at every fed position
    # A prompt shared by several rows (a GRPO group) is prefilled once, then its K/V rows
    # and logits are copied to each of its rows: the same bits as a prefill of every row.
    shared = prompt_groups(tokens[:, :P], pad_left)
    first = torch.arange(B, device=device) if shared is None else shared[0]
    cache = KVCache.for_model(model, len(first), L)

    # The running batch: `rows` are the grid rows still decoded, in order. Once at most half
    # of them are live, the finished ones leave (their KV rows, noise generators, pad offsets):
    # the backends are batch-invariant, so a live row's bits do not depend on who else is
    # in the batch, and the later steps cost what the live rows need.
    rows = torch.arange(B, device=device)
    noise = None if params.temperature == 0 else RowNoise(generators, model.config.vocab_size,
                                                           params.max_new_tokens, device)
    # Inference mode: no version counters or autograd dispatch on the decode's many small ops
    # (`benchmarks/decode_step.py --modes no_grad,inference` times both). The outputs (`tokens`,
    # `logprobs`, `mask`) were allocated above, outside it: normal tensors a training forward may use.
    with phase(model, "rollout"):
        # The decoder layers without their module dispatch, for this rollout's weights (the same bits).
        layers = model.rollout_layers()
    with phase(model, "rollout"), torch.inference_mode():
        # the prompts' keys sit in slots [0, P): the prefill attends over the first `key_slots`
        keys = model.key_slots(P, L, queries=P)
        logits = model(tokens[first, :P], make_context(pad_left[first], 0, P, keys, cache, routing=routing),
                       n_last=1, layers=layers)[:, -1]
        if shared is not None:
            of_row = shared[1]
            logits = logits[of_row]
            cache.keep_rows(of_row)
            _rows_of_prompts(routing, of_row)
        fused = logprobs_fused(model, logits)
        steps = 0
        for t in range(params.max_new_tokens):
            col = P + t
            step_noise = noise.next() if noise is not None else None
            tok, lp = sample_next(logits, params, step_noise, fused=fused)  # [R] for the running rows
            live = ~done[rows]
            tok = torch.where(live, tok, torch.full_like(tok, pad_id))
            tokens[rows, col] = tok
            logprobs[rows, col] = torch.where(live, lp, torch.zeros_like(lp))
            mask[rows, col] = live
            steps = t + 1
            finished = live & torch.isin(tok, eos)
            for i in finished.nonzero().flatten().tolist():
                reasons[int(rows[i])] = "stop"
            if params.stop_strings:
                for i in (live & ~finished).nonzero().flatten().tolist():
                    b = int(rows[i])
                    text = decode(tokens[b, P : col + 1][mask[b, P : col + 1]].tolist())
                    if any(s in text for s in params.stop_strings):
                        finished[i] = True
                        reasons[b] = "stop"
            still = live & ~finished
            done[rows] = ~still
            if not bool(still.any()) or t == params.max_new_tokens - 1:
                break
            running = still.nonzero().flatten()
            if 2 * len(running) <= len(rows):
                rows, tok = rows[running], tok[running]
                if noise is not None:
                    noise.keep_rows(running)
                cache.keep_rows(running)
            # the step's keys sit in slots [0, col]: it attends over the first `key_slots` of the L
            keys = model.key_slots(col + 1, L)
            logits = model(tok[:, None], make_context(pad_left[rows], col, 1, keys, cache, routing=routing),
                           layers=layers)[:, -1]
            if routing is not None and len(rows) < B:
                _widen_routing(routing, rows, B)

    S = P + steps
    tokens, logprobs, mask = tokens[:, :S], logprobs[:, :S], mask[:, :S]
    completion_ids = [tokens[b, P:][mask[b, P:]].tolist() for b in range(B)]
    return Rollout(tokens, pad_left, P, L, mask, logprobs, reasons, completion_ids,
                   routing=sampled_routing(routing, S))


def score(
    model: Transformer,
    rollout: Rollout,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    routing: dict[int, list[torch.Tensor]] | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training forward: log-prob of every token of the grid.

    Returns (logp [B, S] with 0 outside the completion region, entropy [B, S] or
    None). Differentiable; runs FP8Linear in phase "train" (the caller's grad
    mode decides whether a graph is built). Only completion positions go through
    the lm_head, which keeps memory at B x (S - prompt_len) x vocab. `routing`
    (an MoE model's `routing_record`) is filled with the experts of every
    position (`sampled_routing` gives `Rollout.routing`'s form).

    `share_prompts`: rows with the same prompt (`prompt_groups`) have their prompt
    computed once (`forward_shared_prompts`): the same log-probs, bit for bit, for
    a fraction of the work; the gradient is the same sum, rounded differently."""
    tokens, P = rollout.tokens, rollout.prompt_len
    B, S = tokens.shape
    shared = prompt_groups(tokens[:, :P], rollout.pad_left) if share_prompts else None
    with phase(model, "train"):
        if shared is None:
            ctx = make_context(rollout.pad_left, 0, S, rollout.cache_len, routing=routing)
            logits = model(tokens, ctx, head_span=(P - 1, S - 1))  # predicts columns P .. S-1
        else:
            logits = forward_shared_prompts(model, rollout, *shared, routing=routing)
    T, V = S - P, logits.shape[-1]
    lp, ent = token_logprobs(logits.reshape(B * T, V), tokens[:, P:].reshape(B * T), temperature,
                             with_entropy=with_entropy, fused=logprobs_fused(model, logits))
    logp = torch.zeros(B, S, dtype=lp.dtype, device=tokens.device)
    logp[:, P:] = lp.view(B, T)
    logp = torch.where(rollout.completion_mask, logp, torch.zeros_like(logp))
    entropy = None
    if ent is not None:
        entropy = torch.zeros(B, S, dtype=ent.dtype, device=tokens.device)
        entropy[:, P:] = ent.view(B, T)
    return logp, entropy


def forward_shared_prompts(
    model: Transformer,
    rollout: Rollout,
    first: torch.Tensor,
    of_row: torch.Tensor,
    routing: dict[int, list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """`score`'s forward in two calls, each distinct prompt computed once: logits
    [B, S - P, vocab] of positions P-1 .. S-2 (those predicting the completion
    columns), bitwise those of the one-call forward. `first`, `of_row`: `prompt_groups`.

    Call 1: the U distinct prompts, slots [0, P), keeping their K/V (`PromptKV`).
    Call 2: every row's slots [P, S-1) (the last column's K/V no query reads),
    attending its prompt's K/V and its own, as a decode step reads the cache.
    Each query row sees exactly the key vector of the one-call forward (its
    prompt's keys, its own, zeros in the masked slots beyond), and every product
    is batch-invariant, so the bits are the same; the U x P prompt tokens replace
    B x P. With a graph, the backward sums a prompt's gradients over its rows
    (index_select's backward) before its backward GEMMs, instead of adding each
    row's products in them: the same gradient, rounded differently."""
    tokens, P = rollout.tokens, rollout.prompt_len
    S = tokens.shape[1]
    prompt, rest = hidden_shared_prompts(model, tokens, rollout.pad_left, P, rollout.cache_len, first, of_row,
                                         stop=S - 1, routing=routing)
    h = rows_of_prompts(prompt[:, -1:], of_row)  # [B, 1, D]: position P-1 of each row
    if rest is not None:
        h = torch.cat([h, rest], dim=1)  # [B, S - P, D]
    return model.logits(h)


def hidden_shared_prompts(
    model: Transformer,
    tokens: torch.Tensor,
    pad_left: torch.Tensor,
    prompt_len: int,
    cache_len: int,
    first: torch.Tensor,
    of_row: torch.Tensor,
    stop: int,
    routing: dict[int, list[torch.Tensor]] | None = None,
    amax: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The two calls of a forward that computes each shared prompt once (`score`,
    `calibrate`): the U distinct prompts' slots [0, prompt_len) -> hidden [U, P, D],
    then every row's slots [prompt_len, stop) reading its prompt's K/V (`PromptKV`)
    -> hidden [B, stop - P, D], or None when stop == prompt_len. `routing` (MoE)
    ends with the prompt call's record widened to every row; `amax` records both calls.

    Where the attention is the fused kernel, the key slots stop at the first multiple of 16
    that holds `stop` rather than at `cache_len` (the rollout's room for `max_new_tokens`):
    the kernel reads no slot past a row's last live key, so the bits are the same, and the
    zero padding, the kernel's copies of K and V and the backward's [B, H, T, L] tensors
    shrink with it."""
    P = prompt_len
    if model.attention_fused():
        cache_len = min(cache_len, -(-stop // KEY_SLOT_STEP) * KEY_SLOT_STEP)
    kv = PromptKV(of_row, cache_len)
    ctx = make_context(pad_left[first], 0, P, cache_len, kv, amax=amax, routing=routing)
    prompt = model.hidden(tokens[first, :P], ctx)
    _rows_of_prompts(routing, of_row)
    if stop <= P:
        return prompt, None
    ctx = make_context(pad_left, P, stop - P, cache_len, kv, amax=amax, routing=routing)
    return prompt, model.hidden(tokens[:, P:stop], ctx)
