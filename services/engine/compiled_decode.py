"""Decode-only engine steps as `torch.compile`d graphs on the CPU (`--compile`), one per
batch bucket.

At batch 1 the eager decode step spends about half its time outside the weight products,
dispatching its ~730 ops from Python (bench/serving/decode_compile.py). Here the decode step of a dense
full-attention model (the Llama and Qwen3 families: no Gated DeltaNet, no experts, standard
wiring) is one graph for inductor's CPU backend: the norms, rotary, output gates, SiLU and
residual adds between the products fuse into a few C++ kernels. Two things stay opaque
custom ops inside the graph:

- `splitstack::linear`: `models.layers.project`, the eager engine's own product (oneDNN on
  the packed bf16 weight or its int8 copy, MKL's strategies in fp32). The weights never
  enter the graph: the op names one by its index in the engine's table, set beside the
  call. So the graphs use the packed copies the eager path already holds (inductor's
  `freezing` would fold another copy into every graph), and one architecture's graphs are
  the same for every engine and every run: inductor's on-disk cache serves them.
- `splitstack::paged_decode`: the step's keys and values into the paged cache, in place,
  then `kernels.attention.cpu_paged`, the native batched paged decode kernel. Block tables
  change every step without changing the graph: as with vLLM's forward context, the step's
  prepared tables (and the weight table) are set beside the call (`_STEP`), not passed in.

Where `kernels.torch_ops` builds (a C++ compiler and torch's headers), both run as C++
operators instead (`splitstack_cpu::int8_linear` for the products of weights with a native
int8 copy, `bf16_linear` for bf16 weights on oneDNN's packed copy, `paged_decode` for
attention), with the weight table and the step's tables set per thread
(`torch_ops.set_step`). At batch 1 the Python ops' own bodies (dispatch, checks,
allocations, ctypes) had cost more than the kernels they called: about 9 of a 17 ms int8
step. fp32 products keep `splitstack::linear` (MKL's strategies in `project`).

A step of B rows runs at the smallest bucket >= B. Rows B.. are padding: row 0's token and
position attending to one key of row 0's sequence. They write nothing into the cache and
their logits are dropped, so the step is exact and padding costs products, not attention.
Steps the graphs do not cover (any prefill, a batch past the largest bucket) run eagerly.
The buckets compile when the runner is built (`warm`): 15-30 s each on 2 cores the first
time, a few seconds from inductor's cache (`use_cache_dir`). A server builds them on a
thread beside the engine instead (`warm_in_background`): steps run eagerly until their
bucket's graph is ready, so the first request never waits for the compiler. Either way
the warm-up runs on a scratch cache of the real one's shape, so a live request's blocks
are never written."""
from __future__ import annotations

import logging
import os
import threading
import time
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import torch_ops
from kernels.attention import cpu_paged
from kernels.cuda_graph import bucket_for
from models.layers import (MLP, int8_copy, native_int8_rows, onednn_bf16, project,
                           still_fused)
from models.model import CausalLM
from services.engine.kv_cache import lazy_zeros
from services.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE = Path.home() / ".cache" / "splitstack" / "torchinductor"

_INPUTS = ("ids", "cos", "sin", "slots", "kv")      # `_forward`'s arguments
_STEP = threading.local()    # the step being run: .plan (cpu_paged.Prepared), .weights (the
                             # engine's [(weight, bias)], which `splitstack::linear` indexes),
                             # .rows (the real rows; the rest are padding)


@torch.library.custom_op("splitstack::linear", mutates_args=())
def _linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    weight, bias = _STEP.weights[key]
    return project(x, weight, bias)


