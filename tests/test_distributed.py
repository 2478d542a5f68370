"""Data parallelism (fp8rl/distributed.py, docs/design.md section 11): the
row split, the exact gradient sum, and torchrun runs on gloo whose metrics,
weights and optimizer state equal a one-process run's bit for bit."""

from __future__ import annotations

import functools
import itertools
import json
import os
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8rl.checkpoint import checkpoint_path
from fp8rl.distributed import (
    REDUCE_PIECE,
    DistributedError,
    GradientSum,
    World,
    clip_,
    gather_global,
    global_row_order,
    global_norm,
    rank_groups,
    row_shard,
)
from fp8rl.rollout.engine import Rollout

# Metrics that are measurements of the machine, not of the run.
TIMING = {"time_rollout_s", "time_train_s", "time_sync_s", "time_step_s", "rollout_tokens_per_s", "peak_mem_bytes"}

SMALL_RUN = """\
model = "tiny-arith"
task = "arith"
flow = "{flow}"
backend = "{backend}"
[rollout]
prompts_per_step = 4
group_size = 4
max_new_tokens = 16
[train]
steps = {steps}
micro_batches = 2
grad_chunks = 2
[eval]
every = 0
n = 8
batch_size = 4
max_new_tokens = 8
[checkpoint]
every = 1
keep_last = 3
"""


def test_rank_groups_deal_each_micro_batch_out_in_contiguous_shares():
    # 8 groups, 2 micro-batches of 4 groups, 2 gradient chunks each: rank r of 2 gets one chunk of each.
    assert rank_groups(8, 2, 2, World(0, 2)) == [0, 1, 4, 5]
    assert rank_groups(8, 2, 2, World(1, 2)) == [2, 3, 6, 7]
    assert rank_groups(8, 2, 2, World(0, 1)) == list(range(8))
    assert sorted(g for r in range(4) for g in rank_groups(8, 2, 4, World(r, 4))) == list(range(8))
    with pytest.raises(DistributedError, match=r"grad_chunks = 2 chunks, not a multiple of 4.*grad_chunks=4"):
        rank_groups(8, 2, 2, World(0, 4))
    with pytest.raises(DistributedError, match="does not split into 2 micro-batches of 3 gradient chunks"):
        rank_groups(8, 2, 3, World(0, 1))


