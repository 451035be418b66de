"""The 8da4w recipes, SmoothQuant folding, the logit metrics and the eager ablation, on a tiny
random model (seconds)."""

import json

import pytest
import torch

from conftest import build_tiny
from edge_export import records
from edge_export.sqnr import logit_agreement
from edge_export.xnnpack.lower import (
    HEAD_BITS,
    Recipe,
    ZeroShifted,
    apply_recipe,
    scheme_recipe,
    shift_to_float_zero,
)
from edge_infer.api import missing_provenance


def _decoder(path):
    from transformers import AutoModelForCausalLM

    from edge_export.decoder import StaticDecoder

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, StaticDecoder(hf, "xnnpack").eval()


def _dequantized(linear) -> torch.Tensor:
    w = linear.weight
    return (w.dequantize() if hasattr(w, "dequantize") else w).detach().float()


def _max_levels_per_group(w: torch.Tensor, group: int) -> int:
    groups = w.reshape(-1, group)
    return max(len(torch.unique(g)) for g in groups)


def test_8da4w_default_keeps_the_head_at_8_bits():
    recipe = scheme_recipe("8da4w", 32)
    assert (recipe.body_bits, recipe.group_size, recipe.head_bits) == (4, 32, HEAD_BITS)
    assert HEAD_BITS == 8 and recipe.head_group_size == 0 and recipe.activations == "int8"
    assert scheme_recipe("8da4w", 64, head_bits=4).head_bits == 4
    with pytest.raises(ValueError, match="unknown XNNPACK scheme"):
        scheme_recipe("w4a16", 32)


@pytest.mark.parametrize("kw", [dict(body_bits=9), dict(head_bits=0),
                                dict(activations="int4"), dict(group_size=-1),
                                dict(mapping="nf4"), dict(group_size=0, mapping="float-zero")])
def test_recipe_refuses_what_cannot_run(kw):
    with pytest.raises(ValueError):
        Recipe(**kw)


def test_apply_recipe_quantizes_body_and_head_as_told(tiny_llama):
    hf, model = _decoder(tiny_llama)
    embed_before = model.embed_tokens.weight.detach().clone()
    apply_recipe(model, Recipe(4, 32, 8, 0))
    # body: int4 in groups of 32 -> at most 16 levels per group
    assert _max_levels_per_group(_dequantized(model.layers[0].q_proj), 32) <= 16
    assert _max_levels_per_group(_dequantized(model.layers[1].mlp.down_proj), 32) <= 16
    # head: int8 per row -> more than 16 levels in some group of 32, at most 256 per row
    head = _dequantized(model.lm_head)
    assert _max_levels_per_group(head, 32) > 16
    assert max(len(torch.unique(row)) for row in head) <= 256
    # the tied embedding is left fp32 and unchanged
    assert torch.equal(model.embed_tokens.weight.detach(), embed_before)


