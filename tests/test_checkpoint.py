import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fp8rl.checkpoint as ckpt
from fp8rl.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _setup(seed):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model, opt, seed, start, stop):
    """Steps start..stop-1; each step's data come from (seed, step) alone, as in the
    trainer, so a resume needs only model, optimizer and step. Returns the losses."""
    losses = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x = torch.randn(16, 4, generator=g)
        target = torch.randn(16, 2, generator=g)
        loss = ((model(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _save(run, step, model, opt, **kw):
    return save_checkpoint(
        checkpoint_path(run, step), model_state=model.state_dict(), optimizer=opt,
        meta={"step": step, "flow": "jet"}, **kw,
    )


def _assert_same_optimizer_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for idx, st in sa["state"].items():
        assert st.keys() == sb["state"][idx].keys()
        for name, v in st.items():
            assert torch.equal(v, sb["state"][idx][name]), (idx, name)


def test_resume_continues_training_bit_for_bit(tmp_path):
    model, opt = _setup(0)
    _train(model, opt, 7, 0, 3)
    path = _save(tmp_path, 3, model, opt)
    expected = _train(model, opt, 7, 3, 6)

    model2, opt2 = _setup(123)  # different init and optimizer state
    meta = load_checkpoint(path, model2, opt2)
    assert meta == {"step": 3, "flow": "jet"}
    got = _train(model2, opt2, 7, meta["step"], 6)
    assert torch.equal(got, expected)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    _assert_same_optimizer_state(opt, opt2)


def test_checkpoint_holds_only_safetensors_and_json(tmp_path):
    model, opt = _setup(0)
    _train(model, opt, 0, 0, 1)
    path = _save(tmp_path, 1, model, opt)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json", "meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors"]
    # the parent holds only the finished step dir
    assert [p.name for p in path.parent.iterdir()] == ["step_1"]


def test_latest_ignores_tmp_dirs_and_sorts_numerically(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for name in ("step_2", "step_10", "step_11.tmp-abc", "step_x"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_10"


def test_interrupted_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    model, opt = _setup(0)

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "_fsync_dir", killed)  # dies after all files are written
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, model, opt)
    assert latest_checkpoint(tmp_path) is None
    assert list((tmp_path / "checkpoints").iterdir()) == []  # the partial tmp dir was removed


def test_keep_last_prunes_and_same_step_overwrites(tmp_path):
    model, opt = _setup(0)
    for step in (1, 2, 3):
        _save(tmp_path, step, model, opt, keep_last=2)
    _save(tmp_path, 3, model, opt, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]


def test_missing_tensor_is_named_and_nothing_is_modified(tmp_path):
    model, opt = _setup(0)
    state = model.state_dict()
    del state["2.bias"]
    path = save_checkpoint(checkpoint_path(tmp_path, 1), model_state=state, optimizer=opt,
                           meta={})
    target = _model(1)
    before = [p.clone() for p in target.parameters()]
    with pytest.raises(CheckpointError, match=r"'2.bias' is missing \(expected shape \(2,\)\)"):
        load_checkpoint(path, target)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    model, opt = _setup(0)
    path = _save(tmp_path, 1, model, opt)
    other = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 2))
    with pytest.raises(CheckpointError, match=r"'0.weight' has shape \(8, 4\), expected \(9, 4\)"):
        load_checkpoint(path, other)


def test_optimizer_shape_mismatch_names_state_tensor(tmp_path):
    model, opt = _setup(0)
    _train(model, opt, 0, 0, 1)
    path = _save(tmp_path, 1, model, opt)
    # same model tensors, but the optimizer holds the params in another order
    model2 = _model(0)
    opt2 = torch.optim.AdamW(list(model2.parameters())[::-1], lr=1e-2)
    with pytest.raises(CheckpointError, match=r"'state.0.exp_avg' has shape \(8, 4\), parameter 0 \('2.bias'\)"):
        load_checkpoint(path, model2, opt2)


def test_missing_file_names_the_path(tmp_path):
    model, opt = _setup(0)
    path = _save(tmp_path, 1, model, opt)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="step_1/optimizer.safetensors"):
        load_checkpoint(path, model, opt)