def test_two_real_ranks_with_different_configs_are_refused(tmp_path: Path):
    """torchrun ranks whose commands differ (here rank 1's learning rate): one line
    from rank 0, nothing written."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(SMALL_RUN.format(flow="jet", backend="cpu", steps=1))
    launcher = tmp_path / "odd_rank.py"
    launcher.write_text(
        "import os, sys\n"
        "from fp8rl.cli import main\n"
        "extra = ['--set', 'train.lr=1e-3'] if os.environ['RANK'] == '1' else []\n"
        "sys.exit(main(sys.argv[1:] + extra))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher),
           "train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode != 0
    said = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert said == ["error: the resolved config differs between ranks (rank 0 vs rank(s) [1]); every rank must "
                    "be started with the same command and files"], said
    assert not (tmp_path / "run").exists()


def test_ranks_started_with_different_configs_are_refused(monkeypatch: pytest.MonkeyPatch):
    world = World(0, 3)
    monkeypatch.setattr(World, "gather_objects", lambda self, obj: [obj, obj, obj + " changed"])
    with pytest.raises(DistributedError, match=r"the resolved config differs between ranks \(rank 0 vs rank\(s\) \[2\]\)"):
        world.check_same("{}", "the resolved config")
    monkeypatch.setattr(World, "gather_objects", lambda self, obj: [obj, obj, obj])
    world.check_same("{}", "the resolved config")


def test_global_row_order_puts_gathered_rows_back_in_one_process_order():
    world = World(0, 2)
    perm = global_row_order(4, 2, 2, 2, world)  # groups: rank 0 -> 0, 2; rank 1 -> 1, 3
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    gathered = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]) * 10  # what all_gather would return
    out = torch.empty_like(gathered)
    out[perm] = gathered
    assert out.tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    assert gather_global(torch.arange(3), perm, World()).tolist() == [0, 1, 2]  # one process: as is


def _gradient_sums(chunks: list[torch.Tensor], world_size: int, piece: int = REDUCE_PIECE,
                   split: tuple[int, ...] = (600,), groups: list[list[int]] | None = None,
                   stream: dict[int, list[int]] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`GradientSum` of `chunks` (one micro-batch's chunk gradients, in order) on
    `world_size` ranks run as threads, each with its contiguous share, their
    point-to-point messages and broadcast through queues, the gradient split into
    parameters at `split` (e.g. the first 600 elements and the rest) and reduced in
    pieces of `piece` elements, passed in `groups` of parameters; in its last chunk,
    rank r calls `stream(g)` for each g of `stream[r]` (what the trainer's backward
    hooks do as layers finish) and checks that a passed group's gradients are gone.
    Per rank: its rows of the summed gradient, flattened (the parameters' row
    shards one after another), and the norm it got."""
    import queue
    import threading

    boxes = {(a, b): queue.Queue() for a in range(world_size) for b in range(world_size)}
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    class Relay(World):
        def send(self, t, dst):
            boxes[(self.rank, dst)].put(t.clone())

        def recv(self, t, src):
            return t.copy_(boxes[(src, self.rank)].get(timeout=30))

        def broadcast(self, t, src):
            if self.rank == src:
                for r in range(self.size):
                    if r != src:
                        boxes[(src, r)].put(t.clone())
                return t
            return t.copy_(boxes[(src, self.rank)].get(timeout=30))

    m = len(chunks) // world_size
    sizes = [b - a for a, b in zip((0, *split), (*split, chunks[0].numel()))]

    def rank(r: int) -> None:
        ps = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        acc = GradientSum(ps, Relay(r, world_size), piece, groups)
        for c, g in enumerate(chunks[r * m : (r + 1) * m]):
            for p, part in zip(ps, g.split(sizes)):
                p.grad = part.clone()
            acc.streaming = c == m - 1
            for group in (stream or {}).get(r, []) if acc.streaming else []:
                acc.stream(group)
                if acc.passed[group]:
                    assert all(ps[i].grad is None for i in acc.groups[group])
                    assert all(acc.acc[i] is None and all(x[i] is None for x in acc.pending) for i in acc.groups[group])
            acc.add()
            assert all(p.grad is None for p in ps)
        grads, norm = acc.reduce()
        assert [g.shape for g in grads] == [row_shard(p, world_size, r).shape for p in ps]
        results[r] = (torch.cat(grads), norm)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [results[r][0] for r in range(world_size)], [results[r][1] for r in range(world_size)]


def _whole(rows: list[torch.Tensor], world_size: int, sizes: list[int]) -> torch.Tensor:
    """The flat gradient from every rank's row shards (parameters of `sizes` elements)."""
    per_rank = [r.split([row_shard(torch.empty(n), world_size, k).numel() for n in sizes]) for k, r in enumerate(rows)]
    return torch.cat([torch.cat([per_rank[k][i] for k in range(world_size)]) for i in range(len(sizes))])


