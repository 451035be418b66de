"""The exported unit: a static-KV-cache decoder over HF weights, scored against HF itself."""

import pytest
import torch

from edge_export.decoder import (
    FLOAT_MASK_VALUE,
    MASK_VALUE,
    BlockUnit,
    StaticDecoder,
    StaticShape,
    example_inputs,
    run_sequence,
    sink_prefix,
    window_tokens,
)
from edge_export.sqnr import sqnr_db
from edge_infer.errors import UsageError


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("norm_form", ["fused", "xnnpack"])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen3"])
def test_static_decoder_matches_hf(request, which, norm_form):
    hf = _hf(request.getfixturevalue(which))
    model = StaticDecoder(hf, norm_form).eval()
    shape = StaticShape(8, 32)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = run_sequence(model, lambda a: model(*a), shape, tokens)
    # three chunks: the second and third read the cache the first ones wrote
    assert out.shape == ref.shape
    assert sqnr_db(ref, out) > 100


def test_float_mask_holds_where_masked_scores_tower_over_the_allowed(tiny_llama):
    """Raw scores ~100s apart (qwen2.5's q/k biases do this): -64 lets masked keys through,
    the float graphs' mask does not."""
    hf = _hf(tiny_llama)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    shape = StaticShape(8, 24)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(6))
    scores = {}
    with torch.no_grad():
        ref = hf(tokens).logits
        for value in (MASK_VALUE, FLOAT_MASK_VALUE):
            model = StaticDecoder(hf, "xnnpack", value).eval()
            assert example_inputs(model, shape)[3].min() == value
            scores[value] = sqnr_db(ref, run_sequence(model, lambda a, m=model: m(*a), shape,
                                                      tokens))
    assert scores[FLOAT_MASK_VALUE] > 100
    assert scores[MASK_VALUE] < 60


def test_sink_prefix_is_the_first_token(tiny_llama):
    """Windows fed after the fp32 prefix cache equal HF over [bos] + window."""
    hf = _hf(tiny_llama)
    model = StaticDecoder(hf).eval()
    shape = StaticShape(8, 24)
    prefix = sink_prefix(model, 5)
    assert window_tokens(shape, prefix) == 16 and window_tokens(shape, None) == 24
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(torch.cat([torch.tensor([[5]]), tokens], dim=1)).logits[:, 1:]
        out = run_sequence(model, lambda a: model(*a), shape, tokens, prefix)
        without = run_sequence(model, lambda a: model(*a), shape, tokens)
    assert sqnr_db(ref, out) > 100
    assert sqnr_db(ref, without) < 40  # the prefix really is in the cache


def test_cache_is_really_used(tiny_llama):
    """With the past cache zeroed, later chunks must come out different (not a no-op input)."""
    hf = _hf(tiny_llama)
    model = StaticDecoder(hf).eval()
    shape = StaticShape(8, 16)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(tokens).logits

        def forgetful(args):
            return model(*args[:4], torch.zeros_like(args[4]), torch.zeros_like(args[5]))

        out = run_sequence(model, forgetful, shape, tokens)
    assert sqnr_db(ref[:, :8], out[:, :8]) > 100  # first chunk has no past anyway
    assert sqnr_db(ref[:, 8:], out[:, 8:]) < 40


def test_inputs_are_static_and_finite(tiny_llama):
    model = StaticDecoder(_hf(tiny_llama))
    tokens, cos, sin, mask, k_past, v_past = example_inputs(model, StaticShape(8, 24))
    assert tokens.dtype == torch.int32 and tokens.shape == (1, 8)
    assert cos.shape == sin.shape == (8, 16)
    assert mask.shape == (8, 24)
    assert torch.isfinite(mask).all() and mask.min() == MASK_VALUE and mask.max() == 0
    assert k_past.shape == v_past.shape == (2, 2, 16, 16)


def test_block_unit_shapes(tiny_llama):
    decoder = StaticDecoder(_hf(tiny_llama))
    block = BlockUnit(decoder)
    args = example_inputs(block, StaticShape(8, 24))
    assert args[0].shape == (1, 8, 64) and args[4].shape == (1, 2, 16, 16)
    with torch.no_grad():
        hidden, k, v = block(*args)
    assert hidden.shape == (1, 8, 64) and k.shape == v.shape == (1, 2, 8, 16)


def test_unsupported_architecture_is_refused():
    class Fake(torch.nn.Module):
        class config:
            architectures = ["GPT2LMHeadModel"]

    with pytest.raises(UsageError, match="GPT2LMHeadModel"):
        StaticDecoder(Fake())
