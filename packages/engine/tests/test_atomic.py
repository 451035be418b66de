"""Files a user can trust: quantize --overwrite, killed and concurrent builds, fsync before
rename, pull --force, malformed manifests, the kernel library's recorded sha256."""

import fcntl
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edge_infer import atomic
from edge_infer.cli import main
from edge_infer.quant.checkpoint import MARKER, quantize_checkpoint
from edge_infer.quant.config import W4Config


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    """A bf16 HF folder with one quantizable linear: all quantize needs, in milliseconds."""
    src = tmp_path / "tiny"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(8, 128, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(128, dtype=torch.bfloat16)},
              src / "model.safetensors")
    return src


def quantize(capsys, *args: str) -> tuple[int, str]:
    code = main(["quantize", *map(str, args)])
    return code, capsys.readouterr().err


def test_overwrite_replaces_our_checkpoint(tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert quantize(capsys, tiny_model, out)[0] == 0
    (out / "stale-shard.safetensors").write_bytes(b"old")
    assert quantize(capsys, tiny_model, out, "--overwrite")[0] == 0
    assert (out / MARKER).is_file() and not (out / "stale-shard.safetensors").exists()


def test_overwrite_refuses_a_file(tiny_model, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    code, err = quantize(capsys, tiny_model, out, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and "not a folder" in err, err
    assert out.read_text() == "mine"


def test_overwrite_refuses_a_foreign_folder(tiny_model, tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8")
    code, err = quantize(capsys, tiny_model, out, "--overwrite")
    assert code == 2 and err.count("\n") == 1 and MARKER in err, err
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos", "tiny"]  # no lock, no partial


def test_malformed_config_is_one_line(tiny_model, tmp_path, capsys):
    (tiny_model / "config.json").write_text("{not json")
    code, err = quantize(capsys, tiny_model, tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and "not valid JSON" in err, err


def test_stale_partial_is_swept_by_next_build(tiny_model, tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / ".out.partial-killed"  # what a SIGKILLed build leaves
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"half")
    other = tmp_path / ".other.partial-live"  # another checkpoint's build: not ours to judge
    other.mkdir()
    quantize_checkpoint(tiny_model, out, W4Config())
    assert not stale.exists() and other.exists()


def test_concurrent_build_waits_for_the_lock(tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    # a live build holds the lock: a separate open file, so flock conflicts even in-process
    holder = os.open(tmp_path / ".out.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.pwrite(holder, b"4242\n", 0)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (quantize_checkpoint(tiny_model, out, W4Config()),
                                              done.set()))
    worker.start()
    try:
        assert not done.wait(1.5), "the second build did not wait for the lock"
        assert not out.exists()
    finally:
        os.close(holder)
    worker.join(60)
    assert done.is_set() and (out / MARKER).is_file()
    err = capsys.readouterr().err
    assert "waiting for another build" in err and "pid 4242" in err, err


def test_everything_is_fsynced_before_its_rename(tiny_model, tmp_path, monkeypatch):
    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    quantize_checkpoint(tiny_model, out, W4Config())
    # each file was fsynced under its partial name, before the rename made it `out/...`
    names = {Path(p).name for p in synced}
    assert {p.name for p in out.iterdir()} <= names
    assert str(tmp_path) in synced  # the folder holding the new name


def test_swap_never_leaves_the_target_missing(tmp_path, monkeypatch):
    target = tmp_path / "model"
    target.mkdir()
    (target / "v").write_text("1")
    gaps = []
    real_replace = os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if not target.exists():
            gaps.append((src, dst))

    monkeypatch.setattr(os, "replace", replace)
    with atomic.build_beside(target) as tmp:
        (tmp / "v").write_text("2")
    assert (target / "v").read_text() == "2" and gaps == []
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["model"]


def test_fallback_swap_killed_midway_is_restored(tmp_path):
    """Where RENAME_EXCHANGE is missing: a build killed between its two renames leaves the
    old copy under `.NAME.old-PID`; the next build puts it back before doing anything."""
    target = tmp_path / "model"
    old = tmp_path / ".model.old-123"
    old.mkdir()
    (old / "v").write_text("1")
    with atomic.build_lock(target):
        atomic.sweep(target)
    assert (target / "v").read_text() == "1" and not old.exists()


def test_write_bytes_leaves_old_or_new(tmp_path, monkeypatch):
    path = tmp_path / "record"
    path.write_bytes(b"old")

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["record"]


@pytest.fixture
def kernel_home(tmp_path, monkeypatch):
    """ext.load with the compiler replaced by a stub that writes `lib` where ninja would."""
    from types import SimpleNamespace

    import torch.utils.cpp_extension as ce

    from edge_infer.kernels import ext

    where = tmp_path / "kernels" / "torch-x"
    state = SimpleNamespace(ext=ext, built=where / f"{ext.NAME}.so", builds=[], fail=False,
                            load=ext.load.__wrapped__)  # past functools.cache

    def fake_build(name, build_directory, **kwargs):
        so = Path(build_directory) / f"{name}.so"
        so.write_bytes(b"half")  # the link has started
        state.builds.append(build_directory)
        if state.fail:
            raise RuntimeError("compiler killed")
        so.write_bytes(b"lib")
        return SimpleNamespace(__file__=str(so))

    monkeypatch.setattr(ext, "build_dir", lambda: where)
    monkeypatch.setattr(ext, "_import_built", lambda path: SimpleNamespace(__file__=str(path)))
    monkeypatch.setattr(ce, "load", fake_build)
    return state


def test_kernel_build_records_its_sha256(kernel_home):
    import hashlib

    kernel_home.load()
    built = kernel_home.built
    assert built.read_bytes() == b"lib"
    record = built.with_name(built.name + ".sha256").read_text()
    assert record == f"{hashlib.sha256(b'lib').hexdigest()}  {built.name}\n"
    kernel_home.load()  # verified: loaded, not rebuilt
    assert len(kernel_home.builds) == 1


def test_killed_kernel_build_leaves_nothing_loadable(kernel_home):
    kernel_home.fail = True
    with pytest.raises(RuntimeError, match="compiler killed"):
        kernel_home.load()
    assert not kernel_home.built.exists()


def test_kernel_not_matching_its_record_is_rebuilt(kernel_home):
    kernel_home.load()
    kernel_home.built.write_bytes(b"lib, changed")
    assert kernel_home.load().__file__.startswith(str(kernel_home.built.parent / "build"))
    assert len(kernel_home.builds) == 2 and kernel_home.built.read_bytes() == b"lib"


def test_kernel_mismatch_that_cannot_rebuild_is_one_line(kernel_home, monkeypatch):
    from edge_infer.errors import EdgeInferError

    kernel_home.load()
    kernel_home.built.write_bytes(b"lib, changed")

    def read_only(target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(kernel_home.ext, "build_lock", read_only)
    with pytest.raises(EdgeInferError, match="fails its sha256 check") as err:
        kernel_home.load()
    assert "\n" not in str(err.value)