def test_gradient_sum_is_the_same_on_any_number_of_ranks():
    """The one-process float64 additions in the one-process order on 1, 2 and 4
    ranks, including additions that round in float64 (terms 2**60 apart, as an
    MoE router's unchosen experts give): a sum of per-rank partial sums (what an
    all-reduce computes) differs there, so the check can fail. Each rank gets only
    its rows, which together are the whole; every rank gets the one-process norm."""
    torch.manual_seed(0)
    chunks = [torch.randn(1000) * 10.0 ** torch.randint(-3, 3, (1,)).item() for _ in range(4)]
    for c, v in zip(chunks, (1.0, 2.0**-60, -1.0, 2.0**-60)):
        c[0] = v
    (one,), _ = _gradient_sums(chunks, 1)
    assert one[0] == 2.0**-60  # ((1 + 2**-60) + -1) + 2**-60 in float64
    # parameters of 1 and 2 elements (ranks with no rows) and of none
    for split in ((600,), (1, 2, 600), (600, 600)):
        _, (one_norm,) = _gradient_sums(chunks, 1, split=split)
        for n, piece in itertools.product((2, 4), (REDUCE_PIECE, 1000, 600, 7)):  # pieces: one, split, across
            rows, norms = _gradient_sums(chunks, n, piece, split)
            sizes = [b - a for a, b in zip((0, *split), (*split, 1000))]
            assert torch.equal(_whole(rows, n, sizes), one), (n, piece, split)
            assert all(torch.equal(x, one_norm) for x in norms), (n, piece, split)
            if split == (600,):
                assert all(r.numel() == 1000 // n for r in rows)  # no rank holds more than its share
    partials = (chunks[0].double() + chunks[1].double()) + (chunks[2].double() + chunks[3].double())
    assert partials[0] == 0.0 and not torch.equal(partials.float(), one)
    fp32 = sum(chunks[1:], chunks[0].clone())
    assert not torch.equal(fp32, one)  # why float64: an FP32 running sum rounds more


def _edge_fp32_pairs(n: int = 200_000) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 pairs (a, b) where an FP32 sum and a float64 sum rounded could part
    ways, if any could: random bit patterns (every exponent, subnormals, inf, NaN),
    b a few ulps of a apart or 2**-25..2**-30 of a (halfway and below, where the
    float64 sum rounds before the FP32 rounding), opposite signs that cancel,
    signed zeros and sums past FP32's largest value."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, n), generator=g, dtype=torch.int64).to(torch.int32)
    a, b = bits.view(torch.float32)
    base = torch.randn(n, generator=g)
    near = [base * (1 + 2.0 ** -torch.randint(20, 32, (n,), generator=g)),
            base * 2.0 ** -torch.randint(24, 31, (n,), generator=g).float(),
            -base * (1 + torch.randint(-4, 5, (n,), generator=g) * 2.0**-23),
            torch.nextafter(base, torch.full_like(base, math.inf)) - base]
    big = torch.full((4,), 3.4e38)
    edge_a = torch.tensor([0.0, -0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 1.0])
    edge_b = torch.tensor([-0.0, -0.0, 0.0, 1.0, math.inf, 1e-45, 1e-45, 2.0**-24])
    firsts = torch.cat([a, *[base] * len(near), big, edge_a])
    seconds = torch.cat([b, *near, big * torch.tensor([1.0, 0.01, 1e-7, -1.0]), edge_b])
    return firsts, seconds


def test_two_gradient_terms_are_summed_in_fp32_with_the_float64_sum_s_bits():
    """Two chunks: `GradientSum` adds them in FP32, which must give the bits of their
    float64 sum rounded once (what three or more terms get, and what a 2-rank
    run's running sum gives): on edge values, and through 1 and 2 ranks."""
    from fp8rl.distributed import _added, _summed

    a, b = _edge_fp32_pairs()
    want = (a.double() + b.double()).float()
    got = _summed(_added(_added(None, a), b), torch.float32)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), (a[~same][:4], b[~same][:4])
    assert _summed(_added(None, a), torch.float32) is a  # one term: itself, untouched
    three = _summed(_added(_added(_added(None, a[:9]), b[:9]), a[:9]), torch.float32)
    assert torch.equal(three, ((a[:9].double() + b[:9].double()) + a[:9].double()).float())
    chunks = [a[:1000].nan_to_num(0.0, 0.0, 0.0), b[:1000].nan_to_num(0.0, 0.0, 0.0)]
    (one,), _ = _gradient_sums(chunks, 1)
    (r0, r1), _ = _gradient_sums(chunks, 2)
    assert torch.equal(one, (chunks[0].double() + chunks[1].double()).float())
    assert torch.equal(_whole([r0, r1], 2, [600, 400]), one)


