"""Tokenizer: a thin wrapper around a `tokenizers.Tokenizer` plus the few facts a
Hugging Face folder keeps next to it (special tokens, chat template).

A Hugging Face tokenizer folder is three or four files:

- `tokenizer.json`: the whole tokenization pipeline (normalizer, pre-tokenizer,
  BPE vocabulary and merges, decoder). The `tokenizers` library runs it as is.
- `tokenizer_config.json`: which tokens are BOS / EOS / PAD, and usually the
  chat template (a Jinja2 program that turns a list of messages into a prompt).
- `chat_template.jinja` (newer folders): the chat template as its own file.
- `generation_config.json` / `config.json`: more end-of-sequence ids (Llama 3
  stops on both `<|eot_id|>` and `<|end_of_text|>`).

Chat templates are rendered exactly as transformers does (same Jinja2 options
and helpers), but in an immutable sandbox: a template is data from the
internet and must not be able to touch Python objects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .config import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """Text <-> token ids, special-token ids, and chat-template rendering.

    Build one with `Tokenizer.from_folder(path)` (a Hugging Face folder) or
    `Tokenizer.from_tokenizers(tok, eos_token=...)` (a `tokenizers.Tokenizer`
    made in memory, e.g. the built-in tiny policy's BPE).
    """

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.tok = tok
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))  # dedupe, keep order
        self.bos_token_id = bos_token_id
        # Batched generation needs some pad id; the first EOS is what HF falls back to as well.
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else None
        )
        self.chat_template = chat_template
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source, compiled) cache
        # The original tokenizer_config.json entries, written back by `save` so that
        # options we do not interpret (add_bos_token, model_max_length, ...) survive.
        self.config: dict[str, Any] = dict(config or {})
        for i in self.eos_token_ids + [bos_token_id, self.pad_token_id]:
            if i is not None and (not 0 <= i < 2**32 or tok.id_to_token(i) is None):  # id_to_token takes a u32
                raise ValueError(
                    f"special token id {i} (eos {self.eos_token_ids}, bos {bos_token_id}, pad {self.pad_token_id}) "
                    f"is outside the tokenizer's vocabulary (size {self.vocab_size})"
                )

    # ----------------------------------------------------------------- build
    @classmethod
    def from_tokenizers(
        cls,
        tok: HFTokenizer,
        eos_token: str | Sequence[str],
        chat_template: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ) -> "Tokenizer":
        """Wrap an in-memory `tokenizers.Tokenizer`; special tokens are given as strings."""
        eos_list = [eos_token] if isinstance(eos_token, str) else list(eos_token)
        if not eos_list:
            raise ValueError("from_tokenizers needs at least one eos_token")
        config: dict[str, Any] = {"eos_token": eos_list[0]}
        if bos_token is not None:
            config["bos_token"] = bos_token
        if pad_token is not None:
            config["pad_token"] = pad_token
        return cls(
            tok,
            eos_token_ids=[_token_id(tok, t, "eos_token") for t in eos_list],
            bos_token_id=_token_id(tok, bos_token, "bos_token") if bos_token is not None else None,
            pad_token_id=_token_id(tok, pad_token, "pad_token") if pad_token is not None else None,
            chat_template=chat_template,
            config=config,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
        `generation_config.json`, `config.json` when present) from a folder."""
        folder = Path(path)
        tok_file = folder / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (a Hugging Face tokenizer folder needs tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error says what is wrong but not which file
            raise ValueError(f"{tok_file}: cannot parse tokenizer: {e}") from e

        config_file, gen_file, model_file = (
            folder / TOKENIZER_CONFIG_FILE, folder / "generation_config.json", folder / "config.json"
        )
        config, gen_config, model_config = _read_json(config_file), _read_json(gen_file), _read_json(model_file)

        def special(field: str) -> int | None:
            content = _token_content(config.get(field))
            if content is not None and not isinstance(content, str):
                raise ValueError(f"{config_file}: {field} must be a token string, got {content!r}")
            return None if content is None else _token_id(tok, content, f"{config_file}: {field}")

        eos_ids: list[int] = []
        if (eos := special("eos_token")) is not None:
            eos_ids.append(eos)
        for file, source in ((gen_file, gen_config), (model_file, model_config)):
            eos_ids += _id_list(source.get("eos_token_id"), file, "eos_token_id")
        bos = special("bos_token")
        if bos is None:
            bos = _token_id_field("bos_token_id", (model_file, model_config), (gen_file, gen_config))
        pad = special("pad_token")
        if pad is None:
            pad = _token_id_field("pad_token_id", (gen_file, gen_config), (model_file, model_config))
            if pad is not None and pad < 0:  # old Llama conversions write -1 for "none"
                pad = None

        try:
            template = _select_template(config.get("chat_template"))
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from e
        template_file = folder / CHAT_TEMPLATE_FILE
        if template is None and template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{template_file}: not a UTF-8 text file (byte {e.start}); is it corrupt?") from e
        try:
            tokenizer = cls(
                tok,
                eos_token_ids=eos_ids,
                bos_token_id=bos,
                pad_token_id=pad,
                chat_template=template,
                config=config,
            )
        except ValueError as e:  # a special token id outside the vocabulary
            raise ValueError(f"{folder}: {e}") from e
        if template is not None:  # compile now: a broken template is an error of this folder, not of a later call
            try:
                tokenizer._compiled_template()
            except ValueError as e:
                source = config_file if config.get("chat_template") is not None else template_file
                raise ValueError(f"{source}: {e}") from e
        return tokenizer

    # ----------------------------------------------------------------- use
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included (the model's
        embedding may be larger: some checkpoints pad it)."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`
        from a chat template) become their single ids. `add_special_tokens=True`
        runs the tokenizer's post-processor (e.g. prepends BOS for Llama 3)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        """The string of one token id (None when out of range)."""
        return self.tok.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def pad_token(self) -> str | None:
        return None if self.pad_token_id is None else self.tok.id_to_token(self.pad_token_id)

    # ----------------------------------------------------------- chat template
    def _compiled_template(self) -> jinja2.Template:
        """The compiled chat template, recompiled when `chat_template` changes."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            try:
                self._compiled = (self.chat_template, _chat_template_env().from_string(self.chat_template))
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat template: Jinja syntax error on line {e.lineno}: {e.message}") from e
        return self._compiled[1]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt
        string, as `transformers`' `apply_chat_template(tokenize=False)` does.
        Extra keyword arguments reach the template (e.g. `enable_thinking=False`
        for Qwen3). Tokenize the result with `encode(..., add_special_tokens=False)`:
        the template already wrote any BOS it wants."""
        variables: dict[str, Any] = {
            key: _token_content(self.config.get(key))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if self.config.get(key) is not None
        }
        # An absent token stays undefined (renders as ""), as in transformers; None would render "None".
        for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if value is not None:
                variables.setdefault(key, value)
        variables.update(kwargs)
        try:
            return self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:  # raise_exception(...) from the template lands here
            raise ValueError(f"chat template failed: {e}") from e

    # ----------------------------------------------------------------- save
    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (chat template inside)
        so that this class and `transformers.AutoTokenizer` can load the folder.

        tokenizer_config.json has room for one EOS token; the exporters also write
        all of `eos_token_ids` into generation_config.json, which `from_folder` reads."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / TOKENIZER_FILE))
        config = dict(self.config)
        config.pop("chat_template", None)
        # transformers re-creates the class from this name; the fast tokenizer is always right
        # for a tokenizer.json, and a stale slow-tokenizer class name would need sentencepiece.
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        for key, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token), ("pad_token", self.pad_token)):
            if value is not None:
                config[key] = value
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos={[self.token(i) for i in self.eos_token_ids]}, "
            f"bos={self.bos_token!r}, pad={self.pad_token!r}, chat_template={self.chat_template is not None})"
        )


