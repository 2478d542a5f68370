"""Read a llama.cpp GGUF file as (ModelConfig, Hugging Face state dict, Tokenizer).

GGUF keeps everything in one file: hyper-parameters and the tokenizer as
key/value metadata, weights as (often quantized) tensors. Three things differ
from a Hugging Face checkpoint and are undone here:

1. Names: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`.
2. Shapes: GGUF lists dims fastest-first (`[K, N]` for an `[N, K]` matrix), the
   bytes are the same row-major layout, so the torch shape is the reverse.
3. Q/K rows: for llama, llama.cpp's converter (convert_hf_to_gguf.py,
   `LlamaModel.permute`) reorders the rows of `attn_q`/`attn_k` inside each head
   from HF's rotate-half RoPE layout (first half / second half of the head) to
   GGML's interleaved pairs: head rows `[x0..x31, y0..y31]` become
   `[x0, y0, x1, y1, ...]`. `unpermute_qk` puts them back.

Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized to float32 with
`gguf.quants.dequantize`: the result is exactly the weights llama.cpp computes
with, which is the model we then run and train.

The tokenizer is rebuilt as a `tokenizers` byte-level BPE from the vocabulary,
merges and token types stored in the file, with the pre-tokenizer named by
`tokenizer.ggml.pre` (the regex split llama.cpp uses for that model family).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .load import check_finite
from .tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor -> HF module inside model.layers.{i}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how to split text before BPE, as the matching HF tokenizer.json does.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor, e.g. `blk.0.attn_q.weight`
    -> `model.layers.0.self_attn.q_proj.weight`. Unknown names raise ValueError."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{suffix}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base == "rope_freqs":
        raise ValueError(
            f"GGUF tensor {gguf_name!r} holds precomputed RoPE scaling factors (Llama 3.1+ long-context "
            "scaling), which fp8rl does not read from GGUF; load the Hugging Face folder instead"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama-family Hugging Face model")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` for attn_q (n_head = query heads) and
    attn_k (n_head = KV heads); works for weights [n*d, K] and biases [n*d].

    llama.cpp views each head's d rows as (2, d/2) and swaps the two axes (pairs
    become interleaved); viewing them as (d/2, 2) and swapping back undoes it.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Read a llama GGUF: (config, float32 state dict with HF names, tokenizer or None)."""
    try:
        from gguf import GGUFReader  # optional dependency: only GGUF users need it
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'fp8rl[gguf]'") from None

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError) as e:  # the reader indexes past the end of a corrupt header
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e
    meta = _Metadata(reader, path)
    config = _config(meta, {t.name for t in reader.tensors})
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        try:
            name = hf_tensor_name(t.name)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        w = _dequantize(t, path)
        check_finite(w, t.name, path)
        kind = t.name.split(".")[-2]
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(kind)
        if heads is not None:
            try:
                w = unpermute_qk(w, heads)
            except ValueError as e:
                raise ValueError(f"{path}: tensor {t.name!r}: {e}") from e
        state[name] = w
    return config, state, _tokenizer(meta)


def gguf_to_hf_folder(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert a GGUF file into a Hugging Face folder (config.json, float32
    model.safetensors, tokenizer files), written atomically.

    float32, not bf16: dequantized Q4_1 weights are `d * q + m` with fp16 `d`, `m`,
    which needs more than bf16's 8 significant bits; bf16 would change the model.
    """
    from .export import write_hf_folder

    config, state, tokenizer = read_gguf(gguf_path)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return write_hf_folder(
        config, state, tokenizer, out_dir, torch_dtype="float32", overwrite=overwrite,
        info={"format": "hf", "dtype": "float32", "source": str(gguf_path)},
    )


# --------------------------------------------------------------------- helpers
class _Metadata:
    """Typed access to GGUF key/values with errors that name the file and key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError) as e:  # a value whose stored type or length is corrupt
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is unreadable: {e}") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def typed(self, key: str, kind: str, default: Any = None, required: bool = False) -> Any:
        """`get` (or `require`) checked against `kind`: "int", "number", "str", "bool",
        "int list" or "str list" (a corrupt file can hold any type under any key)."""
        value = self.require(key) if required else self.get(key, default)
        if value is not None and not _is_kind(value, kind):
            raise ValueError(f"{self.path}: GGUF metadata {key!r} should be of type {kind}, got {str(value)[:80]!r}")
        return value


def _is_kind(value: Any, kind: str) -> bool:
    if kind.endswith(" list"):
        return isinstance(value, list) and all(_is_kind(v, kind.removesuffix(" list")) for v in value)
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # True is an int to Python, not to a GGUF file
        return False
    return isinstance(value, {"int": int, "number": (int, float), "str": str}[kind])