def test_layers_passed_during_the_backward_sum_what_the_reduce_sums():
    """`GradientSum.stream`: a rank's last chunk passes groups of parameters (decoder
    layers) as the backward finishes them, dropping their gradients; the result is
    the same bits whether every rank streams, one does, or a group comes out of
    order (it waits for `reduce`, which passes the groups in order on every rank)."""
    torch.manual_seed(1)
    chunks = [torch.randn(1000) * 10.0 ** torch.randint(-3, 3, (1,)).item() for _ in range(4)]
    for c, v in zip(chunks, (1.0, 2.0**-60, -1.0, 2.0**-60)):
        c[0] = v
    groups = [[3], [1, 2], [0]]  # parameters of 1, 1, 598, 400 elements; the last layer first
    (one,), (one_norm,) = _gradient_sums(chunks, 1, split=(1, 2, 600))
    for n, piece in itertools.product((2, 4), (REDUCE_PIECE, 7)):
        every, reversed_ = {r: [0, 1] for r in range(n)}, {r: [1, 0] for r in range(n)}
        for stream in (every, {0: [0, 1, 2]}, {0: [1, 0]}, reversed_, {n - 1: [0]}):
            rows, norms = _gradient_sums(chunks, n, piece, (1, 2, 600), groups, stream)
            assert torch.equal(_whole(rows, n, [1, 1, 598, 400]), one), (n, piece, stream)
            assert all(torch.equal(x, one_norm) for x in norms), (n, piece, stream)
    with pytest.raises(ValueError, match="exactly once"):
        GradientSum([torch.nn.Parameter(torch.zeros(2))] * 2, World(), groups=[[0]])


def _jet_policy(name: str) -> torch.nn.Module:
    """A built-in policy (all tie their embeddings) or "untied": a tiny model whose
    LM head is its own matrix, as in Llama-3-8B; under jet, weights quantized."""
    from fp8rl.model import load
    from fp8rl.precision import apply_flow, refresh_weights
    from test_engine import tiny_model

    model = tiny_model() if name == "untied" else load(name)[0]
    assert model.config.tie_word_embeddings == (name != "untied")
    apply_flow(model, "jet", backend="cpu")
    refresh_weights(model)
    return model


POLICIES = ["tiny-arith", "tiny-moe", "untied"]


@pytest.mark.parametrize("model_name", POLICIES)
def test_a_groups_input_gradient_comes_after_all_its_parameter_gradients(model_name: str):
    """What the trainer's streaming relies on (`Trainer._watch_group_input`): when the
    gradient of a `backward_modules` module's input is computed (the final norm's,
    then each decoder layer's, last first), every gradient of its `backward_groups`
    group (the norm and an untied LM head; a layer's parameters) is final, and no
    later group has one yet (MoE experts no token chose get none at all)."""
    from fp8rl.distributed import backward_groups, backward_modules
    from fp8rl.model.transformer import make_context
    from fp8rl.precision import phase

    model = _jet_policy(model_name)
    params = list(model.parameters())
    groups, modules = backward_groups(model, params), backward_modules(model)
    assert len(groups) == len(modules) + 1  # the rest: the embeddings (a tied LM head), passed at the end
    head = {id(p) for p in (model.model.norm.weight, model.lm_head.weight)}
    assert {id(params[i]) for i in groups[0]} == (head if model_name == "untied" else {id(model.model.norm.weight)})
    seen: list[tuple[int, list[torch.Tensor | None], bool]] = []

    def watch(g: int, _module, args) -> None:
        def check(_grad) -> None:
            now = [None if params[i].grad is None else params[i].grad.clone() for i in groups[g]]
            later = any(params[i].grad is not None for group in groups[g + 1:] for i in group)
            seen.append((g, now, later))
        args[0].register_hook(check)

    for g, module in enumerate(modules):
        module.register_forward_pre_hook(functools.partial(watch, g))
    tokens = torch.randint(2, min(300, model.config.vocab_size), (4, 24))
    with phase(model, "train"):
        logits = model(tokens, make_context(torch.zeros(4, dtype=torch.long), 0, 24, 32))
    logits.float().log_softmax(-1).mean().backward()
    assert [g for g, _, _ in seen] == list(range(len(modules)))
    for g, now, later in seen:
        final = [params[i].grad for i in groups[g]]
        assert any(x is not None for x in now) and not later, g
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(now, final)), g


