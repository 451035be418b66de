from pathlib import Path

import pytest

pytest_plugins = ["edge_infer.testing"]


@pytest.fixture(scope="session", autouse=True)
def edge_home(edge_home) -> Path:
    """The engine's private EDGE_INFER_HOME, for every test here: never the user's."""
    return edge_home


def build_tiny(path: Path, arch: str = "llama") -> Path:
    """A tiny random decoder of a real architecture, saved as an HF folder (no tokenizer)."""
    import torch

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", arch="qwen3")


def tiny_request(model: Path, target: str, out: Path, **kw):
    """A quick Request: builtin tokens, 8-token chunks over a 24-token window, one sequence."""
    from edge_export.decoder import StaticShape
    from edge_export.pipeline import Request

    kw.setdefault("calibration", 4)
    return Request(model=str(model), target=target, out=out, calibration_corpus="builtin",
                   eval_sequences=1, shape=StaticShape(8, 24), **kw)
