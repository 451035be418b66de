"""QNN: the guarded import never downloads; calibrated vs uncalibrated; the SDK messages."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import tiny_request
from edge_export.pipeline import run
from edge_export.qnn.sdk import HTP_LIB, find_sdk, placeholder_root
from edge_infer.cli import main
from edge_infer.errors import EdgeInferError

NO_NETWORK = textwrap.dedent("""
    import socket
    def _refuse(*a, **k):
        raise OSError("network disabled by the test")
    socket.socket.connect = _refuse
    socket.create_connection = _refuse
""")


def test_import_never_downloads_the_sdk(tmp_path):
    """QNN_SDK_ROOT unset and no network: the import must succeed, pointing at our folder."""
    (tmp_path / "sitecustomize.py").write_text(NO_NETWORK)
    env = {k: v for k, v in os.environ.items() if k != "QNN_SDK_ROOT"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["EDGE_INFER_HOME"] = str(tmp_path / "home")
    code = textwrap.dedent("""
        import os, torch
        before = torch.backends.mkldnn.enabled
        from edge_export.qnn.sdk import import_qualcomm, placeholder_root
        QnnQuantizer, QuantDtype = import_qualcomm()
        assert os.environ["QNN_SDK_ROOT"] == str(placeholder_root()), os.environ["QNN_SDK_ROOT"]
        assert not any(placeholder_root().iterdir()), "something was put in the placeholder"
        assert torch.backends.mkldnn.enabled == before, "oneDNN setting changed by the import"
        print("ok", QuantDtype.use_16a8w)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok" in proc.stdout
    assert "[QNN] Using QNN SDK" not in proc.stdout  # no misleading line about our placeholder


def test_sdk_detection(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    assert not find_sdk().can_lower and "QNN_SDK_ROOT is unset" in find_sdk().explain()
    monkeypatch.setenv("QNN_SDK_ROOT", str(placeholder_root()))
    assert find_sdk().root is None  # our own placeholder is not an SDK
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path))
    assert not find_sdk().can_lower and HTP_LIB in find_sdk().explain()
    lib = tmp_path / HTP_LIB
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert find_sdk().can_lower and find_sdk().htp_lib == lib


def test_require_sdk_refuses_fast(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    start = time.perf_counter()
    code = main(["export", str(tiny_llama), "--target", "qnn-w8a16", "--require-sdk",
                 "--out", str(tmp_path / "q")])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1
    assert "--require-sdk given but QNN_SDK_ROOT is unset" in err
    assert "not on PyPI" in err
    assert elapsed < 2.0, f"refusal took {elapsed:.1f} s"
    assert not (tmp_path / "q").exists()  # refused before any work


def test_w8a16_calibrated_beats_uncalibrated_and_says_what_needs_the_sdk(tiny_llama, tmp_path,
                                                                         monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    cal = run(tiny_request(tiny_llama, "qnn-w8a16", tmp_path / "cal", calibration=4))
    uncal = run(tiny_request(tiny_llama, "qnn-w8a16", tmp_path / "uncal", calibration=0))
    for record in (cal, uncal):
        assert record["measured"] == "simulated"
        artifact = tmp_path / ("cal" if record is cal else "uncal") / record["artifact"]
        assert artifact.suffix == ".pt2" and artifact.stat().st_size == record["size_bytes"]
        assert "QNN SDK" in record["needs"] and "lowered" not in record
    assert cal["calibration"] == {"corpus": "builtin", "samples": 4, "tokens": 64}
    assert uncal["calibration"]["samples"] == 0
    assert cal["sqnr_db"] > 20
    assert cal["sqnr_db"] > uncal["sqnr_db"] + 3
    assert cal["target_sqnr_db"] == 30.0 and "target_sqnr_db" not in uncal
    saved = json.loads((tmp_path / "cal" / "record.json").read_text())
    assert saved["needs"] == cal["needs"]


def test_lowering_failure_is_one_clear_line(tiny_llama, tmp_path, monkeypatch):
    """With something that looks like an SDK but is not, lowering is tried and fails clearly."""
    lib = tmp_path / "sdk" / HTP_LIB
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not a library")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    with pytest.raises(EdgeInferError, match="QNN lowering with the SDK at .* failed"):
        run(tiny_request(tiny_llama, "qnn-w8a16", tmp_path / "out", unit="block",
                         calibration=1))
