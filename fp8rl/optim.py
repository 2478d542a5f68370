"""AdamW as one compiled pass per tensor: torch's single-tensor AdamW arithmetic, written once.

torch's CPU AdamW (the single-tensor loop) makes 8 passes over every weight
tensor per step: the decay, the first moment's lerp, the second moment's
multiply and addcmul, the square root, its division, the epsilon, the addcdiv;
each reads and writes whole tensors (SmolLM2-135M: 0.38-0.51 s of a 6.7 s GRPO
step on a 2-core Xeon, benchmarks/README.md). `AdamW` runs the same operations
element by element in one C loop (``fp8rl_adamw`` in fp8/kernels.c): each
element's weight, gradient and moments are read once and written once.

The bits: each operation is the one torch's kernel makes, rounded once in FP32
(the lerp's and the addcmul's fused multiply-adds included), except the square
root, which here is correctly rounded, where torch's (MKL's vsSqrt) is one ulp off
for some inputs, how many depending on the CPU (rarely on a Xeon with AMX, 17% on a
Zen 4 EPYC); so a weight can differ from torch's AdamW in its last bits
(tests/test_optim.py checks every bit against exact arithmetic, and torch's AdamW
against the same operations with torch's square root). Each element takes the same operations
wherever it sits, so an FSDP2 shard steps exactly as the whole tensor would:
the data-parallel trainer and one process train the same bits (torch's fused
AdamW does not, docs/design.md section 9).

The state is `torch.optim.AdamW`'s (``step``, ``exp_avg``, ``exp_avg_sq``, the
same param groups), so checkpoints load either way. Where the compiled kernels
do not load (``FP8RL_KERNELS=0``, no C compiler), or for a tensor that is not a
contiguous FP32 CPU tensor, the step is torch's own AdamW step: the same
operations with torch's square root.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import increment_version

from fp8rl.fp8 import kernels


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes: a DTensor's local shard (FSDP2), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` (decoupled weight decay, no amsgrad) whose step runs
    ``fp8rl_adamw`` on each parameter (module docstring)."""

    def __init__(
        self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    def _compiled(self) -> bool:
        """Whether every parameter with a gradient can take the compiled step."""
        if kernels.library() is None:
            return False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous()
                       for t in (_local(p), _local(p.grad))):
                    return False
        return True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        if closure is not None or not self._compiled():
            return super().step(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's AdamW creates it (its state_dict and checkpoints)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                written = [_local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
                kernels.adamw_(written[0], _local(p.grad), *written[1:], decay=1 - lr * wd, weight=1 - beta1,
                               beta2=beta2, bias_correction2_sqrt=(1 - beta2**step) ** 0.5,  # torch's pow, not math.sqrt
                               eps=eps, neg_step=-(lr / (1 - beta1**step)))
                # A write through a pointer is invisible to torch: bump the version counters as an
                # in-place op would, or the FP8 weights' freshness check (`_version`) keeps stale copies.
                increment_version([p, state["exp_avg"], state["exp_avg_sq"], *written])
        return None
