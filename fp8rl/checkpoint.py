"""Checkpoints: safetensors + JSON only, so loading one executes no code.

Layout of `run_dir/checkpoints/step_N/`:
    model.safetensors      model state (tied / aliased tensors stored once)
    optimizer.safetensors  optimizer state tensors, keys `state.{param_idx}.{name}`
    optimizer.json         optimizer class, param_groups hyper-parameters,
                           non-tensor state values
    meta.json              trainer metadata (step, config, scheduler, ...)
No RNG state is saved: the trainer derives every random draw from
(seed, step, row), so model + optimizer + step number define the resume.
Checkpoints from before that change also hold `rng.safetensors` / `rng.json`;
loading ignores them (and any other extra file).
A checkpoint is written into `step_N.tmp-XXXX` and renamed to `step_N`, so a
directory named `step_N` is always complete. One writer per run directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

CHECKPOINTS_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d+)$")
_ALIASES_KEY = "fp8rl.aliases"  # safetensors metadata: JSON {alias: stored name}


class CheckpointError(ValueError):
    """A checkpoint does not match what it is loaded into (names the tensor or field)."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """`run_dir/checkpoints/step_{step}`."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The `checkpoints/step_N` directory of `run_dir` with the highest N, or None.

    Only exact `step_<digits>` names count: `step_N.tmp-*` dirs of an
    interrupted save are never returned.
    """
    steps = _step_dirs(Path(run_dir) / CHECKPOINTS_DIR)
    return steps[-1][1] if steps else None


def save_checkpoint(
    ckpt_dir: Path,
    *,
    model_state: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write a checkpoint atomically to `ckpt_dir` (e.g. `checkpoint_path(run, N)`) and return it.

    model_state: name -> tensor (e.g. `model.state_dict()`; any device).
    meta: JSON-serialisable dict.
    An existing `ckpt_dir` is replaced. Leftover `*.tmp-*` dirs of killed
    saves in the same parent are removed first. keep_last=K then deletes all
    but the K highest `step_N` siblings.
    """
    ckpt_dir = Path(ckpt_dir)
    parent = ckpt_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    for stale in parent.glob("*.tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale)

    opt_tensors, opt_json = _flatten_optimizer(optimizer)
    for obj, what in ((opt_json, "optimizer"), (meta, "meta")):
        _check_json(obj, what)  # fail before writing anything
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f"{ckpt_dir.name}.tmp-"))
    try:
        _save_tensors(tmp / "model.safetensors", model_state)
        _save_tensors(tmp / "optimizer.safetensors", opt_tensors)
        _write_json(tmp / "optimizer.json", opt_json)
        _write_json(tmp / "meta.json", meta)
        _fsync_dir(tmp)
        if ckpt_dir.exists():  # os.replace cannot replace a non-empty directory
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f"{ckpt_dir.name}.tmp-old-"))
            os.replace(ckpt_dir, old / ckpt_dir.name)
            os.replace(tmp, ckpt_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, ckpt_dir)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp)
        raise
    _fsync_dir(parent)
    if keep_last is not None:
        for _, old_dir in _step_dirs(parent)[:-keep_last]:
            shutil.rmtree(old_dir)
    return ckpt_dir


def load_checkpoint(
    ckpt_dir: Path,
    model: nn.Module | Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return meta.

    `model` is a module (its state_dict is filled) or a name -> tensor dict
    filled in place. Names, shapes and dtypes must match exactly (an exact
    resume must not cast silently); any mismatch raises CheckpointError naming
    the tensor and both shapes, a missing file raises FileNotFoundError naming
    the path. Everything is checked before anything is modified.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    meta = _read_json(ckpt_dir / "meta.json")

    target = model.state_dict() if isinstance(model, nn.Module) else model
    saved = _load_tensors(ckpt_dir / "model.safetensors")
    _check_same_tensors(saved, target, ckpt_dir / "model.safetensors")

    opt_state = None
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, nn.Module) else {}
        opt_state = _unflatten_optimizer(ckpt_dir, optimizer, names)

    with torch.no_grad():
        for k, t in target.items():
            t.copy_(saved[k])
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    return meta


# --- tensors -----------------------------------------------------------------


