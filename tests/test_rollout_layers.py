"""The rollout's decoder layers without the module dispatch (`Transformer.rollout_layers`,
`fp8rl.fp8.linear.rollout_linears`): the module forward's bits in a prefill and in decode
steps, K/V cache included, under every backend and flow, and the module forward wherever
they do not apply (docs/design.md section 5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8rl.fp8.backends import BACKENDS
from fp8rl.fp8.linear import rollout_linears
from fp8rl.model.config import ModelConfig
from fp8rl.model.load import load
from fp8rl.model.transformer import RolloutLayer, Transformer, make_context
from fp8rl.precision import PRESETS, apply_flow, phase
from fp8rl.rollout.calibrate import calibrate
from fp8rl.rollout.kv_cache import KVCache

VOCAB = 97


def model_of(variant: str) -> Transformer:
    """A 2-layer model: "llama"; "qwen3" (q/k RMSNorm); "bias" (q/k/v biases, Qwen2's)."""
    cfg = ModelConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        architecture="Qwen3ForCausalLM" if variant == "qwen3" else "LlamaForCausalLM",
        qk_norm=variant == "qwen3", attention_bias=variant == "bias",
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:  # norms around 1, biases around 0
                p.copy_(("norm" in name) + 0.1 * torch.randn_like(p))
    return model.eval()


def under_flow(variant: str, flow: str, backend: str) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    model = model_of(variant)
    apply_flow(model, PRESETS[flow], backend=backend)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (5, 11), generator=g)
    pad_left = torch.tensor([0, 3, 0, 1, 0])
    if PRESETS[flow].needs_calibration:
        calibrate(model, prompt, pad_left)
    return model, prompt, pad_left


def steps(model: Transformer, prompt: torch.Tensor, pad_left: torch.Tensor, layers, n: int = 4) -> list[torch.Tensor]:
    """A prefill, then `n` decode steps of fixed tokens into a fresh cache: each step's
    logits, then the cache's tensors."""
    B, P = prompt.shape
    L = 32
    cache = KVCache.for_model(model, B, L)
    g = torch.Generator().manual_seed(4)
    out = []
    with phase(model, "rollout"), torch.inference_mode():
        out.append(model(prompt, make_context(pad_left, 0, P, L, cache), n_last=1, layers=layers))
        for t in range(n):
            tok = torch.randint(1, VOCAB, (B, 1), generator=g)
            out.append(model(tok, make_context(pad_left, P + t, 1, L, cache), layers=layers))
    return out + cache.k + cache.v


@pytest.mark.parametrize("backend", ["reference", "cpu", "amx"])
@pytest.mark.parametrize("flow", ["bf16", "jet", "jet-kv"])
@pytest.mark.parametrize("variant", ["llama", "qwen3", "bias"])
def test_rollout_layers_give_the_module_forwards_bits(variant: str, flow: str, backend: str):
    model, prompt, pad_left = under_flow(variant, flow, backend)
    with phase(model, "rollout"):
        layers = model.rollout_layers()
    assert layers is not None and all(isinstance(layer, RolloutLayer) for layer in layers)
    lean = steps(model, prompt, pad_left, layers)
    modules = steps(model, prompt, pad_left, None)
    assert len(lean) == len(modules) >= 5
    for a, b in zip(lean, modules):
        assert torch.equal(a, b)


def test_rollout_layers_follow_the_weights_they_were_built_for():
    """Built after an update, they give the module forward's bits for the new weights; the
    layers built before keep the forms of the old ones (one rollout's weights)."""
    model, prompt, pad_left = under_flow("llama", "jet", "amx")
    with phase(model, "rollout"):
        before = model.rollout_layers()
    old = steps(model, prompt, pad_left, before)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with phase(model, "rollout"):
        after = model.rollout_layers()
    new = steps(model, prompt, pad_left, after)
    assert torch.equal(new[0], steps(model, prompt, pad_left, None)[0])
    assert not torch.equal(new[0], old[0])


def test_a_call_with_a_graph_runs_the_module_forward():
    model, prompt, pad_left = under_flow("llama", "bf16", "amx")
    with phase(model, "rollout"):
        layer = model.rollout_layers()[0]
    B, P = prompt.shape
    cache = KVCache.for_model(model, B, 16)
    ctx = make_context(pad_left, 0, P, 16, cache)
    cos, sin = model.rope(ctx.positions)
    x = model.model.embed_tokens(prompt).detach().requires_grad_(True)
    with phase(model, "rollout"):
        y = layer(x, cos, sin, ctx)
    assert y.grad_fn is not None  # the modules' graph: the lean path builds none


def test_no_rollout_layers_without_a_flow_with_a_hook_or_for_experts():
    model = model_of("llama")
    assert model.rollout_layers() is None  # no flow: the model's own FP32 forward
    apply_flow(model, "bf16", "amx")
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, args: None)
    with phase(model, "rollout"):
        assert model.rollout_layers() is None  # only a module call runs a hook
    handle.remove()
    with phase(model, "rollout"):
        assert model.rollout_layers() is not None
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: None)
    with phase(model, "rollout"):  # the final norm stays a module call: its hook runs either way
        assert model.rollout_layers() is not None
    handle.remove()
    moe, _ = load("tiny-moe")
    apply_flow(moe, "bf16", "amx")
    with phase(moe, "rollout"):
        assert moe.rollout_layers() is None


def test_rollout_linears_resolve_only_one_group_of_fp8_linears():
    model, _, _ = under_flow("llama", "jet", "amx")
    attn = model.model.layers[0].self_attn
    with phase(model, "rollout"):
        assert rollout_linears([attn.q_proj, attn.k_proj]) is not None
        assert rollout_linears([]) is None
        assert rollout_linears([attn.q_proj, torch.nn.Linear(128, 64)]) is None
        attn.k_proj.plan = dataclasses.replace(attn.k_proj.plan, backend=BACKENDS["reference"])
        assert attn.q_proj.group_key() != attn.k_proj.group_key()
        assert rollout_linears([attn.q_proj, attn.k_proj]) is None  # two groups: the module forward's business
