"""The runner protocol (runners/base.py) is everything a runner does: bench run, fidelity and
the pinned child ask a runner only through it, so a new engine is one file. Proved with the
torch runner scoring a tiny model, and with a fourth runner defined here."""

import json
import os
from functools import partial
from pathlib import Path

import pytest

from edge_harness.bench.run import parse_engine
from edge_harness.fidelity import chunks as chunks_mod
from edge_harness.fidelity import score
from edge_harness.fidelity.chunks import make_chunks
from edge_harness.fidelity.metrics import KLAccumulator
from edge_harness.fidelity.run import FidelityPlan, FidelityRun
from edge_harness.runners import get_runner, runners
from edge_harness.runners.base import Build, ModelRef, missing
from edge_infer.api import UsageError, physical_cores

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 40


@pytest.mark.parametrize("engine", sorted(runners()))
def test_every_runner_declares_what_it_can_do(engine):
    cls = runners()[engine]
    for attr in ("full_precision", "profiler", "accepts"):  # its own, not inherited by accident
        assert attr in vars(cls), f"{engine} does not declare {attr}"
    assert missing(cls) == []
    if cls.full_precision is not None:
        assert cls.accepts(cls.full_precision)


def test_fidelity_refuses_a_runner_that_only_times():
    run = FidelityRun(FidelityPlan(models=["smollm2-135m"], builds=[parse_engine("llama-bench:q4_0")]))
    with pytest.raises(UsageError) as err:
        run.run()
    msg = str(err.value)
    assert "\n" not in msg and "llama-bench only times pp/tg" in msg and "llama.cpp" in msg


def test_an_incomplete_runner_is_refused_by_name():
    with pytest.raises(UsageError, match="lacks Scorer.logprobs, Scorer.greedy"):
        get_runner(f"{__name__}:HalfScorer")


# -- the torch runner scores a tiny model in this process (seconds) --------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> ModelRef:
    """A 2-layer random Llama in bf16 with the tiny BPE tokenizer: an HF folder like any other."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edge_infer.testing import tiny_bpe_tokenizer

    root = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_bpe_tokenizer(root)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root)
    return ModelRef("tiny-llama", root)


def test_torch_runner_scores_through_fidelity(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(chunks_mod, "corpus_text", lambda name: TEXT)
    torch_runner = get_runner("torch")
    chunks = make_chunks(partial(torch_runner.tokenize, tiny_llama), "lee", 32, 2)
    assert all(len(ids) == 32 for ids in chunks.ids)

    def loaded(quant: str):
        runner = torch_runner()
        runner.load(torch_runner.prepare(tiny_llama, quant), threads=1, n_ctx=64)
        return runner

    def scored(runner) -> dict:
        acc = KLAccumulator()
        acc.extend(score.compare(runner, tmp_path, "lee", chunks.ids, chunks.first))
        return acc.summary()

    base = loaded(torch_runner.full_precision)
    info = score.write_base(base, tmp_path, "lee", chunks.ids, chunks.first)
    assert info["rows"] == chunks.rows and info["vocab"] == tiny_llama.config["vocab_size"]
    itself = scored(base)
    assert itself["kl_mean"] < 1e-6 and itself["same_top_pct"] == 100.0
    prompt = chunks.ids[0][:8]
    (greedy,) = score.greedy(base, [prompt], 5)
    assert len(greedy) == 5
    assert greedy[0] == int(base.logprobs(prompt + [0], len(prompt) - 1)[0].argmax())

    fp32 = scored(loaded("fp32"))  # bf16 compute against fp32: close, not identical
    assert 0 < fp32["kl_mean"] < 0.05 and fp32["same_top_pct"] > 80


# -- a fourth runner, defined here: bench run and fidelity take it as package.module:Class ----
class FakeRunner:
    """A bigram 'engine' over a seeded table: quant 'noisy' perturbs the table."""

    name = "fake"
    quants = ("fp32", "noisy")
    full_precision = "fp32"
    profiler = False

    @classmethod
    def accepts(cls, quant: str) -> bool:
        return quant in cls.quants

    @classmethod
    def tokenize(cls, model: ModelRef, text: str) -> tuple[list[int], int | None]:
        return [0] + [b % model.token_range for b in text.encode()], 0

    @classmethod
    def prepare(cls, model: ModelRef, quant: str) -> Build:
        return Build(cls.name, model.name, quant, str(model.hf_dir), 32.0 if quant == "fp32" else 4.0,
                     1000, model.token_range)

    @classmethod
    def child_env(cls, cores: list[int], threads: int, options: dict) -> dict[str, str]:
        return {}

    def load(self, build: Build, threads: int, n_ctx: int) -> dict:
        import torch

        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(build.token_range, build.token_range, generator=gen)
        if build.quant == "noisy":
            self.table += 0.3 * torch.randn(self.table.shape, generator=gen)
        return {"version": "fake 1", "threads": threads, "prefix_caching": False}

    def pp(self, n: int, seed: int) -> float:
        return 1e-3

    def tg(self, n: int, seed: int) -> float:
        return 1e-3

    def logprobs(self, ids: list[int], first: int):
        return self.table[ids[first:-1]].log_softmax(-1)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = [ids[-1]]
        for _ in range(n):
            out.append(int(self.table[out[-1]].argmax()))
        return out[1:]

    def close(self) -> None:
        pass


# declares a full-precision build, but computes neither log-probs nor greedy tokens
HalfScorer = type("HalfScorer", (), {k: v for k, v in vars(FakeRunner).items()
                                     if k not in ("logprobs", "greedy")})


def test_a_fourth_runner_needs_no_edit_elsewhere(tmp_path, edge_home, monkeypatch):
    engine = f"{__name__}:FakeRunner"
    assert parse_engine(f"{engine}:noisy").quant == "noisy"
    with pytest.raises(UsageError, match="offers fp32, noisy"):
        parse_engine(f"{engine}:int3")

    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64}))
    monkeypatch.setattr(chunks_mod, "corpus_text", lambda name: TEXT)
    # the pinned child imports this module by name, as it would any adapter's
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    plan = FidelityPlan(models=[str(folder)], builds=[parse_engine(f"{engine}:noisy")],
                        corpora=["lee"], chunks=2, n_ctx=16, prompts=0,
                        cores=str(physical_cores()[0]))
    (rec,) = FidelityRun(plan).run()  # two pinned children: the fp32 base, then noisy
    assert (rec["engine"], rec["quant"], rec["base"]) == ("fake", "noisy", "fake:fp32")
    assert rec["engine_version"] == "fake 1" and rec["positions"] == 2 * (16 - 1 - 8)
    assert rec["kl_mean"] > 1e-3 and rec["same_top_pct"] < 100
