"""The compiled CPU kernels (fp8rl/fp8/kernels.py): built where a C compiler is,
the same bits as the torch code they replace, and optional (without them the torch
code runs, with one warning saying why)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from fp8rl.fp8 import kernels
from fp8rl.fp8.formats import AMAX_FLOORS
from fp8rl.fp8.quant import NonFiniteError, dequantize, quantize, quantize_dequantize, quantize_dequantize_blocks


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch):
    """``kernels.library()`` rebuilt under this test's environment, and again after it."""
    kernels.library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernels.library.cache_clear()


def test_kernels_are_built_where_a_compiler_is():
    if kernels._compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path runs (test_without_kernels_*)")
    if kernels.ENV_SWITCH in os.environ:
        pytest.skip(f"{kernels.ENV_SWITCH} is set")
    assert kernels.library() is not None


def _inputs(g: torch.Generator) -> list[torch.Tensor]:
    """Activations as the linears see them and the awkward cases: values over 80 binades
    (E4M3 subnormals inside a block next to its amax), zero blocks and rows, ragged K,
    3-D, BF16, and views whose rows are not contiguous in memory."""
    out = []
    for shape in [(1, 128), (16, 576), (16, 1536), (128, 128), (7, 130), (3, 5, 256), (300, 384), (2, 1)]:
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float())
        x.view(-1, shape[-1])[0, : min(128, shape[-1])] = 0.0
        out.append(x)
    wide = torch.randn(64, 700, generator=g)
    out += [wide[:, 50:626], wide.T[:300], torch.randn(33, 576, generator=g).bfloat16()]
    return out


@pytest.fixture(params=[(fmt, floor) for fmt in ("fp32", "ue8m0") for floor in sorted(set(AMAX_FLOORS.values()))],
                ids=lambda p: f"{p[0]}-floor{p[1]:g}")
def recipe(request: pytest.FixtureRequest) -> tuple[str, float]:
    """(scale format, amax floor): every one the presets use, where the kernels are."""
    if kernels.library() is None:
        pytest.skip("no compiled kernels here")
    return request.param


def test_compiled_quantize_dequantize_is_the_torch_path_bit_for_bit(recipe: tuple[str, float]):
    scale_fmt, floor = recipe
    g = torch.Generator().manual_seed(31)
    for x in _inputs(g):
        for scale in (1e-12, 1e-3, 1.0, 1e20):
            xs = x * scale
            want = quantize_dequantize(xs, 128, scale_fmt, amax_floor=floor, compiled=False)
            got = quantize_dequantize(xs, 128, scale_fmt, amax_floor=floor)
            assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
            assert got.stride() == want.stride()  # the same layout for the GEMMs that read it
            # signs of zero included: both paths give +0 where a negative value rounds to 0
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (tuple(x.shape), scale)


def _weights(g: torch.Generator) -> list[torch.Tensor]:
    """Weights and weight-gradient operands as `quantize` sees them with 2-D blocks: values
    over 80 binades, a -0 and a tiny negative (codes with the sign of a value that rounds
    to zero), ragged blocks on either axis (SmolLM2's 576 and 192), a strided view, BF16."""
    out = []
    for shape in [(128, 128), (576, 576), (192, 576), (7, 130), (300, 1), (1, 300), (200, 129)]:
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float())
        x[0, 0], x.view(-1)[-1] = -0.0, -1e-30
        out.append(x)
    wide = torch.randn(300, 700, generator=g)
    return out + [wide[:, 50:626], wide.T[:256], torch.randn(130, 576, generator=g).bfloat16()]


