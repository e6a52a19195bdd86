"""`splitstack generate` end to end, as a user runs it (a real subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.sampling import SamplingParams
from models import load_model
from services.cli.argtypes import resolve_dtype
from services.common.tokenizer import eos_token_ids, load_tokenizer
from services.engine import GenerationParams, LLMEngine


ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.slow
def test_generate_token_ids_matches_engine(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")
    proc = run_cli("generate", "--model", str(path), "--token-ids", "1,2,3,4",
                   "--max-tokens", "6", "--ignore-eos", "--print-ids", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    printed = [int(t) for t in proc.stdout.strip().splitlines()[-1].split(",")]
    expect = LLMEngine(load_model(path)).generate(
        [[1, 2, 3, 4]], GenerationParams(max_tokens=6, ignore_eos=True))[0].output_ids
    assert printed == expect and len(printed) == 6
    assert "finish_reason=length" in proc.stderr and "dtype=float32" in proc.stderr


def test_generate_and_serve_share_the_default_dtype():
    """A prompt answered by `generate` and by `serve` runs in one precision unless a flag
    says otherwise: both default to `auto`."""
    from services.cli import build_parser
    from services.cli.serve_args import ServeArgs

    gen = build_parser().parse_args(["generate", "--model", "m", "--token-ids", "1"])
    srv = ServeArgs.from_cli(build_parser().parse_args(["serve", "--model", "m"]))
    assert gen.dtype == srv.dtype == "auto"


@pytest.mark.slow
def test_generate_reports_the_resolved_dtype(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")
    proc = run_cli("generate", "--model", str(path), "--token-ids", "1,2", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"dtype={resolve_dtype('auto')}]" in proc.stderr


@pytest.mark.slow
def test_generate_with_penalties_matches_engine(tiny_checkpoint):
    """SmolLM2 lists numbers in a loop; --repetition-penalty changes the answer exactly as
    the engine does with the same settings."""
    zoo = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"
    args = ("generate", "--model", str(zoo), "--chat", "--prompt",
            "List the numbers from one to ten.", "--max-tokens", "24", "--print-ids",
            "--dtype", "float32")
    plain = run_cli(*args)
    proc = run_cli(*args, "--repetition-penalty", "1.3", "--presence-penalty", "0.5")
    assert plain.returncode == proc.returncode == 0, proc.stderr
    ids = lambda out: [int(t) for t in out.stdout.strip().splitlines()[-1].split(",")]  # noqa: E731
    tok = load_tokenizer(zoo)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "List the numbers "
                                                                      "from one to ten."}],
                                         add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    expect = LLMEngine(load_model(zoo), eos_token_ids=eos_token_ids(zoo)).generate(
        [prompt], GenerationParams(max_tokens=24, sampling=SamplingParams(
            repetition_penalty=1.3, presence_penalty=0.5)))[0].output_ids
    assert ids(proc) == expect and ids(proc) != ids(plain)
    path, _ = tiny_checkpoint("llama3")
    bad = run_cli("generate", "--model", str(path), "--token-ids", "1,2",
                  "--presence-penalty", "3")
    assert bad.returncode == 2 and "presence_penalty must be in [-2, 2]" in bad.stderr


@pytest.mark.slow
def test_generate_rejects_overlong_request(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    proc = run_cli("generate", "--model", str(path), "--token-ids", "1,2",
                   "--max-tokens", "100000")
    assert proc.returncode == 2 and "max_tokens" in proc.stderr


@pytest.mark.slow
def test_generate_bad_token_ids_message(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    proc = run_cli("generate", "--model", str(path), "--token-ids", "1,x")
    assert proc.returncode != 0 and "comma-separated integers" in proc.stderr


def test_derive_hybrid_passes_the_recipe_flags(monkeypatch, tmp_path):
    """`derive hybrid --fa-phase/--needle-frac/--delta` reach `derive_hybrid` (the training
    itself is tested in tests/integration/test_hybrid_checkpoint.py)."""
    from services.cli import main
    from tools.zoo import derive_hybrid

    seen = {}
    monkeypatch.setattr(derive_hybrid, "derive_hybrid",
                        lambda parent, out, **kw: seen.update(kw, out=out) or {"ok": True})
    assert main(["derive", "hybrid", "--fa-phase", "2", "--needle-frac", "0.5", "--threads",
                 "1", "--delta", str(tmp_path / "d.safetensors"), "--out",
                 str(tmp_path / "m"), "--steps", "3"]) in (0, None)
    assert seen["fa_phase"] == 2 and seen["needle_frac"] == 0.5 and seen["steps"] == 3
    assert seen["delta_path"] == str(tmp_path / "d.safetensors")
    assert not {"init_delta", "needle_len", "answer_weight", "kl_lr", "gradient_checkpointing",
                "attn_weight", "attn_layers", "copy_frac"} & set(seen)              # defaults
    seen.clear()
    assert main(["derive", "hybrid", "--init-delta", "old.safetensors", "--needle-len", "1024",
                 "--answer-weight", "2", "--kl-lr", "3e-4", "--threads", "1",
                 "--out", str(tmp_path / "m")]) in (0, None)
    assert (seen["init_delta"], seen["needle_len"], seen["answer_weight"], seen["kl_lr"]) == (
        "old.safetensors", 1024, 2.0, 3e-4)
    seen.clear()
    assert main(["derive", "hybrid", "--fa-layers", "21,3,17,3", "--repeated-share", "0.3",
                 "--needle-formats", "varied", "--gradient-checkpointing", "--threads", "1",
                 "--out", str(tmp_path / "m")]) in (0, None)
    assert seen["fa_layers"] == [3, 17, 21] and seen["repeated_share"] == 0.3
    assert seen["needle_formats"] == "varied" and seen["gradient_checkpointing"] is True
    seen.clear()
    assert main(["derive", "hybrid", "--attn-weight", "0.5", "--attn-layers", "23,17",
                 "--threads", "1", "--out", str(tmp_path / "m")]) in (0, None)
    assert seen["attn_weight"] == 0.5 and seen["attn_layers"] == [17, 23]
    seen.clear()
    assert main(["derive", "hybrid", "--copy-frac", "0.25", "--threads", "1",
                 "--out", str(tmp_path / "m")]) in (0, None)
    assert seen["copy_frac"] == 0.25


def test_derive_induction_heads_prints_each_attention_layer(tmp_path, tiny_configs, capsys):
    from models import load_model
    from models.random_checkpoint import save_random_checkpoint
    from services.cli import main

    cfg = dict(tiny_configs["qwen3_5"], num_hidden_layers=4)
    cfg.pop("layer_types", None)
    save_random_checkpoint(cfg, tmp_path, seed=1, std=0.1)
    assert main(["derive", "induction-heads", "--parent", str(tmp_path), "--threads", "1"]) == 0
    fa = load_model(tmp_path).config.full_attention_layers
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layer")]
    assert [int(line.split()[1]) for line in lines] == fa and fa
    assert all("induction" in line and "previous-token" in line for line in lines)
    out_ablated = main(["derive", "induction-heads", "--parent", str(tmp_path), "--threads", "1",
                        "--ablate", f"{fa[0]}:0,{fa[-1]}:*"])
    assert out_ablated == 0 and f"ablated {fa[0]}:0,{fa[-1]}:*" in capsys.readouterr().out
    gdn = next(l for l in range(4) if l not in fa)
    assert main(["derive", "induction-heads", "--parent", str(tmp_path), "--threads", "1",
                 "--ablate", f"{gdn}:0"]) == 2
    assert "no softmax attention" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["16", "16:x", "16:0:1", ",", "x:*"])
def test_derive_rejects_a_malformed_head_list(bad, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as err:
        main(["derive", "induction-heads", "--ablate", bad])
    assert err.value.code == 2 and "--ablate" in capsys.readouterr().err


def test_derive_rejects_a_malformed_layer_list(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as err:
        main(["derive", "hybrid", "--fa-layers", "3,x"])
    assert err.value.code == 2 and "--fa-layers" in capsys.readouterr().err


def test_apply_hybrid_rebuilds_from_the_given_delta(monkeypatch, tmp_path):
    """`derive apply-hybrid --delta D` rebuilds from D (an older delta from git history,
    say), not from the zoo's."""
    from services.cli import main
    from tools.zoo import derive_hybrid

    seen = []
    monkeypatch.setattr(derive_hybrid, "apply_hybrid",
                        lambda parent, out, delta=None: seen.append((out, delta)) or out)
    assert main(["derive", "apply-hybrid", "--delta", "old.safetensors", "--threads", "1",
                 "--out", str(tmp_path / "m")]) in (0, None)
    assert seen == [(str(tmp_path / "m"), "old.safetensors")]


