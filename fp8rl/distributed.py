"""Data parallelism under torchrun: which rows a rank owns, the few collectives
the trainer needs, and the FSDP2-sharded master weights and AdamW state.

One run, any number of processes (docs/design.md section 11). The run is a
function of the global configuration, not of the world size N:

- a step's prompt groups are dealt out per optimizer micro-batch: micro-batch
  i holds groups [i*g, (i+1)*g) (g = prompts_per_step / micro_batches, as in
  one process), cut into `train.grad_chunks` gradient chunks, and rank r rolls
  out and trains the contiguous 1/N of them (`rank_groups`; N must divide
  grad_chunks). A group never spans ranks, so advantages need no
  communication;
- every rank pads its rollout to the step's global grid (the longest prompt
  of the whole step, the longest sequence of any rank), so a row's tokens,
  log-probs and gradient are those of the one-process run (the backends are
  batch-invariant);
- a micro-batch's gradient is the sum of its chunks' gradients (one backward
  per chunk, in one process too), added in chunk order in float64 (the
  running sum passed from rank to rank, `GradientSum`), then rounded once to
  FP32: the one-process additions in the one-process order, so 1 and N ranks
  give the same bits (tests/test_distributed.py);
- the master weights, AdamW state and summed gradient are sharded with FSDP2
  (`fully_shard`, Shard(0) DTensors): the last rank of the running sum sends
  each rank only its rows of the summed gradient and the norm for clipping,
  and each rank steps its shard; the updated shards are all-gathered into
  the rank's compute model and quantized there once per optimizer step, one
  weight at a time: the compute model keeps only the quantized forms of its
  linears' weights (what rollout and training read), not their FP32 values.
  Checkpoints hold the optimizer state as torch.distributed.checkpoint shards
  (fp8rl/checkpoint.py), readable at any world size.

`World()` is one process: every collective is the identity, so the trainer
has one code path.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8rl.optim import AdamW


class DistributedError(ValueError):
    """A run that cannot be split across the ranks as asked (batch split,
    configs that differ between ranks): a user error, one line."""


class RankLostError(RuntimeError):
    """A collective failed: another rank died or cannot be reached."""


@contextlib.contextmanager
def collective(rank: int):
    """Turn a failed gloo collective (a peer that died: "Connection reset by
    peer", a timeout) into one `RankLostError` line."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RankLostError(
            f"rank {rank}: another data-parallel rank stopped or cannot be reached ({first[:160]}); "
            "stopping too; continue with --resume"
        ) from e


@dataclass(frozen=True)
class World:
    """This process's place in the run: `rank` of `size` processes."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @staticmethod
    def from_env(timeout_s: float = 600.0) -> "World":
        """The world torchrun describes in the environment (WORLD_SIZE, RANK,
        MASTER_ADDR, ...); one process when it describes none. Joins the gloo
        process group (CPU) on first use; a rendezvous or collective that does
        not complete within `timeout_s` raises instead of hanging."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return World()
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return World(dist.get_rank(), dist.get_world_size())

    # -- collectives (identity in one process) -------------------------------------------

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` [n, ...] (equal shapes) concatenated in rank order [N*n, ...]."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        with collective(self.rank):
            dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        with collective(self.rank):
            dist.all_gather_object(out, obj)
        return out

    def max_int(self, x: int) -> int:
        if self.size == 1:
            return x
        t = torch.tensor([x], dtype=torch.long)
        with collective(self.rank):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def any(self, flag: bool) -> bool:
        return self.max_int(int(flag)) == 1

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks."""
        if self.size > 1:
            with collective(self.rank):
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        with collective(self.rank):
            dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `t` from rank `src`."""
        with collective(self.rank):
            dist.recv(t, src)
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """In-place: every rank's `t` := rank `src`'s."""
        if self.size > 1:
            with collective(self.rank):
                dist.broadcast(t, src)
        return t

    def gather_varying(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` [n_r, ...] (n_r may differ) concatenated in rank order."""
        if self.size == 1:
            return t
        n = self.max_int(t.shape[0])
        padded = torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
        padded[: t.shape[0]] = t
        counts = self.gather_rows(torch.tensor([t.shape[0]]))
        parts = self.gather_rows(padded).split(n)
        return torch.cat([part[: int(c)] for part, c in zip(parts, counts)])

    def barrier(self) -> None:
        if self.size > 1:
            with collective(self.rank):
                dist.barrier()

    def check_same(self, text: str, what: str) -> None:
        """Raise on every rank if `text` differs between ranks (e.g. the resolved config)."""
        texts = self.gather_objects(text)
        odd = [r for r, t in enumerate(texts) if t != texts[0]]
        if odd:
            raise DistributedError(f"{what} differs between ranks (rank 0 vs rank(s) {odd}); "
                                   "every rank must be started with the same command and files")


def rank_groups(n_groups: int, micro_batches: int, grad_chunks: int, world: World) -> list[int]:
    """The prompt groups rank `world.rank` owns, in its local order: of every
    micro-batch's g = n_groups / micro_batches groups, cut into `grad_chunks`
    gradient chunks, the rank's contiguous grad_chunks / N chunks. Raises when
    the split is not whole."""
    if n_groups % micro_batches or (n_groups // micro_batches) % grad_chunks:
        raise DistributedError(
            f"rollout.prompts_per_step {n_groups} does not split into {micro_batches} micro-batches of "
            f"{grad_chunks} gradient chunks of whole prompt groups"
        )
    if grad_chunks % world.size:
        raise DistributedError(
            f"the global batch does not split across {world.size} ranks: each micro-batch's gradient is the sum of "
            f"train.grad_chunks = {grad_chunks} chunks, not a multiple of {world.size}; set train.grad_chunks to a "
            f"multiple of {world.size} (e.g. --set train.grad_chunks={world.size}: the run is then the same on 1 "
            f"process and on {world.size})"
        )
    g = n_groups // micro_batches
    share = g // world.size
    return [i * g + world.rank * share + j for i in range(micro_batches) for j in range(share)]


def group_rows(groups: list[int], group_size: int) -> torch.Tensor:
    """The global rows [len(groups) * group_size] of prompt groups `groups`, in their order."""
    return torch.tensor([g * group_size + j for g in groups for j in range(group_size)], dtype=torch.long)


def global_row_order(n_groups: int, group_size: int, micro_batches: int, grad_chunks: int, world: World) -> torch.Tensor:
    """`perm` [B] with `perm[k]` = the global row of the k-th row of `world.gather_rows(local)`."""
    return torch.cat([group_rows(rank_groups(n_groups, micro_batches, grad_chunks, World(r, world.size)), group_size)
                      for r in range(world.size)])


def gather_global(t: torch.Tensor, perm: torch.Tensor, world: World) -> torch.Tensor:
    """Local rows [b, ...] of every rank -> the global batch [B, ...] in one-process order."""
    if world.size == 1:
        return t
    gathered = world.gather_rows(t)
    out = torch.empty_like(gathered)
    out[perm] = gathered
    return out


# Elements of the float64 running sum in flight at once during `GradientSum.reduce`
# (32 MiB): what bounds the reduction's extra memory, whatever the model's size.
REDUCE_PIECE = 1 << 22


class GradientSum:
    """A micro-batch's gradient: its chunks' FP32 gradients summed in chunk order in
    float64 (the first term kept as it is: one term is its own sum), rounded once
    to FP32, the same bits on any number of ranks; and its global L2 norm, as
    torch's `clip_grad_norm_` computes it in one process.

    Two terms are summed in FP32, not float64: the float64 sum of two FP32 numbers
    rounded to FP32 is their FP32 sum, bit for bit (double rounding through a format
    of at least 2p + 2 bits is innocuous for one addition, Figueroa 1995: 53 >= 2 * 24 + 2;
    tests/test_distributed.py checks it on edge values). One process and rank 0 keep
    a second term beside the first until a third comes or the sum is taken, so a
    2-chunk micro-batch costs one FP32 pass over the gradient instead of three
    float64 ones (a SmolLM2 step with `grad_chunks = 2`: 0.26-0.63 s -> see
    benchmarks/README.md); a third term starts the float64 sum, added to in place.

    One process adds each chunk's gradient as its backward ends (`add()`). On N
    ranks, rank r holds chunks [r*m, (r+1)*m) of the micro-batch (`rank_groups`);
    `reduce()` passes the running float64 sum along the ranks: rank r receives the
    sum of the chunks before its own from rank r-1, adds its own in order, sends
    the sum on, and the last rank rounds the total to FP32. Every addition is the
    one-process addition, in its order, so the result does not depend on N even
    where a float64 addition rounds (terms spanning more than 2**29, as the
    gradients of a mixture-of-experts router's unchosen experts can).

    The flat gradient travels in pieces of at most `piece` elements, one after
    another (additions are elementwise, so pieces change no bits): a rank holds
    one float64 piece at a time, never a float64 copy of the whole gradient,
    except rank 0 (and one process), which sums its own chunks as they come, in
    float64 once it has two. A rank's chunk gradients are dropped parameter by
    parameter as the running sum passes them. As each parameter's sum completes,
    the last rank takes its norm and sends every rank only its rows of it
    (`row_shard`: FSDP2's Shard(0) split, what the rank's master shard steps; one
    message per piece and rank), so no rank holds the whole summed gradient; the
    norm of the whole, from the per-parameter norms in parameter order, is
    broadcast.

    The sum passes the parameters in `groups` (`backward_groups`: the final norm
    and an untied LM head, each decoder layer, last first, then the rest), and it
    need not wait for the backward to end: in a rank's last chunk of the
    micro-batch (`streaming`), the trainer calls `stream(g)` as soon as the
    backward has finished group g, which passes its gradients on and drops them.
    With one chunk per rank (`grad_chunks` = N) a rank then never holds its chunk's
    whole gradient, one group's at a time (and the embeddings' at the end).
    Every rank passes the groups in the same order (a group not streamed, or
    streamed out of order, is passed by `reduce()`), so the additions and the
    messages are the same whichever rank streams what."""

    def __init__(
        self, params: list[nn.Parameter], world: World, piece: int = REDUCE_PIECE,
        groups: list[list[int]] | None = None,
    ) -> None:
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"GradientSum needs parameters of one dtype, got {sorted({str(p.dtype) for p in params})}")
        self.params = params
        self.world = world
        self.piece = piece
        # The order in which the running sum passes the parameters: groups of indices
        # (the head's, then a decoder layer's each, in the order the backward finishes
        # them, then the rest).
        self.groups = groups if groups is not None else [list(range(len(params)))]
        if sorted(i for g in self.groups for i in g) != list(range(len(params))):
            raise ValueError("GradientSum groups must hold every parameter index exactly once")
        self.streaming = False  # set for a rank's last chunk of a micro-batch: `stream()` may pass groups
        self._reset()

    def _reset(self) -> None:
        n = len(self.params)
        # rank 0: running sum; FP32 for one term, a pair of FP32 terms for two, float64 from three
        self.acc: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
        self.pending: list[list[torch.Tensor | None]] = []  # rank > 0: its chunks, until the running sum arrives
        self.taken = [False] * n  # this chunk's gradient of parameter i is taken
        self.passed = [False] * len(self.groups)  # the running sum has passed group g
        self.mine: list[torch.Tensor | None] = [None] * n  # this rank's rows of each summed gradient
        self.norms: dict[int, torch.Tensor] = {}  # the last rank's per-parameter norms

    def add(self, indices: list[int] | None = None) -> None:
        """Take this chunk's `.grad`s of `indices` (the rest of the chunk's when None,
        which ends the chunk) and clear them."""
        rest = indices is None
        if rest:
            indices = [i for i in range(len(self.params)) if not self.taken[i]]
        if self.world.rank > 0 and not any(self.taken):
            self.pending.append([None] * len(self.params))  # a new chunk
        for i in indices:
            p = self.params[i]
            g = None if p.grad is None else p.grad.detach()
            p.grad = None
            self.taken[i] = True
            if g is None:  # no gradient (an expert no token chose): a zero term
                continue
            if self.world.rank == 0:
                self.acc[i] = _added(self.acc[i], g)
            else:
                self.pending[-1][i] = g
        if rest:
            self.taken = [False] * len(self.params)

    def stream(self, group: int) -> None:
        """During the backward of this rank's last chunk of the micro-batch, when
        `group`'s gradients are final (its head or decoder layer is done): take them and pass
        the running sum over them now, so this rank never holds the chunk's whole
        gradient. Only in order: a group whose predecessors have not passed waits
        for `reduce()`, which passes every rank's groups in the same order (so a
        rank whose backward stopped early still meets the others)."""
        if not self.streaming or self.world.size == 1 or self.passed[group] or not all(self.passed[:group]):
            return
        self.add(self.groups[group])
        self._pass(group)

    def reduce(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's summed FP32 gradient, this rank's part of it per
        parameter (one process: the whole; N ranks: `row_shard` of it), and the
        L2 norm of the whole gradient (a 0-dim FP32 tensor, the same on every rank)."""
        w = self.world
        dtype = self.params[0].dtype
        self.streaming = False
        if w.size == 1:
            grads = [torch.zeros_like(p) if a is None else _summed(a, dtype).reshape(p.shape)
                     for p, a in zip(self.params, self.acc)]
            self._reset()
            return grads, global_norm([torch.linalg.vector_norm(g) for g in grads])
        for g in range(len(self.groups)):
            if not self.passed[g]:
                self._pass(g)
        norm = torch.zeros((), dtype=dtype)
        if w.rank == w.size - 1:
            norm = global_norm([self.norms[i] for i in range(len(self.params))])
        mine = self.mine
        self._reset()
        assert all(g is not None for g in mine)
        return mine, w.broadcast(norm, w.size - 1)  # type: ignore[return-value]

    def _pass(self, group: int) -> None:
        """The running sum over one group's parameters, in pieces of at most `piece`
        elements: received from rank r-1, this rank's terms added, sent to r+1;
        the last rank rounds each parameter's total to FP32, keeps its norm and
        sends each rank its rows (`self.mine`)."""
        w = self.world
        dtype = self.params[0].dtype
        last = w.size - 1
        index = self.groups[group]

        def my_rows(i: int) -> torch.Tensor:  # an empty tensor of this rank's rows of parameter i
            shape = row_shard(torch.empty(self.params[i].shape, device="meta"), w.size, w.rank).shape
            return torch.empty(shape, dtype=dtype)

        for i in index:
            if self.params[i].numel() == 0:  # no piece has them; the norm as one process takes it
                self.mine[i] = my_rows(i)
                self.norms[i] = torch.linalg.vector_norm(self.mine[i])
        summing: dict[int, torch.Tensor] = {}  # the last rank's: a parameter's FP32 sum until it completes
        for local in _pieces([self.params[i].numel() for i in index], self.piece):
            segments = [(index[k], start, stop) for k, start, stop in local]
            sizes = [stop - start for _, start, stop in segments]
            running = torch.zeros(sum(sizes), dtype=torch.float64)
            parts = running.split(sizes)
            if w.rank == 0:
                for (i, start, stop), part in zip(segments, parts):
                    terms = self.acc[i]
                    for term in (terms if isinstance(terms, tuple) else () if terms is None else (terms,)):
                        part.add_(term.reshape(-1)[start:stop])  # exact: float64 += FP32 or float64
            else:
                w.recv(running, w.rank - 1)
                for grads in self.pending:
                    for (i, start, stop), part in zip(segments, parts):
                        if grads[i] is not None:
                            part.add_(grads[i].reshape(-1)[start:stop].to(torch.float64))
            finished = [i for i, _, stop in segments if stop == self.params[i].numel()]
            for i in finished:  # this rank's terms of parameter i are in the running sum now
                self.acc[i] = None
                for grads in self.pending:
                    grads[i] = None
            if w.rank < last:
                w.send(running, w.rank + 1)
                rows = [my_rows(i) for i in finished]
                flat = torch.empty(sum(r.numel() for r in rows), dtype=dtype)
                if flat.numel():  # the rows of this piece's finished parameters, in one message
                    w.recv(flat, last)
                for i, r, got in zip(finished, rows, flat.split([r.numel() for r in rows])):
                    self.mine[i] = got.view(r.shape)
                continue
            total = running.to(dtype)  # rounded once, on the last rank
            for (i, start, stop), part in zip(segments, total.split(sizes)):
                summing.setdefault(i, torch.empty(self.params[i].numel(), dtype=dtype))[start:stop].copy_(part)
            wholes = [summing.pop(i).view(self.params[i].shape) for i in finished]
            for i, whole in zip(finished, wholes):
                self.norms[i] = torch.linalg.vector_norm(whole)
                self.mine[i] = row_shard(whole, w.size, last).clone()
            for r in range(last if wholes else 0):
                flat = torch.cat([row_shard(whole, w.size, r).reshape(-1) for whole in wholes])
                if flat.numel():
                    w.send(flat, r)
        self.passed[group] = True