# --------------------------------------------------------------------- helpers
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for
    transformers' assistant masks; for rendering it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    """The Jinja2 environment transformers renders chat templates in (same
    whitespace options and helpers), sandboxed and immutable."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    """A folder's optional JSON file: {} when absent."""
    return read_json_object(path) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as a
    serialized AddedToken ({"content": "<s>", ...})."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _token_id(tok: HFTokenizer, content: str, what: str) -> int:
    token_id = tok.token_to_id(content)
    if token_id is None:
        raise ValueError(f"{what}: token {content!r} is not in the vocabulary")
    return token_id


def _id_list(value: Any, file: Path, field: str) -> list[int]:
    """A token id or a list of them (eos_token_id), checked to be integers."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: {field} must be a token id or a list of token ids, got {value!r}")
    return ids


def _token_id_field(field: str, *sources: tuple[Path, dict[str, Any]]) -> int | None:
    """An optional token id (bos_token_id, pad_token_id) from the first (file, dict)
    source that has the key, checked to be an integer."""
    for file, config in sources:
        if field in config:
            value = config[field]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{file}: {field} must be a token id, got {value!r}")
            return value
    return None


def _select_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} (the
    "default" one is the chat template; others are e.g. "tool_use")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        if not (default is None or isinstance(default, str)):
            raise ValueError(f"chat_template 'default' must be a string, found {type(default).__name__}")
        return default
    raise ValueError(f"chat_template must be a string or a list of named templates, found {type(value).__name__}")
