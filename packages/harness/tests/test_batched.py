"""bench batched: llama-batched-bench's invocation and output, and refusals (the measuring
loop's guard fields are checked with the other record kinds in test_guard.py)."""

import json

import pytest

from edge_harness.bench import batched
from edge_harness.bench.llama_tools import batched_bench_args, parse_batched_bench
from edge_harness.bench.run import EngineSpec
from edge_infer.api import EdgeInferError, UsageError


def entry(pl: int, tg: int = 32, t_tg: float = 0.8, threads: int = 2) -> str:
    return json.dumps({"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1,
                       "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": threads,
                       "n_threads_batch": threads, "pp": 1, "tg": tg, "pl": pl,
                       "n_kv": pl * (tg + 1), "t_pp": 0.01, "speed_pp": 100.0, "t_tg": t_tg,
                       "speed_tg": pl * tg / t_tg if t_tg else 0.0, "t": t_tg + 0.01, "speed": 1.0})


def test_batched_bench_decodes_the_asked_batch_from_a_one_token_prompt():
    args = batched_bench_args("/bin/llama-batched-bench", "m.gguf", 32, 8, 2)
    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert flag("-npp") == "1" and flag("-ntg") == "32" and flag("-npl") == "8"
    assert flag("-t") == "2" and flag("--output-format") == "jsonl"
    # a unified KV cache large enough for every sequence's tokens
    assert "-kvu" in args and int(flag("-c")) >= 8 * 33


def test_parse_takes_the_one_entry_of_the_asked_batch():
    out = "main: n_kv_max = 4096\n" + entry(4, t_tg=0.5) + "\n" + entry(8) + "\n"
    assert parse_batched_bench(out, 32, 8, 2)["t_tg"] == 0.8
    assert parse_batched_bench(out, 32, 4, 2)["t_tg"] == 0.5
    with pytest.raises(EdgeInferError, match="0 entries for tg 32, pl 16"):
        parse_batched_bench(out, 32, 16, 2)
    with pytest.raises(EdgeInferError, match="ran 1 threads"):
        parse_batched_bench(entry(8, threads=1), 32, 8, 2)
    with pytest.raises(EdgeInferError, match="no positive t_tg"):
        parse_batched_bench(entry(8, t_tg=0.0), 32, 8, 2)


def test_engines_that_cannot_batch_and_bad_sizes_are_refused_before_loading():
    kw = {"guard": None, "emit": None, "record": None, "say": lambda s: None}
    with pytest.raises(UsageError, match="llama.cpp cannot decode several.*ours"):
        batched.run("smollm2-135m", [EngineSpec("llama.cpp", "q4_k_m")], [1, 8], 32, 3, [0], **kw)
    with pytest.raises(UsageError, match="at least 1"):
        batched.run("smollm2-135m", [EngineSpec("ours", "w4a8")], [0, 8], 32, 3, [0], **kw)
    with pytest.raises(UsageError, match="-n and -r"):
        batched.run("smollm2-135m", [EngineSpec("ours", "w4a8")], [1], 0, 3, [0], **kw)
