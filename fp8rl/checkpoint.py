"""Checkpoints: safetensors + JSON only, so loading one executes no code.

Layout of `run_dir/checkpoints/step_N/`:
    model.safetensors      model state (tied / aliased tensors stored once)
    optimizer.safetensors  optimizer state tensors, keys `state.{param_idx}.{name}`
    optimizer.json         optimizer class, param_groups hyper-parameters,
                           non-tensor state values
    optimizer/             instead of the two above, from data-parallel ranks:
                           the optimizer state as torch.distributed.checkpoint
                           shards (each rank writes its own; .metadata maps them)
    meta.json              trainer metadata (step, config, scheduler, ...)
    <extra>.json           files the caller adds (the trainer: config.json)
    manifest.json          SHA-256 and size of every file above, written last
No RNG state is saved: the trainer derives every random draw from
(seed, step, row), so model + optimizer + step number define the resume.
Checkpoints from before that change also hold `rng.safetensors` / `rng.json`;
loading ignores them (and any other extra file).

Crash safety (docs/design.md section 10): a checkpoint is written whole into
`step_N.tmp-XXXX`, fsynced, and renamed to `step_N`, so a directory named
`step_N` is always complete; pruning renames a directory away before
deleting it, so a kill mid-delete never leaves a partial `step_N`. Leftover
`*.tmp-*` directories are removed by the next save. Loading verifies the
manifest's checksums and that every tensor is finite; a checkpoint with a
non-finite weight or optimizer value is never written. One writer per run
directory (data-parallel ranks write their optimizer shards into the
unpublished checkpoint that writer made).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

CHECKPOINTS_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d+)$")
_ALIASES_KEY = "fp8rl.aliases"  # safetensors metadata: JSON {alias: stored name}
MANIFEST = "manifest.json"
SHARDED_OPTIMIZER = "optimizer"  # directory of torch.distributed.checkpoint optimizer shards


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
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    keep_last: int | None = None,
    extra_json: Mapping[str, Any] | None = None,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint atomically to `ckpt_dir` (e.g. `checkpoint_path(run, N)`) and return it.

    model_state: name -> tensor (e.g. `model.state_dict()`; any device).
    meta: JSON-serialisable dict. extra_json: file name -> JSON object, written
    inside the checkpoint before it is published (the trainer's config.json).
    A non-finite value in a floating-point model or optimizer tensor raises
    CheckpointError naming it, before anything is written. An existing
    `ckpt_dir` is replaced. Leftover `*.tmp-*` dirs of killed saves in the same
    parent are removed first. keep_last=K then deletes all but the K highest
    `step_N` siblings. `optimizer=None` with `write_shards(tmp)`: data-parallel
    ranks write the optimizer state into the unpublished checkpoint themselves
    (`save_sharded_optimizer`); the manifest then covers their files too.
    """
    ckpt_dir = Path(ckpt_dir)
    parent = ckpt_dir.parent
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    extra = dict(extra_json or {})
    reserved = {"model.safetensors", "optimizer.safetensors", "optimizer.json", "meta.json", MANIFEST}
    if reserved & set(extra) or not all(name.endswith(".json") and "/" not in name for name in extra):
        raise ValueError(f"extra_json names must be plain *.json files other than {sorted(reserved)}, got {sorted(extra)}")
    opt_tensors, opt_json = _flatten_optimizer(optimizer) if optimizer is not None else ({}, None)
    for obj, what in ((opt_json, "optimizer"), (meta, "meta"), *((v, k) for k, v in extra.items())):
        _check_json(obj, what)  # fail before writing anything
    _check_finite(model_state, "model")
    _check_finite(opt_tensors, "optimizer")
    remove_leftovers(parent)

    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f"{ckpt_dir.name}.tmp-"))
    try:
        _save_tensors(tmp / "model.safetensors", model_state)
        if optimizer is not None:
            _save_tensors(tmp / "optimizer.safetensors", opt_tensors)
            _write_json(tmp / "optimizer.json", opt_json)
        _write_json(tmp / "meta.json", meta)
        for name, obj in extra.items():
            _write_json(tmp / name, obj)
        if write_shards is not None:
            write_shards(tmp)
        _write_json(tmp / MANIFEST, _manifest(tmp))  # last: its presence means the rest is whole
        _fsync_dir(tmp)
        _publish(tmp, ckpt_dir)
    except BaseException:
        if tmp.exists():
            _remove_dir(tmp)
        raise
    if keep_last is not None:
        _prune(parent, keep_last)
    return ckpt_dir


