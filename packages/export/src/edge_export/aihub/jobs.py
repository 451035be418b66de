"""AI Hub jobs: compile for a named device, then run inference with profiling on it.

  compile_job   = client.submit_compile_job(model=<.pt2>, device=Device(name), input_specs=...,
                                            options=..., calibration_data=...)
  inference_job = client.submit_inference_job(model=compile_job.get_target_model(), device=...,
                                              inputs={name: [array, ...]}, profile=True)

then the compiled model, the on-device outputs and the profile are downloaded. Inputs are the
graph's inputs by name (decoder.INPUT_NAMES), one list entry per chunk; the device sees the
same chunks as the local float model did (reference-cache protocol), so its logits compare
chunk by chunk with the reference.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_infer.api import EdgeInferError

DEFAULT_DEVICE = "Samsung Galaxy S24 (Family)"
DEFAULT_OPTIONS = "--target_runtime qnn_context_binary --quantize_full_type w8a16"

_DTYPES = {np.dtype(n): n for n in ("float32", "int8", "int16", "int32", "int64", "uint8",
                                     "uint16")}


@dataclass
class DeviceRun:
    compile_job_id: str
    inference_job_id: str
    target_model: Path | None
    outputs: dict[str, list[np.ndarray]]
    profile: dict


def input_specs(inputs: dict[str, list[np.ndarray]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """qai_hub's input_specs form: name -> (shape, dtype name), from the first sample."""
    specs = {}
    for name, samples in inputs.items():
        first = samples[0]
        if first.dtype not in _DTYPES:
            raise EdgeInferError(f"input {name!r} has dtype {first.dtype}, which AI Hub does not "
                                 f"accept ({', '.join(_DTYPES.values())})")
        specs[name] = (tuple(int(d) for d in first.shape), _DTYPES[first.dtype])
    return specs


def wait(job, what: str, poll_s: float, say: Callable[[str], None]) -> None:
    """Poll until `job` finishes, saying its state when it changes and every minute."""
    start, last, last_said = time.monotonic(), None, 0.0
    while True:
        status = job.get_status()
        elapsed = time.monotonic() - start
        if status.code != last or elapsed - last_said >= 60:
            say(f"AI Hub {what} job {job.job_id}: {status.code} ({elapsed:.0f} s)")
            last, last_said = status.code, elapsed
        if status.finished:
            if not status.success:
                raise EdgeInferError(f"AI Hub {what} job {job.job_id} failed: "
                                     f"{status.message or status.code}; see {job.url}")
            return
        time.sleep(poll_s)


def run_on_device(client, model_file: Path, device_name: str,
                  inputs: dict[str, list[np.ndarray]], out_dir: Path, *,
                  options: str = DEFAULT_OPTIONS,
                  calibration: dict[str, list[np.ndarray]] | None = None,
                  name: str = "edge-infer", poll_s: float = 10.0,
                  say: Callable[[str], None] | None = None) -> DeviceRun:
    import qai_hub

    say = say or (lambda line: print(line, file=sys.stderr))
    device = qai_hub.Device(device_name)
    compile_job = client.submit_compile_job(
        model=str(model_file),
        device=device,
        name=f"{name} compile",
        input_specs=input_specs(inputs),
        options=options,
        calibration_data=calibration,
    )
    say(f"submitted compile job {compile_job.job_id} for {device_name}: {compile_job.url}")
    wait(compile_job, "compile", poll_s, say)
    target = compile_job.get_target_model()
    if target is None:
        raise EdgeInferError(f"AI Hub compile job {compile_job.job_id} produced no model")
    downloaded = compile_job.download_target_model(str(out_dir / "aihub_target_model"))
    inference_job = client.submit_inference_job(
        model=target,
        device=device,
        inputs=inputs,
        name=f"{name} inference",
        profile=True,
    )
    say(f"submitted inference job {inference_job.job_id}: {inference_job.url}")
    wait(inference_job, "inference", poll_s, say)
    outputs = inference_job.download_output_data()
    if not outputs:
        raise EdgeInferError(f"AI Hub inference job {inference_job.job_id} returned no outputs")
    profile = inference_job.download_profile()
    (out_dir / "aihub_profile.json").write_text(json.dumps(profile, indent=1, default=str))
    np.savez(out_dir / "aihub_outputs.npz",
             **{f"{k}_{i}": a for k, v in outputs.items() for i, a in enumerate(v)})
    return DeviceRun(compile_job.job_id, inference_job.job_id,
                     Path(downloaded) if downloaded else None, dict(outputs), profile)


def pick_output(outputs: dict[str, list[np.ndarray]], shape: tuple[int, ...]) -> list[np.ndarray]:
    """The device output with the reference's shape (AI Hub renames outputs output_0, ...)."""
    for samples in outputs.values():
        if tuple(samples[0].shape) == tuple(shape):
            return samples
    got = {k: tuple(v[0].shape) for k, v in outputs.items()}
    raise EdgeInferError(f"no device output has the reference's shape {tuple(shape)}: {got}")
