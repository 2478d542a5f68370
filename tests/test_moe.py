"""Mixture-of-experts decoders (docs/design.md section 12): transformers parity of
Qwen3-MoE, Qwen2-MoE and Mixtral, export with per-expert FP8 weights and
scales, experts under the precision flow, batch-invariant dispatch, and
on-policy routing (rollout and training choose the same experts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp8rl.fp8.backends import BACKENDS, CPUBackend, batch_invariance_failures
from fp8rl.fp8.linear import FP8Linear
from fp8rl.model import export_fp8_block, export_hf, load
from fp8rl.model.config import ModelConfig
from fp8rl.model.load import load_config
from fp8rl.model.transformer import Router, SparseMoE, Transformer, make_context, route
from fp8rl.precision import PRESETS, apply_flow
from fp8rl.rl.metrics import mismatch_metrics, routing_mismatch
from fp8rl.rollout.calibrate import calibrate
from fp8rl.rollout.engine import SamplingParams, generate, left_pad, routing_record, sampled_routing, score

# Random tiny checkpoints written by transformers' own classes: every routing rule covered.
# Widths are multiples of 16, so that the flows convert every expert (precision.DIM_MULTIPLE).
_SIZES = dict(hidden_size=64, num_heads=4, intermediate_size=96)
MOE_CASES = {
    # a dense layer among MoE ones (mlp_only_layers), renormalised top-k
    "qwen3-moe": dict(arch="qwen3_moe", num_layers=3, **_SIZES, moe=dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    # every second layer MoE (decoder_sparse_step), top-3 without renormalisation
    "qwen3-moe-step2": dict(arch="qwen3_moe", num_layers=2, **_SIZES, moe=dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=2)),
    # the gated shared expert, q/k/v bias
    "qwen2-moe": dict(arch="qwen2_moe", **_SIZES, moe=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "mixtral": dict(arch="mixtral", **_SIZES, moe=dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _ids(vocab: int, shape: tuple[int, int] = (2, 19), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _expert_sets(model: Transformer, ids: torch.Tensor) -> set[tuple]:
    """The distinct (layer, expert set) choices of every token of `ids`."""
    B, T = ids.shape
    record: dict = {}
    with torch.no_grad():
        model(ids, make_context(torch.zeros(B, dtype=torch.long), 0, T, T, routing=record))
    return {(layer, tuple(e.tolist())) for layer, calls in record.items() for e in calls[0].reshape(-1, calls[0].shape[-1])}


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_forward_matches_transformers(case, hf_checkpoint, hf_reference_logits):
    folder = hf_checkpoint(**MOE_CASES[case])
    model, _ = load(folder)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        ours = model(ids)
    ref = hf_reference_logits(folder, ids)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4
    # the comparison exercises routing: tokens choose many different expert sets
    c = model.config
    assert len(_expert_sets(model, ids)) >= 3 * len(c.moe_layers)
    assert c.moe_layers == {"qwen3-moe": [0, 2], "qwen3-moe-step2": [1]}.get(case, [0, 1])


def test_moe_config_fields_and_round_trip(hf_checkpoint):
    c = load_config(hf_checkpoint(**MOE_CASES["qwen2-moe"], tokenizer=False))
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
        "Qwen2MoeForCausalLM", 4, 2, 32)
    assert c.shared_expert_intermediate_size == 48 and c.attention_bias and not c.norm_topk_prob
    m = load_config(hf_checkpoint(**MOE_CASES["mixtral"], tokenizer=False))
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob) == (4, 96, True)
    for config in (c, m, load_config(hf_checkpoint(**MOE_CASES["qwen3-moe"], tokenizer=False))):
        again = ModelConfig.from_hf_dict(config.to_hf_dict())
        assert {k: v for k, v in again.to_dict().items() if k != "extra"} == {
            k: v for k, v in config.to_dict().items() if k != "extra"}


@pytest.mark.parametrize("case", ["qwen3-moe", "mixtral", "qwen2-moe"])
def test_moe_export_hf_loads_in_transformers(case, tmp_path, hf_checkpoint, hf_reference_logits):
    folder = hf_checkpoint(**MOE_CASES[case])
    model, tok = load(folder)
    out = export_hf(model, tok, tmp_path / "hf", dtype=torch.float32)
    ids = _ids(model.config.vocab_size)
    assert torch.equal(hf_reference_logits(out, ids), hf_reference_logits(folder, ids))


# vLLM's FusedMoE loader (FusedMoE.make_expert_params_mapping) maps checkpoint names
# `experts.<e>.<proj>.` onto its stacked w13_/w2_ parameters: `weight` and `weight_scale_inv`.
VLLM_EXPERT_NAMES = {"qwen3-moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                     "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


@pytest.mark.parametrize("case", VLLM_EXPERT_NAMES)
def test_moe_fp8_export_names_and_bits(case, tmp_path, hf_checkpoint):
    """Per-expert FP8 weights and 128x128 scales under the checkpoint's own names, the
    router in float32; reloaded, the policy computes the same logits under jet."""
    model, tok = load(hf_checkpoint(**MOE_CASES[case]))
    apply_flow(model, "jet", "reference")
    out = export_fp8_block(model, tok, tmp_path / "fp8")
    block, projs = VLLM_EXPERT_NAMES[case]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in model.config.moe_layers:
            prefix = f"model.layers.{layer}.{block}"
            assert f.get_tensor(f"{prefix}.gate.weight").dtype == torch.float32  # the router is not FP8
            for e in range(model.config.num_experts):
                for proj in projs:
                    w = f.get_tensor(f"{prefix}.experts.{e}.{proj}.weight")
                    s = f.get_tensor(f"{prefix}.experts.{e}.{proj}.weight_scale_inv")
                    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
                    assert tuple(s.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                    q = model.get_submodule(f"{prefix}.experts.{e}.{proj}").qweight  # the bits the flow uses
                    assert torch.equal(w.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(s, q.scale)
    fp8_names = [n for n in names if n.endswith(".weight_scale_inv")]
    assert not [n for n in fp8_names if "gate." in n and "experts" not in n and "gate_proj" not in n]
    reloaded, _ = load(out)
    apply_flow(reloaded, "jet", "reference")
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))


def test_experts_are_fp8_and_router_stays_fp32(hf_checkpoint):
    model, _ = load(hf_checkpoint(**MOE_CASES["qwen2-moe"]))
    plan = apply_flow(model, "jet", "cpu")
    experts = [n for n in plan.converted if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert any(".shared_expert." in n for n in plan.converted)
    for n in experts:
        layer = model.get_submodule(n)
        assert isinstance(layer, FP8Linear) and layer.qweight.block == (128, 128)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert len(routers) == 4  # gate and shared_expert_gate of each layer
    assert all(r.router_backend is BACKENDS["cpu"] for r in routers)
    assert not [n for n in list(plan.converted) + list(plan.skipped) if n.endswith(("gate", "shared_expert_gate"))]


def _tiny_moe(arch: str = "MixtralForCausalLM", seed: int = 0, **kw) -> Transformer:
    """A random tiny MoE whose router logits are O(1), so routing is varied and
    close calls are common (what an FP8 rounding can flip)."""
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    moe.update(kw)
    config = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        architecture=arch, max_position_embeddings=256, eos_token_id=1, **moe,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.1 if name.endswith("gate.weight") else 0.05)
    return model.eval()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("flow", ["bf16", "jet"])
def test_a_tokens_output_does_not_depend_on_its_companions(backend, flow):
    """A token computed alone (a decode step) or among 48 others (training) goes
    through the same experts with the same bits."""
    moe = _tiny_moe().model.layers[0].block_sparse_moe
    model = torch.nn.Module()
    model.moe = moe
    apply_flow(model, flow, backend)
    x = torch.randn(1, 48, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        together = moe(x)
        for i in (0, 7, 47):
            assert torch.equal(moe(x[:, i : i + 1]), together[:, i : i + 1]), i
        assert torch.equal(moe(x[:, 10:30]), together[:, 10:30])


def test_route_ties_go_to_the_lower_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2]] and torch.allclose(weights, torch.tensor([[0.5, 0.5]]))


def test_router_invariance_is_probed():
    """`batch_invariance_failures` checks the routers' shapes too: a backend whose
    router product depends on the batch is caught (and auto would not pick it)."""

    class BatchDependentRouter(CPUBackend):
        name = "batch-dependent-router"

        def router_logits(self, x, w):
            return (x @ w.T) * (1 + 1e-6 * (x.shape[0] > 1))

    model = _tiny_moe()
    failures = batch_invariance_failures(BatchDependentRouter(), model)
    assert failures and all(f.startswith("router 8x64") for f in failures)
    assert batch_invariance_failures(BACKENDS["cpu"], model) == []


def _rollout_and_score(model: Transformer, n: int = 16, max_new_tokens: int = 32, eos_ids: tuple[int, ...] = (1,)):
    prompts = [[(7 * i + j) % 90 + 2 for j in range(3 + i % 5)] for i in range(n)]
    if model.flow_plan.flow.needs_calibration:
        calibrate(model, *left_pad(prompts, 0))
    out = generate(model, prompts, SamplingParams(max_new_tokens=max_new_tokens), eos_ids=list(eos_ids), pad_id=0,
                   seeds=list(range(n)))
    record = routing_record(model)
    with torch.no_grad():
        logp, _ = score(model, out, 1.0, routing=record)
    return out, logp, sampled_routing(record, out.tokens.shape[1])


@pytest.mark.parametrize("flow", [f for f in PRESETS if f != "fp8-rollout"])
@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_unified_flows_route_identically(flow, arch):
    extra = {"shared_expert_intermediate_size": 48, "norm_topk_prob": False} if arch == "Qwen2MoeForCausalLM" else {}
    model = _tiny_moe(arch, **extra)
    apply_flow(model, flow, "cpu")
    # many EOS ids: most rows finish early and leave the decode batch (their routing too)
    out, logp, routing = _rollout_and_score(model, eos_ids=tuple(range(1, 8)))
    mask = out.completion_mask
    lengths = mask.sum(1)
    assert lengths.max() > lengths.median()  # a row outlived half the batch: finished rows left it
    assert out.routing.shape == (*out.tokens.shape, 2, 2) and out.routing.dtype == torch.int16
    assert torch.equal(routing[mask], out.routing[mask])  # the same experts for every sampled token
    assert routing_mismatch(routing, out.routing, mask) == 0.0
    assert torch.equal(logp[mask], out.logprobs[mask])
    assert mismatch_metrics(logp, out.logprobs, mask)["token_mult_prob_error"] == 1.0


def test_fp8_rollout_routes_differently():
    """The off-policy recipe: FP8 rollout, BF16 training forward. Rounding the
    experts' and attention's inputs moves router logits enough to flip close top-k
    choices, which the metric shows (0.15 measured on this model)."""
    model = _tiny_moe()
    apply_flow(model, "fp8-rollout", "cpu")
    out, logp, routing = _rollout_and_score(model)
    share = routing_mismatch(routing, out.routing, out.completion_mask)
    assert 0.02 < share < 0.8
    assert mismatch_metrics(logp, out.logprobs, out.completion_mask)["token_mult_prob_error"] > 1.0


def test_routing_follows_select_and_padding():
    model = _tiny_moe()
    apply_flow(model, "jet", "cpu")
    out, _, _ = _rollout_and_score(model, n=4, max_new_tokens=8)
    assert torch.equal(out.select([2, 0]).routing, out.routing[[2, 0]])
    wide = out.padded_to(out.tokens.shape[1] + 3, 0)
    assert wide.routing.shape[1] == out.tokens.shape[1] + 3 and (wide.routing[:, -3:] == -1).all()
    assert (out.routing[:, 0] == -1).all()  # column 0 was sampled by no position


def test_dense_models_have_no_routing(hf_checkpoint):
    model, _ = load(hf_checkpoint(arch="llama", tokenizer=False))
    apply_flow(model, "jet", "cpu")
    out = generate(model, [[3, 4, 5]], SamplingParams(max_new_tokens=4), eos_ids=[2], pad_id=0, seeds=[0])
    assert out.routing is None and routing_record(model) is None
    assert routing_mismatch(None, None, out.completion_mask) == 0.0


def _config(**kw) -> dict:
    d = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    d.update(kw)
    return d


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than num_experts=4"),
    ({"num_experts": 0}, "num_experts must be a positive integer"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive integer"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "sliding_window": 4096},
     "sliding_window=4096 is not supported"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 0},
     "shared_expert_intermediate_size must be a positive integer"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
])
def test_moe_config_errors(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf_dict(_config(**change))


def test_moe_config_file_errors_name_the_file(tmp_path: Path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in _config().items() if k != "num_experts"}))
    with pytest.raises(ValueError, match=r"config.json: missing field 'num_experts'"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, num_experts=4)
    with pytest.raises(ValueError, match="needs norm_topk_prob=True"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, architecture="MixtralForCausalLM", num_experts=2, num_experts_per_tok=1,
                    moe_intermediate_size=8)


def test_sparse_moe_skips_experts_no_token_chose():
    """Experts without tokens run no GEMM (grouped dispatch) and get no gradient
    from this call; the trainer's gradient sum treats that as zero."""
    moe: SparseMoE = _tiny_moe().model.layers[0].block_sparse_moe
    x = torch.randn(1, 1, 64, requires_grad=True)
    moe(x).sum().backward()
    with_grad = [e for e in moe.experts if e.w1.weight.grad is not None]
    assert len(with_grad) == 2 and moe.gate.weight.grad is not None