def _added(acc: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
           g: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`GradientSum`'s running sum of one parameter with the term `g` added: the term
    itself, then the pair of both terms, then their float64 sum, added to in place
    (float64 += FP32 is the float64 addition of the widened term)."""
    if acc is None:
        return g
    if isinstance(acc, tuple):
        total = acc[0].to(torch.float64)
        total.add_(acc[1])
        return total.add_(g)
    if acc.dtype == torch.float64:
        return acc.add_(g)
    return acc, g


def _summed(acc: torch.Tensor | tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A running sum (`_added`) rounded once to `dtype`: a pair by one addition in
    `dtype`, the same bits as its float64 sum rounded (`GradientSum`)."""
    if isinstance(acc, tuple):
        return (acc[0] + acc[1]).to(dtype)  # not in place: the terms are the backward's gradient tensors
    return acc.to(dtype)


def backward_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose input gradient marks a `backward_groups` group final, in
    the order the backward reaches them: the final norm (its group: the norm and an
    untied LM head, whose gradients the backward has accumulated by then), then the
    decoder layers, last first."""
    return [model.model.norm, *reversed(model.model.layers)]


def backward_groups(model: nn.Module, params: list[nn.Parameter]) -> list[list[int]]:
    """Indices into `params` in the order a backward finishes them, the order in
    which `GradientSum` passes them: the final norm and an untied LM head (the
    LM head's gradient is the largest of a decoder with a big vocabulary), each
    decoder layer, last layer first, then the rest (embeddings, and a tied LM head,
    which is the embedding and gets its last term only at the end)."""
    index = {id(p): i for i, p in enumerate(params)}
    embedding = {id(p) for p in model.model.embed_tokens.parameters()}
    head = [*model.model.norm.parameters(), *(p for p in model.lm_head.parameters() if id(p) not in embedding)]
    units = [head, *(list(layer.parameters()) for layer in reversed(model.model.layers))]
    groups = [[index[id(p)] for p in unit if id(p) in index] for unit in units]
    seen = {i for g in groups for i in g}
    return [*groups, [i for i in range(len(params)) if i not in seen]]


def global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a gradient from its parameters' L2 norms, in parameter order:
    what `torch.nn.utils.clip_grad_norm_` computes on the CPU (its per-tensor norms
    are `vector_norm`s there; tested bit for bit)."""
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` in place by min(1, max_norm / (norm + 1e-6)), as
    `clip_grad_norm_` does: elementwise, so a rank's rows are scaled as the whole is."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def row_shard(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's rows of `t` under FSDP2's Shard(0) on n ranks: `torch.chunk(t, n)[r]`,
    empty past the last chunk (as DTensor pads its shards)."""
    chunks = t.chunk(n, dim=0)
    return chunks[r] if r < len(chunks) else t[t.shape[0]:]


def _pieces(sizes: list[int], piece: int) -> list[list[tuple[int, int, int]]]:
    """Tensors of `sizes` elements, flattened one after another, cut into pieces of at
    most `piece` elements: per piece, its (tensor index, start, stop) segments."""
    pieces: list[list[tuple[int, int, int]]] = [[]]
    room = piece
    for i, n in enumerate(sizes):
        start = 0
        while start < n:
            if room == 0:
                pieces.append([])
                room = piece
            stop = min(n, start + room)
            pieces[-1].append((i, start, stop))
            room -= stop - start
            start = stop
    return pieces


class ShardedMaster:
    """FSDP2-sharded master weights and AdamW state of a compute model.

    `fully_shard` is applied to a copy of the model's structure made on the meta
    device (each decoder layer, then the root), whose shards are then allocated
    and filled with this rank's rows of the model's weights: its parameters are
    Shard(0) DTensors and AdamW's state is
    created on those shards. `step()` takes this rank's rows of the reduced and
    clipped gradient (`GradientSum`), steps the rank's shard, and all-gathers
    the updated weights back into the compute model. AdamW is elementwise, so
    the sharded step gives the bits of the unsharded one.

    With `release=True` the compute model's FP8Linear weights hold no FP32 data
    between optimizer steps (`FP8Linear.release_weight`): the forward and the
    backward read only their quantized forms, so `pull()` all-gathers one weight
    at a time, requantizes its layer and frees it again. Its other parameters
    (embeddings, norms, the LM head) stay whole: the forward reads them."""

    def __init__(self, model: nn.Module, optimizer_kwargs: dict[str, Any], release: bool = False) -> None:
        from torch.distributed.fsdp import fully_shard

        from fp8rl.model.load import meta_model
        from fp8rl.precision import fp8_linears

        self.model = model
        # The master's structure on the meta device, sharded, then each rank's shards
        # allocated and filled from the compute weights: no rank holds a second whole copy.
        self.master = meta_model(model.config)
        names = [n for n, _ in model.named_parameters()]
        if [n for n, _ in self.master.named_parameters()] != names:
            raise RuntimeError("the FSDP2 master's parameters do not match the model's (names or order)")
        for (_, m), (_, p) in zip(self.master.named_parameters(), model.named_parameters()):
            m.requires_grad_(p.requires_grad)
        for layer in self.master.model.layers:
            fully_shard(layer)
        fully_shard(self.master)
        self.master.to_empty(device=next(model.parameters()).device)
        self.compute = [p for p in model.parameters() if p.requires_grad]
        self.shards = [p for p in self.master.parameters() if p.requires_grad]
        self.push()
        self.optimizer = AdamW(self.shards, **optimizer_kwargs)
        self.linears = list(fp8_linears(model))
        # compute weight -> its FP8Linear, for the weights this rank holds only quantized
        self.releasable = {id(m.weight): m for m in self.linears} if release else {}

    def release(self) -> int:
        """Free the compute model's FP8Linear weights (quantized first if stale);
        returns the bytes freed."""
        freed = 0
        for c in self.compute:
            layer = self.releasable.get(id(c))
            if layer is not None and not layer.weight_released:
                freed += c.numel() * c.element_size()
                layer.release_weight()
        return freed

    def restore(self) -> None:
        """Give every released weight its memory back, uninitialized and without its
        quantized forms (``FP8Linear.restore_weight``), for a checkpoint load to fill;
        then ``push()`` and ``release()`` again."""
        for layer in self.releasable.values():
            layer.restore_weight()

    def step(self, grads: list[torch.Tensor]) -> None:
        """One AdamW step of this rank's shards on `grads`, its rows of each
        parameter's gradient (`row_shard`), then `pull()`."""
        from torch.distributed.tensor import DTensor

        for s, g in zip(self.shards, grads, strict=True):
            if g.shape != s.to_local().shape:
                raise RuntimeError(f"gradient rows {tuple(g.shape)} for a shard of {tuple(s.to_local().shape)}")
            s.grad = DTensor.from_local(g, s.device_mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride())
        self.optimizer.step()  # local: each rank its shard
        self.optimizer.zero_grad(set_to_none=True)
        self.pull()

    def pull(self) -> None:
        """The compute model's weights := the full master weights (all-gather), and
        every FP8Linear requantized; a released weight is gathered, quantized and
        released again, one at a time, so it is never whole for long."""
        with torch.no_grad(), collective(dist.get_rank()):
            for c, s in zip(self.compute, self.shards):
                layer = self.releasable.get(id(c))
                if layer is not None:
                    layer.restore_weight()
                c.copy_(s.full_tensor())
                if layer is not None:
                    layer.release_weight()  # requantizes the new values first
        for layer in self.linears:
            layer.ensure_fresh()  # the weights pulled whole (quantized once per optimizer step)

    def model_state(self) -> dict[str, torch.Tensor] | None:
        """The compute model's `state_dict()` with its released weights all-gathered
        from the master (a collective: every rank calls it); rank 0 gets the dict,
        the others drop each gathered weight at once and get None."""
        shard_of = dict(zip(map(id, self.compute), self.shards))
        main = dist.get_rank() == 0
        state: dict[str, torch.Tensor] = {}
        with torch.no_grad(), collective(dist.get_rank()):
            for name, t in self.model.state_dict(keep_vars=True).items():
                layer = self.releasable.get(id(t))
                full = shard_of[id(t)].full_tensor() if layer is not None and layer.weight_released else t.detach()
                if main:
                    state[name] = full
        return state if main else None

    def push(self) -> None:
        """The master shards := the compute model's weights (after a checkpoint load)."""
        with torch.no_grad():
            for c, s in zip(self.compute, self.shards):
                s.to_local().copy_(_shard_of(c.detach(), s).to_local())

    def load_full_optimizer(self, full: torch.optim.Optimizer) -> None:
        """This rank's shard of a one-process optimizer state (a resumed checkpoint)."""
        sd = full.state_dict()
        state = {}
        for i, st in sd["state"].items():
            shard = self.shards[i]
            state[i] = {
                k: (_shard_of(v, shard) if torch.is_tensor(v) and v.shape == shard.shape else v) for k, v in st.items()
            }
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _shard_of(full: torch.Tensor, like: Any) -> Any:
    """`full` (identical on every rank) as a DTensor placed like `like`; each
    rank keeps its own slice, nothing is sent (src_data_rank=None)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
