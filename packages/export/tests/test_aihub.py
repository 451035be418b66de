"""AI Hub at its boundary: our checks before the client, and a fake client that holds our
calls to the real signatures of qai_hub.Client.submit_compile_job / submit_inference_job."""

import inspect
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import qai_hub
import torch

from conftest import tiny_request
from edge_export.aihub import client as hub_client
from edge_export.decoder import INPUT_NAMES, StaticDecoder
from edge_export.pipeline import run
from edge_infer.cli import main
from edge_infer.errors import EdgeInferError

TOKEN = "sekrit-token-0123456789abcdef"
ACCEPTED_DTYPES = {"float32", "int8", "int16", "int32", "int64", "uint8", "uint16"}


def write_ini(path: Path, api_url: str) -> Path:
    path.write_text(f"[api]\napi_token = {TOKEN}\napi_url = {api_url}\n"
                    "web_url = https://workbench.example\nverbose = False\n")
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when we return: connect is refused


def test_config_path_is_qai_hubs(monkeypatch, tmp_path):
    monkeypatch.delenv("QAIHUB_CLIENT_INI", raising=False)
    assert hub_client.config_path() == Path(qai_hub.api_utils.get_config_path())
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "x.ini"))
    assert hub_client.config_path() == Path(qai_hub.api_utils.get_config_path())


def test_missing_credentials_fail_at_once(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "nope" / "client.ini"))
    start = time.perf_counter()
    code = main(["export", str(tiny_llama), "--target", "aihub", "--out", str(tmp_path / "o")])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.count("\n") == 0, err  # one line
    assert "no AI Hub credentials" in err and "client.ini does not exist" in err
    assert "qai-hub configure" in err
    assert elapsed < 2.0, f"took {elapsed:.1f} s"


def test_unreachable_service_fails_at_once_without_the_token(tiny_llama, tmp_path, monkeypatch,
                                                              capsys):
    ini = write_ini(tmp_path / "client.ini", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
    for key in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)
    start = time.perf_counter()
    code = main(["export", str(tiny_llama), "--target", "aihub", "--out", str(tmp_path / "o")])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1
    assert "AI Hub at 127.0.0.1 is unreachable" in err and "nothing was submitted" in err
    assert TOKEN not in err
    assert elapsed < 2.0, f"took {elapsed:.1f} s (qai-hub's own retries take ~45 s)"


def test_blackholed_service_is_bounded_by_our_timeout(monkeypatch):
    def hang(*_a, timeout=None, **_k):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    with pytest.raises(hub_client.AIHubUnavailable, match="unreachable"):
        hub_client.check_reachable("https://aihub.example", timeout=0.1)


def test_config_without_token_is_refused(tmp_path, monkeypatch):
    ini = tmp_path / "client.ini"
    ini.write_text("[api]\napi_url = https://x\n")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
    with pytest.raises(hub_client.AIHubUnavailable, match="lacks"):
        hub_client.read_config()
    assert TOKEN not in repr(hub_client.HubConfig(ini, "https://x", TOKEN))


# ---- the fake client ----


class FakeJob:
    def __init__(self, kind: str, state=qai_hub.JobStatus.State.SUCCESS, message=None):
        self.job_id = f"j{kind}1"
        self.url = f"https://workbench.example/jobs/{self.job_id}"
        self.kind = kind
        self._status = qai_hub.JobStatus(state, message)
        self.target = object()  # stands for the compiled qai_hub.Model
        self.outputs = None

    def get_status(self):
        return self._status

    def get_target_model(self):
        return self.target

    def download_target_model(self, filename: str) -> str:
        Path(filename).write_bytes(b"QNN context binary stand-in")
        return filename

    def download_output_data(self):
        return self.outputs

    def download_profile(self):
        return {"execution_summary": {"estimated_inference_time": 1234}}


