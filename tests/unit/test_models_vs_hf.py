"""Our stage-composed forward against Hugging Face transformers on the same checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import CheckpointError, ConfigError, ModelConfig, load_model
from tests.helpers.checkpoints import FAMILIES


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_hf(family, tiny_checkpoint, tiny_configs):
    path, hf = tiny_checkpoint(family)
    torch.manual_seed(0)
    ids = torch.randint(0, tiny_configs[family]["vocab_size"], (2, 100))   # crosses chunk 64
    with torch.no_grad():
        ref = hf(ids).logits
    ours = load_model(path, dtype=torch.float32).forward(ids)
    assert ours.shape == (2, 100, tiny_configs[family]["vocab_size"])
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_close_to_hf(family, tiny_checkpoint, tiny_configs):
    path, hf = tiny_checkpoint(family)
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_configs[family]["vocab_size"], (2, 100))
    hf_bf16 = type(hf).from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf_bf16(ids).logits
    ours = load_model(path, dtype=torch.bfloat16).forward(ids)
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, ref) <= 3e-2


def test_stages_compose_the_forward(tiny_checkpoint):
    """A hand-composed stage loop reproduces forward (the API services depend on)."""
    from kernels.attention.naive import attention_lse

    path, _ = tiny_checkpoint("qwen3_next")
    m = load_model(path)
    ids = torch.randint(0, 1024, (1, 20))
    pos = torch.arange(20)[None]
    x = m.embed(ids)
    for l in range(m.config.num_hidden_layers):
        if m.layer(l).kind == "full_attention":
            a = m.attn_inputs(l, x, pos)
            h = m.attn_output(l, x, attention_lse(a.q, a.k, a.v)[0], a.gate)
        else:
            inp = m.gdn_inputs(l, x)
            o, _, _ = m.gdn_mix(l, inp, chunked=False)
            h = m.gdn_output(l, x, o, inp.z)
        x = m.mlp(l, h)
    assert torch.allclose(m.final(x), m.forward(ids), atol=1e-4)


def test_sharded_checkpoint_loads_identically(tiny_checkpoint, tmp_path):
    path, hf = tiny_checkpoint("llama3")
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = torch.randint(0, 1024, (1, 30))
    assert torch.equal(load_model(tmp_path).forward(ids), load_model(path).forward(ids))


def test_llama_old_rope_scaling_format(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama3")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")          # the oldest spelling
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old, new = ModelConfig.from_pretrained(tmp_path), ModelConfig.from_pretrained(path)
    assert old.rope == new.rope and old.rope.rope_type == "llama3"
    ids = torch.randint(0, 1024, (1, 40))
    assert torch.equal(load_model(tmp_path).forward(ids), load_model(path).forward(ids))


def test_llama3_rope_uses_all_three_bands(tiny_configs):
    from models.rope import inv_frequencies

    cfg = ModelConfig.from_hf(tiny_configs["llama3"])
    base = 1.0 / (cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    ratio = inv_frequencies(cfg.rope, cfg.head_dim) / base
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(1 / 8)).any()
    assert ((ratio > 1 / 8 + 1e-6) & (ratio < 1 - 1e-6)).any()


def test_qwen35_hub_prefix_and_skipped_towers(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("qwen3_5")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    state = load_file(path / "model.safetensors")
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in state.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
    renamed["mtp.layers.0.weight"] = torch.zeros(4)
    save_file(renamed, tmp_path / "model.safetensors")
    ids = torch.randint(0, 1024, (1, 30))
    assert torch.equal(load_model(tmp_path).forward(ids), load_model(path).forward(ids))


def test_qwen35_nested_text_config(tiny_configs):
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True,
              "text_config": {k: v for k, v in tiny_configs["qwen3_5"].items()
                              if k != "model_type"}}
    cfg = ModelConfig.from_hf(nested)
    assert cfg.model_type == "qwen3_5_text" and cfg.gdn_layout == "flat"
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("qwen3")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="k_norm"):
        load_model(tmp_path)


def test_unsupported_model_type_is_rejected():
    with pytest.raises(ConfigError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2"})
