"""`edge-infer export MODEL --ablate`: which part of 8da4w loses the signal, measured in eager.

Each variant quantizes a fresh copy of the float model with torchao (no lowering: seconds
per variant, not the minutes of a .pte; the .pte row matched its eager model within 0.1 dB)
and is scored like an export row: the logits of every scored token of the eval windows
(carried cache, sink prefix unless the variant drops it) against the HF model in fp32, as
SQNR, same-top % and KL. One record per variant, `measured: "eager"`, same provenance.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch

from edge_export import records
from edge_export.decoder import (
    FLOAT_MASK_VALUE,
    StaticDecoder,
    StaticShape,
    sink_prefix,
    window_tokens,
)
from edge_export.sqnr import logit_agreement, sqnr_db
from edge_export.xnnpack.lower import Recipe, apply_recipe
from edge_infer.api import OTHER_CORPUS, UsageError, utc_now

log = logging.getLogger("edge_export")


@dataclass(frozen=True)
class Variant:
    name: str
    why: str  # what it isolates, one line of the table
    recipe: Recipe
    sink_prefix: bool = True
    smooth_alpha: float | None = None  # SmoothQuant scales from calibration statistics
    grid_smooth: bool = False  # grid-keeping scales searched on calibration inputs


def _variants() -> tuple[Variant, ...]:
    return (
        Variant("8da4w g32, head 4-bit", "torchao 8da4w on every linear (the export before)",
                Recipe(4, 32, 4, 32)),
        Variant("w4 g32 weight-only, head 4-bit", "same weights, float activations: what "
                "int8 activations cost", Recipe(4, 32, 4, 32, activations="float")),
        Variant("8da8w", "int8 weights per channel: int8 activations with near-lossless "
                "weights", Recipe(8, 0, 8, 0)),
        Variant("fp32 body, head 4-bit", "the 4-bit tied head alone", Recipe(None, 32, 4, 32)),
        Variant("8da4w g32, head fp32", "the body alone", Recipe(4, 32, None)),
        Variant("8da4w g32, head 8-bit", "head at int8 per channel", Recipe(4, 32, 8, 0)),
        Variant("8da4w g16, head 8-bit", "a smaller group (eager only: XNNPACK "
                "delegates groups that are multiples of 32)", Recipe(4, 16, 8, 0)),
        Variant("8da4w g64, head 8-bit", "a larger group", Recipe(4, 64, 8, 0)),
        # not g128: smollm2's 576 inputs are not a multiple of it; one scale per row instead
        Variant("8da4w per channel, head 8-bit", "one scale per output row",
                Recipe(4, 0, 8, 0)),
        Variant("8da4w g32, head 8-bit, no sink prefix", "the attention-sink token through "
                "the quantized graph", Recipe(4, 32, 8, 0), sink_prefix=False),
        Variant("8da4w g32, head 8-bit, smooth 0.5", "SmoothQuant scales (alpha 0.5) from "
                "calibration activations", Recipe(4, 32, 8, 0), smooth_alpha=0.5),
        Variant("8da4w g32 asymmetric, head 8-bit", "a zero point per group: the grid of a "
                "Q4_1-style checkpoint", Recipe(4, 32, 8, 0, mapping="asymmetric")),
        Variant("w4 g32 asymmetric weight-only, head 8-bit", "the same grid with float "
                "activations (the engine's W4A16-g32-zp form)",
                Recipe(4, 32, 8, 0, activations="float", mapping="asymmetric")),
        Variant("8da4w g32 float zero, head 8-bit", "a float offset per group, as Q4_1, "
                "carried by a linear over group sums: the checkpoint's own grid",
                Recipe(4, 32, 8, 0, mapping="float-zero")),
        Variant("w4 g32 float zero weight-only, head 8-bit", "the same with float "
                "activations: what the int8 activations cost on that grid",
                Recipe(4, 32, 8, 0, activations="float", mapping="float-zero")),
        Variant("8da4w g32 float zero, head fp32", "that grid, without the head's 8 bits",
                Recipe(4, 32, None, mapping="float-zero")),
        Variant("8da4w g32 float zero, head 8-bit, smooth 0.5", "SmoothQuant before the "
                "split: kinder int8 activations, the grid lost",
                Recipe(4, 32, 8, 0, mapping="float-zero"), smooth_alpha=0.5),
        Variant("8da4w g32 float zero, head 8-bit, grid-keeping scales", "one scale per "
                "group of 32 inputs, searched per layer on calibration inputs: kinder int8 "
                "activations, the grid kept (the export's default)",
                Recipe(4, 32, 8, 0, mapping="float-zero"), grid_smooth=True),
        Variant("8da4w g32 float zero, head fp32, grid-keeping scales", "the same without "
                "the head's 8 bits", Recipe(4, 32, None, mapping="float-zero"),
                grid_smooth=True),
    )


VARIANTS = {v.name: v for v in _variants()}


@dataclass
class _Scored:
    """The eval windows and float reference for one sink-prefix setting."""

    prefix: object
    length: int
    windows: list[torch.Tensor]
    ref: torch.Tensor


def _static(hf) -> StaticDecoder:
    return StaticDecoder(hf, "xnnpack", FLOAT_MASK_VALUE).eval()


def ablate(model_spec: str, variants: list[str] | None = None, *, eval_sequences: int = 4,
           calibration: int = 16, calibration_corpus: str = "lee",
           shape: StaticShape | None = None, record_path=None) -> list[dict]:
    """Score each variant (default: all of VARIANTS); returns the records (appended to
    `record_path` too, one at a time, as each finishes)."""
    from edge_export.decoder import run_sequence
    from edge_export.pipeline import load_model
    from edge_export.smooth import grid_smooth, input_absmax, smooth_in_place
    from edge_infer.api import token_windows

    names = list(VARIANTS) if not variants else variants
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant(s) {unknown}; known: {'; '.join(VARIANTS)}")
    shape = shape or StaticShape()
    loaded = load_model(model_spec)
    hf = loaded.hf
    if loaded.tokenizer is None:
        calibration_corpus = "builtin"
    eval_corpus = OTHER_CORPUS[calibration_corpus]
    bos = hf.config.bos_token_id
    float_model = _static(hf)

    def windows(corpus, count, length, seed):
        return token_windows(corpus, count, length, tokenizer=loaded.tokenizer,
                             vocab=hf.config.vocab_size, seed=seed)

    scored: dict[bool, _Scored] = {}

    @torch.no_grad()
    def setting(with_prefix: bool) -> _Scored:
        if with_prefix not in scored:
            prefix = sink_prefix(float_model, 0 if bos is None else int(bos)) \
                if with_prefix else None
            length = window_tokens(shape, prefix)
            ws = windows(eval_corpus, eval_sequences, length, seed=1)
            refs = []
            for w in ws:
                full = w if prefix is None else torch.cat([prefix.tokens, w], dim=1)
                refs.append(hf(full).logits[:, full.shape[1] - w.shape[1]:])
            scored[with_prefix] = _Scored(prefix, length, ws, torch.cat(refs, dim=1))
        return scored[with_prefix]

    # provenance once, before the first row is appended: each append dirties the results file
    # itself, which must not mark the later rows of the same run "-dirty"
    provenance = records.stamp({})
    guard = records.guard()
    out = []
    for name in names:
        v = VARIANTS[name]
        s = setting(v.sink_prefix)
        with guard.observe(f"8da4w ablation {name}") as verdict:
            t0 = time.perf_counter()
            model = _static(copy.deepcopy(hf))
            smooth = None
            if v.smooth_alpha is not None:
                cal = windows(calibration_corpus, calibration, s.length, seed=0)
                stats = input_absmax(model.layers, lambda w, m=model, p=s.prefix: run_sequence(
                    m, lambda a: m(*a), shape, w, p), cal)
                smooth_in_place(model.layers, stats, v.smooth_alpha)
                smooth = {"alpha": v.smooth_alpha, "statistic": "max |x| per input channel",
                          "corpus": calibration_corpus, "samples": len(cal),
                          "tokens": len(cal) * s.length}
            if v.grid_smooth:
                cal = windows(calibration_corpus, calibration, s.length, seed=0)
                facts = grid_smooth(model.layers, lambda w, m=model, p=s.prefix: run_sequence(
                    m, lambda a: m(*a), shape, w, p), cal, len(cal) * s.length,
                    v.recipe.group_size)
                smooth = {**facts, "corpus": calibration_corpus, "samples": len(cal),
                          "tokens": len(cal) * s.length}
            apply_recipe(model, v.recipe)
            quantize_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            with torch.no_grad():
                logits = torch.cat([run_sequence(model, lambda a, m=model: m(*a), shape, w, s.prefix)
                                    for w in s.windows], dim=1)
            eval_s = time.perf_counter() - t1
        record = {
            "model": loaded.name,
            "model_source": loaded.source,
            "arch": float_model.facts["arch"],
            "unit": "decoder",
            "target": "xnnpack-8da4w",
            "backend": "xnnpack",
            "scheme": "8da4w",
            "variant": name,
            "variant_why": v.why,
            "recipe": v.recipe.as_record(),
            "group_size": v.recipe.group_size,
            "smooth": smooth,
            "shape": {"chunk": shape.chunk, "context": shape.context},
            "sink_prefix": None if s.prefix is None else {
                "token_id": int(s.prefix.tokens[0, 0]), "computed_in": "fp32 eager, once"},
            "eval": {"corpus": eval_corpus, "sequences": eval_sequences,
                     "tokens_per_sequence": s.length,
                     "protocol": "carried cache: each chunk's keys/values come from the "
                                 "graph itself"},
            "calibration": None,
            "needs": None,
            "measured": "eager",
            "sqnr_db": sqnr_db(s.ref, logits),
            **logit_agreement(s.ref, logits),
            "export_s": quantize_s,
            "eval_s": eval_s,
            "artifact": None,
            "size_bytes": None,
        }
        record.update(provenance, created=utc_now(), **verdict.fields())
        log.info("%s: SQNR %.2f dB, same top %.2f%%, KL %.4f", name, record["sqnr_db"],
                 record["same_top_pct"], record["kl_mean"])
        if record_path is not None:
            records.append(record_path, record)
        out.append(record)
        del model
    return out