def _q4_1_linear(out=48, inp=128, group=32, seed=0) -> torch.nn.Linear:
    """A linear whose weights sit on a Q4_1 grid: per group of 32 inputs, d q + m with codes
    0..15 (both ends used), a float step d and a float minimum m."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp // group, group), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    step = torch.rand(out, inp // group, 1, generator=g) * 0.02 + 0.001
    low = torch.randn(out, inp // group, 1, generator=g) * 0.05 - 8 * step
    linear = torch.nn.Linear(inp, out, bias=False)
    linear.weight.data = (codes * step + low).flatten(1)
    return linear


def test_float_zero_split_is_exact_in_float():
    linear = _q4_1_linear()
    x = torch.randn(5, 128)
    want = linear(x)
    shifted = shift_to_float_zero(linear, 4, 32)
    assert isinstance(shifted, ZeroShifted) and shifted.offsets.shape == (48, 4)
    torch.testing.assert_close(shifted(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of the group"):
        shift_to_float_zero(torch.nn.Linear(40, 8), 4, 32)


def test_float_zero_keeps_a_q4_1_grid_that_symmetric_rounding_loses():
    x = torch.randn(7, 128)
    errors = {}
    for mapping in ("float-zero", "symmetric", "asymmetric"):
        model = torch.nn.Sequential(_q4_1_linear())
        want = model(x)
        apply_recipe(model, Recipe(4, 32, None, activations="float", mapping=mapping))
        errors[mapping] = ((model(x) - want).norm() / want.norm()).item()
    # the checkpoint's own codes come back: exact to float rounding
    assert errors["float-zero"] < 1e-5
    # torchao's symmetric and integer-zero grids round each weight a second time
    assert errors["symmetric"] > 1e-2 and errors["asymmetric"] > 1e-2


def test_head_none_leaves_the_head_float(tiny_llama):
    _, model = _decoder(tiny_llama)
    before = model.lm_head.weight.detach().clone()
    apply_recipe(model, Recipe(4, 32, None, activations="float"))
    assert torch.equal(_dequantized(model.lm_head), before)
    assert _max_levels_per_group(_dequantized(model.layers[0].o_proj), 32) <= 16


def _outlier_decoder(path):
    """The tiny decoder with one outlier input channel (as real models have), 16 tokens, and
    `run(window)` through it: what the smoothing tests fold scales into."""
    from edge_export.decoder import StaticShape, run_sequence

    _, model = _decoder(path)
    shape = StaticShape(8, 24)
    with torch.no_grad():
        model.layers[0].input_layernorm.weight[3] = 40.0
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(w):
        return run_sequence(model, lambda a: model(*a), shape, w)

    return model, tokens, run


def test_smoothing_is_exact_in_float_and_evens_out_the_activations(tiny_llama):
    from edge_export.smooth import input_absmax, smooth_in_place

    model, tokens, run = _outlier_decoder(tiny_llama)
    with torch.no_grad():
        before = run(tokens)
    stats = input_absmax(model.layers, run, [tokens])
    assert len(stats) == 2 and stats[0]["input_layernorm"].shape == (64,)
    assert int(stats[0]["input_layernorm"].argmax()) == 3
    smooth_in_place(model.layers, stats, alpha=0.5)
    with torch.no_grad():
        after = run(tokens)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    smoothed = input_absmax(model.layers, run, [tokens])[0]["input_layernorm"]
    # the outlier channel's share of the range shrank
    assert smoothed.max() / smoothed.median() < stats[0]["input_layernorm"].max() / \
        stats[0]["input_layernorm"].median()


def test_grid_keeping_scales_keep_a_q4_1_grid_that_per_channel_scales_lose():
    from edge_export.smooth import group_scales, smooth_scales

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x[:, 37] *= 30.0  # an outlier input channel
    errors = {}
    for form in ("grid", "per-channel"):
        linear = _q4_1_linear()
        if form == "grid":
            s, _, _ = group_scales(x, linear.weight.detach(), 32)
            assert torch.equal(s.view(-1, 32), s.view(-1, 32)[:, :1].expand(-1, 32))
        else:
            s = smooth_scales(x.abs().amax(0), [linear.weight.detach()], 0.5)
        with torch.no_grad():
            linear.weight.mul_(s)
        model = torch.nn.Sequential(linear)
        want = model(x / s)
        apply_recipe(model, Recipe(4, 32, None, activations="float", mapping="float-zero"))
        errors[form] = ((model(x / s) - want).norm() / want.norm()).item()
    assert errors["grid"] < 1e-5  # the scaled group is still d' q + min': same codes
    assert errors["per-channel"] > 1e-2


def test_group_scales_never_lose_to_none_and_calm_an_outlier_group():
    from edge_export.smooth import CANDIDATES, fake_int8_per_token, group_scales

    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 96, generator=g)
    w = torch.randn(40, 96, generator=g)
    _, calm, _ = group_scales(x, w, 32)
    assert CANDIDATES[0] == (0.0, 0.0) and min(calm) <= calm[0]
    x[:, 5] *= 50.0
    s, errors, pick = group_scales(x, w, 32)
    assert errors[pick] == min(errors)
    assert min(errors) < 0.7 * errors[0]  # the outlier group scaled down pays off (~0.51)
    assert s[5] > s[40] and s[5] > s[70]
    # the fake quantizer is int8: at most 256 levels per row, and exact on those levels
    q = fake_int8_per_token(x[:4])
    assert all(len(torch.unique(row)) <= 256 for row in q)
    torch.testing.assert_close(fake_int8_per_token(q), q)
    with pytest.raises(ValueError, match="multiple of the group"):
        group_scales(x[:, :40], w[:, :40], 32)


def test_grid_keeping_scales_are_exact_in_float(tiny_llama):
    from edge_export.smooth import GRID_SITES, grid_smooth_in_place, input_samples

    model, tokens, run = _outlier_decoder(tiny_llama)
    with torch.no_grad():
        before = run(tokens)
    samples = input_samples(model.layers, run, [tokens], stride=2)
    assert len(samples) == 2 and len(samples[0]) == len(GRID_SITES)
    assert samples[0][0].shape == (8, 64)  # 16 rows, every second kept
    chosen = grid_smooth_in_place(model.layers, samples, 32)
    assert len(chosen) == 2 * len(GRID_SITES)
    assert all(c["error"] <= c["error_unscaled"] for c in chosen)
    with torch.no_grad():
        after = run(tokens)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_smooth_scales_limits():
    from edge_export.smooth import smooth_scales

    act = torch.tensor([1.0, 4.0, 16.0])
    w = [torch.tensor([[2.0, 1.0, 0.5]]), torch.tensor([[-4.0, 0.1, 0.1]])]
    torch.testing.assert_close(smooth_scales(act, w, 1.0), act)
    torch.testing.assert_close(smooth_scales(act, w, 0.0), 1.0 / torch.tensor([4.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match="alpha"):
        smooth_scales(act, w, 1.5)


def test_logit_agreement():
    ref = torch.tensor([[[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])
    same = logit_agreement(ref, ref.clone())
    assert same["same_top_pct"] == 100.0 and same["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    flipped = ref.clone()
    flipped[0, 1] = torch.tensor([0.0, 0.0, 2.0])  # second position's argmax moves
    out = logit_agreement(ref, flipped)
    assert out["same_top_pct"] == 50.0
    p = torch.softmax(torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64), 0)
    q = torch.softmax(torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64), 0)
    assert out["kl_mean"] == pytest.approx(float((p * (p.log() - q.log())).sum()) / 2)
    with pytest.raises(ValueError, match="shapes differ"):
        logit_agreement(ref, ref[:, :1])


def test_ablate_writes_one_eager_record_per_variant(tiny_llama, tmp_path):
    from edge_export.ablate import ablate
    from edge_export.decoder import StaticShape

    path = tmp_path / "export.jsonl"
    names = ["8da4w g32, head 4-bit", "fp32 body, head 4-bit",
             "8da4w g32, head 8-bit, no sink prefix", "8da4w g32, head 8-bit, smooth 0.5",
             "8da4w g32 float zero, head 8-bit, grid-keeping scales"]
    rows = ablate(str(tiny_llama), names, eval_sequences=1, calibration=2,
                  shape=StaticShape(8, 24), record_path=path)
    saved = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["variant"] for r in saved] == names
    # one provenance for the run: appending its own rows does not make the later ones dirty
    assert len({r["git_commit"] for r in saved}) == 1
    for r in rows:
        assert r["measured"] == "eager" and r["target"] == "xnnpack-8da4w"
        assert 0.0 <= r["same_top_pct"] <= 100.0 and r["kl_mean"] > 0
        assert 0 < r["sqnr_db"] < 100  # quantized: finite, and not the float model
        for key in ("versions", "machine", "git_commit", "recipe", "eval", "created"):
            assert key in r
        # each variant's times were observed by the guard, and the record says so
        assert missing_provenance(r) == [] and r["guard"] in ("ok", "contended")
    by = {r["variant"]: r for r in rows}
    assert by[names[2]]["sink_prefix"] is None and by[names[0]]["sink_prefix"]["token_id"] == 1
    assert by[names[2]]["eval"]["tokens_per_sequence"] == 24  # no prefix: the whole window
    assert by[names[3]]["smooth"]["alpha"] == 0.5 and by[names[3]]["smooth"]["samples"] == 2
    assert by[names[1]]["recipe"]["body_bits"] is None
    grid = by[names[4]]["smooth"]
    assert grid["form"].startswith("grid-keeping") and grid["samples"] == 2
    assert grid["local_error_mean"] <= grid["local_error_unscaled_mean"]
    # the ablation rows render in their own table and never replace an export row
    pte = dict(saved[0], variant=None, measured="pte", sqnr_db=9.0, size_bytes=2**20,
               export_s=5.0, artifact="m.pte")
    md = records.render_markdown([pte, *saved])
    assert "## 8da4w ablation, in eager" in md
    assert "| 8da4w g32, head 8-bit, smooth 0.5 |" in md
    assert "| xnnpack-8da4w | n/a (dynamic) | 9.0 | pte |" in md


def test_ablate_refuses_an_unknown_variant(tiny_llama):
    from edge_export.ablate import ablate
    from edge_infer.errors import UsageError

    with pytest.raises(UsageError, match="unknown variant"):
        ablate(str(tiny_llama), ["8da4w g33"])


def test_export_without_target_says_what_it_needs(tiny_llama, capsys):
    from edge_infer.cli import main

    assert main(["export", str(tiny_llama), "--out", "x"]) != 0
    assert "--target" in capsys.readouterr().err


def test_tiny_builder_still_ties_the_head(tmp_path):
    hf, model = _decoder(build_tiny(tmp_path / "t"))
    assert model.lm_head.weight is model.embed_tokens.weight