@pytest.mark.slow
def test_bad_input_is_one_error_line_not_a_traceback(tiny_checkpoint, tmp_path, capsys,
                                                     monkeypatch):
    """Every subcommand reports bad settings and missing files as `error: ...` and exit 2;
    malformed integer lists are usage errors naming the option."""
    from services.cli import main

    path, _ = tiny_checkpoint("qwen3")
    monkeypatch.delenv("SPLITSTACK_TRACEBACK", raising=False)
    capsys.readouterr()                                   # the fixture's progress bars
    cases = [
        (["calibrate", "--model", str(tmp_path / "nowhere"), "--splits", "1", "--out",
          str(tmp_path / "m")], "nowhere"),
        (["eval", "--model", str(ZOO), "--arms", "ridgefill", "--lengths", "512"],
         "needs calibrated maps"),
        (["eval", "--model", str(ZOO), "--arms", "psychic"], "unknown arm"),
        (["generate", "--model", str(path), "--token-ids", "1,2", "--max-tokens", "-3"],
         "max_tokens"),
        (["import-gguf", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")],
         "none.gguf"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.endswith("\n") and err.splitlines()[-1].startswith("error: "), err
        assert needle in err and "Traceback" not in err, err
    for argv in (["calibrate", "--model", str(path), "--splits", "a", "--out", "x"],
                 ["eval", "--model", str(path), "--lengths", "1k"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "expected comma-separated integers" in capsys.readouterr().err
    monkeypatch.setenv("SPLITSTACK_TRACEBACK", "1")        # the traceback on request
    with pytest.raises(ValueError, match="unknown arm"):
        main(["eval", "--model", str(ZOO), "--arms", "psychic"])


@pytest.mark.parametrize("flags, option", [
    (["--kv-cache-gib", "-1"], "--kv-cache-gib"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib"),
    (["--attention-shards", "1", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--mlp-replicas", "0"], "--mlp-replicas"),         # was taken as the default, 1
    (["--attention-shards", "0"], "--attention-shards"),   # was the embedded engine
    (["--threads", "0"], "--threads"),
    (["--port", "99999"], "--port"),
])
def test_serve_refuses_bad_sizes_before_starting_anything(flags, option, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "unused", *flags])
    assert exc.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_cluster_config_refuses_nonpositive_sizes():
    from services.deployment.ray_cluster import ClusterConfig

    for name in ("max_num_seqs", "kv_cache_bytes", "threads", "block_size"):
        with pytest.raises(ValueError, match=name):
            ClusterConfig(model="unused", **{name: 0})


def test_serve_api_key_from_flag_or_environment(monkeypatch):
    from services.cli import build_parser

    monkeypatch.delenv("SPLITSTACK_API_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    monkeypatch.setenv("SPLITSTACK_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "k"]).api_key == "k"
