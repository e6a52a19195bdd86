"""One engine of bench/peers/run.py, kept in its own process: reads JSON requests on stdin, runs
each, answers one JSON line on stdout. Run by bench/peers/run.py, not by hand.

    python -m bench.peers.worker splitstack MODEL_DIR float32|bfloat16 [int8] [compile]
    python -m bench.peers.worker hf MODEL_DIR float32|bfloat16
    python -m bench.peers.worker llama.cpp MODEL.gguf THREADS       (the .peers venv's python)

Requests: {"op": "generate", "prompts": [[ids]...], "new_tokens": N} -> {"first": seconds to
every sequence's first token, "total": seconds to the last, "tokens": [[ids]...]}, greedy.
The llama.cpp side imports only llama_cpp and numpy (its venv has no torch).
"""
from __future__ import annotations

import json
import os
import sys
import time


class Splitstack:
    """One engine for the worker's life (`int8`: `--quantization int8`; `compile`:
    `--compile`, its graphs built here, before any timing)."""

    def __init__(self, model_dir: str, dtype: str, *modes: str):
        import torch
        from models import load_model
        from services.engine import EngineConfig, GenerationParams, LLMEngine
        torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "2")))
        self.params_cls = GenerationParams
        model = load_model(model_dir, getattr(torch, dtype))
        model.quantize("int8" if "int8" in modes else None)
        self.engine = LLMEngine(model, EngineConfig(
            max_num_batched_tokens=2048, max_prefill_chunk=512, max_num_seqs=8,
            compile_decode="compile" in modes))

    def generate(self, prompts, new_tokens):
        engine = self.engine
        params = self.params_cls(max_tokens=new_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        start, first = time.perf_counter(), None
        while engine.has_unfinished():
            engine.step()
            if first is None and all(len(s.output_ids) >= 1 for s in engine.seqs.values()):
                first = time.perf_counter()
        total = time.perf_counter() - start
        tokens = [engine.pop(i).output_ids for i in ids]
        return {"first": first - start, "total": total, "tokens": tokens}


class HF:
    def __init__(self, model_dir: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "2")))
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                          dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts, new_tokens):
        torch = self.torch
        ids = torch.tensor(prompts)

        def run(n):
            start = time.perf_counter()
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0)
            return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()
        first, _ = run(1)
        total, tokens = run(new_tokens) if new_tokens > 1 else (first, None)
        return {"first": first, "total": total, "tokens": tokens or []}


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API: one context with a sequence per
    prompt, every step one `llama_decode` of the whole batch (as its server batches)."""

    def __init__(self, gguf: str, threads: str):
        import llama_cpp as lc
        import numpy as np
        self.lc, self.np = lc, np
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 8192, 512, 512, 16
        params.n_threads = params.n_threads_batch = int(threads)
        params.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(512, 0, 16)

    def _decode(self, entries):
        """entries: (token, pos, seq, wants_logits) -> logits rows of those that want them."""
        lc, b = self.lc, self.batch
        out = []
        for start in range(0, len(entries), 512):
            part = entries[start:start + 512]
            b.n_tokens = len(part)
            for i, (tok, pos, seq, want) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, int(want)
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, want) in enumerate(part):
                if want:
                    row = lc.llama_get_logits_ith(self.ctx, i)
                    out.append(self.np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())
        return [int(t) for t in out]

    def generate(self, prompts, new_tokens):
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, tok in enumerate(p)]
        last = self._decode(entries)
        first = time.perf_counter() - start
        tokens = [[t] for t in last]
        for step in range(1, new_tokens):
            last = self._decode([(tokens[s][-1], len(p) + step - 1, s, True)
                                 for s, p in enumerate(prompts)])
            for s, t in enumerate(last):
                tokens[s].append(t)
        return {"first": first, "total": time.perf_counter() - start, "tokens": tokens}


def main() -> None:
    kind, *args = sys.argv[1:]
    engine = {"splitstack": Splitstack, "hf": HF, "llama.cpp": LlamaCpp}[kind](*args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(engine.generate(req["prompts"], req["new_tokens"])), flush=True)


if __name__ == "__main__":
    main()
