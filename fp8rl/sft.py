"""Supervised warm-up, and the built-in `tiny-arith` policy it produces.

`fp8rl sft` trains a model on a task's worked solutions (loss on the solution
tokens only). With no `--model`, it builds the tiny policy from scratch: a
byte-level BPE tokenizer trained on the task's text, and a ~1M-parameter
Llama-style decoder, warmed up to a clearly non-zero but far from perfect
held-out accuracy, so that RL has something to improve. Everything is seeded;
the same command rebuilds the same files.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from fp8rl.config import SFTConfig
from fp8rl.fp8.backends import BACKENDS
from fp8rl.model.config import ModelConfig
from fp8rl.model.transformer import Transformer
from fp8rl.precision import FULL_PRECISION_ATTENTION, AttentionPlan
from fp8rl.prompts import encode_prompts
from fp8rl.tasks import Problem, Task

PAD, EOS = "<|pad|>", "<|eos|>"


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Any:
    """A byte-level BPE (the `tokenizers` library) with <|pad|>=0 and <|eos|>=1."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from fp8rl.model.tokenizer import Tokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer.from_tokenizers(tok, eos_token=EOS, pad_token=PAD)


def tiny_model_config(cfg: SFTConfig, tokenizer: Any) -> ModelConfig:
    """Llama-style, or Mixtral-style with `cfg.num_experts` experts in every layer."""
    moe = {}
    if cfg.num_experts:
        moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True)
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        architecture="MixtralForCausalLM" if cfg.num_experts else "LlamaForCausalLM",
        **moe,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_ids[0],
        bos_token_id=None,
    )


def stop_early(problem: Problem) -> Problem:
    """The same worked steps, but `#### <first step's result>`: a plausible wrong
    final answer (the chain is right, the answer stops one step short)."""
    lines = problem.solution.split("\n")
    first = lines[0].rsplit("=", 1)[-1].strip() if "=" in lines[0] else problem.answer
    return Problem(question=problem.question, solution="\n".join(lines[:-1] + [f"#### {first}"]), answer=first)


def sft_batch(tokenizer: Any, problems: list[Problem], system_prompt: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids [B, T], loss_mask [B, T]): prompt, solution, EOS;
    the mask marks the solution and EOS tokens (targets predicted from the left)."""
    prompts = encode_prompts(tokenizer, [p.question for p in problems], system_prompt)
    eos = tokenizer.eos_token_ids[0]
    rows = [(pr, tokenizer.encode(p.solution) + [eos]) for pr, p in zip(prompts, problems)]
    T = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        mask[i, len(a) : len(a) + len(b)] = True
    return ids, mask


def sft_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the masked tokens. Right padding never affects real
    tokens under causal attention, so the plain forward is exact here."""
    logits = model(ids[:, :-1])
    target = ids[:, 1:]
    m = mask[:, 1:]
    return F.cross_entropy(logits[m], target[m])


def run_sft(
    model: Transformer,
    tokenizer: Any,
    task: Task,
    cfg: SFTConfig,
    *,
    seed: int,
    on_step: Callable[[int, float, float], None] | None = None,
    system_prompt: str = "",
) -> list[float]:
    """Train on `task.train_problems(seed)`; AdamW, linear warm-up then cosine decay.
    Returns the per-step losses."""
    torch.manual_seed(seed)
    training_attention = AttentionPlan("fp32", "fp32", BACKENDS[cfg.attention_backend])  # reference: the usual plan
    for layer in model.model.layers:  # training only: the saved policy carries no plan
        layer.self_attn.attention_plan = training_attention
    stream = task.train_problems(seed)
    noise_rng = random.Random(seed + 7)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    losses = []
    model.train()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        if step >= cfg.warmup_steps:
            progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
            lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = list(itertools.islice(stream, cfg.batch_size))
        if cfg.early_answer_noise > 0:
            batch = [stop_early(p) if noise_rng.random() < cfg.early_answer_noise else p for p in batch]
        ids, mask = sft_batch(tokenizer, batch, system_prompt)
        loss = sft_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], lr)
    for layer in model.model.layers:
        layer.self_attn.attention_plan = FULL_PRECISION_ATTENTION
    model.eval()
    return losses


def build_tiny_policy(task: Task, cfg: SFTConfig, *, seed: int) -> tuple[Transformer, Any]:
    """A fresh tokenizer (trained on 20k task texts) and a randomly initialised tiny model."""
    texts = (f"{p.question}\n{p.solution}" for p in itertools.islice(task.train_problems(seed + 1), 20000))
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    torch.manual_seed(seed)
    model = Transformer(tiny_model_config(cfg, tokenizer))
    with torch.no_grad():  # GPT-2 style init: small normal weights, scaled residual projections
        for name, p in model.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight"))  # w2: Mixtral's down
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if residual else 0.02
                torch.nn.init.normal_(p, std=std)
    return model, tokenizer


def save_policy(model: Transformer, tokenizer: Any, out_dir: Path, info: dict[str, Any]) -> None:
    """Write an HF folder (config.json, model.safetensors, tokenizer files, sft.json) atomically."""
    from fp8rl.model.export import export_hf

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    export_hf(model, tokenizer, tmp / "m", dtype=torch.float32)
    (tmp / "m" / "sft.json").write_text(json.dumps(info, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp / "m", out_dir)
    shutil.rmtree(tmp)


def sft_info(
    cfg: SFTConfig, seed: int, task: Task, losses: list[float], evals: dict[str, Any], seconds: float, command: str
) -> dict[str, Any]:
    return {
        "command": command,
        "sft_config": {**asdict(cfg), "seed": seed},
        "task": task.describe(),
        "final_loss": losses[-1] if losses else None,
        "eval": {k: v for k, v in evals.items() if k != "samples"},
        "wall_time_s": round(seconds, 1),
        "torch": torch.__version__,
        "built": time.strftime("%Y-%m-%d"),
    }
