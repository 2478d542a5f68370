"""Shared test fixtures: tiny random Hugging Face checkpoints written by
transformers' own model classes, a tiny tokenizer, and transformers' logits as
the reference to compare our forward against.

Use the fixtures (`hf_checkpoint`, `hf_reference_logits`, `tiny_hf_tokenizer`)
rather than importing this module. transformers is a test-only dependency, so
it is imported inside the helpers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

# Tiny models: one thread is as fast as two and immune to a busy neighbour on a
# shared 2-core machine (two threads there made the suite 30x slower).
torch.set_num_threads(1)

# A ChatML-style template with the features real templates use: a system-prompt
# default, loop variables, raise_exception, bos_token, the generation prompt, and
# indented block tags on their own lines (rendered right only with HF's
# trim_blocks / lstrip_blocks options).
TINY_CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are tiny.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. 12 + 30 = 42.",
    "What is 2+3? The answer is 5. #### 5",
    "Ünïcödé text: café, naïve, 日本語, emoji 🙂 and tabs\tand\nnewlines.",
] * 20


def make_tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with ChatML special tokens
    (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2), trained in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    return tok


def write_tiny_tokenizer_folder(folder: Path, chat_template: str | None = TINY_CHAT_TEMPLATE) -> Path:
    """tokenizer.json + tokenizer_config.json (bos <|im_start|>, eos <|im_end|>)
    as transformers writes them, with the chat template inside the config."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_hf_checkpoint(
    folder: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 72,
    intermediate_size: int = 100,
    num_layers: int = 2,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 320,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    attention_bias: bool = False,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer: bool = True,
    moe: dict[str, Any] | None = None,
) -> Path:
    """Write a random tiny checkpoint with transformers' own classes
    (`arch`: "llama", "qwen2", "qwen3", or the MoE "qwen3_moe", "qwen2_moe",
    "mixtral" with their config keys in `moe`) and return its folder.

    Every parameter is randomized, norm weights (1 + 0.1 * randn) and biases
    included, at scales that keep activations O(1), so a wrong norm, bias or
    head layout shows up in the logits. `max_shard_size` (e.g. "30KB") writes
    several shards plus model.safetensors.index.json.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        # the pre-v5 spelling, which transformers 5 still accepts (as rope_parameters)
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        kwargs["attention_bias"] = attention_bias
    config = config_cls(**kwargs, **(moe or {}))
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:  # [out, in] matrices (stacked per expert in transformers 5): unit-variance outputs
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model = model.to(dtype)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **save_kwargs)
    if tokenizer:
        write_tiny_tokenizer_folder(folder)
    return folder


def hf_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 eager-attention logits for `input_ids` [B, T]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


@pytest.fixture
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `hf_checkpoint(arch="qwen3", tie=True, ...)` -> folder of a random
    tiny checkpoint written by transformers (see `write_hf_checkpoint`)."""

    def make(**kwargs: Any) -> Path:
        return write_hf_checkpoint(tmp_path_factory.mktemp("hf"), **kwargs)

    return make


@pytest.fixture
def hf_reference_logits() -> Callable[[Path, torch.Tensor], torch.Tensor]:
    """`hf_reference_logits(folder, input_ids)`: transformers' float32 logits."""
    return hf_logits


@pytest.fixture
def tiny_hf_tokenizer(tmp_path: Path) -> Path:
    """A folder with tokenizer.json + tokenizer_config.json (ChatML template)."""
    return write_tiny_tokenizer_folder(tmp_path / "tok")