@pytest.mark.parametrize("model_name", POLICIES)
def test_the_trainer_streams_a_group_once_the_backward_of_all_its_calls_is_done(model_name: str):
    """A training forward that shares prompts (`score`'s default on GRPO groups) calls
    every decoder layer twice, and the prompt call's parameter gradients arrive with
    the completion call's K/V gradients. `Trainer._watch_group_input` must pass a
    group to the gradient sum only when all its calls' backward is done: the
    gradients taken then are the group's final ones, every group is passed once,
    the head's first, then the layers, last first."""
    from fp8rl.distributed import backward_groups, backward_modules
    from fp8rl.rollout.engine import SamplingParams, generate, score
    from fp8rl.train import Trainer

    model = _jet_policy(model_name)
    params = list(model.parameters())
    groups, modules = backward_groups(model, params), backward_modules(model)
    taken: dict[int, list[torch.Tensor | None]] = {}

    class Recorder:  # stands for GradientSum.stream: what the sum would take now
        def stream(self, group: int) -> None:
            assert group not in taken, group
            taken[group] = [None if params[i].grad is None else params[i].grad.clone() for i in groups[group]]

    trainer = object.__new__(Trainer)  # only the hooks' state
    trainer._group_calls, trainer._grad_sum, trainer._watched = [0] * len(groups), Recorder(), modules
    prompts = [[5 + i, 40 + 3 * i, 77, 12 + i][: 2 + i % 3] for i in range(3) for _ in range(4)]
    # the rollout meets no hook (the training phase's only), so it runs the rollout layers where the model has them
    out = generate(model, prompts, SamplingParams(max_new_tokens=10), eos_ids=[1], pad_id=0, seeds=range(12))
    assert trainer._group_calls == [0] * len(groups)
    with trainer._watching_group_inputs():
        logp, _ = score(model, out)
        # the final norm once (the head reads all rows together), each layer twice: prompt call, completion call
        assert trainer._group_calls == [1, *[2] * len(model.model.layers), 0]
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
    assert not any(m._forward_pre_hooks for m in modules)  # removed with the phase
    assert list(taken) == list(range(len(modules))) and trainer._group_calls == [0] * len(groups)
    for group in range(len(modules)):
        final = [params[i].grad for i in groups[group]]
        assert any(g is not None for g in final), group
        for now, end in zip(taken[group], final):
            assert (now is None and end is None) or torch.equal(now, end), group


def test_gradient_sum_of_one_term_is_that_term_and_missing_terms_are_zero():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    acc = GradientSum([p, q], World())
    p.grad = torch.tensor([0.1, -2.5, 3e-30])
    acc.add()  # q has no gradient (an expert no token chose)
    (gp, gq), _ = acc.reduce()
    assert gp.tolist() == torch.tensor([0.1, -2.5, 3e-30]).tolist() and gq.tolist() == [0.0, 0.0]


def test_norm_and_clipping_are_torchs_clip_grad_norm_bit_for_bit():
    """The trainer clips with `global_norm` + `clip_` (so that a rank holding only
    its rows can clip them): the bits of `torch.nn.utils.clip_grad_norm_` on the CPU,
    norm and clipped gradients, for a clipping and a non-clipping max norm."""
    torch.manual_seed(0)
    for max_norm in (0.5, 1e9):
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in ((7, 5), (1000,), (3, 129), (1,))]
        grads = [torch.randn(p.shape) * 10.0 ** torch.randint(-4, 2, (1,)).item() for p in ps]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        norm = global_norm([torch.linalg.vector_norm(g) for g in grads])
        rows = [row_shard(g, 2, 1).clone() for g in grads]  # a rank's rows, clipped alone
        clip_(grads, norm, max_norm)
        assert torch.equal(norm, want)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, ps))
        clip_(rows, norm, max_norm)
        assert all(torch.equal(r, row_shard(p.grad, 2, 1)) for r, p in zip(rows, ps))


def test_row_shard_is_fsdp2s_shard0_split():
    """`row_shard` is the split of FSDP2's Shard(0) placement, empty ranks included."""
    from torch.distributed.tensor import Shard

    for rows, n in ((10, 2), (7, 4), (3, 4), (1, 2), (129, 8)):
        t = torch.arange(rows * 3).reshape(rows, 3)
        want, _ = Shard(0)._split_tensor(t, n, with_padding=False)
        for r in range(n):
            assert torch.equal(row_shard(t, n, r), want[r]), (rows, n, r)


