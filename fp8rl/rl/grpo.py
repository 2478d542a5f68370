"""GRPO math: group-relative advantages, the clipped policy loss, the k3 KL.

Pure functions on tensors; no state. Shapes: B sequences (B = n_prompts * G,
the G samples of one prompt contiguous), T response positions, V vocabulary.
A `mask` is bool or 0/1 of shape [B, T]: 1 marks a response token that counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp() of a log-ratio above ~88 overflows float32. Ratios this far from 1 are
# clipped (or carry a detached IS weight) anyway, so the clamp only removes inf.
# The one bound for every log-ratio (PPO ratio, k3 KL, IS weights in correction.py).
MAX_LOG_RATIO = 20.0


def group_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages, one per sample.

    rewards: [B] with B = n_prompts * group_size, samples of one prompt contiguous.
    Returns float32 [B]: `(r - mean_g) / (std_g + eps)`, or `r - mean_g` when
    `normalize_std=False`. `std_g` is the *sample* (unbiased, N-1) standard
    deviation, as `torch.std` in TRL and verl, so advantages match theirs.
    A group whose rewards are all equal (incl. group_size == 1) gets exactly 0:
    it carries no learning signal, and its float mean may differ from r by an ulp.
    Computed in float64.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a multiple of group_size={group_size}")
    r = rewards.to(torch.float64).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.view(-1).to(torch.float32)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is set.

    x and mask broadcast together (mask bool or 0/1). dim=None reduces
    everything to a 0-d tensor, else reduces `dim`. Entries of `x` under a 0
    mask are ignored even if inf/NaN (padded log-probs may be -inf). An empty
    selection (fully masked row) gives 0, not NaN.
    """
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    count = torch.broadcast_to(m, xm.shape).to(x.dtype)
    if dim is None:
        return xm.sum() / count.sum().clamp(min=1)
    return xm.sum(dim) / count.sum(dim).clamp(min=1)


def k3_kl(log_ratio: Tensor) -> Tensor:
    """Schulman's k3 estimator per token, `exp(d) - d - 1` with d = log_ratio.

    Non-negative, 0 iff d == 0. d is clamped to +-MAX_LOG_RATIO before exp.
    """
    d = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_weights: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    n_normalize: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO clipped surrogate (GRPO / DAPO style).

    logp [B, T] (carries grad), old_logp [B, T] (behaviour policy, the training
    forward at rollout time), advantages [B], mask [B, T]; optional is_weights
    [B, T] (rollout-correction weights, detached here) and ref_logp [B, T].

    Per token, with ratio = exp(logp - old_logp) (log-ratio clamped to +-20):
        pg  = -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)
        pg *= is_weights                                   (after clipping)
        tok = pg + kl_coef * (exp(ref - logp) - (ref - logp) - 1)
    loss = sum(tok over unmasked) / N, N the unmasked count of this call (at
    least 1), or `n_normalize` when given: each micro-batch is its own
    optimizer step (PPO epochs over minibatches), normalised by its own tokens;
    the trainer calls this once per prompt group of a micro-batch with N the
    micro-batch's count, so the groups' losses sum to the micro-batch's. The
    KL term is not IS-weighted.
    Defaults eps_low=0.2, eps_high=0.28: DAPO's clip-higher, which keeps
    low-probability tokens able to grow; pass eps_high=0.2 for classic PPO.

    Stats (floats over this call's unmasked tokens, 0.0 if there are none):
    `ppo_clip_frac` fraction where the clipped term was taken (its gradient is
    0), `kl` mean k3 to the reference (0.0 without ref_logp), `ratio_mean`,
    `n_tokens` the unmasked count of this call, `n_clipped` the count where the
    clipped term was taken. Computed in float32.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must match"
        )
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")
    for name, t in (("is_weights", is_weights), ("ref_logp", ref_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must have shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    m = mask.bool()
    logp = logp.float()
    log_ratio = (logp - old_logp.float().detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.float().detach().unsqueeze(1)
    pg_unclipped = -ratio * adv
    pg_clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = torch.maximum(pg_unclipped, pg_clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.float().detach()
    kl = None
    if ref_logp is not None:
        kl = k3_kl(ref_logp.float().detach() - logp)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    # where(), not multiply: masked positions may hold inf/NaN (padding).
    per_token = torch.where(m, per_token, torch.zeros((), device=per_token.device))
    count = int(m.sum())
    loss = per_token.sum() / float(max(count if n_normalize is None else n_normalize, 1))

    with torch.no_grad():
        stats = {
            "ppo_clip_frac": float(masked_mean((pg_clipped > pg_unclipped).float(), m)),
            "kl": float(masked_mean(kl, m)) if kl is not None else 0.0,
            "ratio_mean": float(masked_mean(ratio, m)),
            "n_tokens": float(count),
            "n_clipped": float(((pg_clipped > pg_unclipped) & m).sum()),
        }
    return loss, stats

