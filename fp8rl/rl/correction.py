"""Importance-sampling correction between the rollout and the training policy.

When the rollout engine's policy differs from the training forward's (FP8
rollout + BF16 training, another engine, FP8 KV cache), the samples are
off-policy. The per-token weight `w = exp(logp_train_old - logp_rollout)`
re-weights the clipped policy loss (after clipping, detached); the methods
below bound its variance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8rl.rl.grpo import MAX_LOG_RATIO

METHODS = ("none", "tis", "icepop", "seq-mask-tis")


def importance_weights(
    logp_train_old: Tensor,
    logp_rollout: Tensor,
    mask: Tensor,
    method: str,
    cap: float = 2.0,
    lo: float = 0.5,
    hi: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token IS weights [B, T] (float32, detached, 0 at masked positions).

    logp_train_old, logp_rollout, mask: [B, T]. With r = exp(d),
    d = clamp(logp_train_old - logp_rollout, -20, 20) computed in float64:
      none          w = 1
      tis           w = min(r, cap)                    (truncated IS)
      icepop        w = r if lo <= r <= hi else 0      (drop mismatched tokens)
      seq-mask-tis  w = min(r, cap) * [lo <= g <= hi], g = exp(masked mean of d
                    over the sequence) its geometric-mean ratio: whole
                    sequences outside the band are dropped, the rest get
                    token-level TIS (as NeMo-RL; OpenRLHF leaves r unclamped).
    Bands are inclusive. Stats over unmasked tokens, of the weights applied
    (0.0 when no token is unmasked): `is_weight_mean`, `is_weight_max`,
    `is_clip_frac` = fraction of tokens whose weight differs from r (clamped
    to cap or zeroed, incl. tokens of dropped sequences).
    """
    if method not in METHODS:
        raise ValueError(f"unknown importance-sampling method {method!r}; valid: {', '.join(METHODS)}")
    if logp_train_old.shape != logp_rollout.shape or logp_train_old.shape != mask.shape:
        raise ValueError(
            f"logp_train_old {tuple(logp_train_old.shape)}, logp_rollout {tuple(logp_rollout.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape"
        )
    if cap <= 0 or lo > hi:
        raise ValueError(f"need cap > 0 and lo <= hi, got cap={cap}, lo={lo}, hi={hi}")
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=m.device)
    d = logp_train_old.detach().double() - logp_rollout.detach().double()
    d = torch.where(m, d, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r = torch.exp(d)

    if method == "none":
        w = torch.ones_like(r)
        modified = torch.zeros_like(m)
    elif method == "tis":
        w = r.clamp(max=cap)
        modified = r > cap
    elif method == "icepop":
        keep = (r >= lo) & (r <= hi)
        w = torch.where(keep, r, zero)
        modified = ~keep
    else:  # seq-mask-tis
        n = m.sum(dim=1, keepdim=True).clamp(min=1)
        g = torch.exp(d.sum(dim=1, keepdim=True) / n)  # d is 0 at masked positions
        keep_seq = (g >= lo) & (g <= hi)
        w = torch.where(keep_seq, r.clamp(max=cap), zero)
        modified = ~keep_seq | (r > cap)

    w = torch.where(m, w, zero)
    n_tok = int(m.sum())
    if n_tok == 0:
        stats = {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_clip_frac": 0.0}
    else:
        stats = {
            "is_weight_mean": float(w.sum() / n_tok),
            "is_weight_max": float(w[m].max()),
            "is_clip_frac": float((modified & m).sum()) / n_tok,
        }
    return w.float(), stats
