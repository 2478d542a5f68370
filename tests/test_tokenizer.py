"""Tokenizer: same ids and same chat-template rendering as transformers on the
same folder, special tokens from every config file, save/load round trip,
sandboxed templates, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl.model import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n"}],
    [
        {"role": "user", "content": "12 + 30?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "café 日本語 🙂"},
    ],
]


def _hf_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def test_chat_template_matches_transformers(tiny_hf_tokenizer):
    ours, hf = Tokenizer.from_folder(tiny_hf_tokenizer), _hf_tokenizer(tiny_hf_tokenizer)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    # the template really used its features: default system prompt, bos variable, trim filter
    text = ours.apply_chat_template(CONVERSATIONS[1])
    assert text.startswith("<|im_start|><|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n" in text


def test_encode_decode_match_transformers(tiny_hf_tokenizer):
    ours, hf = Tokenizer.from_folder(tiny_hf_tokenizer), _hf_tokenizer(tiny_hf_tokenizer)
    text = ours.apply_chat_template(CONVERSATIONS[2])
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids.count(1) == text.count("<|im_start|>")  # special tokens are single ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_token_ids(tiny_hf_tokenizer):
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.pad_token_id == 0
    assert tok.vocab_size == 300 and tok.eos_token == "<|im_end|>"


def test_eos_ids_from_generation_and_model_config(tiny_hf_tokenizer):
    (tiny_hf_tokenizer / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tiny_hf_tokenizer / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    config = json.loads((tiny_hf_tokenizer / "tokenizer_config.json").read_text())
    del config["pad_token"]
    config["eos_token"] = {"content": "<|im_end|>", "special": True}  # serialized AddedToken form
    (tiny_hf_tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    assert tok.eos_token_ids == [2, 0, 5]
    assert tok.pad_token_id == 2  # no pad token anywhere: first EOS


def test_chat_template_file_and_named_list(tiny_hf_tokenizer):
    config_file = tiny_hf_tokenizer / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_folder(tiny_hf_tokenizer).chat_template is None
    (tiny_hf_tokenizer / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_folder(tiny_hf_tokenizer).apply_chat_template(CONVERSATIONS[0]) == "What is 2+3?!"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_folder(tiny_hf_tokenizer).chat_template == "D"


def test_template_kwargs_and_tojson(tiny_hf_tokenizer):
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    out = tok.apply_chat_template(CONVERSATIONS[2], enable_thinking=False)
    assert out == '{"role": "user", "content": "12 + 30?"}<no-think>'


def test_save_round_trip_and_transformers_reads_it(tiny_hf_tokenizer, tmp_path):
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    assert again.chat_template == tok.chat_template
    assert (again.eos_token_ids, again.bos_token_id, again.pad_token_id) == (
        tok.eos_token_ids, tok.bos_token_id, tok.pad_token_id
    )
    hf = _hf_tokenizer(tmp_path / "saved")
    text = tok.apply_chat_template(CONVERSATIONS[2])
    assert hf.apply_chat_template(CONVERSATIONS[2], tokenize=False, add_generation_prompt=True) == text
    assert hf.encode(text, add_special_tokens=False) == again.encode(text)
    assert hf.eos_token_id == 2


def test_from_tokenizers(tiny_hf_tokenizer):
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(tiny_hf_tokenizer / "tokenizer.json"))
    tok = Tokenizer.from_tokenizers(raw, eos_token="<|im_end|>", chat_template="{{ messages[0]['content'] }}")
    assert tok.eos_token_ids == [2] and tok.pad_token_id == 2 and tok.bos_token_id is None
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "What is 2+3?"
    with pytest.raises(ValueError, match=r"eos_token: token '<\|eot\|>' is not in the vocabulary"):
        Tokenizer.from_tokenizers(raw, eos_token="<|eot|>")


def test_template_errors_are_clear(tiny_hf_tokenizer):
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    with pytest.raises(ValueError, match=r"chat template failed: unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    broken = Tokenizer.from_folder(tiny_hf_tokenizer)
    broken.chat_template = "{% for m in messages %}"
    with pytest.raises(ValueError, match=r"Jinja syntax error"):
        broken.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",  # reach Python internals
    "{% set _ = messages.append({'role': 'x'}) %}",  # mutate the caller's data
])
def test_templates_are_sandboxed(tiny_hf_tokenizer, template):
    tok = Tokenizer.from_folder(tiny_hf_tokenizer)
    tok.chat_template = template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_folder(tmp_path)


def test_bad_tokenizer_config_names_file(tiny_hf_tokenizer):
    (tiny_hf_tokenizer / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: invalid JSON"):
        Tokenizer.from_folder(tiny_hf_tokenizer)