class FakeClient:
    """Binds every call to the real qai_hub.Client signature and checks the argument shapes.
    Its "device" is the float model itself, so a correct flow scores > 100 dB."""

    def __init__(self, model_dir: Path, fail_compile: bool = False):
        from transformers import AutoModelForCausalLM

        self.device_model = StaticDecoder(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
        self.fail_compile = fail_compile
        self.calls = []

    def _bind(self, name, args, kwargs):
        sig = inspect.signature(getattr(qai_hub.Client, name))
        bound = sig.bind(self, *args, **kwargs)  # TypeError on a wrong/unknown argument
        bound.apply_defaults()
        self.calls.append((name, bound.arguments))
        return bound.arguments

    def submit_compile_job(self, *args, **kwargs):
        a = self._bind("submit_compile_job", args, kwargs)
        assert isinstance(a["device"], qai_hub.Device) and a["device"].name
        model = Path(a["model"])
        assert model.suffix == ".pt2" and model.is_file()  # a torch.export program file
        torch.export.load(str(model))
        specs = a["input_specs"]
        assert list(specs) == list(INPUT_NAMES)
        for shape, dtype in specs.values():
            assert isinstance(shape, tuple) and all(type(d) is int for d in shape)
            assert dtype in ACCEPTED_DTYPES
        assert specs["tokens"][1] == "int32"
        assert "--target_runtime" in a["options"]
        if a["calibration_data"] is not None:
            self._check_dataset(a["calibration_data"], specs)
        self.specs = specs
        job = FakeJob("compile")
        if self.fail_compile:
            job._status = qai_hub.JobStatus(qai_hub.JobStatus.State.FAILED, "op not supported")
        self.compile_job = job
        return job

    def submit_inference_job(self, *args, **kwargs):
        a = self._bind("submit_inference_job", args, kwargs)
        assert a["model"] is self.compile_job.target  # the compiled model, not the source
        assert isinstance(a["device"], qai_hub.Device)
        assert a["profile"] is True
        inputs = a["inputs"]
        self._check_dataset(inputs, self.specs)
        job = FakeJob("inference")
        logits, k_new, v_new = [], [], []
        with torch.no_grad():
            for i in range(len(inputs["tokens"])):
                args_i = [torch.from_numpy(inputs[name][i]) for name in INPUT_NAMES]
                out = self.device_model(*args_i)
                logits.append(out[0].numpy())
                k_new.append(out[1].numpy())
                v_new.append(out[2].numpy())
        job.outputs = {"output_0": logits, "output_1": k_new, "output_2": v_new}
        return job

    @staticmethod
    def _check_dataset(data, specs):
        assert isinstance(data, dict) and list(data) == list(specs)
        counts = {len(v) for v in data.values()}
        assert len(counts) == 1 and counts.pop() >= 1
        for name, samples in data.items():
            shape, dtype = specs[name]
            for x in samples:
                assert isinstance(x, np.ndarray) and x.shape == shape and x.dtype == dtype


@pytest.fixture
def fake_ini(tmp_path, monkeypatch):
    monkeypatch.setenv("QAIHUB_CLIENT_INI",
                       str(write_ini(tmp_path / "client.ini", "https://aihub.example")))


def test_device_flow_with_fake_client(tiny_llama, tmp_path, fake_ini):
    client = FakeClient(tiny_llama)
    out = tmp_path / "hub"
    record = run(tiny_request(tiny_llama, "aihub", out, calibration=2, device="Fake Phone"),
                 client)
    names = [c[0] for c in client.calls]
    assert names == ["submit_compile_job", "submit_inference_job"]
    compile_args = client.calls[0][1]
    assert compile_args["device"].name == "Fake Phone"
    # windows of 16 tokens (24-token context less the sink prefix) = 2 chunks of 8
    assert len(compile_args["calibration_data"]["tokens"]) == 2 * 2
    assert len(client.calls[1][1]["inputs"]["tokens"]) == 2
    assert record["measured"] == "device" and record["sqnr_db"] > 100
    assert record["aihub"]["compile_job"] == "jcompile1"
    assert record["aihub"]["inference_job"] == "jinference1"
    assert (out / "aihub_profile.json").is_file() and (out / "aihub_outputs.npz").is_file()
    assert record["size_bytes"] == (out / record["artifact"]).stat().st_size
    for f in out.iterdir():
        assert TOKEN.encode() not in f.read_bytes(), f"token leaked into {f.name}"


def test_failed_device_job_is_one_clear_error(tiny_llama, tmp_path, fake_ini):
    client = FakeClient(tiny_llama, fail_compile=True)
    with pytest.raises(EdgeInferError, match="compile job jcompile1 failed: op not supported"):
        run(tiny_request(tiny_llama, "aihub", tmp_path / "hub", calibration=0), client)
