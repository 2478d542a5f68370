"""Export: a plain HF folder transformers loads with the same logits, a block-FP8
folder with exactly our quantized weights, atomic and non-destructive writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fp8rl.fp8 import FP8Linear, QTensor, dequantize, quantize
from fp8rl.model import export_fp8_block, export_hf, load
from fp8rl.model.load import load_state_dict_from_folder
from fp8rl.precision import apply_flow

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_fp8(name: str) -> bool:
    """Decoder-layer linear weights (not biases, not lm_head) are the FP8 ones."""
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch,tie,dtype", [
    ("llama", False, torch.float32),
    ("qwen2", True, torch.bfloat16),
    ("qwen3", False, torch.bfloat16),
])
def test_export_hf_loads_in_transformers(arch, tie, dtype, tmp_path, hf_checkpoint, hf_reference_logits):
    model, tok = load(hf_checkpoint(arch=arch, tie=tie))
    out = export_hf(model, tok, tmp_path / "out", dtype=dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {dtype}
    assert ("lm_head.weight" in names) == (not tie)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    assert "quantization_config" not in config

    ids = _ids(model.config.vocab_size)
    reloaded, tok2 = load(out)
    with torch.no_grad():
        ours, ours_reloaded = model(ids), reloaded(ids)
    ref = hf_reference_logits(out, ids)
    assert (ours_reloaded - ref).abs().max() < 1e-4
    if dtype == torch.float32:  # lossless export: the exported model is our model
        assert torch.equal(ours, ours_reloaded)
    assert tok2.chat_template == tok.chat_template and tok2.eos_token_ids == tok.eos_token_ids


def _fp8_model(hf_checkpoint, **kw):
    # hidden 200 / intermediate 300: partial 128-blocks on both axes
    return load(hf_checkpoint(arch="qwen2", hidden_size=200, num_heads=5, num_kv_heads=1,
                              intermediate_size=300, **kw))


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_export_fp8_block_bits(scale_fmt, tmp_path, hf_checkpoint):
    model, tok = _fp8_model(hf_checkpoint)
    out = export_fp8_block(model, tok, tmp_path / "fp8", scale_fmt=scale_fmt)
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["fmt"] == "e4m3"
    assert quant["activation_scheme"] == "dynamic" and quant["weight_block_size"] == [128, 128]
    assert quant.get("scale_fmt", "fp32") == scale_fmt

    raw = load_state_dict_from_folder(out, dequantize=False)
    params = dict(model.named_parameters())
    n_fp8 = 0
    for name, p in params.items():
        if _is_fp8(name):
            q = quantize(p.detach().float(), block=(128, 128), scale_fmt=scale_fmt)
            data, scale = raw[name], raw[name + "_scale_inv"]
            assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            assert scale.shape == (-(-p.shape[0] // 128), -(-p.shape[1] // 128))
            assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)), name
            assert torch.equal(scale, q.scale), name
            n_fp8 += 1
        else:  # embeddings, norms, biases: the policy's own FP32 tensors
            assert raw[name].dtype == torch.float32 and torch.equal(raw[name], p.detach()), name
    assert n_fp8 == 7 * model.config.num_layers
    assert "lm_head.weight_scale_inv" not in raw

    # our loader dequantizes to exactly the weights the FP8 forward computes with
    reloaded, tok2 = load(out)
    for name, p in reloaded.named_parameters():
        if _is_fp8(name):
            q = quantize(params[name].detach().float(), block=(128, 128), scale_fmt=scale_fmt)
            assert torch.equal(p, dequantize(q)), name
            # Re-quantizing the reloaded weight (what a precision flow does) gives the same
            # FP8 weights: bit-identical with fp32 scales (s = fl(amax/448) is recovered from
            # fl(448 s)); with ue8m0 a block may come back as (2q, s/2): other bits, same values.
            q2 = quantize(p.detach(), block=(128, 128), scale_fmt=scale_fmt)
            if scale_fmt == "fp32":
                assert torch.equal(q2.scale, q.scale)
                assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
            assert torch.equal(dequantize(q2), p)
    assert tok2 is not None and tok2.eos_token_ids == tok.eos_token_ids

    # a plain export of the FP8-loaded model is a plain checkpoint again
    plain = json.loads((export_hf(reloaded, tok2, tmp_path / "plain") / "config.json").read_text())
    assert "quantization_config" not in plain


def test_export_fp8_uses_cached_qweight(tmp_path, hf_checkpoint):
    """A linear that already holds its FP8 weight (FP8Linear.qweight) is exported
    bit for bit, not re-quantized: here a deliberately different QTensor."""
    # dims multiples of 16 (so the flow converts them) with partial 128-blocks: 208, 304
    model, _ = load(hf_checkpoint(arch="qwen2", hidden_size=208, num_heads=4, num_kv_heads=1,
                                  intermediate_size=304, tokenizer=False))
    apply_flow(model, "jet")
    linear = model.model.layers[0].mlp.up_proj
    assert isinstance(linear, FP8Linear)
    cached = quantize(linear.weight.detach().float() * 0.5, block=(128, 128))
    linear.qweight = cached
    raw = load_state_dict_from_folder(export_fp8_block(model, None, tmp_path / "fp8"), dequantize=False)
    assert torch.equal(raw["model.layers.0.mlp.up_proj.weight"].view(torch.uint8), cached.data.view(torch.uint8))
    assert torch.equal(raw["model.layers.0.mlp.up_proj.weight_scale_inv"], cached.scale)

    linear.qweight = QTensor(cached.data, cached.scale, (1, 128))
    with pytest.raises(ValueError, match=r"up_proj\.weight: the cached FP8 weight has block \(1, 128\)"):
        export_fp8_block(model, None, tmp_path / "fp8b")
    linear.qweight = cached
    with pytest.raises(ValueError, match=r"scale_fmt='fp32' but scale_fmt='ue8m0'"):
        export_fp8_block(model, None, tmp_path / "fp8c", scale_fmt="ue8m0")


def test_export_fp8_of_model_under_precision_flow(tmp_path, hf_checkpoint):
    """Under a precision flow the FP8Linear layers' own qweight objects are
    exported, refreshed first: after an optimizer step (weights changed, no
    forward yet) the export holds the new weights, not last step's cache."""
    from fp8rl.precision import PRESETS, apply_flow, fp8_linears

    # all dims multiples of 16, so every decoder linear becomes an FP8Linear
    model, tok = load(hf_checkpoint(arch="qwen2", hidden_size=64, num_heads=4, num_kv_heads=2,
                                    intermediate_size=96, tokenizer=False))
    flow = PRESETS["jet"].replace(scale_fmt="ue8m0")
    apply_flow(model, flow)
    layers = {layer.name: layer for layer in fp8_linears(model)}
    assert len(layers) == 7 * model.config.num_layers
    with torch.no_grad():
        model(_ids(model.config.vocab_size))  # fills the caches
        for layer in layers.values():
            layer.weight.add_(0.01)  # "optimizer step"
    raw = load_state_dict_from_folder(export_fp8_block(model, None, tmp_path / "fp8", scale_fmt="ue8m0"),
                                      dequantize=False)
    for name, layer in layers.items():
        fresh = quantize(layer.weight.detach(), block=(128, 128), scale_fmt="ue8m0")
        assert torch.equal(raw[name + ".weight"].view(torch.uint8), fresh.data.view(torch.uint8)), name
        assert torch.equal(raw[name + ".weight"].view(torch.uint8), layer.qweight.data.view(torch.uint8)), name
        assert torch.equal(raw[name + ".weight_scale_inv"], layer.qweight.scale), name
    with pytest.raises(ValueError, match=r"use scale_fmt='ue8m0' but scale_fmt='fp32' was asked"):
        export_fp8_block(model, None, tmp_path / "fp8-fp32")


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_fp8_export_reloads_to_the_same_policy(scale_fmt, tmp_path, hf_checkpoint):
    """What the docstring claims: the export, loaded back and put under the same
    flow, computes bit-identical logits (FP8 weights, FP32 embeddings and norms)."""
    from fp8rl.precision import PRESETS, phase

    # every dim a multiple of 16 (every decoder linear becomes FP8), partial 128-blocks (208, 304, 64)
    model, tok = load(hf_checkpoint(arch="qwen2", hidden_size=208, num_heads=4, num_kv_heads=1, head_dim=64,
                                    intermediate_size=304, tie=True))
    flow = PRESETS["jet"].replace(scale_fmt=scale_fmt)
    assert not apply_flow(model, flow).skipped.keys() - {"lm_head"}
    out = export_fp8_block(model, tok, tmp_path / "fp8", scale_fmt=scale_fmt)
    reloaded, _ = load(out)
    apply_flow(reloaded, flow)
    ids = _ids(model.config.vocab_size)
    for name in ("rollout", "train"):
        with torch.no_grad(), phase(model, name), phase(reloaded, name):
            assert torch.equal(reloaded(ids), model(ids)), name


