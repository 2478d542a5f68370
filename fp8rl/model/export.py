"""Write a model back out as a Hugging Face folder, in BF16/FP32 or block FP8.

Two layouts:

- `export_hf`: the plain folder `transformers.AutoModelForCausalLM.from_pretrained`
  loads: `config.json`, `generation_config.json`, `model.safetensors`, tokenizer
  files. With tied embeddings `lm_head.weight` is left out (it *is* the
  embedding), as transformers does.
- `export_fp8_block`: the DeepSeek-V3 block-FP8 layout. Every linear inside
  the decoder layers is stored as `weight` (float8_e4m3fn [N, K]) plus
  `weight_scale_inv` (fp32 [ceil(N/128), ceil(K/128)], the dequantization
  multiplier despite its name); `config.json` says so in `quantization_config`.
  The FP8 weights are produced by `fp8rl.fp8.quantize` (or taken from a linear's
  cached `qweight`): the bits our own FP8 forward uses. Everything else
  (embeddings, lm_head, norms, biases) is written in float32, the dtype the
  policy computes with (embedding lookup and norms in FP32; the LM head takes
  BF16 operands of the FP32 weight). `torch_dtype` stays "bfloat16", the
  activation dtype for an engine that follows it (transformers by default);
  such an engine casts the float32 tensors to BF16 when it loads them.

  Exact: `fp8rl.model.load(folder)` under the same flow computes bit-identical
  logits in every phase that runs the decoder linears in FP8 (tested). Not part
  of that claim: a linear the flow leaves unquantized (a dimension not a
  multiple of 16) is still written in FP8; a BF16 phase (`bf16`, the training
  forward of `fp8-rollout`) computes with the master weights, which the export
  rounds to FP8; FP8 KV/attention scales (`jet-kv`) are not written. Another
  engine gets the same weights but computes with its own numerics (following
  `torch_dtype`: BF16 activations, embeddings and norms; its own activation
  quantization and kernels): close, not bitwise; the mismatch metrics measure
  that gap.

  Who reads which shapes: our loader, any (partial 128-blocks included).
  transformers (5.x, on CPU it dequantizes on load and needs `accelerate`):
  only checkpoints whose decoder-linear dimensions are all multiples of 128; it
  takes the block size from the scale grid, so another dimension either fails
  to load (SmolLM2: 576 = 4.5 blocks) or, where the dimension happens to divide
  by its number of blocks (200 = 2 x 100), loads with wrong weights. vLLM and
  SGLang size the scale grid by ceil(dim/128), as DeepSeek-V3's own 576-wide
  `kv_a_proj_with_mqa` needs (not run here).

Folders are written atomically: everything goes to a temporary sibling folder
that is renamed into place at the end, so a crash never leaves half a
checkpoint. A marker file (`fp8rl_export.json`) tells a previous export apart
from unrelated files, which are never overwritten unless `overwrite=True`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from fp8rl.fp8 import FP8Linear, quantize

from .config import ModelConfig

if TYPE_CHECKING:
    from .tokenizer import Tokenizer
    from .transformer import Transformer

MARKER_FILE = "fp8rl_export.json"
FP8_BLOCK = (128, 128)
# Linears inside the decoder layers: the ones vLLM/SGLang run in block FP8. Experts
# keep their per-expert checkpoint names (`mlp.experts.<e>.gate_proj`, Mixtral's
# `block_sparse_moe.experts.<e>.w1`), each with its own `weight_scale_inv`: what
# vLLM's FusedMoE weight loader maps into its stacked w13/w2 FP8 weights and scales.
# MoE routers (`mlp.gate`, `shared_expert_gate`) stay float32, as vLLM builds them
# unquantized.
_FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight"
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_hf(
    model: "Transformer",
    tokenizer: "Tokenizer | None",
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write `model` (and `tokenizer`) as a plain Hugging Face folder in `dtype`
    (bfloat16, float16 or float32). Returns the folder."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in hf_tensors(model).items()}
    return write_hf_folder(
        model.config, tensors, tokenizer, out_dir, torch_dtype=_DTYPE_NAMES[dtype],
        overwrite=overwrite, info={"format": "hf", "dtype": _DTYPE_NAMES[dtype], "source": _source(model)},
    )


def export_fp8_block(
    model: "Transformer",
    tokenizer: "Tokenizer | None",
    out_dir: str | Path,
    scale_fmt: str = "fp32",
    overwrite: bool = False,
) -> Path:
    """Write `model` in the block-FP8 layout (see module docstring). `scale_fmt`
    "ue8m0" rounds each block scale up to a power of two (DeepSeek-V3.1 style;
    recorded as `quantization_config.scale_fmt`). Returns the folder."""

    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf_tensors(model).items():
        if not _FP8_LINEAR.fullmatch(name):
            tensors[name] = t.detach().to(torch.float32).contiguous()  # the policy's own FP32 tensor
            continue
        q = _cached_qweight(model, name, t, scale_fmt)
        if q is None:
            q = quantize(t.detach().float(), block=FP8_BLOCK, fmt="e4m3", scale_fmt=scale_fmt, name=name)
        tensors[name] = q.data.contiguous()
        tensors[name + "_scale_inv"] = q.scale.to(torch.float32).contiguous()
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }
    if scale_fmt != "fp32":
        quant["scale_fmt"] = scale_fmt
    return write_hf_folder(
        model.config, tensors, tokenizer, out_dir, torch_dtype="bfloat16", quantization_config=quant,
        overwrite=overwrite, info={"format": "fp8_block", "scale_fmt": scale_fmt, "source": _source(model)},
    )


def write_hf_folder(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    tokenizer: "Tokenizer | None",
    out_dir: str | Path,
    torch_dtype: str,
    quantization_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
) -> Path:
    """Atomically write config.json, generation_config.json, model.safetensors
    and tokenizer files. `tensors` must already have their final names and dtypes."""
    hf_config = config.to_hf_dict()
    # A model loaded from an FP8 checkpoint carries the old quantization_config in
    # `extra`; transformers >= 5 spells the dtype key `dtype`. Write ours only.
    for key in ("quantization_config", "dtype", "torch_dtype", "transformers_version"):
        hf_config.pop(key, None)
    hf_config["torch_dtype"] = torch_dtype
    if quantization_config is not None:
        hf_config["quantization_config"] = quantization_config
    eos = tokenizer.eos_token_ids if tokenizer is not None and tokenizer.eos_token_ids else config.eos_ids
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": tokenizer.pad_token_id if tokenizer is not None else None,
    }
    with atomic_dir(out_dir, overwrite) as tmp:
        # "format": "pt" is what transformers checks before trusting a safetensors file.
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
        if tokenizer is not None:
            tokenizer.save(tmp)
        _write_json(tmp / MARKER_FILE, info or {})
    return Path(out_dir)


@contextmanager
def atomic_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `out_dir`; on success it replaces `out_dir`.

    `out_dir` may be absent, empty, or a previous export (has `fp8rl_export.json`);
    any other non-empty folder is refused unless `overwrite=True`. On error the
    temporary folder is removed and `out_dir` is untouched.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER_FILE).is_file() and not overwrite:
        raise FileExistsError(
            f"{out_dir} is not empty and is not a previous fp8rl export; "
            "choose another folder or pass overwrite=True (--overwrite) to replace it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp makes the folder private (0700) and safetensors writes 0600 files;
        # a checkpoint is meant to be shared like any file the user writes.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            # rename() cannot replace a non-empty folder: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------- helpers
def hf_tensors(model: "Transformer") -> dict[str, torch.Tensor]:
    """The model's tensors under their Hugging Face names, tied lm_head left out.

    The names come from a fresh `Transformer` on the meta device, so extra state
    a precision flow may add to modules (quantized caches, scales) never leaks
    into the checkpoint."""
    from .transformer import Transformer

    with torch.device("meta"):
        names = list(Transformer(model.config).state_dict())
    state = model.state_dict()
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"model has no tensor {missing[0]!r} ({len(missing)} missing); cannot export")
    if model.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    return {n: state[n] for n in names}


def _cached_qweight(model: "Transformer", name: str, weight: torch.Tensor, scale_fmt: str) -> Any:
    """The QTensor an FP8Linear already uses for this weight, if it has one: the
    export must be bit-identical to what our FP8 forward computes with."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if not isinstance(module, FP8Linear):
        return None
    # FP8Linear requantizes lazily on its next forward: right after optimizer.step()
    # its cache still holds the previous step's weights. Export the current policy.
    module.ensure_fresh()
    q = module.qweight
    if q is None:
        return None
    if tuple(q.block) != FP8_BLOCK or q.fmt != "e4m3" or tuple(q.data.shape) != tuple(weight.shape):
        raise ValueError(
            f"{name}: the cached FP8 weight has block {tuple(q.block)}, format {q.fmt}, shape "
            f"{tuple(q.data.shape)}; the FP8 export needs block {FP8_BLOCK}, e4m3, shape {tuple(weight.shape)}"
        )
    if q.scale_fmt != scale_fmt:
        raise ValueError(
            f"{name}: the model's FP8 weights use scale_fmt={q.scale_fmt!r} but scale_fmt={scale_fmt!r} "
            "was asked; export with the model's own scale format so the bits match"
        )
    return q


def _source(model: Any) -> str | None:
    return getattr(model, "source", None)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
