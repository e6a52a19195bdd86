"""The attention service: owns requests, holds the cache side's weights, drives decode.

Per step, for a batch of rows (prefill rows of new requests, or one decode row per running
request), with standard wiring (DESIGN.md, "Q-First decode protocol"):

    z, k, v = pool.stage(0, token ids)
    for each layer l:
        full attention:  q = Wq N1(z)
                         prefill: append k, v; (O, lse) = merge over shards of the causal
                                  sweep including the row itself
                         decode:  (O, lse) = merge over shards of the sweep of positions < j,
                                  then combine with the row's own k, v; append k, v
        linear attention: conv + delta rule from the request's state slot, gated norm, Wo
        u = z + Wo(out)
        z, k, v = pool.stage(l + 1, u)          (the last stage samples instead)

Holds: Wq, Wo, the attention norms and output gate, the GDN conv / gates / norm / out_proj
and every request's GDN states (in-process it shares the model object with the pool).
Scheduling: a request waits until its prompt fits on every shard (and a state slot is free);
a running request that cannot get a block for its next position preempts the newest running
request, which gives back everything and is recomputed from its tokens later. A request that
fails frees its blocks on every shard and its state slot; the others continue.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels.merge import combine_current, merge_many
from kernels.sampling import as_entries, sample
from models.config import FULL_ATTENTION
from models.gdn import GDNInputs
from models.model import CausalLM
from services.attention.shard import KVShard
from services.common.transport import Transport
from services.engine.block_manager import SlotPool
from services.engine.engine import PromptExport, StepOutput
from services.engine.sequence import GenerationParams, RequestError, check_request


@dataclass(eq=False)     # identity: membership tests must not compare tensors
class Request:
    seq_id: int
    prompt_ids: list[int]
    params: GenerationParams
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    num_cached: int = 0
    state_slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    prefilled: PromptExport | None = None     # its prompt, prefilled by the prefill service
    prompt_logprobs: list | None = None       # `params.prompt_logprobs`: TokenLogprobs of
                                              # prompt tokens 1..P−1, sent with the first token

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class AttentionService:
    def __init__(self, model: CausalLM, shards: list[KVShard], pool: Transport,
                 wiring: str = "standard", max_num_seqs: int = 16,
                 eos_token_ids: tuple[int, ...] = ()):
        if wiring not in ("standard", "qfirst"):
            raise ValueError(f"unknown wiring {wiring!r}")
        if wiring != model.config.wiring:
            raise ValueError(f"this checkpoint was trained for {model.config.wiring!r} "
                             f"wiring, not {wiring!r}")
        self.model, self.shards, self.pool, self.wiring = model, shards, pool, wiring
        self.cfg = model.config
        self.eos = tuple(eos_token_ids)
        self.slots = SlotPool(max_num_seqs) if self.cfg.is_hybrid else None
        gdn = self.cfg.linear_attention_layers
        self.gdn_index = {l: i for i, l in enumerate(gdn)}
        if gdn:
            self.conv = torch.zeros(len(gdn), max_num_seqs, self.cfg.gdn_conv_dim,
                                    self.cfg.linear_conv_kernel_dim - 1, dtype=model.dtype,
                                    device=model.device)
            self.rec = torch.zeros(len(gdn), max_num_seqs, self.cfg.linear_num_value_heads,
                                   self.cfg.linear_key_head_dim, self.cfg.linear_value_head_dim,
                                   device=model.device)
        self.max_num_seqs = max_num_seqs
        self.requests: dict[int, Request] = {}      # every request until popped
        self.waiting: deque[Request] = deque()      # not admitted (or preempted): no KV held
        self._ids = itertools.count()

    # ---- request lifecycle -----------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: GenerationParams,
                    prefilled: PromptExport | None = None) -> int:
        """`prefilled`: the prompt's KV, GDN states and logits from the prefill service;
        they are stored on admission and the first token sampled from the logits."""
        self.validate(prompt_ids, params)
        if prefilled is not None and prefilled.num_tokens != len(prompt_ids):
            raise RequestError("prompt", len(prompt_ids),
                               f"the prefill covers {prefilled.num_tokens} tokens")
        req = Request(next(self._ids), list(prompt_ids), params, prefilled=prefilled)
        if params.sampling.seed is not None:
            req.generator = torch.Generator().manual_seed(params.sampling.seed)
        self.requests[req.seq_id] = req
        self.waiting.append(req)
        return req.seq_id

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Refuse what this service can never run; reads only fixed sizes (any thread)."""
        check_request(prompt_ids, params, self.cfg.vocab_size)
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_position_embeddings:
            raise RequestError("max_tokens", params.max_tokens, "exceeds the context length")
        if any(s.blocks_needed(-1, total) > s.blocks.num_blocks for s in self.shards):
            raise RequestError("max_tokens", params.max_tokens,
                               "prompt + max_tokens exceeds this attention service's KV cache")

    def abort(self, seq_id: int) -> None:
        req = self.requests.get(seq_id)
        if req is not None and req.finish_reason is None:
            if req in self.waiting:
                self.waiting.remove(req)
            self.release(req, "abort")

    def release(self, req: Request, reason: str, error: str | None = None) -> None:
        self._free(req)
        req.finish_reason, req.error = reason, error

    def _free(self, req: Request) -> None:
        for shard in self.shards:
            shard.free(req.seq_id)
        if req.state_slot is not None:
            self.slots.free(req.state_slot)
            req.state_slot = None

    def running(self) -> list[Request]:
        return [r for r in self.requests.values()
                if r.finish_reason is None and r not in self.waiting]

    def has_unfinished(self) -> bool:
        return any(r.finish_reason is None for r in self.requests.values())

    def pop(self, seq_id: int) -> Request:
        return self.requests.pop(seq_id)

    @property
    def kv_usage(self) -> float:
        return max((s.blocks.usage for s in self.shards), default=0.0)

    # ---- scheduling: admission and preemption -----------------------------------------
    def _reserve(self, req: Request, length: int) -> bool:
        """Room on every shard for positions < `length`, or nothing taken at all."""
        need = [s.blocks_needed(req.seq_id, length) for s in self.shards]
        if not all(s.blocks.can_allocate(n) for s, n in zip(self.shards, need)):
            return False
        for s in self.shards:
            s.reserve(req.seq_id, length)
        return True

    def _preempt(self, req: Request) -> None:
        """Give back `req`'s blocks and state; it is recomputed from its tokens later."""
        self._free(req)
        req.num_cached = 0
        self.waiting.appendleft(req)

    def _schedule(self) -> None:
        running = self.running()
        for r in running:        # oldest first: each needs room for its next position
            while r.finish_reason is None and r not in self.waiting \
                    and not self._reserve(r, len(r.tokens)):
                victim = [x for x in running if x not in self.waiting][-1]
                self._preempt(victim)
        while self.waiting and len(self.running()) < self.max_num_seqs:
            req = self.waiting[0]
            if (self.slots is not None and not self.slots.num_free) \
                    or not self._reserve(req, len(req.tokens)):
                break
            self.waiting.popleft()
            if self.slots is not None:
                req.state_slot = self.slots.allocate()
                self.conv[:, req.state_slot].zero_()
                self.rec[:, req.state_slot].zero_()

    # ---- one step over rows ------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit what fits, then run one batched step: the prompts of newly admitted
        requests, or one decode row per running request. A failure (every pool replica
        down, say) fails the requests of this step only and frees their KV."""
        self._schedule()
        installed = [r for r in self.running() if r.prefilled is not None]
        outputs = [self._install(r) for r in installed]
        new = [r for r in self.running() if r.num_cached == 0]
        batch = new if new else [r for r in self.running() if r not in installed]
        if not batch:
            return outputs
        try:
            tokens, logprobs, logits = self._run(batch, decode=not new)
        except Exception as exc:  # noqa: BLE001 — reported on each request of the step
            error = f"{type(exc).__name__}: {exc}"
            for r in batch:
                self.release(r, "error", error)
            return outputs + [StepOutput(r.seq_id, None, None, True, "error", error)
                              for r in batch]
        for i, r in enumerate(batch):
            r.num_cached = len(r.tokens)
            outputs.append(self._emit(r, int(tokens[i]), float(logprobs[i]), logits[i]))
        return outputs

    def _emit(self, r: Request, tok: int, logprob: float, logits: torch.Tensor) -> StepOutput:
        r.output_ids.append(tok)
        if r.params.return_logits:
            r.logits.append(logits.clone())
        if r.params.stops(r.output_ids, tok, self.eos):
            self.release(r, "stop")
        elif len(r.output_ids) >= r.params.max_tokens:
            self.release(r, "length")
        prompt = r.prompt_logprobs if len(r.output_ids) == 1 else None
        return StepOutput(r.seq_id, tok, logprob, r.finish_reason is not None, r.finish_reason,
                          top_logprobs=r.params.top_logprobs(logits), prompt_logprobs=prompt)

    def _install(self, r: Request) -> StepOutput:
        """Store an admitted request's prefilled prompt and sample its first token; the
        prefill is dropped either way (after a preemption the prompt is recomputed here)."""
        ex, r.prefilled = r.prefilled, None
        try:
            for i, l in enumerate(self.cfg.full_attention_layers):
                for s in self.shards:
                    s.write_prompt(l, r.seq_id, ex.kv[i, 0], ex.kv[i, 1])
            if r.state_slot is not None:
                self.conv[:, r.state_slot] = ex.conv
                self.rec[:, r.state_slot] = ex.recurrent
            tokens, logprobs = sample(ex.logits[None].float(), [r.params.sampling],
                                      [r.generator],
                                      [r.params.history(r.prompt_ids, r.output_ids, self.eos)])
        except Exception as exc:  # noqa: BLE001 — this request only
            error = f"{type(exc).__name__}: {exc}"
            self.release(r, "error", error)
            return StepOutput(r.seq_id, None, None, True, "error", error)
        r.num_cached = len(r.prompt_ids)
        return self._emit(r, int(tokens[0]), float(logprobs[0]), ex.logits.float())

    @torch.inference_mode()
    def _run(self, batch: list[Request], decode: bool):
        seq_ids, positions, ids = [], [], []
        for r in batch:
            span = range(r.num_cached, len(r.tokens))
            seq_ids += [r.seq_id] * len(span)
            positions += list(span)
            ids += r.tokens[r.num_cached:]
        dev = self.model.device
        pos = torch.tensor(positions, device=dev)
        pending = self.pool.submit("stage", 0, torch.tensor(ids, device=dev), pos)
        u = None                     # what `pending` was computed from: layer l−1's MLP input
        for l in range(self.cfg.num_hidden_layers):
            if self.model.layer(l).kind == FULL_ATTENTION:
                u = self._full_attention(l, pending, seq_ids, pos, decode, u)
            else:
                u = self._gated_deltanet(l, pending.result(), batch, decode)
            if l + 1 < self.cfg.num_hidden_layers:
                pending = self.pool.submit("stage", l + 1, u, pos)
        if not decode:
            self._score_prompts(batch, seq_ids, positions, u)
        last = torch.tensor([i for i, s in enumerate(seq_ids)
                             if i + 1 == len(seq_ids) or seq_ids[i + 1] != s], device=dev)
        return self.pool.call("final", u[last], [r.params.sampling for r in batch],
                              [r.generator for r in batch],
                              [r.params.history(r.prompt_ids, r.output_ids, self.eos)
                               for r in batch])

    def _score_prompts(self, batch, seq_ids, positions, u) -> None:
        """Prompt log-probs of the requests that ask for them, from their prompt rows' last
        residual (the pool's `score`); once, on the request's first computation."""
        for r in batch:
            k = r.params.prompt_logprobs
            if k is None or r.prompt_logprobs is not None:
                continue
            rows = [i for i, (s, p) in enumerate(zip(seq_ids, positions))
                    if s == r.seq_id and p + 1 < len(r.prompt_ids)]
            if not rows:                          # a one-token prompt: nothing to score
                r.prompt_logprobs = []
                continue
            targets = torch.tensor([r.prompt_ids[positions[i] + 1] for i in rows],
                                   dtype=torch.long)
            r.prompt_logprobs = as_entries(targets,
                                           *self.pool.call("score", u[rows], targets, k))

    def _full_attention(self, l, pending, seq_ids, pos, decode, u_prev):
        m = self.model
        parts = None
        if decode and self.wiring == "qfirst" and l > 0:
            # q-first: q comes from u_prev, which the pool is still turning into z, k, v;
            # the cache sweep runs now, overlapping the pool's feed-forward
            q, gate = m.attn_query(l, m.norm_in(l, u_prev), pos)
            parts = [s.sweep(l, seq_ids, q, pos) for s in self.shards]
            out = pending.result()
        else:
            out = pending.result()
            q, gate = m.attn_query(l, m.norm_in(l, m.query_source(l, out.z, u_prev)), pos)
        if decode:   # sweep what is cached (< j), then fold in the row's own k, v
            if parts is None:
                parts = [s.sweep(l, seq_ids, q, pos) for s in self.shards]
            o, lse = combine_current(*merge_many(parts), q, out.k, out.v)
            for s in self.shards:
                s.append(l, seq_ids, pos, out.k, out.v)
        else:        # prompt rows: cache them first, then one causal sweep including self
            for s in self.shards:
                s.append(l, seq_ids, pos, out.k, out.v)
            o, _ = merge_many([s.sweep(l, seq_ids, q, pos + 1) for s in self.shards])
        return m.attn_output(l, out.z, o, gate)

    def _gated_deltanet(self, l, out, batch, decode):
        gi = self.gdn_index[l]
        if decode:   # one row per request: a single batched recurrent step over their slots
            sl = torch.tensor([r.state_slot for r in batch], device=self.rec.device)
            inp = GDNInputs(*(t[:, None] for t in out.gdn))
            o, c, s = self.model.gdn_mix(l, inp, self.conv[gi, sl], self.rec[gi, sl])
            self.conv[gi, sl], self.rec[gi, sl] = c, s
            return self.model.gdn_output(l, out.z, o[:, 0], out.gdn.z)
        o = torch.empty_like(out.gdn.z)
        row = 0
        for r in batch:
            n = len(r.tokens)
            sl = r.state_slot
            inp = GDNInputs(*(t[row:row + n][None] for t in out.gdn))
            o_r, c, s = self.model.gdn_mix(l, inp, self.conv[gi, sl:sl + 1],
                                           self.rec[gi, sl:sl + 1])
            self.conv[gi, sl], self.rec[gi, sl] = c[0], s[0]
            o[row:row + n] = o_r[0]
            row += n
        return self.model.gdn_output(l, out.z, o, out.gdn.z)

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: GenerationParams) -> list[Request]:
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.requests.pop(i) for i in ids]