def test_padded_rollout_keeps_its_rows():
    r = Rollout(
        tokens=torch.tensor([[5, 6, 7]]), pad_left=torch.tensor([0]), prompt_len=1, cache_len=16,
        completion_mask=torch.tensor([[False, True, True]]), logprobs=torch.tensor([[0.0, -1.0, -2.0]]),
        finish_reasons=["stop"], completion_ids=[[6, 7]],
    )
    w = r.padded_to(5, pad_id=0)
    assert w.tokens.tolist() == [[5, 6, 7, 0, 0]]
    assert w.completion_mask.tolist() == [[False, True, True, False, False]]
    assert w.logprobs.tolist() == [[0.0, -1.0, -2.0, 0.0, 0.0]]
    assert w.completion_ids == [[6, 7]] and w.n_tokens == 2
    with pytest.raises(ValueError, match="cannot pad"):
        r.padded_to(2, pad_id=0)


# -- torchrun runs ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train(tmp: Path, name: str, nproc: int, *, flow: str = "jet-kv", backend: str = "cpu", steps: int = 2,
          extra: tuple[str, ...] = (), check: bool = True) -> subprocess.CompletedProcess:
    """`fp8rl train` on `nproc` processes (torchrun --standalone, gloo) into tmp/name."""
    cfg = tmp / f"{name}.toml"
    cfg.write_text(SMALL_RUN.format(flow=flow, backend=backend, steps=steps))
    args = ["train", "--config", str(cfg), "--out", str(tmp / name), "--no-progress", *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "fp8rl", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "fp8rl", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def optimizer_state(ckpt: Path) -> dict:
    """A checkpoint's AdamW state read into one process, whichever world size wrote
    it (optimizer.safetensors of one process, torch.distributed.checkpoint shards of N)."""
    from fp8rl.checkpoint import load_checkpoint
    from fp8rl.model import load
    from fp8rl.precision import apply_flow

    run = json.loads((ckpt / "config.json").read_text())
    model, _ = load(run["model"])
    apply_flow(model, run["flow"], backend="reference")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    load_checkpoint(ckpt, model, opt)
    return opt.state_dict()["state"]


def assert_same_run(a: Path, b: Path, step: int, evals: bool = True) -> None:
    """Metrics (timings aside), evaluations (unless a resumed run evaluated at
    the end of each part), weights, optimizer state and Q/K/V scales equal bit for bit."""
    rows_a = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert len(rows_a) == len(rows_b) == step
    for ra, rb in zip(rows_a, rows_b):
        diff = {k: (ra[k], rb[k]) for k in ra if k not in TIMING and ra[k] != rb[k]}
        assert diff == {}, f"step {ra['step']}"
    if evals:
        assert (a / "eval.jsonl").read_text() == (b / "eval.jsonl").read_text()  # two batches: one per rank
    ca, cb = (checkpoint_path(run, step) for run in (a, b))
    ta, tb = load_file(ca / "model.safetensors"), load_file(cb / "model.safetensors")
    assert ta.keys() == tb.keys()
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    sa, sb = optimizer_state(ca), optimizer_state(cb)
    assert sa.keys() == sb.keys() and sa
    assert [i for i in sa for k in sa[i] if not torch.equal(sa[i][k], sb[i][k])] == []
    meta_a, meta_b = (json.loads((c / "meta.json").read_text()) for c in (ca, cb))
    assert meta_a["attention_scales"] == meta_b["attention_scales"]


def test_two_ranks_train_exactly_what_one_process_trains(tmp_path: Path):
    """The fast 2-rank check of the default suite: jet-kv (FP8 weights, KV cache
    and attention, so the Q/K/V calibration is pooled across ranks) on the fast
    `cpu` backend, 2 steps of 2 optimizer steps each, 2 gradient chunks, with a KL
    penalty (its frozen reference is a copy of a rank's model after its release; from the
    second optimizer step on, the policy differs from it and the penalty is in the loss)."""
    kl = ("--set", "train.kl_coef=0.05")
    train(tmp_path, "one", 1, extra=kl)
    two = train(tmp_path, "two", 2, extra=kl)
    assert "2 data-parallel ranks" in two.stdout
    assert "FP32 weights of the linears released on every rank" in two.stdout  # only FSDP2 shards hold them
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["token_mult_prob_error"] == 1.0 for r in rows)
    # the optimizer state as each rank's shard, under the checkpoint's manifest
    ckpt = checkpoint_path(tmp_path / "two", 2)
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"} <= set(listed)
    assert not (ckpt / "optimizer.safetensors").exists()
    # a one-process export and eval read the trained weights
    from fp8rl.cli import main
    from fp8rl.model import load

    assert main(["export", "--model", str(ckpt), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    exported = load(tmp_path / "hf")[0].state_dict()
    trained = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    assert main(["eval", "--model", str(ckpt), "--task", "arith", "--n", "4", "--json"]) == 0
    from fp8rl.cli import _load_any

    model, _ = _load_any(str(ckpt))
    scales = json.loads((ckpt / "meta.json").read_text())["attention_scales"]
    assert model.model.layers[1].self_attn.k_scale.tolist() == scales["1.k"] != [1.0] * len(scales["1.k"])


def untied_arith(folder: Path) -> Path:
    """tiny-arith with an LM head of its own (the embedding plus noise), as a
    Hugging Face folder: the built-in policies all tie it."""
    import dataclasses

    from fp8rl.model import load
    from fp8rl.model.export import export_hf
    from fp8rl.model.transformer import Transformer

    model, tokenizer = load("tiny-arith")
    untied = Transformer(dataclasses.replace(model.config, tie_word_embeddings=False))
    state = dict(model.state_dict())
    embedding = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embedding + 1e-3 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0))
    untied.load_state_dict(state)
    return export_hf(untied, tokenizer, folder, dtype=torch.float32)


