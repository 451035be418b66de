"""`edge-infer bench batched`: a decode step's time against the sequences decoded together.

What continuous batching buys is how little a step of B sequences costs over a step of one.
Per engine, one build is loaded in a pinned child (as `bench run` loads it). For each batch size
B it decodes B sequences together for n steps after a 1-token prompt each, r times, under the
contention guard; a record holds the time per step in ms:
- ours (`ours:QUANT`): vLLM admitting B sequences per step (max_num_seqs = the largest B), the
  median over the sequences of last - first token time, / n (the runner's `batched`);
- llama.cpp (`llama-bench:QUANT`): its own `llama-batched-bench`, built with llama-bench from
  the same sdist, on the same GGUF: `-npp 1 -ntg n -npl B`, its t_tg / n. The tool's JSONL
  entry of each repetition goes into the record.
Ratios are formed within one engine and one run: step(B) / step(1).
"""

from __future__ import annotations

from edge_harness.isolation.child import Worker
from edge_harness.runners import get_runner, locate, runners
from edge_infer.api import UsageError

STEPS = "edge_harness.bench.batched:steps"


def steps(runner, n: int, batch: int, seed: int) -> dict:
    """In the child: n decode steps of `batch` sequences on the loaded build."""
    seconds = runner.batched(n, seed, batch)
    return {"seconds": seconds, "extra": getattr(runner, "last_extra", None)}


def run(model_name: str, specs: list, batches: list[int], n: int, reps: int, cores: list[int], *,
        guard, emit, record, say=print) -> None:
    """Every engine spec (bench run's ENGINE:QUANT) at every batch size; one record each."""
    from edge_harness.bench.run import resolve_model

    if not batches or min(batches) < 1:
        raise UsageError(f"--batches must be sizes of at least 1, got {batches}")
    if n < 1 or reps < 1:
        raise UsageError(f"-n and -r must be at least 1, got {n} and {reps}")
    for spec in specs:  # refuse before anything is loaded
        if not hasattr(get_runner(spec.engine), "batched"):
            having = sorted(name for name, r in runners().items() if hasattr(r, "batched"))
            raise UsageError(f"bench batched: {spec.engine} cannot decode several sequences per "
                             f"step here; engines that can: {', '.join(having)}")
    model = resolve_model(model_name)
    threads = len(cores)
    for spec in specs:
        runner = get_runner(spec.engine)
        build = runner.prepare(model, spec.quant)
        options = {**dict(spec.options), "max_num_seqs": max(batches)}
        build = type(build)(**{**build.to_dict(), "options": options})
        engine = getattr(runner, "batched_engine", spec.engine)
        say(f"batched {model.name} {engine}:{spec.quant}: batches {batches}, tg{n} x {reps} "
            f"on cores {cores}")
        with Worker(cores, runner.child_env(cores, threads, options),
                    label=f"batched-{model.name}-{spec.engine}") as w:
            facts = w.request("load", engine=locate(runner), build=build.to_dict(),
                              threads=threads, n_ctx=n + 16)["facts"]
            w.request("on_runner", fn=STEPS, kwargs={"n": min(n, 8), "batch": max(batches),
                                                     "seed": 999})  # warm-up, untimed
            for b in sorted(set(batches)):
                verdict = guard.verdict()
                seconds, per_rep = [], []
                for rep in range(reps):
                    what = f"batched decode of {model.name} {engine}:{spec.quant}, batch {b}"
                    res = guard.measure(w.pid, what, verdict, w.request, "on_runner", fn=STEPS,
                                        kwargs={"n": n, "batch": b, "seed": rep},
                                        say=say)["result"]
                    seconds.append(res["seconds"])
                    if res.get("extra"):
                        per_rep.append(res["extra"])
                rec = record(
                    engine=engine, engine_version=facts["version"], model=model.name,
                    quant=spec.quant, test=f"batched_b{b}_tg{n}",
                    samples=[s / n * 1e3 for s in seconds], unit="ms/step", n_gen=n,
                    threads=threads, cores=cores, **verdict.fields(),
                    extra={"batch": b, "seconds": seconds, "facts": facts, "options": options,
                           **({"repetitions": per_rep} if per_rep else {})})
                emit(rec)
                say(f"batched {model.name} {engine}:{spec.quant} batch {b}: "
                    f"{rec.median:.2f} ms per step ({min(rec.samples):.2f}-{max(rec.samples):.2f})")