def test_fp8_export_loads_in_transformers(tmp_path, hf_checkpoint, hf_reference_logits):
    """transformers (CPU: it dequantizes) reads the export when every decoder-linear
    dimension is a multiple of 128, and computes what our full-precision forward
    computes on the same dequantized weights: within 1e-4, float32 summation order
    being the only difference (as for the plain export). Our FP8 flow's logits
    differ more: it also quantizes the activations."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load FP8 checkpoints")
    model, tok = load(hf_checkpoint(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=384))
    out = export_fp8_block(model, tok, tmp_path / "fp8")
    ids = _ids(model.config.vocab_size)
    reloaded, _ = load(out)
    with torch.no_grad():
        ours = reloaded(ids)
    assert (hf_reference_logits(out, ids) - ours).abs().max() < 1e-4


def test_fp8_checkpoint_errors(tmp_path, hf_checkpoint):
    model, _ = _fp8_model(hf_checkpoint, tokenizer=False)
    out = export_fp8_block(model, None, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: the checkpoint has FP8 tensors but no quantization_config"):
        load(out)


def test_refuses_to_overwrite_foreign_folder(tmp_path, hf_checkpoint):
    model, tok = load(hf_checkpoint(tokenizer=False))
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match=r"mine is not empty and is not a previous fp8rl export"):
        export_hf(model, tok, target)
    assert (target / "notes.txt").read_text() == "precious"
    export_hf(model, tok, target, overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "model.safetensors").is_file()
    # a previous export is replaced without overwrite=True, an empty folder is fine too
    export_fp8_block(model, tok, target)
    assert "quantization_config" in json.loads((target / "config.json").read_text())
    (tmp_path / "empty").mkdir()
    export_hf(model, tok, tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # no temporary folders left


def test_failed_export_leaves_previous_export_intact(tmp_path, hf_checkpoint):
    model, tok = load(hf_checkpoint())
    target = export_hf(model, tok, tmp_path / "out", dtype=torch.float32)
    before = (target / "model.safetensors").read_bytes()

    class BrokenTokenizer:
        eos_token_ids, pad_token_id = [2], 2

        def save(self, folder):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        export_hf(model, BrokenTokenizer(), target, dtype=torch.bfloat16)
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