def test_two_ranks_train_an_untied_lm_head_exactly_like_one_process(tmp_path: Path):
    """An LM head of its own is a group of the streamed gradient sum (with the final
    norm, passed as soon as the head's backward is done, `backward_groups`): the
    same bits as one process, the head's weights and AdamW state included."""
    folder = untied_arith(tmp_path / "untied")
    extra = ("--model", str(folder))
    train(tmp_path, "one", 1, extra=extra)
    train(tmp_path, "two", 2, extra=extra)
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)  # (step 1 has no reward: step 2 trains)
    trained = load_file(checkpoint_path(tmp_path / "two", 2) / "model.safetensors")
    start = load_file(folder / "model.safetensors")
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])  # the head was trained
    assert not torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])


def test_a_damaged_optimizer_shard_is_refused(tmp_path: Path):
    from fp8rl.checkpoint import CheckpointError, verify_checkpoint

    train(tmp_path, "two", 2, steps=1)
    shard = checkpoint_path(tmp_path / "two", 1) / "optimizer" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0.distcp: SHA-256 differs"):
        verify_checkpoint(shard.parent.parent)
    res = train(tmp_path, "two", 1, steps=2, extra=("--resume",), check=False)
    assert res.returncode == 2 and "__1_0.distcp: SHA-256 differs" in res.stderr


def test_a_batch_that_does_not_split_is_refused_in_one_line(tmp_path: Path):
    """Through `fp8rl train --nproc 3` (which starts torchrun)."""
    res = train(tmp_path, "three", 1, extra=("--nproc", "3"), check=False)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-2000:]  # rank 0 says it, once
    assert "does not split across 3 ranks" in errors[0] and "grad_chunks=3" in errors[0]
    assert not (tmp_path / "three").exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("flow,backend", [("bf16", "cpu"), ("fp8-rollout", "reference"), ("fp8-grads", "reference")])
def test_two_ranks_equal_one_process_under_other_flows(tmp_path: Path, flow: str, backend: str):
    train(tmp_path, "one", 1, flow=flow, backend=backend)
    train(tmp_path, "two", 2, flow=flow, backend=backend)
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)


