"""PrecisionFlow presets, validation, and model conversion helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fp8rl.fp8 import FP8Linear
from fp8rl.precision import PRESETS, PrecisionFlow, convert_linears, get_flow, phase, refresh_weights, resolve_plan

# docs/design.md section 4, row by row:
# (rollout_linear, train_fprop, train_dgrad, train_wgrad, grad_transport, kv_cache, attention)
TABLE = {
    "bf16": ("bf16", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16"),
    "fp8-rollout": ("fp8", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16"),
    "jet": ("fp8", "fp8", "bf16", "bf16", "bf16", "bf16", "bf16"),
    "jet-e2e": ("fp8", "fp8", "fp8", "fp8", "bf16", "bf16", "bf16"),
    "jet-kv": ("fp8", "fp8", "fp8", "fp8", "bf16", "fp8", "fp8"),
    "fp8-grads": ("fp8", "fp8", "fp8", "fp8", "fp8", "bf16", "bf16"),
}
FIELDS = ("rollout_linear", "train_fprop", "train_dgrad", "train_wgrad", "grad_transport", "kv_cache", "attention")


def test_presets_match_the_design_table():
    assert list(PRESETS) == list(TABLE)
    for name, row in TABLE.items():
        flow = PRESETS[name]
        assert flow.name == name
        assert tuple(getattr(flow, f) for f in FIELDS) == row, name
        assert flow.scale_fmt == "fp32"
        assert flow.high_precision == ("embed_tokens", "lm_head", "norm")
        assert get_flow(name) is flow
    assert PrecisionFlow() == PRESETS["jet"]  # the default flow


def test_flows_are_frozen_and_replace_validates():
    flow = PRESETS["jet"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        flow.train_fprop = "bf16"
    custom = flow.replace(scale_fmt="ue8m0", name="jet-ue8m0")
    assert custom.scale_fmt == "ue8m0" and custom.train_fprop == "fp8" and flow.scale_fmt == "fp32"
    with pytest.raises(ValueError, match="scale_fmt"):
        flow.replace(scale_fmt="e8m0")
    assert flow.replace(high_precision=["lm_head"]).high_precision == ("lm_head",)


@pytest.mark.parametrize("field", FIELDS)
def test_unknown_precision_is_rejected_naming_field_and_choices(field):
    with pytest.raises(ValueError, match=rf"PrecisionFlow\.{field} must be one of 'bf16', 'fp8'; got 'fp16'"):
        PrecisionFlow(**{field: "fp16"})


def test_other_validation_errors():
    with pytest.raises(ValueError, match=r"scale_fmt must be one of 'fp32', 'ue8m0'"):
        PrecisionFlow(scale_fmt="fp16")
    with pytest.raises(ValueError, match="high_precision"):
        PrecisionFlow(high_precision="lm_head")  # a bare string would match letter by letter
    with pytest.raises(ValueError, match="name"):
        PrecisionFlow(name="")
    with pytest.raises(ValueError, match=r"quantizer must be one of 'fp8rl', 'vllm'"):
        PrecisionFlow(quantizer="sglang")
    with pytest.raises(ValueError, match="quantizer 'vllm' needs scale_fmt 'fp32'"):
        PrecisionFlow(quantizer="vllm", scale_fmt="ue8m0")


def test_quantizer_convention_sets_the_input_amax_floor_of_every_linear():
    assert {p.input_amax_floor for p in resolve_plan(PRESETS["jet"], "cpu").linear.values()} == {1e-4}
    vllm = resolve_plan(PRESETS["jet"].replace(quantizer="vllm"), "cpu")
    assert {p.input_amax_floor for p in vllm.linear.values()} == {2.0**-9}


def test_get_flow_unknown_lists_presets():
    with pytest.raises(ValueError, match="bf16, fp8-rollout, jet, jet-e2e, jet-kv, fp8-grads"):
        get_flow("fp8")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(64)
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.router = nn.Linear(64, 10)  # 10 outputs: not a multiple of 16
        self.attn = nn.MultiheadAttention(64, 4)  # out_proj: an nn.Linear subclass read as weights

    def forward(self, x):
        h = self.input_layernorm(x)
        return x + self.mlp(self.q_proj(h)) + self.router(h).sum(-1, keepdim=True)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(128, 64)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 128, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def test_convert_linears_reports_and_skips():
    model = Tiny()
    params_before = {n: p for n, p in model.named_parameters()}
    report = convert_linears(model, PRESETS["jet"])
    expected = [f"layers.{i}.{n}" for i in range(2) for n in ("q_proj", "mlp.0", "mlp.2")]
    assert report.converted == expected
    subclassed = {"layers.0.attn.out_proj", "layers.1.attn.out_proj"}
    assert set(report.skipped) == {"layers.0.router", "layers.1.router", "lm_head"} | subclassed
    assert "subclass" in report.skipped["layers.0.attn.out_proj"]
    assert "lm_head" in report.skipped["lm_head"] and "high_precision" in report.skipped["lm_head"]
    assert "out_features=10" in report.skipped["layers.0.router"]
    assert isinstance(model.layers[1].mlp[2], FP8Linear) and model.layers[1].mlp[2].name == "layers.1.mlp.2"
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].router) is nn.Linear
    # Same Parameter objects under the same names: optimizers and checkpoints keep working.
    assert {n: p for n, p in model.named_parameters()} == params_before
    assert all(params_before[n] is p for n, p in model.named_parameters())
    logits = model(torch.randint(0, 128, (2, 7)))
    assert logits.shape == (2, 7, 128)
    # Converting again finds nothing left to convert.
    again = convert_linears(model, PRESETS["jet"])
    assert again.converted == [] and set(again.skipped) == set(report.skipped)


def test_convert_linears_custom_high_precision_and_bf16_flow():
    model = Tiny()
    report = convert_linears(model, PRESETS["bf16"].replace(high_precision=("q_proj",)))
    assert "lm_head" in report.converted  # no longer protected
    assert "layers.0.q_proj" in report.skipped
    assert all(isinstance(model.get_submodule(n), FP8Linear) for n in report.converted)


def test_phase_context_swaps_plans_and_refresh():
    model = Tiny()
    plan = convert_linears(model, PRESETS["fp8-rollout"])
    assert model.flow_plan is plan
    train, rollout = plan.linear["train"], plan.linear["rollout"]
    assert (train.fprop, rollout.fprop) == ("bf16", "fp8")  # the flow, resolved per phase
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 6 and all(m.plan is train for m in layers)
    layers[0].plan = rollout  # a mixed state must come back exactly
    before = [m.plan for m in layers]
    with phase(model, "rollout"):
        assert all(m.plan is rollout for m in layers)
    assert [m.plan for m in layers] == before
    with pytest.raises(RuntimeError, match="boom"):
        with phase(model, "rollout"):
            raise RuntimeError("boom")
    assert [m.plan for m in layers] == before
    with pytest.raises(ValueError, match="'train', 'rollout'"):
        with phase(model, "generate"):
            pass
    assert refresh_weights(model) == 6
    q = [m.qweight for m in layers]
    assert all(x is not None for x in q)
    assert refresh_weights(model) == 6
    assert all(m.qweight is not old for m, old in zip(layers, q))
    q = [m.qweight for m in layers]
    with phase(model, "rollout"):  # swapping plans keeps the weight forms: no requantization
        model(torch.randint(0, 128, (1, 3)))
    model(torch.randint(0, 128, (1, 3)))
    assert all(m.qweight is old for m, old in zip(layers, q))


def test_phase_of_a_model_without_flow():
    model = Tiny()
    with phase(model, "rollout"):  # nothing to switch: runs as it is
        model(torch.randint(0, 128, (1, 3)))
    convert_linears(model, PRESETS["jet"])
    del model.flow_plan
    with pytest.raises(ValueError, match="no flow_plan"):
        with phase(model, "rollout"):
            pass


@pytest.mark.parametrize("name", list(PRESETS))
def test_resolved_plan_follows_the_flow(name):
    """The plan is the flow, field by field, for every GEMM, attention and the head."""
    flow = PRESETS[name]
    plan = resolve_plan(flow, "reference")
    assert plan.linear["rollout"].fprop == flow.rollout_linear and plan.linear["train"].fprop == flow.train_fprop
    for p in plan.linear.values():
        assert (p.dgrad, p.wgrad, p.grad_transport, p.scale_fmt) == (
            flow.train_dgrad, flow.train_wgrad, flow.grad_transport, flow.scale_fmt)
        assert p.weight_forms == {flow.rollout_linear, flow.train_fprop, flow.train_dgrad}
        assert p.backend.name == "reference"
    assert plan.attention.kv == flow.kv_cache
    assert plan.attention.qp == ("fp8" if flow.attention == "fp8" else "bf16")
    assert plan.head.precision == "bf16"
    assert flow.needs_calibration == (name == "jet-kv")
