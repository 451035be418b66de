"""Scheme configs and edge profiles: data that round-trips and fails loudly."""

import pytest

from edge_infer import profiles
from edge_infer.errors import UsageError
from edge_infer.quant.config import W4Config


def test_w4config_round_trips_through_hf_dict():
    cfg = W4Config(group_size=64, zero_point=True, scale_dtype="fp16",
                   modules_to_not_convert=("model.layers.0.",))
    d = cfg.to_hf()
    assert d["quant_method"] == "edge_w4" and d["bits"] == 4
    assert W4Config.from_hf(d) == cfg


def test_w4config_rejects_bad_values():
    with pytest.raises(ValueError, match="group size 100"):
        W4Config(group_size=100)
    with pytest.raises(ValueError, match="unknown edge_w4 quantization_config keys"):
        W4Config.from_hf({"quant_method": "edge_w4", "group_sise": 64})
    with pytest.raises(ValueError, match="not an edge_w4"):
        W4Config.from_hf({"quant_method": "gptq"})


def test_bits_per_weight_counts_scales_and_zeros():
    assert W4Config(group_size=128).bits_per_weight(64, 256) == 4 + 16 / 128
    assert W4Config(group_size=32, zero_point=True).bits_per_weight(64, 256) == 4 + 24 / 32


def test_shipped_profile_loads():
    p = profiles.load("smollm2-135m")
    assert p.quant.group_size == 64  # 576 is not a multiple of 128
    assert p.serve.enforce_eager is True


def test_profile_quant_is_the_scheme_config():
    """A profile's [quant] is a W4Config itself, so its defaults and checks are the config's."""
    assert profiles.load("smollm2-135m").quant == W4Config(group_size=64)
    assert profiles.Profile().quant == W4Config()


def test_quantize_flags_default_to_the_config():
    import argparse

    from edge_infer.quant import cli

    sub = argparse.ArgumentParser().add_subparsers()
    cli.add_parser(sub)
    args = sub.choices["quantize"].parse_args(["in", "out"])
    assert W4Config(scheme=args.scheme, group_size=args.group, zero_point=args.zero_point,
                    scale_dtype=args.scale_dtype, quantize_lm_head=args.quantize_lm_head) == W4Config()


def test_unknown_model_gets_generic_profile():
    assert profiles.load("no-such-model") == profiles.Profile()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[serve]\nmax_model_len = 'long'\n", "serve.max_model_len"),
        ("[serve]\nmax_modle_len = 10\n", "unknown profile key serve.max_modle_len"),
        ("[sevre]\n", "unknown profile table [sevre]"),
        ("[threads]\ncores = [0, -1]\n", "threads.cores"),
        ("[quant]\ngroup_size = 100\n", "[quant]: group size 100"),
        ("[quant]\nmodules_to_not_convert = []\n", "unknown profile key quant.modules_to_not_convert"),
        ("[serve\n", "not valid TOML"),
    ],
)
def test_bad_profile_names_the_key(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UsageError) as info:
        profiles.load(f)
    assert message in str(info.value)