def test_old_checkpoint_with_rng_files_still_loads(tmp_path):
    """Checkpoints written before RNG state was dropped hold rng.json / rng.safetensors."""
    model, opt = _setup(0)
    _train(model, opt, 0, 0, 2)
    path = _save(tmp_path, 2, model, opt)
    (path / "rng.json").write_text('{"py": {"kind": "python_random", "state": [3, [1, 2], null]}}')
    save_file({"data": torch.Generator().manual_seed(0).get_state()}, str(path / "rng.safetensors"))
    model2, opt2 = _setup(1)
    assert load_checkpoint(path, model2, opt2) == {"step": 2, "flow": "jet"}
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    _assert_same_optimizer_state(opt, opt2)
    assert (path / "rng.json").is_file() and (path / "rng.safetensors").is_file()  # left as they were


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(checkpoint_path(tmp_path, 1), model_state=model.state_dict(), optimizer=opt,
                           meta={})
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 1
    torch.manual_seed(1)
    model2 = Tied()
    load_checkpoint(path, model2)
    assert torch.equal(model2.head.weight, model.emb.weight)
    assert model2.head.weight is model2.emb.weight


def test_non_json_meta_is_named_and_nothing_is_written(tmp_path):
    model, opt = _setup(0)
    with pytest.raises(TypeError, match=r"meta.sched.lr: Tensor"):
        save_checkpoint(checkpoint_path(tmp_path, 1), model_state=model.state_dict(), optimizer=opt,
                        meta={"sched": {"lr": torch.tensor(1.0)}})
    assert not (tmp_path / "checkpoints").exists()  # checked before anything is written


# --- integrity -------------------------------------------------------------------


def test_damaged_file_is_caught_by_the_checksum_before_anything_changes(tmp_path):
    model, opt = _setup(0)
    _train(model, opt, 0, 0, 1)
    path = _save(tmp_path, 1, model, opt)
    target, opt2 = _setup(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-100:] = b"\xff" * 100  # inside the tensor bytes: a loader alone would not notice
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_1/model.safetensors: SHA-256 differs"):
        load_checkpoint(path, target, opt2)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    (path / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="meta.json: size differs"):
        verify_checkpoint(path)


def test_unreadable_files_give_errors_naming_them(tmp_path):
    model, opt = _setup(0)
    path = _save(tmp_path, 1, model, opt)
    (path / "manifest.json").unlink()  # as a checkpoint from before manifests: loaded unverified
    assert verify_checkpoint(path) is False
    (path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_checkpoint(path, model, opt)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json: invalid JSON"):
        load_checkpoint(path, model, opt)


def test_non_finite_weights_are_never_written_nor_loaded(tmp_path):
    model, opt = _setup(0)
    _train(model, opt, 0, 0, 1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite value.*refusing to write"):
        _save(tmp_path, 1, model, opt)
    assert not checkpoint_path(tmp_path, 1).exists()
    with torch.no_grad():
        next(model.parameters())[0, 0] = 0.0
    path = _save(tmp_path, 1, model, opt)
    # a legacy checkpoint (no manifest) holding a NaN is refused on load
    state = {k: v.clone() for k, v in model.state_dict().items()}
    next(iter(state.values())).view(-1)[0] = float("inf")
    save_file(state, str(path / "model.safetensors"))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="non-finite value.*unusable"):
        load_checkpoint(path, model, opt)


def test_extra_json_is_inside_the_published_checkpoint(tmp_path):
    model, opt = _setup(0)
    path = save_checkpoint(checkpoint_path(tmp_path, 1), model_state=model.state_dict(), optimizer=opt,
                           meta={"step": 1}, extra_json={"config.json": {"seed": 3}})
    assert json.loads((path / "config.json").read_text()) == {"seed": 3}
    assert "config.json" in json.loads((path / "manifest.json").read_text())["files"]
    with pytest.raises(ValueError, match="extra_json names"):
        save_checkpoint(checkpoint_path(tmp_path, 2), model_state=model.state_dict(), optimizer=opt,
                        meta={}, extra_json={"meta.json": {}})


def test_a_kill_while_pruning_never_leaves_a_partial_step_dir(tmp_path, monkeypatch):
    import fp8rl.checkpoint as ck

    model, opt = _setup(0)
    for step in (1, 2):
        _save(tmp_path, step, model, opt)

    def killed(path):  # the process dies half-way through deleting step_1
        files = sorted(Path(path).rglob("*.safetensors"))
        files[0].unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "_remove_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_path(tmp_path, 3), model_state=model.state_dict(), optimizer=opt,
                        meta={"step": 3}, keep_last=2)
    parent = tmp_path / "checkpoints"
    steps = sorted(p.name for p in parent.iterdir() if ".tmp-" not in p.name)
    assert steps == ["step_2", "step_3"]  # step_1 was renamed away before the delete began
    for name in steps:
        assert verify_checkpoint(parent / name)
    monkeypatch.undo()
    _save(tmp_path, 4, model, opt)  # the next save clears the leftover
    assert sorted(p.name for p in parent.iterdir()) == ["step_2", "step_3", "step_4"]
