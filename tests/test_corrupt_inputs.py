"""Every bad model file a user can supply is a one-line ValueError (FileNotFoundError
for a missing one) that names the file, raised before anything is built or written,
and `fp8rl eval --model BAD` prints it as one `error: ...` line and exits 2.

Each case starts from a valid input (a tiny HF folder written by transformers, a
sharded one, or a GGUF converted from it the way llama.cpp does) and corrupts one
file: truncation, 100 bytes of 0xFF over the header, random bytes, bad JSON, a
missing shard, absurd config values, NaN/Inf weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_load import write_llama_gguf

from fp8rl.cli import main
from fp8rl.model import export_fp8_block, load


# ------------------------------------------------------------------ corruptions
def _target(source: Path, name: str) -> Path:
    return source / name if name else source  # "" = the source itself (a .gguf file)


def truncate(name: str = "") -> Callable[[Path], None]:
    def corrupt(source: Path) -> None:
        f = _target(source, name)
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])

    return corrupt


def overwrite_ff(name: str = "", at: int = 0) -> Callable[[Path], None]:
    """100 bytes of 0xFF at offset `at` (0: over the header)."""

    def corrupt(source: Path) -> None:
        f = _target(source, name)
        data = bytearray(f.read_bytes())
        data[at : at + 100] = b"\xff" * 100
        f.write_bytes(bytes(data))

    return corrupt


def random_bytes(name: str = "") -> Callable[[Path], None]:
    def corrupt(source: Path) -> None:
        f = _target(source, name)
        f.write_bytes(np.random.default_rng(0).bytes(max(f.stat().st_size, 64)))

    return corrupt


def write_text(name: str, text: str) -> Callable[[Path], None]:
    return lambda source: (source / name).write_text(text)


def edit_json(name: str, **changes: Any) -> Callable[[Path], None]:
    """Set keys of a JSON file (a value of None deletes the key)."""

    def corrupt(source: Path) -> None:
        data = json.loads((source / name).read_text())
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (source / name).write_text(json.dumps(data))

    return corrupt


def edit_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def corrupt(source: Path) -> None:
        state = load_file(str(source / "model.safetensors"))
        edit(state)
        save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})

    return corrupt


def set_value(name: str, index: tuple[int, ...], value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name][index] = value

    return edit


def remove_first_shard(source: Path) -> None:
    sorted(source.glob("model-*.safetensors"))[0].unlink()


def truncate_first_shard(source: Path) -> None:
    truncate(sorted(source.glob("model-*.safetensors"))[0].name)(source)


# ------------------------------------------------------------------------ cases
class Case(NamedTuple):
    base: str  # "hf" | "sharded" | "gguf" | "gguf-nan" | "gguf-bad-eps" | "fp8" | "small-vocab"
    corrupt: Callable[[Path], None]
    file: str  # the file the message must name ("" = the source itself; a glob picks a shard)
    match: str  # what the message must say
    error: type[Exception] = ValueError


ST, INDEX = "model.safetensors", "model.safetensors.index.json"
UP = "model.layers.0.mlp.up_proj.weight"
CASES: dict[str, Case] = {
    # safetensors weights
    "safetensors-truncated": Case("hf", truncate(ST), ST, r"not a valid safetensors file"),
    "safetensors-ff-header": Case("hf", overwrite_ff(ST), ST, r"not a valid safetensors file"),
    "safetensors-ff-header-json": Case("hf", overwrite_ff(ST, at=8), ST, r"not a valid safetensors file"),
    "safetensors-random": Case("hf", random_bytes(ST), ST, r"not a valid safetensors file"),
    "safetensors-empty": Case("hf", write_text(ST, ""), ST, r"not a valid safetensors file"),
    # sharded checkpoints
    "index-bad-json": Case("sharded", write_text(INDEX, '{"weight_map": '), INDEX, r"invalid JSON"),
    "index-random": Case("sharded", random_bytes(INDEX), INDEX, r"not a UTF-8 text file"),
    "index-not-object": Case("sharded", write_text(INDEX, "[]"), INDEX, r"expected a JSON object"),
    "index-weight-map-list": Case("sharded", edit_json(INDEX, weight_map=["a"]), INDEX, r"weight_map"),
    "index-shard-outside": Case("sharded", edit_json(INDEX, weight_map={UP: "../x.safetensors"}), INDEX,
                                r"not a file name inside"),
    "shard-missing": Case("sharded", remove_first_shard, "model-00001-*", r"lists shard", FileNotFoundError),
    "shard-truncated": Case("sharded", truncate_first_shard, "model-00001-*", r"not a valid safetensors file"),
    # JSON files
    "config-empty": Case("hf", write_text("config.json", ""), "config.json", r"invalid JSON"),
    "config-random": Case("hf", random_bytes("config.json"), "config.json", r"not a UTF-8 text file"),
    "config-list": Case("hf", write_text("config.json", "[1]"), "config.json", r"expected a JSON object"),
    "tokenizer-bad-json": Case("hf", write_text("tokenizer.json", '{"model": '), "tokenizer.json", r"cannot parse"),
    "tokenizer-random": Case("hf", random_bytes("tokenizer.json"), "tokenizer.json", r"cannot parse"),
    "tokenizer-config-bad-json": Case("hf", write_text("tokenizer_config.json", "{"), "tokenizer_config.json",
                                      r"invalid JSON"),
    "tokenizer-config-random": Case("hf", random_bytes("tokenizer_config.json"), "tokenizer_config.json",
                                    r"not a UTF-8 text file"),
    "tokenizer-config-eos-int": Case("hf", edit_json("tokenizer_config.json", eos_token=5), "tokenizer_config.json",
                                     r"eos_token must be a token string"),
    "chat-template-syntax": Case("hf", edit_json("tokenizer_config.json", chat_template="{% for %}"),
                                 "tokenizer_config.json", r"Jinja syntax error"),
    "generation-config-bad-json": Case("hf", write_text("generation_config.json", "{,}"), "generation_config.json",
                                       r"invalid JSON"),
    "generation-config-eos-str": Case("hf", edit_json("generation_config.json", eos_token_id="x"),
                                      "generation_config.json", r"eos_token_id must be a token id"),
    # config values
    "config-missing-key": Case("hf", edit_json("config.json", vocab_size=None), "config.json",
                               r"missing field 'vocab_size'"),
    "config-negative-size": Case("hf", edit_json("config.json", hidden_size=-72), "config.json",
                                 r"hidden_size must be a positive integer"),
    "config-string-size": Case("hf", edit_json("config.json", intermediate_size="100"), "config.json",
                               r"intermediate_size must be a positive integer"),
    "config-zero-heads": Case("hf", edit_json("config.json", num_attention_heads=0, head_dim=None), "config.json",
                              r"num_attention_heads must be a positive integer"),
    "config-heads-not-dividing": Case("hf", edit_json("config.json", num_attention_heads=5, head_dim=None),
                                      "config.json", r"hidden_size=72 is not a multiple of num_attention_heads=5"),
    "config-zero-kv-heads": Case("hf", edit_json("config.json", num_key_value_heads=0), "config.json",
                                 r"num_kv_heads must be a positive integer"),
    "config-odd-head-dim": Case("hf", edit_json("config.json", head_dim=11), "config.json", r"head_dim=11 is odd"),
    "config-huge-vocab": Case("hf", edit_json("config.json", vocab_size=10**12), "config.json",
                              r"vocab_size must be a positive integer below 2\*\*31"),
    "config-vocab-mismatch": Case("hf", edit_json("config.json", vocab_size=1000), "config.json",
                                  r"vocab_size=1000 and hidden_size=72 do not fit .* \[320, 72\]"),
    "config-billion-layers": Case("hf", edit_json("config.json", num_hidden_layers=10**9), "config.json",
                                  r"1000000000 layers but the checkpoint .* has tensors for 2"),
    "config-negative-eps": Case("hf", edit_json("config.json", rms_norm_eps=-1e-5), "config.json",
                                r"rms_norm_eps must be a positive finite number"),
    "config-rope-theta-string": Case("hf", edit_json("config.json", rope_theta="big", rope_parameters=None),
                                     "config.json", r"rope_theta must be a positive finite number"),
    "config-rope-scaling-string": Case("hf", edit_json("config.json", rope_scaling="llama3", rope_parameters=None),
                                       "config.json", r"rope_scaling must be an object"),
    "config-architectures-string": Case("hf", edit_json("config.json", architectures="LlamaForCausalLM"),
                                        "config.json", r"architectures must be a list"),
    "fp8-quantization-config-string": Case("fp8", edit_json("config.json", quantization_config="fp8"),
                                           "config.json", r"no quantization_config"),
    # weights
    "weight-nan": Case("hf", edit_weights(set_value(UP, (3, 5), float("nan"))), ST,
                       rf"tensor '{re.escape(UP)}' has 1 NaN/Inf value \(first at \[3, 5\]\)"),
    "weight-inf": Case("hf", edit_weights(set_value("model.norm.weight", (7,), float("-inf"))), ST,
                       r"tensor 'model\.norm\.weight' has 1 NaN/Inf value"),
    "weight-wrong-shape": Case("hf", edit_weights(lambda s: s.__setitem__(UP, s[UP][:50])), "",
                               rf"'{re.escape(UP)}' has shape \[50, 72\], expected \[100, 72\]"),
    "weight-int-dtype": Case("hf", edit_weights(lambda s: s.__setitem__(UP, s[UP].to(torch.int32))), "",
                             r"dtype torch\.int32, expected a floating-point tensor"),
    "tokenizer-larger-than-model": Case("small-vocab", lambda source: None, "tokenizer.json",
                                        r"tokenizer has 300 tokens but the model's vocab_size is 256"),
    # GGUF
    "gguf-truncated": Case("gguf", truncate(), "", r"not a readable GGUF file"),
    "gguf-ff-magic": Case("gguf", overwrite_ff(), "", r"not a readable GGUF file"),
    "gguf-ff-counts": Case("gguf", overwrite_ff(at=8), "", r"not a readable GGUF file"),  # was an IndexError
    "gguf-ff-metadata": Case("gguf", overwrite_ff(at=64), "", r"not a readable GGUF file"),  # was an IndexError
    "gguf-random": Case("gguf", random_bytes(), "", r"not a readable GGUF file"),
    "gguf-text-file": Case("gguf", lambda f: f.write_text("not a model\n"), "", r"not a readable GGUF file"),
    "gguf-nan-weight": Case("gguf-nan", lambda f: None, "", r"tensor 'blk\.0\.ffn_up\.weight' has 1 NaN/Inf value"),
    "gguf-ff-weights": Case("gguf", overwrite_ff(at=-4096), "", r"NaN/Inf value"),  # float data of the last tensor
    "gguf-negative-eps": Case("gguf-bad-eps", lambda f: None, "", r"rms_norm_eps must be a positive finite number"),
}


def _build(base: str, hf_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """The valid input a case corrupts."""
    if base == "sharded":
        return hf_checkpoint(max_shard_size="30KB")
    if base == "small-vocab":  # the tiny tokenizer has 300 tokens
        return hf_checkpoint(vocab_size=256)
    if base == "fp8":
        model, tok = load(hf_checkpoint())
        return export_fp8_block(model, tok, tmp_path / "fp8")
    if base.startswith("gguf"):
        folder = hf_checkpoint(arch="llama")
        if base == "gguf-nan":
            edit_weights(set_value(UP, (0, 0), float("nan")))(folder)
        overrides = {"rms_norm_eps": -1e-5} if base == "gguf-bad-eps" else None
        return write_llama_gguf(tmp_path / "model.gguf", folder, config_overrides=overrides)
    return hf_checkpoint()


def _named_file(source: Path, file: str) -> str:
    if not file:
        return str(source)
    if "*" in file:
        return next(source.glob(file)).name  # a shard, before the case removes it
    return str(source / file)


def _tree(*roots: Path) -> dict[str, int]:
    """Every file under `roots` with its size: to check that nothing was written."""
    return {str(p): p.stat().st_size for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES)
def test_bad_model_file_is_one_line_error(case, hf_checkpoint, tmp_path, monkeypatch, capsys):
    c = CASES[case]
    source = _build(c.base, hf_checkpoint, tmp_path)
    named = _named_file(source, c.file)
    c.corrupt(source)

    with pytest.raises(c.error) as info:
        load(source)
    message = str(info.value)
    assert type(info.value) is c.error, f"{type(info.value).__name__}: {message}"
    assert named in message, message
    assert re.search(c.match, message), message
    assert "\n" not in message

    # The CLI: one `error:` line, exit code 2, nothing written (run dir, cache, model folder).
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("FP8RL_CACHE", str(tmp_path / "cache"))
    roots = (tmp_path, source if source.is_dir() else source.parent)
    before = _tree(*roots)
    capsys.readouterr()
    rc = main(["eval", "--model", str(source), "--json", "--set", "eval.n=1", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert _tree(*roots) == before


def test_valid_inputs_pass_the_cli(hf_checkpoint, tmp_path, monkeypatch, capsys):
    """The control: the uncorrupted inputs the cases start from evaluate fine."""
    monkeypatch.chdir(tmp_path)
    for source in (hf_checkpoint(), hf_checkpoint(max_shard_size="30KB"),
                   write_llama_gguf(tmp_path / "model.gguf", hf_checkpoint(arch="llama"))):
        assert main(["eval", "--model", str(source), "--json", "--set", "eval.n=1", "--max-new-tokens", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["n"] == 1


def test_non_finite_fp8_scale_is_named(hf_checkpoint, tmp_path):
    """A block-FP8 checkpoint whose scale is Inf: the scale tensor is named."""
    model, tok = load(hf_checkpoint())
    folder = tmp_path / "fp8"
    export_fp8_block(model, tok, folder)
    state = load_file(str(folder / ST))
    scale = next(k for k in state if k.endswith("_scale_inv"))
    state[scale][0, 0] = float("inf")
    save_file(state, str(folder / ST), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder / ST))}: tensor '{re.escape(scale)}' has 1 NaN/Inf"):
        load(folder)
