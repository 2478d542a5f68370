"""Run logging: `metrics.jsonl` (one JSON object per step), `eval.jsonl`,
TensorBoard scalars and an atomically written `summary.json`.

Train steps go to `metrics.jsonl`, evaluations to a separate `eval.jsonl`
(same line format `{"step": N, ...}`), so that `metrics.jsonl` stays exactly
one object per step. Floats are written by `json` with `repr`, the shortest
text that reads back to the same double, so a resumed run can be compared
number for number. NaN/inf are written as `NaN`/`Infinity` (Python's json
reads them back; a skipped step may log an inf grad_norm).
"""

from __future__ import annotations

import json
import numbers
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
SUMMARY_FILE = "summary.json"
TB_DIR = "tb"


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new file, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file, in order; [] if the file does not exist.

    A last line without its newline that does not parse is a write torn by a
    kill and is skipped; any other malformed line raises ValueError naming
    `path:line`.
    """
    path = Path(path)
    if not path.exists():
        return []
    # errors="replace": a kill can tear a multi-byte character; that line is then skipped below
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):  # no trailing newline: torn final write
                break
            raise ValueError(f"{path}:{i}: malformed JSON line ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}")
        records.append(rec)
    return records


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write `run_dir/summary.json` atomically (indented, keys in given order)."""
    path = Path(run_dir) / SUMMARY_FILE
    atomic_write_text(path, json.dumps(_jsonable(summary), indent=2) + "\n")
    return path


def _jsonable(value: Any, key: str = "") -> Any:
    """Plain JSON types from tensors / numpy scalars; TypeError names the key otherwise."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {key!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar / 0-d array
        return value.item()
    raise TypeError(f"metric {key!r}: cannot write {type(value).__name__} to JSON")


class RunLogger:
    """Appends per-step records of one run directory; one writer per run.

    `log_step(step, metrics)` writes `{"step": step, **metrics}` to
    `metrics.jsonl`, `log_eval` to `eval.jsonl`, each line flushed at once;
    numeric values also go to TensorBoard under `run_dir/tb` (train metrics by
    name, eval metrics as `eval/<name>`). Steps must increase within a file:
    logging a step already present raises, so a resumed run must first call
    `truncate_after(checkpoint_step)`. TensorBoard's writer is opened on the
    first record with `purge_step` = last step in `metrics.jsonl` + 1, so
    events a killed run wrote past its checkpoint are hidden too (also when
    the truncation was done by another RunLogger instance).
    """

    def __init__(self, run_dir: Path, use_tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.use_tensorboard = use_tensorboard
        if use_tensorboard:
            _require_tensorboard()
        self._writer = None
        self._files: dict[str, Any] = {}
        self._last_step: dict[str, int | None] = {}
        for name in (METRICS_FILE, EVAL_FILE):
            _drop_torn_tail(self.run_dir / name)
            recs = read_metrics(self.run_dir / name)
            self._last_step[name] = recs[-1]["step"] if recs else None
        # metrics.jsonl is the source of truth: TensorBoard events of later steps
        # (left by a killed run, truncated since) are purged when the writer opens.
        last = self._last_step[METRICS_FILE]
        self._purge_step = last + 1 if last is not None else None

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one train record; metric values are numbers, strings, or scalar tensors."""
        self._append(METRICS_FILE, step, metrics, tb_prefix="")

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one evaluation record (e.g. accuracy, n) to `eval.jsonl`."""
        self._append(EVAL_FILE, step, metrics, tb_prefix="eval/")

    def truncate_after(self, step: int) -> None:
        """Drop records with step > `step` from both files (atomic rewrite).

        Call when resuming from the checkpoint of `step`: a run killed after
        logging step 7 but checkpointed at step 6 then logs 7 again, once.
        """
        self._close_files()
        for name in (METRICS_FILE, EVAL_FILE):
            path = self.run_dir / name
            if not path.exists():
                continue
            kept = [r for r in read_metrics(path) if r["step"] <= step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
            self._last_step[name] = kept[-1]["step"] if kept else None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = step + 1

    def close(self) -> None:
        self._close_files()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _append(self, name: str, step: int, metrics: dict[str, Any], tb_prefix: str) -> None:
        step = int(step)
        last = self._last_step[name]
        if last is not None and step <= last:
            raise ValueError(
                f"step {step} is not after the last step {last} in {self.run_dir / name}; "
                f"call truncate_after(step) when resuming"
            )
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step' (it is the first argument)")
        record = {"step": step, **{k: _jsonable(v, k) for k, v in metrics.items()}}
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.run_dir / name, "a", encoding="utf-8")
        f.write(json.dumps(record) + "\n")
        f.flush()
        self._last_step[name] = step
        if self.use_tensorboard:
            writer = self._tb()
            for k, v in record.items():
                # bool is an int subclass but not a curve worth plotting
                if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool):
                    writer.add_scalar(tb_prefix + k, float(v), global_step=step)
            writer.flush()

    def _tb(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=self._purge_step)
        return self._writer

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "RunLogger(use_tensorboard=True) needs the 'tensorboard' package: "
            "pip install tensorboard, or pass use_tensorboard=False"
        ) from e


def _drop_torn_tail(path: Path) -> None:
    """Remove an unterminated last line (a write torn by a kill) so appends stay line-aligned."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    # A complete record that only lacks its newline is kept; a torn fragment is dropped.
    keep = data + b"\n" if _is_json(data[cut:]) else data[:cut]
    atomic_write_text(path, keep.decode("utf-8"))


def _is_json(b: bytes) -> bool:
    try:
        json.loads(b)
    except ValueError:  # JSONDecodeError or a torn UTF-8 sequence
        return False
    return True


__all__ = ["RunLogger", "read_metrics", "write_summary", "atomic_write_text", "METRICS_FILE", "EVAL_FILE"]
