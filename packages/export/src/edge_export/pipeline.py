"""`export`: one model, one target -> an artifact in OUT, its SQNR, and one record.

Order of work, cheapest refusal first: the target's prerequisites (AI Hub credentials and
reachability; the QNN SDK when --require-sdk) are checked before the model is even loaded.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge_export import records
from edge_export.decoder import (
    FLOAT_MASK_VALUE,
    INPUT_NAMES,
    BlockUnit,
    SinkPrefix,
    StaticDecoder,
    StaticShape,
    example_inputs,
    run_sequence,
    sink_prefix,
    window_tokens,
)
from edge_export.sqnr import sqnr_db
from edge_export.targets import GROUP_SIZE, SQNR_TARGETS, TARGETS, Target, preflight
from edge_infer.api import OTHER_CORPUS, EdgeInferError, UsageError, token_windows

log = logging.getLogger("edge_export")


@dataclass
class Request:
    model: str
    target: str
    out: Path
    unit: str = "decoder"
    calibration: int = 16
    calibration_corpus: str = "lee"
    eval_sequences: int = 4
    shape: StaticShape = field(default_factory=StaticShape)
    group_size: int = GROUP_SIZE
    soc: str = "SM8650"
    require_sdk: bool = False
    device: str | None = None
    hub_options: str | None = None
    record: Path | None = None
    sink_prefix: bool = True

    @property
    def eval_corpus(self) -> str:
        return OTHER_CORPUS[self.calibration_corpus]


@dataclass
class Loaded:
    name: str
    hf_dir: Path
    hf: torch.nn.Module
    tokenizer: object | None
    source: dict


def load_model(spec: str) -> Loaded:
    """MODEL is a folder (HF layout) or a registry name (pulled on first use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edge_infer.api import REGISTRY

    path = Path(spec)
    source: dict = {}
    if path.is_dir():
        hf_dir, name = path, path.name
        manifest = path.parent / "manifest.json"
        if path.name == "hf" and manifest.is_file():  # a model folder of our store
            name = path.parent.name
            source = json.loads(manifest.read_text()).get("source", {})
    elif spec in REGISTRY:
        from edge_infer.api import is_pulled, model_path, pull

        pulled = model_path(spec) if is_pulled(spec) else pull(spec)
        hf_dir, name = pulled.hf_dir, spec
        source = pulled.manifest.get("source", {})
    else:
        known = ", ".join(sorted(REGISTRY))
        raise UsageError(f"MODEL {spec!r} is neither a folder nor a known model ({known})")
    if not (hf_dir / "config.json").is_file():
        raise UsageError(f"{hf_dir} has no config.json: not a HF model folder")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = None
    if (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return Loaded(name, hf_dir, hf, tokenizer, source)


def _unit(loaded: Loaded, unit: str, backend: str):
    if backend == "xnnpack":  # attention in float: a mask far past any raw score
        decoder = StaticDecoder(loaded.hf, "xnnpack", FLOAT_MASK_VALUE).eval()
    else:
        decoder = StaticDecoder(loaded.hf, "fused").eval()
    if unit == "decoder":
        return decoder
    return BlockUnit(decoder, 0).eval()


@dataclass
class Job:
    """One export in progress: what every step needs to feed and score the graph."""

    req: Request
    loaded: Loaded
    model: torch.nn.Module  # the unit in float, eager
    prefix: SinkPrefix | None
    length: int  # tokens per scored/calibration window
    client: object | None = None  # the AI Hub client preflight returned (aihub target)

    def windows(self, corpus: str, count: int, seed: int) -> list[torch.Tensor]:
        return token_windows(corpus, count, self.length, tokenizer=self.loaded.tokenizer,
                             vocab=self.loaded.hf.config.vocab_size, seed=seed)

    def feed(self, step, window: torch.Tensor) -> torch.Tensor:
        return run_sequence(self.model, step, self.req.shape, window, self.prefix)

    @torch.no_grad()
    def reference(self, windows) -> torch.Tensor:
        """Float eager reference: the HF model itself for the decoder (so the static wrapper
        is scored too), over prefix + window; the block in fp32 eager for the block unit."""
        if self.req.unit == "block":
            return torch.cat([self.feed(lambda a: self.model(*a), w) for w in windows], dim=1)
        outs = []
        for w in windows:
            full = w if self.prefix is None else torch.cat([self.prefix.tokens, w], dim=1)
            outs.append(self.loaded.hf(full).logits[:, full.shape[1] - w.shape[1]:])
        return torch.cat(outs, dim=1)

    @torch.no_grad()
    def score(self, step, windows, ref) -> float:
        """SQNR of what `step` (input tuple -> outputs) gives over `windows`, against `ref`."""
        return sqnr_db(ref, torch.cat([self.feed(step, w) for w in windows], dim=1))


_CHECK = object()


def run(req: Request, client=_CHECK) -> dict:
    """Export and score; `client` is preflight's result when the caller already ran it."""
    if client is _CHECK:
        client = preflight(req.target, unit=req.unit, calibration=req.calibration,
                           eval_sequences=req.eval_sequences, require_sdk=req.require_sdk)
    with records.guard().observe(f"export {req.model} {req.unit} {req.target}") as verdict:
        record = _export(req, client)
    records.stamp(record, verdict)
    (req.out / "record.json").write_text(json.dumps(records._clean(record), indent=2) + "\n")
    if req.record:
        records.append(req.record, record)
    return record


def _export(req: Request, client) -> dict:
    """The record of one export, before its provenance (run's `stamp`)."""
    target = TARGETS[req.target]
    req.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(req.model)
    model = _unit(loaded, req.unit, target.backend)
    if loaded.tokenizer is None and req.calibration_corpus != "builtin":
        log.info("%s has no tokenizer: using the builtin token stream", loaded.name)
        req.calibration_corpus = "builtin"
    prefix = None
    if req.sink_prefix:
        bos = loaded.hf.config.bos_token_id
        prefix = sink_prefix(model, 0 if bos is None else int(bos))
    job = Job(req, loaded, model, prefix, window_tokens(req.shape, prefix), client)
    eval_windows = job.windows(req.eval_corpus, req.eval_sequences, seed=1)
    ref = job.reference(eval_windows)
    record = {
        "model": loaded.name,
        "model_source": loaded.source,
        "arch": model.facts["arch"],
        "unit": req.unit,
        "target": req.target,
        "backend": target.backend,
        "scheme": target.scheme,
        "shape": {"chunk": req.shape.chunk, "context": req.shape.context},
        "sink_prefix": None if prefix is None else {
            "token_id": int(prefix.tokens[0, 0]), "computed_in": "fp32 eager, once"},
        "eval": {
            "corpus": req.eval_corpus,
            "sequences": req.eval_sequences,
            "tokens_per_sequence": job.length,
            "protocol": "carried cache: each chunk's keys/values come from the graph itself",
        },
        "calibration": None,
        "needs": None,
    }
    if req.unit == "decoder":
        wrapper = job.score(lambda a: model(*a), eval_windows, ref)
        record["wrapper_sqnr_db"] = wrapper  # the static wrapper in fp32 eager vs HF
        log.info("static decoder (fp32 eager) vs HF: %.1f dB", wrapper)
    target.exporter()(job, target, eval_windows, ref, record)
    calibrated = bool(record["calibration"] and record["calibration"]["samples"])
    goal = SQNR_TARGETS.get((req.target, calibrated))
    if goal is not None and req.unit == "decoder":
        record["target_sqnr_db"] = goal
    return record


def _artifact_name(job: Job, record: dict, suffix: str, tag: str = "") -> str:
    parts = [record["model"], job.req.unit, job.req.target, tag]
    return "-".join(p for p in parts if p) + suffix


# The targets' exporters (targets.Target.export names them): each quantizes, lowers and scores
# one job, filling `record`.


def export_xnnpack(job: Job, target: Target, eval_windows, ref, record) -> None:
    from edge_export.xnnpack.lower import (
        GRID_SMOOTH,
        SMOOTH_ALPHA,
        PteRunner,
        quantize_in_place,
        to_pte,
    )

    req, model = job.req, job.model
    t0 = time.perf_counter()
    if target.scheme == "8da4w" and req.calibration:
        if GRID_SMOOTH:
            _grid_smooth(job, record)
        elif SMOOTH_ALPHA is not None:
            _smooth(job, record)
    recipe = quantize_in_place(model, target.scheme, req.group_size)
    quantize_s = time.perf_counter() - t0
    if recipe is not None:
        record["recipe"] = recipe.as_record()
        record["eager_sqnr_db"] = job.score(lambda a: model(*a), eval_windows, ref)
        record["group_size"] = req.group_size if target.scheme == "8da4w" else None
        log.info("%s in eager: %.1f dB", target.scheme, record["eager_sqnr_db"])
    log.info("lowering to XNNPACK (minutes for a 100M+ model)")
    t1 = time.perf_counter()
    pte = req.out / _artifact_name(job, record, ".pte")
    pte.write_bytes(to_pte(model, example_inputs(model, req.shape)))
    record["export_s"] = quantize_s + time.perf_counter() - t1  # the eager scoring excluded
    record["artifact"] = pte.name
    record["size_bytes"] = pte.stat().st_size
    t2 = time.perf_counter()
    record["sqnr_db"] = job.score(PteRunner(pte), eval_windows, ref)
    record["eval_s"] = time.perf_counter() - t2
    record["measured"] = "pte"


def _smooth(job: Job, record: dict) -> None:
    """SmoothQuant scales from the float model's activations on the calibration windows,
    folded into the RMSNorms and linears before 8da4w rounds them (edge_export.smooth)."""
    from edge_export.smooth import input_absmax, smooth_in_place
    from edge_export.xnnpack.lower import SMOOTH_ALPHA

    model = job.model
    layers = _layers(model)
    windows = _calibration(job, record)
    stats = input_absmax(layers, lambda w: job.feed(lambda a: model(*a), w), windows)
    smooth_in_place(layers, stats, SMOOTH_ALPHA)
    record["smooth"] = {"alpha": SMOOTH_ALPHA, "statistic": "max |x| per input channel"}


def _layers(model) -> torch.nn.ModuleList:
    return model.layers if isinstance(model, StaticDecoder) else torch.nn.ModuleList([model.block])


def _grid_smooth(job: Job, record: dict) -> None:
    """Grid-keeping scales searched on the float model's calibration inputs, folded before
    8da4w rounds the weights (edge_export.smooth.grid_smooth)."""
    from edge_export.smooth import grid_smooth

    model = job.model
    windows = _calibration(job, record)
    record["smooth"] = grid_smooth(_layers(model), lambda w: job.feed(lambda a: model(*a), w),
                                   windows, len(windows) * job.length, job.req.group_size)


def _calibration(job: Job, record: dict) -> list[torch.Tensor]:
    req = job.req
    windows = job.windows(req.calibration_corpus, req.calibration, seed=0)
    record["calibration"] = {"corpus": req.calibration_corpus, "samples": len(windows),
                             "tokens": len(windows) * job.length}
    return windows


def export_qnn(job: Job, target: Target, eval_windows, ref, record) -> None:
    from edge_export.qnn import quantize as qnn
    from edge_export.qnn.sdk import find_sdk

    req = job.req
    calibration = _calibration(job, record)
    t0 = time.perf_counter()
    graph = qnn.quantize(job.model, req.shape, target.scheme, calibration, feed=job.feed)
    record["calibrate_s"] = time.perf_counter() - t0
    example = example_inputs(job.model, req.shape)
    t1 = time.perf_counter()
    simulated = qnn.fold_weight_dequantize(graph)  # same numbers, weights dequantized once
    record["sqnr_db"] = job.score(lambda a: simulated(*a), eval_windows, ref)
    record["eval_s"] = time.perf_counter() - t1
    record["measured"] = "simulated"
    tag = "calibrated" if calibration else "uncalibrated"
    pt2 = req.out / _artifact_name(job, record, ".pt2", tag)
    t2 = time.perf_counter()
    record["size_bytes"] = qnn.save_graph(graph, example, pt2)
    record["artifact"] = pt2.name
    sdk = find_sdk()
    if sdk.can_lower:
        log.info("lowering to a QNN context binary for %s with the SDK at %s", req.soc, sdk.root)
        try:
            blob = qnn.lower(graph, example, req.soc)
        except Exception as exc:
            raise EdgeInferError(f"{req.target}: QNN lowering with the SDK at {sdk.root} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        pte = pt2.with_suffix(".pte")
        pte.write_bytes(blob)
        record["lowered"] = {"artifact": pte.name, "size_bytes": len(blob), "soc": req.soc}
        record["needs"] = "a Snapdragon device (or --target aihub) to run the .pte"
    else:
        record["needs"] = ("QNN SDK (libQnnHtp.so, QNN_SDK_ROOT) to lower to a QNN context "
                           "binary; a device or AI Hub to run it")
    record["export_s"] = record["calibrate_s"] + (time.perf_counter() - t2)


def export_aihub(job: Job, target: Target, eval_windows, ref, record) -> None:
    from edge_export.aihub import jobs
    from edge_export.aihub.client import read_config

    req, model = job.req, job.model

    def reference_chunks(windows):
        """Every chunk's inputs as the float model produces them (reference-cache protocol)."""
        chunks = []

        def step(args):
            chunks.append(args)
            return model(*args)

        with torch.no_grad():
            for w in windows:
                job.feed(step, w)
        return {name: [c[i].numpy().copy() for c in chunks] for i, name in enumerate(INPUT_NAMES)}

    t0 = time.perf_counter()
    program = torch.export.export(model, example_inputs(model, req.shape))
    pt2 = req.out / _artifact_name(job, record, ".pt2", "fp32")
    torch.export.save(program, str(pt2))
    inputs = reference_chunks(eval_windows)
    calibration = _calibration(job, record)
    calibration_data = reference_chunks(calibration) if calibration else None
    options = req.hub_options or jobs.DEFAULT_OPTIONS
    device = req.device or jobs.DEFAULT_DEVICE
    config = read_config()
    try:
        result = jobs.run_on_device(job.client, pt2, device, inputs, req.out, options=options,
                                    calibration=calibration_data,
                                    name=f"{record['model']} export")
    except EdgeInferError as exc:
        raise EdgeInferError(config.redact(str(exc))) from None
    except Exception as exc:  # qai_hub's own errors: one line, never the token
        raise EdgeInferError(config.redact(f"AI Hub: {type(exc).__name__}: {exc}")) from None
    record["export_s"] = time.perf_counter() - t0
    logits_shape = (1, req.shape.chunk, ref.shape[-1])
    device_logits = jobs.pick_output(result.outputs, logits_shape)
    out = torch.cat([torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in device_logits],
                    dim=1)
    record["sqnr_db"] = sqnr_db(ref, out)
    record["measured"] = "device"
    record["eval"]["protocol"] = ("reference cache: each chunk's past keys/values come from the "
                                  "float model")
    record["aihub"] = {"device": device, "options": options,
                       "compile_job": result.compile_job_id,
                       "inference_job": result.inference_job_id,
                       "profile": "aihub_profile.json"}
    if result.target_model is not None and result.target_model.exists():
        record["artifact"] = result.target_model.name
        record["size_bytes"] = result.target_model.stat().st_size
    else:
        record["artifact"], record["size_bytes"] = None, None