def test_compiled_block_quantize_and_dequantize_are_the_torch_path_bit_for_bit(recipe: tuple[str, float]):
    scale_fmt, floor = recipe
    g = torch.Generator().manual_seed(37)
    for x in _weights(g):
        for scale in (1e-12, 1.0, 1e20):
            for block in [(128, 128), (128, 1), (1, 128), (64, 32)]:  # weights, the FP8 wgrad's, dgrad's, any
                want = quantize(x * scale, block, scale_fmt=scale_fmt, amax_floor=floor, compiled=False)
                got = quantize(x * scale, block, scale_fmt=scale_fmt, amax_floor=floor)
                assert got.data.dtype == want.data.dtype and got.block == want.block
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (tuple(x.shape), block)
                assert torch.equal(got.scale, want.scale)
                # the FP8 backward's operands on `cpu` (FP32) and `amx` (BF16): the dequantized codes in one pass
                for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                    fused = quantize_dequantize_blocks(x * scale, block, dtype, scale_fmt, amax_floor=floor)
                    assert torch.equal(fused.view(bits), dequantize(want, dtype, compiled=False).view(bits)), (block, dtype)
                for q in (want, want.t()):  # the dgrad reads the transposed weight
                    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                        fast, slow = dequantize(q, dtype), dequantize(q, dtype, compiled=False)
                        assert fast.dtype == slow.dtype == dtype
                        assert torch.equal(fast.view(bits), slow.view(bits)), (tuple(x.shape), block, dtype)


def test_compiled_block_quantize_names_a_non_finite_tensor():
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.ones(256, 200)
        w[130, 150] = bad
        for block in ((128, 128), (128, 1)):  # the general loop, the column blocks' own
            with pytest.raises(NonFiniteError, match="'layers.3.mlp.up_proj.weight'"):
                quantize(w, block, name="layers.3.mlp.up_proj.weight")
            with pytest.raises(NonFiniteError, match="'layers.3.mlp.up_proj input'"):
                quantize_dequantize_blocks(w, block, name="layers.3.mlp.up_proj input")


@pytest.mark.parametrize("rows", [3, 64])  # 64 x 1536: rows shared by the threads, the bad one in the last
def test_compiled_path_names_a_non_finite_tensor(rows: int):
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(rows, 200 if rows < 64 else 1536)
        x[rows - 2, 150] = bad
        with pytest.raises(NonFiniteError, match="'layer3 input'"):
            quantize_dequantize(x, 128, name="layer3 input")


