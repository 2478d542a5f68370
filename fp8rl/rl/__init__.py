"""GRPO math, rollout-correction weights and mismatch metrics (pure torch functions)."""

from fp8rl.rl.correction import METHODS as IS_METHODS
from fp8rl.rl.correction import importance_weights
from fp8rl.rl.grpo import group_advantages, k3_kl, masked_mean, policy_loss
from fp8rl.rl.metrics import METRIC_NAMES, MISMATCH_METRICS, mismatch_metrics

__all__ = [
    "IS_METHODS",
    "METRIC_NAMES",
    "MISMATCH_METRICS",
    "group_advantages",
    "importance_weights",
    "k3_kl",
    "masked_mean",
    "mismatch_metrics",
    "policy_loss",
]
