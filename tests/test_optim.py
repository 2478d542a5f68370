"""fp8rl/optim.py: AdamW's step as one compiled loop (``fp8rl_adamw``), checked against
exact rational arithmetic, against torch's AdamW, across shards, and through checkpoints."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fp8rl.fp8 import kernels
from fp8rl.optim import AdamW

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels unavailable")
HYPER = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _f32(x: Fraction) -> Fraction:
    """``x`` rounded to the nearest FP32 number, ties to even (finite, in range)."""
    c = np.float32(float(x))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    best = min(cands, key=lambda r: (abs(Fraction(float(r)) - x), int(np.array(r).view(np.int32)) & 1))
    return Fraction(float(best))


def _sqrt32(v: Fraction) -> Fraction:
    """The correctly rounded FP32 square root of ``v >= 0``: the FP32 number whose
    rounding interval (between the midpoints to its neighbours) holds sqrt(v)."""
    if v == 0:
        return Fraction(0)
    c = np.float32(math.sqrt(float(v)))
    for r in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        lo = (Fraction(float(r)) + Fraction(float(np.nextafter(r, np.float32(-np.inf))))) / 2
        hi = (Fraction(float(r)) + Fraction(float(np.nextafter(r, np.float32(np.inf))))) / 2
        if lo * lo <= v <= hi * hi:
            return Fraction(float(r))
    raise AssertionError(v)


def _exact_step(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, eps: float, wd: float):
    """One element's step (fp8rl_adamw's documented operations) in exact rational
    arithmetic, each operation rounded once to FP32; the scalars rounded to FP32 as
    torch rounds a Python float for an FP32 op."""
    s = lambda x: Fraction(float(np.float32(x)))  # noqa: E731
    decay, w, b2, s2 = s(1 - lr * wd), s(1 - beta1), s(beta2), s(1 - beta2)
    bc2s, e, neg = s((1 - beta2**step) ** 0.5), s(eps), s(-(lr / (1 - beta1**step)))
    p = _f32(p * decay)
    m = _f32(w * _f32(g - m) + m)  # fma: one rounding
    v = _f32(_f32(s2 * g) * g + _f32(v * b2))  # fma
    d = _f32(_f32(_sqrt32(v) / bc2s) + e)
    p = _f32(p + _f32(_f32(neg * m) / d))
    return p, m, v


@needs_kernels
def test_the_kernel_is_the_documented_operations_each_rounded_once():
    """Three steps of 2,000 elements (gradients from 1e-30 to 1e3, zeros, signs)
    equal the exact rational arithmetic of the kernel's formula rounded per
    operation, bit for bit: the fmas fused, the square root correctly rounded."""
    gen = torch.Generator().manual_seed(0)
    n = 2000
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 4, (n,), generator=gen).float()
             for _ in range(3)]
    grads[1][:50] = 0.0
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    exact = [(Fraction(float(x)), Fraction(0), Fraction(0)) for x in p.tolist()]
    m, v = torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        kernels.adamw_(p, g, m, v, decay=1 - lr * wd, weight=1 - b1, beta2=b2,
                       bias_correction2_sqrt=(1 - b2**step) ** 0.5, eps=eps, neg_step=-(lr / (1 - b1**step)))
        exact = [_exact_step(pe, Fraction(float(gi)), me, ve, step, lr, b1, b2, eps, wd)
                 for (pe, me, ve), gi in zip(exact, g.tolist())]
    for got, k in ((p, 0), (m, 1), (v, 2)):
        want = torch.tensor([float(e[k]) for e in exact], dtype=torch.float32)
        assert torch.equal(got, want), (k, int((got != want).sum()))


def _torch_emulation(p, g, m, v, step: int, hyper: dict, sqrt) -> None:
    """torch's single-tensor AdamW step (torch/optim/adam.py) in place, with ``sqrt``
    for the square root."""
    lr, (b1, b2), eps, wd = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (sqrt(v) / (1 - b2**step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / (1 - b1**step)))


@needs_kernels
def test_adamw_is_torch_s_adamw_but_for_torch_s_square_root():
    """Against torch's AdamW on 1,000,003 weights over 4 steps (sizes off the vector
    width: the loops' tails too): every bit equals torch's operations with a correctly
    rounded square root, and torch's own AdamW equals the same operations with torch's
    square root, bit for bit: the square root is the only difference. How often torch's
    FP32 sqrt is one ulp off depends on the CPU (rarely on a Xeon with AMX; 17% of
    inputs on an AMD EPYC Zen 4 with torch 2.13, 2026-12-07), so the weights that
    differ are counted and printed, and only bounded by what one ulp of the
    denominator can move a step: far below a step (lr) over these 4 steps."""
    gen = torch.Generator().manual_seed(1)
    n = 1_000_003
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10.0 ** torch.empty(n).uniform_(-6, 0, generator=gen) for _ in range(4)]
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_ours, opt_theirs = AdamW([ours], **HYPER), torch.optim.AdamW([theirs], **HYPER)
    emu, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    emu_torch, m_torch, v_torch = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        _torch_emulation(emu, g, m, v, step, HYPER, lambda x: x.double().sqrt().float())
        _torch_emulation(emu_torch, g, m_torch, v_torch, step, HYPER, torch.sqrt)
    state = opt_ours.state[ours]
    assert torch.equal(ours.detach(), emu) and torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)
    assert state["step"].item() == 4.0
    theirs_state = opt_theirs.state[theirs]
    assert torch.equal(theirs.detach(), emu_torch) and torch.equal(theirs_state["exp_avg"], m_torch)
    assert torch.equal(theirs_state["exp_avg_sq"], v_torch)
    sqrt_off = int((torch.sqrt(v) != v.double().sqrt().float()).sum())
    differ = ours.detach() != theirs.detach()
    apart = (ours.detach() - theirs.detach()).abs().max().item() / HYPER["lr"]
    print(f"torch's sqrt one ulp off for {sqrt_off} of {n} second moments here; weights differing from "
          f"torch's AdamW after 4 steps: {int(differ.sum())}, at most {apart:.2e} of a step (lr) apart")
    # One ulp of the denominator moves an update (about lr) by 2**-23 of it, and can flip the
    # weight's last rounding: one ulp of |p| < 8 (randn) is <= 2**-21, 1.6e-4 of lr (3e-3).
    # 1e-3 of lr holds a few such ulps; a wrong formula would move weights by a step.
    assert apart < 1e-3


@needs_kernels
def test_a_shard_steps_as_the_whole_tensor_does():
    """Each element takes the same operations wherever it sits: the halves of a tensor
    split off the vector width step to the whole's bits (what FSDP2's row shards need)."""
    gen = torch.Generator().manual_seed(2)
    whole = torch.randn(1001, 37, generator=gen)
    halves = [t.clone() for t in whole.chunk(2)]
    opt_whole = AdamW([w := torch.nn.Parameter(whole.clone())], **HYPER)
    params = [torch.nn.Parameter(h) for h in halves]
    opt_parts = AdamW(params, **HYPER)
    for _ in range(3):
        g = torch.randn(1001, 37, generator=gen)
        w.grad = g.clone()
        for prm, gh in zip(params, g.chunk(2)):
            prm.grad = gh.clone()
        opt_whole.step()
        opt_parts.step()
    assert torch.equal(torch.cat([prm.detach() for prm in params]), w.detach())


def test_a_step_bumps_the_version_counters_as_an_in_place_op_does():
    """The kernel writes through pointers; the step must still advance each written
    tensor's `_version`, which the FP8 weights' caches key on (an FP8Linear requantizes
    after an optimizer step only if its weight's version moved)."""
    from fp8rl.fp8.linear import FP8Linear
    from fp8rl.precision import apply_flow

    def jet_model(weight: torch.Tensor) -> tuple[torch.nn.Module, FP8Linear]:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(weight)
        apply_flow(model, "jet", backend="reference")
        return model, next(m for m in model.modules() if isinstance(m, FP8Linear))

    model, layer = jet_model(torch.randn(256, 256, generator=torch.Generator().manual_seed(5)) * 0.05)
    opt = AdamW([layer.weight], **HYPER)
    x = torch.randn(4, 256)
    with torch.no_grad():
        before = model(x)  # quantizes the weight (its cache)
    layer.weight.grad = torch.ones_like(layer.weight)
    versions = layer.weight._version
    opt.step()
    state = opt.state[layer.weight]
    assert layer.weight._version > versions and state["exp_avg"]._version > 0 and state["exp_avg_sq"]._version > 0
    fresh, _ = jet_model(layer.weight.detach())
    with torch.no_grad():
        after, want = model(x), fresh(x)
    assert not torch.equal(after, before) and torch.equal(after, want)  # requantized: the new weights' output


def test_without_the_kernels_the_step_is_torch_s(monkeypatch):
    """No compiled kernels (or a tensor the kernel does not take): torch's AdamW step,
    bit for bit, and the same state layout either way (checkpoints load across)."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(300, generator=gen)
    grads = [torch.randn(300, generator=gen) for _ in range(3)]
    monkeypatch.setattr(kernels, "library", lambda: None)
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_ours, opt_theirs = AdamW([ours], **HYPER), torch.optim.AdamW([theirs], **HYPER)
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.equal(ours.detach(), theirs.detach())
    sd_ours, sd_theirs = opt_ours.state_dict(), opt_theirs.state_dict()
    assert sd_ours["state"][0].keys() == sd_theirs["state"][0].keys()
    assert sd_ours["param_groups"][0].keys() == sd_theirs["param_groups"][0].keys()


@needs_kernels
def test_state_moves_between_torch_s_adamw_and_ours():
    """A state written by torch's AdamW continues under ours and the other way round:
    the same keys, dtypes and step counter (a checkpoint of an older run resumes)."""
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(64, 8, generator=gen)
    grads = [torch.randn(64, 8, generator=gen) for _ in range(4)]
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_a, opt_b = torch.optim.AdamW([a], **HYPER), AdamW([b], **HYPER)
    for g in grads[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    moved_a, moved_b = AdamW([a], **HYPER), torch.optim.AdamW([b], **HYPER)
    moved_a.load_state_dict(opt_a.state_dict())
    moved_b.load_state_dict(opt_b.state_dict())
    for g in grads[2:]:
        a.grad, b.grad = g.clone(), g.clone()
        moved_a.step()
        moved_b.step()
    for opt, prm in ((moved_a, a), (moved_b, b)):
        state = opt.state[prm]
        assert state["step"].item() == 4.0 and state["step"].dtype == torch.float32
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert (a.detach() - b.detach()).abs().max() < 1e-6  # the same steps; at most a square root's last bit apart


def test_trainer_steps_with_fp8rl_s_adamw(tmp_path):
    """The trainer's optimizer, one process and data-parallel master alike, is this AdamW."""
    from fp8rl.train import Trainer
    from test_train import small_cfg

    trainer = Trainer(small_cfg(tmp_path / "r", **{"train.steps": 0, "eval.n": 0}), log=lambda s: None)
    assert type(trainer.optimizer) is AdamW