def _f32(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); take
    the shortest decimal that rounds to the same float32, as the HF config had."""
    return float(str(np.float32(x)))


def _config(meta: _Metadata, tensor_names: set[str]) -> ModelConfig:
    arch = meta.typed("general.architecture", "str", required=True)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}); load the Hugging Face folder instead"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{meta.path}: RoPE scaling {scaling!r} in GGUF is not supported")
    n_head = meta.typed(f"{arch}.attention.head_count", "int", required=True)
    hidden = meta.typed(f"{arch}.embedding_length", "int", required=True)
    tokens = meta.typed("tokenizer.ggml.tokens", "str list")
    vocab = meta.typed(f"{arch}.vocab_size", "int") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{meta.path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = (
        meta.typed(f"{arch}.attention.key_length", "int")
        or meta.typed(f"{arch}.rope.dimension_count", "int")
        or (hidden // n_head if n_head > 0 else 0)  # 0: ModelConfig says what is wrong
    )
    biases = sorted(n for n in tensor_names if n.endswith(".bias"))
    if biases:
        raise ValueError(f"{meta.path}: llama GGUF with bias tensors ({biases[0]}, ...) is not supported")
    pad = meta.typed("tokenizer.ggml.padding_token_id", "int")
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.typed(f"{arch}.feed_forward_length", "int", required=True),
            num_layers=meta.typed(f"{arch}.block_count", "int", required=True),
            num_heads=n_head,
            num_kv_heads=meta.typed(f"{arch}.attention.head_count_kv", "int") or n_head,
            head_dim=head_dim,
            architecture="LlamaForCausalLM",
            rms_norm_eps=_f32(meta.typed(f"{arch}.attention.layer_norm_rms_epsilon", "number", required=True)),
            rope_theta=_f32(meta.typed(f"{arch}.rope.freq_base", "number", 10000.0)),
            max_position_embeddings=meta.typed(f"{arch}.context_length", "int", 2048),
            # No separate output matrix: the lm_head is the token embedding.
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.typed("tokenizer.ggml.bos_token_id", "int"),
            eos_token_id=meta.typed("tokenizer.ggml.eos_token_id", "int"),
            extra={} if pad is None else {"pad_token_id": pad},
        )
    except ValueError as e:
        raise ValueError(f"{meta.path}: GGUF metadata describes an invalid model: {e}") from e


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 in torch layout (dims reversed)."""
    from gguf import quants

    try:
        array = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which cannot be dequantized "
            f"(the gguf package has no dequantizer for it: {e})"
        ) from e
    shape = [int(d) for d in reversed(t.shape.tolist())]
    # The reader memory-maps the file read-only: copy into a writable float32 array.
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)


def _pre_tokenizer(name: str, meta: _Metadata) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if name in _DIGITS_THEN_GPT2:  # each digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if name == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = ", ".join((*_DIGITS_THEN_GPT2, "gpt-2", "llama-bpe"))
    raise ValueError(f"{meta.path}: tokenizer pre-tokenizer {name!r} is not supported (supported: {known})")


def _tokenizer(meta: _Metadata) -> Tokenizer | None:
    """Rebuild the byte-level BPE tokenizer stored in the GGUF metadata."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ValueError(f"{meta.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = meta.typed("tokenizer.ggml.tokens", "str list", required=True)
    types: list[int] = meta.typed("tokenizer.ggml.token_type", "int list") or [1] * len(tokens)
    merges: list[str] = meta.typed("tokenizer.ggml.merges", "str list", required=True)
    if len(types) != len(tokens):
        raise ValueError(f"{meta.path}: {len(tokens)} tokenizer.ggml.tokens but {len(types)} token types")
    if not all(" " in m for m in merges):
        raise ValueError(f"{meta.path}: tokenizer.ggml.merges holds an entry that is not a 'left right' pair")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{meta.path}: tokenizer.ggml.tokens has duplicate entries")
    try:
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise ValueError(f"{meta.path}: the tokenizer vocabulary and merges do not fit: {e}") from e
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(meta.typed("tokenizer.ggml.pre", "str", "gpt-2"), meta)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole in the text and skipped on
    # decode; user-defined ones are matched whole but decoded like text.
    tok.add_tokens([
        AddedToken(tokens[i], special=types[i] == _TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens)) if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ])

    def token_of(key: str) -> str | None:
        i = meta.typed(key, "int")
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    bos, eos = token_of("tokenizer.ggml.bos_token_id"), token_of("tokenizer.ggml.eos_token_id")
    pad = token_of("tokenizer.ggml.padding_token_id")
    eot = token_of("tokenizer.ggml.eot_token_id")  # Llama 3's <|eot_id|>: generation stops there too
    if eos is None:
        raise ValueError(f"{meta.path}: GGUF metadata has no valid tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.typed("tokenizer.ggml.add_bos_token", "bool", False)) and bos is not None
    add_eos = bool(meta.typed("tokenizer.ggml.add_eos_token", "bool", False)) and eos is not None
    if add_bos or add_eos:  # e.g. Llama 3 prepends <|begin_of_text|> to every encode
        def template(seq: str, type_id: int) -> list[str]:
            return [f"{bos}:{type_id}"] * add_bos + [f"${seq}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos

        tok.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=template("A", 0) + template("B", 1),
            special_tokens=[(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    wrapped = Tokenizer.from_tokenizers(
        tok,
        eos_token=[eos] + ([eot] if eot is not None and eot != eos else []),
        chat_template=meta.typed("tokenizer.chat_template", "str"),
        bos_token=bos,
        pad_token=pad,
    )
    wrapped.config.update(add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    return wrapped
