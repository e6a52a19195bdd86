"""Would compiling the decode step pay on the CPU? One decode step of SmolLM2 (bf16) three
ways, in one run, median of N:

- `engine`: the engine's own step (`LLMEngine.step`, eager, packed bf16 products);
- `compiled`: the same math as one `torch.compile`d graph (inductor's CPU backend with
  `freezing`, so the bf16 weights are packed for oneDNN and the pointwise ops between the
  products fused into C++ kernels); the paged KV write and the native paged attention are
  custom ops inside the graph;
- `products`: only the step's weight products (the floor any engine streams at).

    .venv/bin/python bench/decode_compile.py [--batch 1 8] [--repeats 5] [--int8]

`--int8` adds the compiled step on weight-only int8 products (`aten._weight_int8pack_mm`,
per-row scales). The compiled variants serve one batch size per graph (the engine would need
one per bucket) and take 25-45 s to compile here; this script measures, it is not a mode.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention import cpu_paged  # noqa: E402
from models import load_model  # noqa: E402
from models.layers import project  # noqa: E402

BLOCK, PROMPT = 16, 200
_PLAN: dict = {}


@torch.library.custom_op("splitstack_bench::paged_decode", mutates_args=())
def _paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    return cpu_paged.decode(q, k_cache, v_cache, prepared=_PLAN["plan"])[0].to(q.dtype)


@_paged_decode.register_fake
def _(q, k_cache, v_cache):
    return torch.empty_like(q)


@torch.library.custom_op("splitstack_bench::write_kv", mutates_args=("kv",))
def _write_kv(kv: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    kv[0, layer].flatten(0, 1)[slots] = k
    kv[1, layer].flatten(0, 1)[slots] = v


@_write_kv.register_fake
def _(kv, layer, slots, k, v):
    return None


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), \
        scale.to(w.dtype)


class Step(nn.Module):
    """The decode step of a Llama-family model (SmolLM2) written as one traceable function."""

    def __init__(self, model, int8: bool):
        super().__init__()
        cfg = model.config
        self.h, self.heads, self.kv_heads, self.d = (cfg.hidden_size, cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        self.inter, self.eps, self.int8 = cfg.intermediate_size, cfg.rms_norm_eps, int8
        frozen = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731
        self.embed = frozen(model.model.embed_tokens.weight)
        self.norm = frozen(model.model.norm.weight)
        layers = list(model.model.layers)
        self.w_in = nn.ParameterList(frozen(x.input_layernorm.weight) for x in layers)
        self.w_post = nn.ParameterList(frozen(x.post_attention_layernorm.weight) for x in layers)
        self.products = {}
        for name, get in (("qkv", lambda x: x.self_attn.qkv.weight),
                          ("o", lambda x: x.self_attn.o_proj.weight),
                          ("gate_up", lambda x: x.mlp.gate_up.weight),
                          ("down", lambda x: x.mlp.down_proj.weight)):
            weights = [get(x) for x in layers]
            if int8:
                pairs = [_int8(w) for w in weights]
                setattr(self, name + "_q", nn.ParameterList(frozen(p[0]) for p in pairs))
                setattr(self, name + "_s", nn.ParameterList(frozen(p[1]) for p in pairs))
            else:
                setattr(self, name, nn.ParameterList(frozen(w) for w in weights))

    def _lin(self, x, name, l):
        if self.int8:
            return torch.ops.aten._weight_int8pack_mm(x, getattr(self, name + "_q")[l],
                                                      getattr(self, name + "_s")[l])
        return F.linear(x, getattr(self, name)[l])

    def _norm(self, w, x):
        return w * F.rms_norm(x.float(), (self.h,), None, self.eps).to(x.dtype)

    def forward(self, ids, cos, sin, slots, kv):
        x = F.embedding(ids, self.embed)
        cos, sin = cos[:, None], sin[:, None]
        half = self.d // 2
        for l in range(len(self.w_in)):
            qkv = self._lin(self._norm(self.w_in[l], x), "qkv", l)
            q, k, v = qkv.split([self.heads * self.d, self.kv_heads * self.d,
                                 self.kv_heads * self.d], -1)
            q, k = q.view(-1, self.heads, self.d), k.view(-1, self.kv_heads, self.d)
            q = q * cos + torch.roll(q, half, -1) * sin
            k = k * cos + torch.roll(k, half, -1) * sin
            torch.ops.splitstack_bench.write_kv(kv, l, slots, k, v.view(-1, self.kv_heads, self.d))
            o = torch.ops.splitstack_bench.paged_decode(q, kv[0, l], kv[1, l])
            h = x + self._lin(o.reshape(o.shape[0], -1), "o", l)
            gate, up = self._lin(self._norm(self.w_post[l], h), "gate_up", l).split(
                [self.inter, self.inter], -1)
            x = h + self._lin(F.silu(gate) * up, "down", l)
        return F.linear(self._norm(self.norm, x), self.embed).float()


def median_ms(fn, repeats: int, inner: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(times)


def engine_step_ms(model, batch: int, repeats: int) -> float:
    from services.engine import EngineConfig, GenerationParams, LLMEngine

    times = []
    for r in range(repeats):
        engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=4096, max_prefill_chunk=512,
                                               max_num_seqs=max(8, batch)))
        gen = torch.Generator().manual_seed(r)
        for _ in range(batch):
            engine.add_request(torch.randint(0, model.config.vocab_size, (PROMPT,),
                                             generator=gen).tolist(),
                               GenerationParams(max_tokens=33, ignore_eos=True))
        engine.step()                                     # the prompts
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/zoo/smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    import torch._inductor.config as inductor

    inductor.freezing = True
    torch.set_num_threads(args.threads)
    model = load_model(args.model, torch.bfloat16).fuse_projections()
    cfg = model.config
    layers = cfg.num_hidden_layers
    variants = [False, True] if args.int8 else [False]
    steps = {int8: torch.compile(Step(model, int8).eval(), dynamic=False) for int8 in variants}
    print(f"model {args.model}, bf16, {args.threads} threads, prompts of {PROMPT} tokens, "
          f"median of {args.repeats}")
    for batch in args.batch:
        kv = torch.randn(2, layers, batch * 16, BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                         dtype=torch.bfloat16)
        tables = torch.arange(batch * 16).view(batch, 16)
        lens = torch.full((batch,), PROMPT)
        _PLAN["plan"] = cpu_paged.prepare(tables, lens, BLOCK, cfg.num_attention_heads,
                                          cfg.head_dim)
        ids = torch.randint(0, cfg.vocab_size, (batch,))
        slots = tables[:, (PROMPT - 1) // BLOCK] * BLOCK + (PROMPT - 1) % BLOCK
        row = {"engine": engine_step_ms(model, batch, args.repeats)}
        with torch.no_grad():
            cos, sin = model.rotary.cos_sin(lens - 1, torch.bfloat16)
            for int8, step in steps.items():
                start = time.perf_counter()
                step(ids, cos, sin, slots, kv)
                name = "compiled int8" if int8 else "compiled"
                print(f"  batch {batch}: {name} graph built in {time.perf_counter() - start:.0f} s")
                row[name] = median_ms(lambda: step(ids, cos, sin, slots, kv), args.repeats)
        xs = [torch.randn(batch, n, dtype=torch.bfloat16) for n in (cfg.hidden_size,
                                                                    cfg.intermediate_size)]

        def products():
            for layer in model.model.layers:
                project(xs[0], layer.self_attn.qkv.weight)
                project(xs[0], layer.self_attn.o_proj.weight)
                project(xs[0], layer.mlp.gate_up.weight)
                project(xs[1], layer.mlp.down_proj.weight)
            project(xs[0], model.lm_head_weight())
        with torch.inference_mode():
            products()
            row["products"] = median_ms(products, args.repeats)
        base = row["engine"]
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} ms ({base / v:.2f}x)"
                                             for k, v in row.items()))


if __name__ == "__main__":
    main()
