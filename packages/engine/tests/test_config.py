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


def test_one_checkpoint_name_for_serve_and_the_harness(monkeypatch, tmp_path):
    from edge_infer.quant.builds import checkpoint_dir, default_config

    monkeypatch.setenv("EDGE_INFER_HOME", str(tmp_path))
    cfg = default_config("smollm2-135m")
    assert checkpoint_dir("smollm2-135m", cfg) == tmp_path / "checkpoints" / "smollm2-135m-w4a16-g64"
    head = W4Config(scheme="w4a8", group_size=32, zero_point=True, quantize_lm_head=True)
    assert checkpoint_dir("m", head).name == "m-w4a8-g32-zp-head"


def test_one_vllm_environment_from_cores_or_a_profile():
    import os

    from edge_infer.serve.runtime import vllm_env

    env = vllm_env([4, 5, 6], 2, 3, in_process=True, fused=False)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["EDGE_INFER_FUSED_DECODE"] == "0"
    plain = vllm_env([4, 5, 6])
    assert plain["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in plain and "EDGE_INFER_FUSED_DECODE" not in plain
    with pytest.raises(UsageError, match="--threads 4: choose 1..3"):
        vllm_env([4, 5, 6], 4)
    served = vllm_env(profiles.Profile(), 1)  # a profile: its cores (this process's) and KV size
    assert served["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert served["VLLM_CPU_KVCACHE_SPACE"] == str(profiles.Profile().serve.kv_cache_gib)


def test_scale_dtype_names_are_the_ones_with_a_torch_dtype():
    from edge_infer.quant.config import SCALE_DTYPE_NAMES
    from edge_infer.quant.primitives import SCALE_DTYPES

    assert set(SCALE_DTYPE_NAMES) == set(SCALE_DTYPES)