@_linear.register_fake
def _(x, key, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("splitstack::paged_decode", mutates_args=("kv",))
def _paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                  layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Write the step's k, v [B, KV, D] into cache layer `layer` at flat `slots` (the real
    rows only: `_STEP.rows`), then attend q [B, H, D] over each row's keys (the step's
    prepared tables)."""
    kvh, d = k.shape[-2:]
    n = _STEP.rows
    k_cache, v_cache = kv[0, layer], kv[1, layer]
    k_cache.view(-1, kvh, d)[slots[:n]] = k[:n].to(kv.dtype)
    v_cache.view(-1, kvh, d)[slots[:n]] = v[:n].to(kv.dtype)
    return cpu_paged.decode(q, k_cache, v_cache, prepared=_STEP.plan)[0].to(q.dtype)


@_paged_decode.register_fake
def _(q, k, v, kv, layer, slots):
    return torch.empty_like(q)


def unsupported(model: CausalLM) -> str | None:
    """Why the compiled step cannot run `model` here, or None when it can."""
    cfg = model.config
    if model.device.type != "cpu":
        return "the compiled decode step is for the CPU (CUDA has SPLITSTACK_DECODE_GRAPHS)"
    if cfg.is_hybrid:
        return "Gated DeltaNet layers run eagerly"
    if cfg.wiring != "standard":
        return f"{cfg.wiring} wiring runs eagerly"
    if any(not isinstance(layer.mlp, MLP) for layer in model.model.layers):
        return "mixture-of-experts layers run eagerly"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"{model.dtype} runs eagerly"
    if not cpu_paged.available():
        return "the native paged decode kernel did not build (no C compiler)"
    return None


def use_cache_dir(path: str | Path | None = None) -> Path:
    """Point inductor's on-disk cache at `path` (default: $TORCHINDUCTOR_CACHE_DIR if set,
    else ~/.cache/splitstack/torchinductor), so compiled graphs survive restarts."""
    chosen = Path(path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
    chosen.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(chosen)
    return chosen


class CompiledDecode:
    """The runner's decode-only steps as compiled graphs; `runner` is a `ModelRunner`
    (its cache and model). Engine thread only, after `warm`."""

    def __init__(self, runner, batch_buckets: tuple[int, ...] = BATCH_BUCKETS):
        reason = unsupported(runner.model)
        if reason:
            raise ValueError(reason)
        self.model, self.cache = runner.model, runner.cache
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        if not self.batch_buckets or self.batch_buckets[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {batch_buckets}")
        cfg = self.model.config
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        with torch.no_grad():       # `still_fused` holds only while no gradient is recorded
            self._plan = self._layer_plan()
        # the native operators (kernels.torch_ops), where they build: attention always, the
        # products of weights with a native int8 copy up to their row limit, those of bf16
        # weights on oneDNN's packed copy otherwise
        self.native = torch_ops.available()
        self.int8_rows = [native_int8_rows(w) if self.native else 0 for w, _ in self.weights]
        self.bf16 = [self.native and onednn_bf16(w) is not None for w, _ in self.weights]
        self._table = 0
        if self.native:
            self._table = torch_ops.weight_table([
                torch_ops.WeightEntry(w.shape[1], w.shape[0],
                                      int8_copy(w).packed if rows else None,
                                      onednn_bf16(w) if bf16 else None, b)
                for (w, b), rows, bf16 in zip(self.weights, self.int8_rows, self.bf16)])
            weakref.finalize(self, torch_ops.release_table, self._table)
        limit = 4 * len(self.batch_buckets) + 8      # graphs per code object (per engine)
        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, name) and getattr(dynamo, name) < limit:
                setattr(dynamo, name, limit)
        # Dynamo keeps its graphs on the function's code object: a copy of `_forward`'s code
        # for this object alone, so the graphs need guards only on the inputs' shapes and
        # dtypes (the bucket), not on the modules and weights they read through `self`
        # (checking those cost 0.5 ms a step)
        own = types.FunctionType(CompiledDecode._forward.__code__.replace(),
                                 CompiledDecode._forward.__globals__, "_forward")
        self._graph = torch.compile(types.MethodType(own, self), dynamic=False, fullgraph=True,
                                    options={"guard_filter_fn": _input_guards_only})
        self.compiled: set[int] = set()       # buckets built
        self.used: set[int] = set()           # buckets run by a step
        self.gave_up = False                  # a warm-up failed: the rest stay eager

    # ---- what the graph computes -------------------------------------------------------
    def _register(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
        self.weights.append((weight, bias))
        return len(self.weights) - 1, weight.shape[0]

    def _layer_plan(self) -> list[dict]:
        """Per layer: the modules the graph calls and the weight keys of its products."""
        plan = []
        for l, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = still_fused(attn.qkv, attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = still_fused(mlp.gate_up, mlp.gate_proj, mlp.up_proj)
            entry = {
                "layer": layer, "attn": attn, "fa": self.cache.fa_index[l],
                "qkv": ([self._register(qkv.weight, qkv.bias)] if qkv is not None else
                        [self._register(p.weight, p.bias)
                         for p in (attn.q_proj, attn.k_proj, attn.v_proj)]),
                "o": self._register(attn.o_proj.weight, attn.o_proj.bias),
                "gate_up": ([self._register(gate_up.weight, gate_up.bias)] if gate_up is not None
                            else [self._register(p.weight, p.bias)
                                  for p in (mlp.gate_proj, mlp.up_proj)]),
                "down": self._register(mlp.down_proj.weight, mlp.down_proj.bias),
            }
            plan.append(entry)
        self._head = self._register(self.model.lm_head_weight(), None)
        return plan

    def _lin(self, x: torch.Tensor, keyed: tuple[int, int]) -> torch.Tensor:
        key, out_features = keyed
        if x.shape[0] <= self.int8_rows[key]:       # the bucket: fixed while tracing
            y = torch.ops.splitstack_cpu.int8_linear(x, key, out_features)
            bias = self.weights[key][1]
            return y if bias is None else y + bias
        if self.bf16[key] and x.dtype == torch.bfloat16:
            return torch.ops.splitstack_cpu.bf16_linear(x, key, out_features)
        return torch.ops.splitstack.linear(x, key, out_features)

    def _products(self, x: torch.Tensor, keyed: list[tuple[int, int]]) -> torch.Tensor:
        if len(keyed) == 1:
            return self._lin(x, keyed[0])
        return torch.cat([self._lin(x, k) for k in keyed], dim=-1)

    def _forward(self, ids, cos, sin, slots, kv):
        model, rotary = self.model, self.model.rotary
        n = ids.shape[0]
        x = F.embedding(ids, model.model.embed_tokens.weight)
        for p in self._plan:
            layer, attn = p["layer"], p["attn"]
            q_width = attn.num_heads * attn.head_dim * (2 if attn.output_gate else 1)
            kv_width = attn.num_kv_heads * attn.head_dim
            q, k, v = self._products(layer.input_layernorm(x), p["qkv"]).split(
                [q_width, kv_width, kv_width], dim=-1)
            q, gate = attn._query(q, cos, sin, rotary)
            k, v = attn._key_value(k, v, cos, sin, rotary)
            if self.native:
                o = torch.ops.splitstack_cpu.paged_decode(q.float(), k, v, kv, p["fa"], slots,
                                                          self.head_dim ** -0.5)
            else:
                o = torch.ops.splitstack.paged_decode(q, k, v, kv, p["fa"], slots)
            o = o.to(x.dtype).reshape(n, -1)
            if gate is not None:
                o = o * torch.sigmoid(gate)
            h = x + self._lin(o, p["o"])
            gate_up = self._products(layer.post_attention_layernorm(h), p["gate_up"])
            g, u = gate_up.chunk(2, dim=-1)
            x = h + self._lin(F.silu(g) * u, p["down"])
        return self._lin(model.final_norm(x), self._head).float()

    # ---- steps ---------------------------------------------------------------------------
    def applies(self, out: SchedulerOutput) -> bool:
        """A decode-only step whose bucket's graph is built (a step in a bucket still
        compiling runs eagerly)."""
        return (bool(out.decode) and not out.prefill
                and bucket_for(len(out.decode), self.batch_buckets) in self.compiled)

    def pending(self) -> int:
        """Buckets whose graph is still to be built (0 once a warm-up gave up)."""
        return 0 if self.gave_up else len(set(self.batch_buckets) - self.compiled)

    def warm(self, up_to: int | None = None) -> float:
        """Build the graphs of every bucket (up to the one that holds `up_to` rows);
        returns the seconds it took. Each is traced and run once on a scratch cache of the
        real one's shape (its untouched pages cost no memory), then the engine's steps of
        that bucket use it."""
        start = time.perf_counter()
        last = bucket_for(up_to, self.batch_buckets) if up_to else None
        kv = self.cache.kv
        scratch = lazy_zeros(*kv.shape, dtype=kv.dtype, device=kv.device)
        for batch in self.batch_buckets:
            if last is not None and batch > last:
                break
            t = time.perf_counter()
            self._call(batch, [0] * batch, [0] * batch, [[0]] * batch, [1] * batch, batch,
                       kv=scratch)
            self.compiled.add(batch)
            log.info("compiled the decode step for batch %d in %.1f s", batch,
                     time.perf_counter() - t)
        return time.perf_counter() - start

    def warm_in_background(self) -> threading.Thread:
        """`warm` on a daemon thread, while the engine steps eagerly; each bucket serves
        steps as soon as it is built. A failure leaves the rest eager and is logged."""
        def build():
            try:
                log.info("compiled the decode step in %.0f s (batch buckets %s), beside the "
                         "engine", self.warm(), self.batch_buckets)
            except Exception:   # inductor needs a C++ toolchain; serve without it
                self.gave_up = True
                log.warning("compiling the decode step failed; buckets %s run eagerly",
                            sorted(set(self.batch_buckets) - self.compiled), exc_info=True)

        thread = threading.Thread(target=build, name="compile-decode", daemon=True)
        thread.start()
        return thread

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [B, vocab] fp32 of the step's decode rows (the runner's `run` contract)."""
        rows = out.decode
        n = len(rows)
        batch = bucket_for(n, self.batch_buckets)
        pad = batch - n
        first = rows[0]
        ids = [c.seq.tokens[c.start] for c in rows] + [first.seq.tokens[first.start]] * pad
        positions = [c.start for c in rows] + [first.start] * pad
        tables = [c.seq.block_table for c in rows] + [first.seq.block_table] * pad
        lens = [c.start + 1 for c in rows] + [1] * pad
        self.used.add(batch)
        return self._call(batch, ids, positions, tables, lens, n)[:n]

    @torch.inference_mode()
    def _call(self, batch: int, ids: list[int], positions: list[int], tables: list[list[int]],
              lens: list[int], rows: int, kv: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket-`batch` graph on these rows; the first `rows` are real. `kv`: the
        cache it reads and writes (default: the engine's)."""
        bs = self.cache.block_size
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        slots = table[torch.arange(batch), pos // bs] * bs + pos % bs
        _STEP.weights, _STEP.rows = self.weights, rows
        _STEP.plan = cpu_paged.prepare(table, torch.tensor(lens, dtype=torch.long), bs,
                                       self.heads, self.head_dim)
        cos, sin = self.model.rotary.cos_sin(pos, self.model.dtype)
        if self.native:
            torch_ops.set_step(self._table, _STEP.plan, rows)
        try:
            return self._graph(torch.tensor(ids, dtype=torch.long), cos, sin, slots,
                               self.cache.kv if kv is None else kv)
        finally:
            _STEP.plan = _STEP.weights = None
            if self.native:
                torch_ops.clear_step()


def _input_guards_only(entries) -> list[bool]:
    """Keep the global-state guards and those on the graph's tensor inputs (which bucket a
    call is); drop those on what `self` reaches (fixed for the object's life, and the code
    object is the object's own)."""
    return [e.name == "" or (e.name in _INPUTS and e.guard_type == "TENSOR_MATCH")
            for e in entries]
