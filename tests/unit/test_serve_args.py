"""`ServeArgs`: one field per `splitstack serve` flag, the flags generated from the fields,
and the engine / prefill / cluster configs built from them."""
from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch

from services.cli import build_parser
from services.cli.argtypes import cpu_native_bf16
from services.cli.serve_args import FlagError, ServeArgs, flag_name, usable_cores
from services.deployment.build import EngineOptions
from services.deployment.ray_cluster import ClusterConfig
from services.prefill.service import PrefillConfig


def serve_parser() -> argparse.ArgumentParser:
    return ServeArgs.add_cli_args(argparse.ArgumentParser(prog="serve"))


def parse(*flags: str) -> ServeArgs:
    return ServeArgs.from_cli(build_parser().parse_args(["serve", *flags]))


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch):
    monkeypatch.delenv("SPLITSTACK_API_KEY", raising=False)


def test_every_field_is_one_flag_with_help():
    actions = {a.option_strings[0]: a for a in serve_parser()._actions
               if a.option_strings and a.dest != "help"}
    names = [flag_name(f.name) for f in dataclasses.fields(ServeArgs)]
    assert sorted(actions) == sorted(names) and len(names) == 71
    for f in dataclasses.fields(ServeArgs):
        action = actions[flag_name(f.name)]
        assert action.dest == f.name
        assert action.help and action.help == f.metadata["help"], f.name
        if f.default is not dataclasses.MISSING:
            assert action.default == f.default, f.name


def test_no_flags_are_the_defaults():
    args = parse()
    assert args == ServeArgs()
    assert not args.uses_cluster and args.torch_threads == max(1, usable_cores() - 1)
    assert args.dtype == "auto" and args.api_key is None
    assert args.torch_dtype is (torch.bfloat16 if cpu_native_bf16() else torch.float32)
    cores = usable_cores()
    assert args.engine_options() == EngineOptions(
        prefill=PrefillConfig(), prefill_threads=cores if cores > args.torch_threads else None)
    assert ServeArgs(threads=1).engine_options().prefill_threads is None    # --threads: all


def test_auto_dtype_follows_the_cpu(monkeypatch):
    from services.cli import argtypes
    monkeypatch.setattr(argtypes, "cpu_native_bf16", lambda: True)
    assert parse().torch_dtype is torch.bfloat16
    assert parse("--gpu").dtype_name == "float32"                 # explicit on a GPU
    assert parse("--dtype", "float32").torch_dtype is torch.float32
    monkeypatch.setattr(argtypes, "cpu_native_bf16", lambda: False)
    assert parse().torch_dtype is torch.float32


def test_flags_reach_the_embedded_configs():
    args = parse("--model", "m", "--dtype", "bfloat16", "--max-num-seqs", "3",
                 "--kv-cache-gib", "0.5", "--threads", "4", "--prefill-mode", "ridgefill",
                 "--maps", "maps/x", "--maps-streamed", "--fill-dtype", "bfloat16",
                 "--split", "5", "--tail", "128", "--selector", "probe", "--budget", "0.2",
                 "--value-rescale", "64", "--key-rescale", "32", "--terminal-correction",
                 "--lexical", "0.1", "--lexical-rank", "shared", "--prefix-cache", "--prefix-cache-bytes", "4096",
                 "--prefix-block-size", "32", "--redis-url", "redis://h:1/0",
                 "--reuse-filled", "--replay-ratio", "0.05")
    assert not args.uses_cluster and args.torch_threads == 4
    assert args.torch_dtype is torch.bfloat16
    assert args.prefill_config() == PrefillConfig(
        mode="ridgefill", maps_dir="maps/x", resident=False, split=5, tail=128,
        selector="probe", budget=0.2, value_rescale=64, key_rescale=32,
        terminal_correction=True, lexical=0.1, lexical_rank="shared", fill_dtype="bfloat16")
    assert args.engine_options() == EngineOptions(
        max_num_seqs=3, kv_cache_bytes=1 << 29, prefill=args.prefill_config(),
        prefix_cache_bytes=4096, prefix_block_size=32, redis_url="redis://h:1/0",
        reuse_filled=True, replay_ratio=0.05)


def test_flags_reach_the_cluster_config():
    args = parse("--model", "m", "--attention-shards", "2", "--kv-splits", "3",
                 "--mlp-replicas", "4", "--wiring", "qfirst", "--transport", "nccl", "--gpu",
                 "--host", "0.0.0.0", "--max-num-seqs", "8", "--dtype", "bfloat16")
    assert args.uses_cluster and args.torch_threads == 1
    config = args.cluster_config()
    assert config.security.token and not config.security.tls   # no token given: one made
    assert config == ClusterConfig(
        model="m", attention_shards=2, mlp_replicas=4, wiring="qfirst", transport="nccl",
        kv_splits=3, kv_cache_bytes=1 << 30, max_num_seqs=8, dtype="bfloat16", threads=1,
        host="0.0.0.0", use_gpu=True, prefill_replicas=0, prefill=args.engine_options(),
        security=config.security)