@pytest.mark.slow
@pytest.mark.parametrize("flow,chunks", [("jet", 2), ("fp8-rollout", 2), ("jet", 4)])
def test_two_ranks_train_the_moe_policy_exactly_like_one_process(tmp_path: Path, flow: str, chunks: int):
    """tiny-moe: routing recorded on each rank, the routing mismatch measured on the
    gathered batch (0 under jet, non-zero off-policy), the same bits; with 4 chunks
    each rank adds two chunks to the running gradient sum it receives."""
    extra = ("--model", "tiny-moe", "--set", f"train.grad_chunks={chunks}", "--set", f"rollout.prompts_per_step={2 * chunks}")
    train(tmp_path, "one", 1, flow=flow, extra=extra)
    train(tmp_path, "two", 2, flow=flow, extra=extra)
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all((r["routing_mismatch"] == 0.0) == (flow == "jet") for r in rows), rows


@pytest.mark.slow
def test_two_nodes_with_a_c10d_rendezvous_train_what_one_process_trains(tmp_path: Path):
    """The several-machines launch of docs/scaling.md, as two torchrun agents on this
    machine (`--nnodes 2`, one rank each, a c10d rendezvous on a free local port): the
    same run, bit for bit, as one process."""
    import socket

    train(tmp_path, "one", 1)
    cfg = tmp_path / "nodes.toml"
    cfg.write_text(SMALL_RUN.format(flow="jet-kv", backend="cpu", steps=2))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
             "-m", "fp8rl", "train", "--config", str(cfg), "--out", str(tmp_path / "nodes"), "--no-progress"]
    nodes = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    outs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert any("2 data-parallel ranks" in out for out, _ in outs)
    assert_same_run(tmp_path / "one", tmp_path / "nodes", 2)


@pytest.mark.slow
def test_resume_at_another_world_size_continues_exactly(tmp_path: Path):
    """1 step on 2 ranks, resumed for the 2nd step on 1 process (and the other
    way round) == 2 uninterrupted steps."""
    train(tmp_path, "whole", 1, steps=2)
    train(tmp_path, "two_then_one", 2, steps=1)
    train(tmp_path, "two_then_one", 1, steps=2, extra=("--resume",))
    assert_same_run(tmp_path / "whole", tmp_path / "two_then_one", 2, evals=False)
    train(tmp_path, "one_then_two", 1, steps=1)
    train(tmp_path, "one_then_two", 2, steps=2, extra=("--resume",))
    assert_same_run(tmp_path / "whole", tmp_path / "one_then_two", 2, evals=False)


@pytest.mark.slow
def test_a_lost_rank_stops_the_run_in_bounded_time_and_resume_continues_exactly(tmp_path: Path):
    """Rank 1 SIGKILLed before its 2nd optimizer phase (step 2, after the step-1
    checkpoint): rank 0 says so in one line and stops, within seconds, and
    `--resume` on 2 ranks ends where an uninterrupted one-process run ends."""
    import time

    train(tmp_path, "whole", 1, steps=3)
    cfg = tmp_path / "lost.toml"
    cfg.write_text(SMALL_RUN.format(flow="jet-kv", backend="cpu", steps=3))
    killpoint = Path(__file__).resolve().parent / "killpoint.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(killpoint),
           "fp8rl.train:Trainer._optimize", "2", "before", "--",
           "train", "--config", str(cfg), "--out", str(tmp_path / "lost"), "--no-progress"]
    env = {**_env(), "KILLPOINT_RANK": "1", "PYTHONPATH": str(killpoint.parent.parent)}
    t0 = time.perf_counter()
    died = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    waited = time.perf_counter() - t0
    assert died.returncode != 0
    assert waited < 120, f"the surviving rank took {waited:.0f} s to stop"
    said = [line for line in (died.stdout + died.stderr).splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "rank 0: another data-parallel rank stopped" in said[0], said
    assert (tmp_path / "lost" / "checkpoints" / "step_1").is_dir()
    train(tmp_path, "lost", 2, steps=3, extra=("--resume",))
    assert_same_run(tmp_path / "whole", tmp_path / "lost", 3, evals=False)