def test_without_kernels_the_torch_path_runs(fresh_library: pytest.MonkeyPatch):
    x = torch.randn(4, 256)
    want = quantize_dequantize(x, 128, compiled=False)
    fresh_library.setenv(kernels.ENV_SWITCH, "0")
    w = torch.randn(200, 300)
    qw = quantize(w, (128, 128), compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        assert kernels.library() is None
        assert torch.equal(quantize_dequantize(x, 128), want)
        assert torch.equal(quantize(w, (128, 128)).data.view(torch.uint8), qw.data.view(torch.uint8))
        assert torch.equal(dequantize(qw, torch.bfloat16), dequantize(qw, compiled=False).bfloat16())
    kernels.library.cache_clear()
    fresh_library.delenv(kernels.ENV_SWITCH)
    fresh_library.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert kernels.library() is None
    assert torch.equal(quantize_dequantize(x, 128), want)


def test_a_failed_build_warns_and_leaves_nothing(fresh_library: pytest.MonkeyPatch, tmp_path: Path):
    fresh_library.setenv("FP8RL_CACHE_DIR", str(tmp_path))
    fresh_library.setenv("CC", "false")  # a "compiler" that fails
    if kernels._compiler() is None:
        pytest.skip("no `false` command")
    with pytest.warns(RuntimeWarning, match="false failed"):
        assert kernels.library() is None
    assert list((tmp_path / "kernels").iterdir()) == []  # no half-written library left


def test_the_library_is_built_once_into_the_cache(fresh_library: pytest.MonkeyPatch, tmp_path: Path):
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    fresh_library.setenv("FP8RL_CACHE_DIR", str(tmp_path))
    flags = kernels.CFLAGS + kernels.OPENMP_FLAGS
    first = kernels._build(cc, flags)
    assert first.parent == tmp_path / "kernels" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert kernels._build(cc, flags) == first and first.stat().st_mtime_ns == stamp  # cached, not rebuilt
    assert kernels.library() is not None
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_a_compiler_without_openmp_still_builds_the_kernels(fresh_library: pytest.MonkeyPatch, tmp_path: Path):
    """OpenMP is optional: where ``-fopenmp`` fails, the plain build loads (one thread, the same bits)."""
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    fresh_library.setenv("FP8RL_CACHE_DIR", str(tmp_path / "cache"))
    fresh_library.setenv("CC", str(wrapper))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.library() is not None
    assert len(list((tmp_path / "cache" / "kernels").iterdir())) == 1


def test_compiled_uniform_draws_are_torch_rand_bit_for_bit():
    """`kernels.uniform_rows` (the sampling noise of every decode step) must draw exactly
    torch.rand's numbers from each generator and leave it where torch.rand would: from
    generators part-way through their Mersenne state (an odd number drawn before, a
    randn's cached normal pending), over widths that cross several state refills."""
    if kernels.library() is None:
        pytest.skip("no compiled kernels here: RowNoise draws with torch.rand")
    assert kernels._uniform_exact()  # this torch's generator layout is the one the kernel reads
    seeds = [0, 1, 2**40 + 7, 123456789]
    ours = [torch.Generator().manual_seed(s) for s in seeds]
    theirs = [torch.Generator().manual_seed(s) for s in seeds]
    for r, (a, b) in enumerate(zip(ours, theirs)):  # the generators at different places of their state
        torch.rand(3 + 311 * r, generator=a), torch.rand(3 + 311 * r, generator=b)
        torch.randn(1, generator=a), torch.randn(1, generator=b)
    for steps, width in ((1, 1), (2, 624), (3, 1249), (5, 97)):
        got = kernels.uniform_rows(ours, steps, width)
        want = torch.stack([torch.rand(steps, width, generator=g) for g in theirs], dim=1)
        assert got.shape == (steps, len(seeds), width) and torch.equal(got, want), (steps, width)
    for a, b in zip(ours, theirs):  # the same state afterwards, the normal cache included
        assert torch.equal(a.get_state(), b.get_state())
        assert torch.equal(torch.randn(5, generator=a), torch.randn(5, generator=b))


def test_without_kernels_uniform_rows_leaves_the_draw_to_torch(fresh_library: pytest.MonkeyPatch):
    fresh_library.setenv(kernels.ENV_SWITCH, "0")
    kernels._uniform_exact.cache_clear()
    try:
        assert kernels.uniform_rows([torch.Generator().manual_seed(0)], 2, 10) is None
    finally:
        kernels._uniform_exact.cache_clear()


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (2, 16), (4, 33), (16, 4099), (5, 384)])
def test_compiled_argmax_of_a_sum_is_torchs(rows: int, vocab: int):
    """`kernels.argmax_sum` (a sampling step's Gumbel-max) must pick torch's index:
    the first maximum among ties, a NaN (inf + -inf too) above every number, -inf
    rows, inside the 16-lane part and in the tail."""
    if kernels.library() is None:
        pytest.skip("no compiled kernels here: sample_next adds and takes torch's argmax")
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    for case in range(8):
        a, b = torch.randn(rows, vocab, generator=g), torch.randn(rows, vocab, generator=g)
        if case == 1:
            a[:, ::3] = float("-inf")  # top-k / top-p filtered logits
        elif case == 2:
            a[:], b[:] = 0.0, 1.0  # every entry ties
        elif case == 3:
            a[0, vocab // 2], a[-1, -1], a[-1, min(1, vocab - 1)] = float("nan"), float("nan"), float("nan")
        elif case == 4:
            a[:], b[:] = float("-inf"), 0.0
        elif case == 5:
            a[:, min(2, vocab - 1)], b[:, min(2, vocab - 1)] = float("inf"), float("-inf")
        elif case == 6:
            a, b = a.round(), b.round()  # many ties
        elif case == 7:
            a[:, -1], a[:, vocab // 3], b[:] = 100.0, 100.0, 0.0  # the tied maximum last and earlier
        assert torch.equal(kernels.argmax_sum(a, b), (a + b).argmax(dim=-1)), case