@pytest.mark.parametrize("flags, sizes", [
    (["--disaggregated"], (1, 1, "grpc", 0)),
    (["--address", "ray://h:10001"], (1, 1, "grpc", 0)),
    (["--disaggregated", "--prefix-cache"], (1, 1, "grpc", 1)),     # the cache lives there
    (["--disaggregated", "--maps", "m"], (1, 1, "grpc", 1)),
    (["--prefill-replicas", "2", "--threads", "3"], (1, 1, "grpc", 2)),
])
def test_any_qfirst_flag_deploys_on_ray_with_unset_sizes_filled(flags, sizes):
    config = parse(*flags).cluster_config()
    assert (config.attention_shards, config.mlp_replicas, config.transport,
            config.prefill_replicas) == sizes
    assert config.threads == (3 if "--threads" in flags else 1)


def test_api_key_from_flag_or_environment(monkeypatch):
    assert ServeArgs().api_key is None
    monkeypatch.setenv("SPLITSTACK_API_KEY", "from-env")
    assert ServeArgs().api_key == "from-env" and parse().api_key == "from-env"
    assert parse("--api-key", "k").api_key == "k"


@pytest.mark.parametrize("fields, flag", [
    ({"port": 0}, "--port"),
    ({"port": 70000}, "--port"),
    ({"kv_cache_gib": math.nan}, "--kv-cache-gib"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_seqs": True}, "--max-num-seqs"),           # a bool is not a count
    ({"threads": 0}, "--threads"),
    ({"attention_shards": 0}, "--attention-shards"),
    ({"kv_splits": 2.5}, "--kv-splits"),
    ({"prefill_replicas": -1}, "--prefill-replicas"),
    ({"dtype": "float16"}, "--dtype"),
    ({"wiring": "sideways"}, "--wiring"),
    ({"transport": "tcp"}, "--transport"),
    ({"prefill_mode": "fast"}, "--prefill-mode"),
    ({"fill_dtype": "float16"}, "--fill-dtype"),
    ({"selector": "oracle"}, "--selector"),
    ({"split": 0}, "--split"),
    ({"tail": -1}, "--tail"),
    ({"budget": 1.5}, "--budget"),
    ({"lexical": -0.1}, "--lexical"),
    ({"lexical_rank": "tfidf"}, "--lexical-rank"),
    ({"value_rescale": -1}, "--value-rescale"),
    ({"replay_ratio": 2.0}, "--replay-ratio"),
    ({"prefix_block_size": 0}, "--prefix-block-size"),
    ({"prefix_cache": "yes"}, "--prefix-cache"),
    ({"model": None}, "--model"),
    ({"redis_url": "redis://h"}, "--prefix-cache"),       # the Redis tier is the cache's
    ({"reuse_filled": True}, "--prefix-cache"),
    ({"transport": "nccl"}, "--gpu"),
    ({"prefill_replicas": 0, "prefix_cache": True}, "--prefill-replicas"),
    ({"prefill_replicas": 0, "maps": "m"}, "--prefill-replicas"),
])
def test_bad_values_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        ServeArgs(**fields)


def test_field_errors_carry_the_flag_and_value():
    with pytest.raises(FlagError) as err:
        ServeArgs(budget=1.5)
    assert (err.value.flag, err.value.value) == ("--budget", 1.5)
    assert str(err.value) == "--budget must be in [0.0, 1.0], got 1.5"


@pytest.mark.parametrize("flags, option", [
    (["--replay-ratio", "1.5"], "--replay-ratio"),
    (["--budget", "-0.5"], "--budget"),
    (["--prefill-replicas", "-1"], "--prefill-replicas"),
    (["--split", "0"], "--split"),
    (["--tail", "x"], "--tail"),
    (["--selector", "oracle"], "--selector"),
])
def test_the_same_ranges_are_usage_errors_on_the_command_line(flags, option, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *flags])
    assert exc.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_speculative_config_takes_vllms_json_and_refuses_what_cannot_run():
    from services.engine.speculative import NgramConfig

    args = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                         '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert args.engine_options().speculative == NgramConfig(3, 5, 1)
    assert parse().engine_options().speculative is None
    for bad, says in (("{not json", "--speculative-config: "), ("[3]", "JSON object"),
                      ('{"method": "eagle"}', "'eagle'"),
                      ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                      ('{"k": 3}', "unknown speculative-config keys")):
        with pytest.raises(FlagError, match=says) as err:
            parse("--speculative-config", bad)
        assert err.value.flag == "--speculative-config"
    # the Ray deployment's attention services draft too
    cluster = parse("--speculative-config", '{"num_speculative_tokens": 2}',
                    "--disaggregated").cluster_config()
    assert cluster.prefill.speculative == NgramConfig(2)


def test_compile_and_quantization_reach_every_engine_and_member():
    args = parse("--compile", "--quantization", "int8")
    options = args.engine_options()
    assert options.compile_decode and options.quantization == "int8"
    assert args.cluster_config().quantization == "int8"
    plain = parse()
    assert not plain.engine_options().compile_decode and plain.cluster_config().quantization is None
    with pytest.raises(SystemExit):
        parse("--quantization", "int4")