def remove_leftovers(checkpoints_dir: Path) -> None:
    """Delete the `*.tmp-*` directories killed saves or prunes left in
    `checkpoints_dir` (created if missing). Only the run's one writer calls it."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    for stale in checkpoints_dir.glob("*.tmp-*"):
        if stale.is_dir():
            _remove_dir(stale)


def _publish(tmp: Path, ckpt_dir: Path) -> None:
    """Rename the finished `tmp` to `ckpt_dir` (replacing an older one) and fsync the parent."""
    parent = ckpt_dir.parent
    if ckpt_dir.exists():  # os.replace cannot replace a non-empty directory
        old = Path(tempfile.mkdtemp(dir=parent, prefix=f"{ckpt_dir.name}.tmp-old-"))
        os.replace(ckpt_dir, old / ckpt_dir.name)
        os.replace(tmp, ckpt_dir)
        _remove_dir(old)
    else:
        os.replace(tmp, ckpt_dir)
    _fsync_dir(parent)


def _prune(parent: Path, keep_last: int) -> None:
    """Delete all but the `keep_last` highest `step_N` directories. Each is first
    renamed to `step_N.tmp-del-*` (atomic), so a kill mid-delete leaves a
    leftover the next save removes, never a partial `step_N`."""
    for _, old_dir in _step_dirs(parent)[:-keep_last]:
        doomed = Path(tempfile.mkdtemp(dir=parent, prefix=f"{old_dir.name}.tmp-del-"))
        os.replace(old_dir, doomed / old_dir.name)
        _fsync_dir(parent)
        _remove_dir(doomed)


def _remove_dir(path: Path) -> None:
    shutil.rmtree(path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, Any]:
    """{"files": {relative path: {"sha256", "bytes"}}} of every file under `folder`."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {"files": {p.relative_to(folder).as_posix(): {"sha256": _sha256(p), "bytes": p.stat().st_size}
                      for p in files}}


def verify_checkpoint(ckpt_dir: Path) -> bool:
    """Check every file against `manifest.json`: FileNotFoundError for a missing
    file, CheckpointError naming the first file with another size or SHA-256. Returns False for
    a checkpoint written before manifests existed (nothing to verify against)."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / MANIFEST).is_file():
        return False
    manifest = _read_json(ckpt_dir / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{ckpt_dir / MANIFEST}: not a checkpoint manifest (no 'files' table)")
    for name, entry in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {path} (listed in {MANIFEST})")
        if not isinstance(entry, dict) or path.stat().st_size != entry.get("bytes"):
            raise CheckpointError(f"{path}: size differs from {MANIFEST}; the file is damaged")
        if _sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: SHA-256 differs from {MANIFEST}; the file is damaged")
    return True


def _check_finite(tensors: Mapping[str, Tensor], what: str, path: Path | None = None) -> None:
    """CheckpointError naming the first floating-point tensor with NaN/Inf values."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad:
                where = f"{path}: " if path is not None else ""
                raise CheckpointError(
                    f"{where}{what} tensor {name!r} has {bad} non-finite value(s); "
                    + ("the checkpoint is unusable" if path is not None else "refusing to write such a checkpoint")
                )


def load_checkpoint(
    ckpt_dir: Path,
    model: nn.Module | Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_module: nn.Module | None = None,
) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return meta.

    An optimizer state written by data-parallel ranks (`optimizer/`) is read
    with torch.distributed.checkpoint into `optimizer`, whose parameters are
    those of `optimizer_module` (default `model`): plain tensors in one
    process, the rank's shards under FSDP2, whatever the world size that wrote it.

    `model` is a module (its state_dict is filled) or a name -> tensor dict
    filled in place. Names, shapes and dtypes must match exactly (an exact
    resume must not cast silently); any mismatch raises CheckpointError naming
    the tensor and both shapes, a missing file raises FileNotFoundError naming
    the path. Everything is checked before anything is modified.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    verify_checkpoint(ckpt_dir)
    meta = _read_json(ckpt_dir / "meta.json")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt_dir / 'meta.json'}: expected a JSON object, got {type(meta).__name__}")

    target = model.state_dict() if isinstance(model, nn.Module) else model
    saved = _load_tensors(ckpt_dir / "model.safetensors")
    _check_same_tensors(saved, target, ckpt_dir / "model.safetensors")
    _check_finite(saved, "model", ckpt_dir / "model.safetensors")

    sharded = optimizer is not None and (ckpt_dir / SHARDED_OPTIMIZER).is_dir()
    opt_state = None
    if optimizer is not None and not sharded:
        names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, nn.Module) else {}
        opt_state = _unflatten_optimizer(ckpt_dir, optimizer, names)

    with torch.no_grad():
        for k, t in target.items():
            t.copy_(saved[k])
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    elif sharded:
        module = optimizer_module or model
        if not isinstance(module, nn.Module):
            raise TypeError("sharded optimizer state needs the module its parameters belong to (optimizer_module)")
        load_sharded_optimizer(ckpt_dir / SHARDED_OPTIMIZER, module, optimizer)
    return meta


# --- optimizer shards of data-parallel ranks ----------------------------------


def save_sharded_optimizer(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank's optimizer shards into `folder` (torch.distributed.checkpoint,
    keyed by parameter names, so any world size can read them back). Collective:
    every rank calls it. A non-finite value raises CheckpointError first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(module, optimizer)
    local = {f"{name}.{k}": (v.to_local() if hasattr(v, "to_local") else v)
             for name, st in osd["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    _check_finite(local, "optimizer")
    dcp.save({"optimizer": osd}, checkpoint_id=str(folder))


def load_sharded_optimizer(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`optimizer` (AdamW over `module`'s parameters, plain or FSDP2 shards) :=
    the state in `folder`. Collective under torch.distributed; plain in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for group in optimizer.param_groups:  # AdamW creates its state lazily: make the slots to read into
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    osd = get_optimizer_state_dict(module, optimizer)
    one_process = not torch.distributed.is_initialized()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"optimizer": osd}, checkpoint_id=str(folder), no_dist=one_process)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{folder}: cannot read the optimizer shards ({e})") from e
    set_optimizer_state_dict(module, optimizer, osd)


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
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    except (SafetensorError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    for alias, stored in aliases.items():
        if stored not in out:
            raise CheckpointError(f"{path}: alias {alias!r} points to missing tensor {stored!r}")
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
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e


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
