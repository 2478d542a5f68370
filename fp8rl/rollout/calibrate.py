"""Static FP8 scales for Q, K and V, recalibrated after every optimizer step.

NeMo-RL's recipe: run a forward, take each token's amax per head, and set
`scale = percentile_99.9(amax) * margin / 448` (margin 1.05). The rollout KV
cache and the training forward then use these same scales (unified flow); the
rare values beyond them saturate at +-448 in E4M3.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8rl.config import CalibrationConfig
from fp8rl.fp8.formats import E4M3_MAX
from fp8rl.model.transformer import Transformer, make_context
from fp8rl.precision import phase

from .engine import hidden_shared_prompts, prompt_groups


def scales_from_amax(amax: torch.Tensor, cfg: CalibrationConfig) -> torch.Tensor:
    """amax [n_tokens, H] -> scale [H] = percentile(amax over tokens) * margin / 448.
    A floor of 1e-4 / 448 keeps an all-zero head from getting a zero scale."""
    pct = torch.quantile(amax.double(), cfg.percentile / 100.0, dim=0)
    return (pct * cfg.margin / E4M3_MAX).clamp(min=1e-4 / E4M3_MAX).float()


@torch.no_grad()
def calibrate(
    model: Transformer,
    tokens: torch.Tensor,
    pad_left: torch.Tensor,
    cache_len: int | None = None,
    cfg: CalibrationConfig = CalibrationConfig(),
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prompt_len: int | None = None,
) -> dict[str, float]:
    """Set every attention layer's q/k/v scales from a training-phase forward over
    `tokens` [B, T] (left-padded, pad slots excluded). Returns summary stats.
    `gather` ([n, H] -> [n_all, H]) pools the per-token amax of every
    data-parallel rank before the percentile, so all ranks set the scales one
    process would set from the whole batch (a percentile is not a max: the
    ranks' own scales could not be combined).

    `prompt_len`: the grid's prompt columns (a rollout's); rows that share a
    prompt (`prompt_groups`) then have it computed once, as `score` does, and
    its per-token amax counted once per row: the same tokens, the same bits, so
    the same scales, for less work."""
    B, T = tokens.shape
    L = cache_len or T
    amax: dict[int, dict[str, list[torch.Tensor]]] = {}
    shared = prompt_groups(tokens[:, :prompt_len], pad_left) if prompt_len and prompt_len < T else None
    with phase(model, "train"), torch.inference_mode():  # the records are read below, outside it
        if shared is None:
            model.hidden(tokens, make_context(pad_left, 0, T, L, amax=amax))
        else:
            hidden_shared_prompts(model, tokens, pad_left, prompt_len, L, *shared, stop=T, amax=amax)
    valid = (torch.arange(T, device=tokens.device)[None, :] >= pad_left[:, None]).reshape(-1)  # [B*T]
    kmax = 0.0
    for layer in model.model.layers:
        attn = layer.self_attn
        rec = amax[attn.layer_idx]
        for name in ("q", "k", "v"):
            per_token = _rows_in_grid_order(rec[name], shared, B, T)[valid]  # [n_valid, H]
            if gather is not None:
                per_token = gather(per_token)
            scale = scales_from_amax(per_token, cfg)
            getattr(attn, f"{name}_scale").copy_(scale)
        kmax = max(kmax, float(attn.k_scale.max()) * E4M3_MAX)
    return {"calib_tokens": int(valid.sum()), "calib_k_amax_max": kmax}


def _rows_in_grid_order(
    calls: list[torch.Tensor], shared: tuple[torch.Tensor, torch.Tensor] | None, B: int, T: int
) -> torch.Tensor:
    """A layer's per-token amax records -> [B * T, H] in the grid's (row, slot) order.
    One call: its [B * T, H]. Shared prompts: the prompt call's [U * P, H], each
    prompt's rows repeated for every row of it, beside the completion call's
    [B * (T - P), H]."""
    if shared is None:
        return torch.cat(calls)
    prompt, rest = calls
    first, of_row = shared
    H = prompt.shape[-1]
    return torch.cat([prompt.view(len(first), -1, H)[of_row], rest.view(B, -1, H)], dim=1).reshape(B * T, H)