def _save_tensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """safetensors file; tensors that are the same view are stored once (tied weights)."""
    out: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach()
        if t.numel() == 0:
            out[name] = t.cpu().contiguous()
            continue
        ptr = t.untyped_storage().data_ptr()
        view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if view in views:
            aliases[name] = views[view]
            continue
        views[view] = name
        # safetensors refuses tensors sharing memory: copy partial overlaps.
        t = t.cpu()
        out[name] = t.clone() if ptr in storages else t.contiguous()
        storages.add(ptr)
    save_file(out, str(path), metadata={_ALIASES_KEY: json.dumps(aliases)})
    _fsync_file(path)


def _load_tensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    with safe_open(str(path), framework="pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}
        aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    for alias, stored in aliases.items():
        out[alias] = out[stored]
    return out


def _check_same_tensors(saved: Mapping[str, Tensor], target: Mapping[str, Tensor], path: Path) -> None:
    for k, t in target.items():
        if k not in saved:
            raise CheckpointError(f"{path}: tensor {k!r} is missing (expected shape {tuple(t.shape)})")
        s = saved[k]
        if s.shape != t.shape:
            raise CheckpointError(
                f"{path}: tensor {k!r} has shape {tuple(s.shape)}, expected {tuple(t.shape)}"
            )
        if s.dtype != t.dtype:
            raise CheckpointError(f"{path}: tensor {k!r} has dtype {s.dtype}, expected {t.dtype}")
    extra = sorted(set(saved) - set(target))
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensor {extra[0]!r} of shape {tuple(saved[extra[0]].shape)} "
            f"({len(extra)} unexpected in all)"
        )


# --- optimizer ---------------------------------------------------------------


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            (tensors if isinstance(v, Tensor) else scalars)[f"state.{idx}.{name}"] = v
    info = {"class": type(optimizer).__name__, "param_groups": sd["param_groups"], "state_scalars": scalars}
    return tensors, info


def _unflatten_optimizer(
    ckpt_dir: Path, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]
) -> dict[str, Any]:
    """Rebuild `optimizer.state_dict()` from the files, checked against `optimizer`."""
    info = _read_json(ckpt_dir / "optimizer.json")
    path = ckpt_dir / "optimizer.safetensors"
    tensors = _load_tensors(path)
    if info["class"] != type(optimizer).__name__:
        raise CheckpointError(f"{ckpt_dir}: optimizer is {type(optimizer).__name__}, checkpoint has {info['class']}")
    groups = info["param_groups"]
    current = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in current]:
        raise CheckpointError(
            f"{ckpt_dir}: optimizer param groups have sizes {[len(g['params']) for g in groups]} "
            f"in the checkpoint, {[len(g['params']) for g in current]} here"
        )
    # state_dict() numbers params in group order; map saved ids to live params
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in groups for i in g["params"]]
    by_id = dict(zip(saved_ids, params))

    state: dict[int, dict[str, Any]] = {}
    entries = list(tensors.items()) + list(info["state_scalars"].items())
    for key, v in entries:
        _, idx, name = key.split(".", 2)
        idx = int(idx)
        if idx not in by_id:
            raise CheckpointError(f"{path}: {key!r} refers to parameter {idx}, which the optimizer lacks")
        p = by_id[idx]
        if isinstance(v, Tensor) and v.ndim > 0 and v.shape != p.shape:
            label = f" ({param_names[id(p)]!r})" if id(p) in param_names else ""
            raise CheckpointError(
                f"{path}: tensor {key!r} has shape {tuple(v.shape)}, parameter {idx}{label} "
                f"has shape {tuple(p.shape)}"
            )
        state.setdefault(idx, {})[name] = v
    # JSON turned tuples (betas) into lists; the optimizers expect tuples
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


# --- files -------------------------------------------------------------------


def _step_dirs(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_json(obj: Any, where: str) -> None:
    """Raise TypeError naming the first value JSON would reject (or silently change)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):  # json.dump would turn 1 into "1"
                raise TypeError(f"{where}: key {k!r} is not a string")
            _check_json(v, f"{where}.{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: {type(obj).__name__} cannot be stored in JSON")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