def _small_run(out: Path, **kw):
    from fp8rl.config import RunConfig

    base = {
        "model": "tiny-moe", "out": str(out), "seed": 0,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 32,
        "train.steps": 2, "train.micro_batches": 2, "train.lr": 1e-3,
        "eval.n": 0, "checkpoint.every": 2,
    }
    base.update(kw)
    return RunConfig().replace(**base)


def test_grpo_trains_the_tiny_moe_policy_on_policy(tmp_path: Path):
    """The built-in tiny-moe under jet: routers and experts learn, every step is
    on-policy (token_mult_prob_error 1.0, routing_mismatch 0.0)."""
    from fp8rl.runlog import read_metrics
    from fp8rl.train import Trainer

    cfg = _small_run(tmp_path / "run")
    model, tok = load(cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(cfg, model=model, tokenizer=tok, log=lambda s: None).run(progress=False)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert {f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(4)} <= changed
    assert len([n for n in changed if ".experts." in n]) >= 4 * 4 * 3 * 3 // 4  # most expert weights moved
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["token_mult_prob_error"], r["routing_mismatch"]) for r in rows] == [(1.0, 0.0)] * 2


def test_off_policy_routing_shows_in_the_step_metrics(tmp_path: Path):
    from fp8rl.runlog import read_metrics
    from fp8rl.train import Trainer

    cfg = _small_run(tmp_path / "run", flow="fp8-rollout", **{"train.steps": 1, "rollout.max_new_tokens": 48})
    Trainer(cfg, log=lambda s: None).run(progress=False)
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["routing_mismatch"] > 0.0 and row["token_mult_prob_error"] > 1.0


def test_mismatch_command_reports_routing(capsys):
    import json

    from fp8rl.cli import main

    assert main(["mismatch", "--model", "tiny-moe", "--flow", "jet", "--prompts", "4", "--samples", "2",
                 "--max-new-tokens", "24", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["routing_mismatch"] == 0.0 and res["token_mult_prob_error"] == 1.0 and res["bitwise_equal"]
