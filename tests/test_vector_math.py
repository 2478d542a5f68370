"""MKL's vector math initialized before a model's first forward (fp8rl/model/vector_math.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from fp8rl.model.config import ModelConfig
from fp8rl.model.transformer import Transformer
from fp8rl.model.vector_math import VML_FUNCTIONS, initialize_vector_math


def test_building_a_model_initializes_vector_math():
    initialize_vector_math.cache_clear()
    Transformer(ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=16))
    assert initialize_vector_math.cache_info().currsize == 1  # done once, by the constructor


def test_every_listed_function_exists_in_torch():
    for name in VML_FUNCTIONS:  # a renamed function would make the warm-up raise at model construction
        assert callable(getattr(torch, name)), name


# What the default run's first evaluation did before its first forward (load, flow, tokenizer,
# KV cache, rollout phase), then the first rotary table of the process and a later one.
_FIRST_FORWARD = """
import torch
from fp8rl.model import load
from fp8rl.model.transformer import make_context
from fp8rl.precision import PRESETS, apply_flow
from fp8rl.prompts import encode_prompts
from fp8rl.rollout.engine import left_pad, phase
from fp8rl.rollout.kv_cache import KVCache
from fp8rl.tasks import make_task
model, tok = load("tiny-arith")
apply_flow(model, PRESETS["jet"], backend="auto")
ids, pad = left_pad(encode_prompts(tok, [p.question for p in make_task("arith").test_problems(100)]), tok.pad_token_id)
cache = KVCache.for_model(model, ids.shape[0], ids.shape[1] + 48)
with phase(model, "rollout"), torch.inference_mode():
    ctx = make_context(pad, 0, ids.shape[1], ids.shape[1] + 48, cache)
    first, later = model.rope(ctx.positions)[1], model.rope(ctx.positions)[1]
print(int((first != later).sum()))
"""


def test_the_first_forward_of_a_process_computes_what_later_ones_do():
    """Before the warm-up, 3 of 8 fresh processes computed half of their first rotary
    table less accurately (MKL's first sin shared by two threads): six processes must all
    agree with themselves now (each would pass by chance with probability about 5/8; 4 of 6
    differed with the warm-up patched out). About 8 s."""
    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", _FIRST_FORWARD], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == "0", "the first forward of a process differed from a later one"
