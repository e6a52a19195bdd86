"""The Q-First runner: executes the engine's scheduled steps as the cache side of Q-First
disaggregated decode (seed 003; docs/design/qfirst.md).

Per step, for the flattened rows of its chunks (decode rows first, then prefill chunks):

    z, k, v = pool.stage(0, token ids)
    for each layer l:
        full attention:  q = Wq N1(z)           (q-first wiring: Wq N1(u), before the reply)
                         standard wiring: append k, v; (O, lse) = merge over shards of the
                                       causal sweep up to and including each row
                         q-first wiring, decode rows: (O, lse) = merge over shards of the
                                       sweep of the sequence's cached positions < j (while
                                       the pool runs), combined with the row's own k, v;
                                       prefill rows as under standard wiring
        linear attention: conv + delta rule from the sequence's state slot, gated norm, Wo
        u = z + Wo(out)
        z, k, v = pool.stage(l + 1, u)          (the last stage samples instead)

Holds: Wq, Wo, the attention norms and output gate, the GDN conv / gates / norm / out_proj,
the KV shards and every sequence's GDN states. The pool holds the rest (embeddings, every
feed-forward, Wk / Wv, the LM head) and no request state. Under q-first wiring the decode
rows' sweep runs while the pool computes the previous feed-forward.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from kernels.merge import combine_current, merge_many
from models.config import FULL_ATTENTION
from models.gdn import GDNInputs
from models.model import CausalLM
from services.attention.shard import KVShard, SeqRows, table_runs
from services.common.messages import PromptExport
from services.common.transport import Transport
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.runner import (CacheLayout, DraftStates, Sampled, SamplingRows,
                                   score_chunk)
from services.engine.scheduler import SchedulerOutput

WIRINGS = ("standard", "qfirst")
SPLIT_ROWS = 4      # a step of this many rows or more runs as two overlapped parts


class _Pass:
    """One part of a step on its way through the layers."""

    def __init__(self, out: SchedulerOutput, st: StepRows):
        self.out, self.st = out, st
        self.pending = None      # its stage call in flight
        self.u = None            # what `pending` was computed from: layer l−1's MLP input


class StepRows:
    """A step's rows as the shards see them, built once per step."""

    def __init__(self, out: SchedulerOutput, shards: list[KVShard], device):
        ids, positions, tables = [], [], []
        self.seqs: list[SeqRows] = []
        for c in out.chunks:
            rows = list(range(len(ids), len(ids) + c.length))
            table = c.seq.block_table
            self.seqs.append(SeqRows(rows, table, table_runs(table)))
            # a speculative step: the sequence's last token, then its draft
            ids += c.seq.tokens[c.start:c.start + c.length - c.draft] + c.seq.draft[:c.draft]
            positions += range(c.start, c.start + c.length)
            tables += [table] * c.length
        self.num_decode = len(out.decode)
        self.decode, self.prefill = self.seqs[:self.num_decode], self.seqs[self.num_decode:]
        self.positions = positions
        self.ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.pos = torch.tensor(positions, dtype=torch.long, device=device)
        # decode rows see positions < j (their own k, v is combined in); prefill rows
        # see up to and including themselves
        self.limits = [p + (i >= self.num_decode) for i, p in enumerate(positions)]
        # every row, once its own k, v is written: positions <= j
        self.after = [p + 1 for p in positions]
        self._plans: dict = {}
        self.writes = []                 # per shard: (row indices, flat slots)
        for s in shards:
            rows, slots = s.slots(tables, positions)
            self.writes.append((torch.tensor(rows, dtype=torch.long, device=device),
                                torch.tensor(slots, dtype=torch.long)))

    def sweep(self, shard: KVShard, layer: int, q: torch.Tensor, which: str):
        """`shard`'s sweep of `which` rows: "decode" (before their own k, v is written),
        "prefill", or "all" (after every row's k, v is written); the decode kernel's plan
        is built at the first layer and reused by the others."""
        seqs = self.decode if which == "decode" else self.prefill if which == "prefill" \
            else self.seqs
        limits = self.after if which == "all" else self.limits
        key = (which, shard.index)
        plan = self._plans.get(key)
        if plan is None and shard.kv.device.type == "cpu":
            plan = self._plans[key] = shard.plan(seqs, limits, q.shape[1])
        return shard.sweep(layer, seqs, q, limits, plan)


class QFirstRunner:
    # the grammars' masks are computed while the layers run: they are needed only by
    # the final call, and the step waits on the pool's replies meanwhile
    defers_sampling = True

    def __init__(self, model: CausalLM, pool: Transport, layout: CacheLayout,
                 num_shards: int = 1, wiring: str | None = None,
                 names: list[str] | None = None, shards: list[KVShard] | None = None):
        """`layout.block_size` (the engine's) is `num_shards` shard blocks: see
        `services.attention.shard`. `shards`: storage to use instead of allocating it (a
        benchmark shares one filled cache between two runners)."""
        wiring = wiring or model.config.wiring
        if wiring not in WIRINGS:
            raise ValueError(f"unknown wiring {wiring!r}")
        if wiring != model.config.wiring:
            raise ValueError(f"this checkpoint was trained for {model.config.wiring!r} "
                             f"wiring, not {wiring!r}")
        if layout.block_size % num_shards:
            raise ValueError(f"block size {layout.block_size} is not a multiple of "
                             f"{num_shards} shards")
        self.model, self.pool, self.wiring = model, pool, wiring
        self.cfg = cfg = model.config
        bs = layout.block_size // num_shards
        self.shards = shards or [KVShard(cfg, i, num_shards, layout.num_blocks, bs, model.dtype,
                                         name=names[i] if names else None, device=model.device)
                                 for i in range(num_shards)]
        if [(s.num_shards, s.block_size, s.kv.shape[3]) for s in self.shards] != \
                [(num_shards, bs, layout.num_blocks)] * num_shards:
            raise ValueError("the shards do not match the engine's cache layout")
        gdn = cfg.linear_attention_layers
        self.gdn_index = {l: i for i, l in enumerate(gdn)}
        self.drafts = DraftStates(model, self.gdn_index)
        self.conv = self.rec = None
        if gdn:
            self.conv = torch.zeros(len(gdn), layout.num_slots, cfg.gdn_conv_dim,
                                    cfg.linear_conv_kernel_dim - 1, dtype=model.dtype,
                                    device=model.device)
            self.rec = torch.zeros(len(gdn), layout.num_slots, cfg.linear_num_value_heads,
                                   cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                   device=model.device)

    # ---- the runner contract ---------------------------------------------------------
    def install(self, table: list[int], slot: int | None, export: PromptExport) -> None:
        for i, l in enumerate(self.cfg.full_attention_layers):
            for s in self.shards:
                s.write_prompt(l, table, export.kv[i, 0], export.kv[i, 1])
        if slot is not None:
            self.conv[:, slot] = export.conv
            self.rec[:, slot] = export.recurrent

    def keep_draft(self, slot: int, rows: int) -> None:
        self.drafts.keep(self.conv, self.rec, slot, rows)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                sampling: SamplingRows | Future[SamplingRows]) -> Sampled:
        for c in out.prefill:
            if c.start == 0 and c.seq.state_slot is not None:
                self.conv[:, c.seq.state_slot].zero_()
                self.rec[:, c.seq.state_slot].zero_()
        # one pass per part: each part's stage call is in flight while the others' layers run
        passes = [_Pass(part, StepRows(part, self.shards, self.model.device))
                  for part in self._parts(out)]
        for p in passes:
            p.pending = self.pool.submit("stage", 0, p.st.ids, p.st.pos)
        layers = self.cfg.num_hidden_layers
        for l in range(layers):
            for p in passes:
                if self.model.layer(l).kind == FULL_ATTENTION:
                    p.u = self._full_attention(l, p.pending, p.st, p.u)
                else:
                    p.u = self._gated_deltanet(l, p.pending.result(), p.out, p.st)
                if l + 1 < layers:
                    p.pending = self.pool.submit("stage", l + 1, p.u, p.st.pos)
        rows_of, offset = {}, 0    # each chunk's sampled rows in the passes' rows, end to end
        for p in passes:
            for seq_rows, c in zip(p.st.prefill, p.out.prefill):
                if c.seq.params.prompt_logprobs is not None:
                    score_chunk(c, p.u[seq_rows.rows],
                                lambda x, t, k: self.pool.call("score", x, t, k))
            for seq_rows, c in zip(p.st.seqs, p.out.chunks):   # the last row; every row
                rows_of[id(c)] = [offset + r for r in seq_rows.rows[-1 - c.draft:]]  # of a draft
            offset += len(p.u)
        last = [r for c in out.chunks if c.sample for r in rows_of[id(c)]]  # `out.chunks` order
        u = torch.cat([p.u for p in passes]) if len(passes) > 1 else passes[0].u
        if isinstance(sampling, Future):
            sampling = sampling.result()
        tokens, logprobs, logits = self.pool.call(
            "final", u[torch.tensor(last, dtype=torch.long, device=u.device)], *sampling)
        return Sampled(tokens, logprobs, logits)

    def _parts(self, out: SchedulerOutput) -> list[SchedulerOutput]:
        """Under standard wiring, a step of two or more chunks and at least `SPLIT_ROWS`
        rows, over a transport whose calls overlap (`Transport.pipelines`), runs as two
        parts of about equal rows: one part's layers on this side while the pool computes
        the other's stage, so both sides compute at once (a ping-pong pipeline). Any other
        step is one part. (Q-first wiring overlaps within one pass already: its sweep runs
        while the pool computes.)"""
        chunks = out.chunks
        if (self.wiring != "standard" or not self.pool.pipelines or len(chunks) < 2
                or sum(c.length for c in chunks) < SPLIT_ROWS):
            return [out]
        half = len(out.decode) // 2
        parts = [SchedulerOutput(out.decode[:half], [], []),
                 SchedulerOutput(out.decode[half:], [], [])]
        for chunk in sorted(out.prefill, key=lambda c: -c.length):  # the longest first,
            rows = [sum(c.length for c in p.chunks) for p in parts]     # to the lighter part
            parts[rows.index(min(rows))].prefill.append(chunk)
        return [p for p in parts if not p.empty]

    # ---- layers ------------------------------------------------------------------------
    def _full_attention(self, l, pending, st: StepRows, u_prev):
        m, nd = self.model, st.num_decode
        parts = None
        early = u_prev is not None and m.query_source(l, None, u_prev) is u_prev
        if early and nd:
            # q-first: q comes from u_prev, which the pool is still turning into z, k, v;
            # the decode rows' cache sweep runs now, overlapping the pool's feed-forward
            q, gate = m.attn_query(l, m.norm_in(l, u_prev), st.pos)
            parts = [st.sweep(s, l, q, "decode") for s in self.shards]
            out = pending.result()
        else:
            out = pending.result()
            q, gate = m.attn_query(l, m.norm_in(l, m.query_source(l, out.z, u_prev)), st.pos)
        for s, (rows, slots) in zip(self.shards, st.writes):
            s.write(l, slots, out.k[rows], out.v[rows])
        if parts is None:
            # every row in one sweep per shard, its own k, v already written (as the
            # embedded runner attends)
            o, lse = merge_many([st.sweep(s, l, q, "all") for s in self.shards])
            return m.attn_output(l, out.z, o, gate)
        if st.prefill:         # the decode rows were swept early: the prefill rows now
            parts += [st.sweep(s, l, q, "prefill") for s in self.shards]
        o, lse = merge_many(parts)      # a row no part sees merges as empty (lse −inf)
        # decode rows: what is cached (< j), then fold in the row's own k, v
        o[:nd], _ = combine_current(o[:nd], lse[:nd], q[:nd], out.k[:nd], out.v[:nd])
        return m.attn_output(l, out.z, o, gate)

    def _gated_deltanet(self, l, out, sched: SchedulerOutput, st: StepRows):
        gi, nd = self.gdn_index[l], st.num_decode
        conv, rec = self.conv[gi], self.rec[gi]
        o = torch.empty_like(out.gdn.z)
        if nd:   # one row per sequence: a single batched recurrent step over their slots
            sl = torch.tensor([c.seq.state_slot for c in sched.decode], device=rec.device)
            inp = GDNInputs(*(t[:nd, None] for t in out.gdn))
            o_d, conv[sl], rec[sl] = self.model.gdn_mix(l, inp, conv[sl], rec[sl])
            o[:nd] = o_d[:, 0]
        for seq_rows, c in zip(st.prefill, sched.prefill):
            r0, n, slot = seq_rows.rows[0], len(seq_rows.rows), c.seq.state_slot
            inp = GDNInputs(*(t[r0:r0 + n][None] for t in out.gdn))
            state = conv[slot:slot + 1], rec[slot:slot + 1]
            o_p, c_new, r_new = (self.drafts.mix(l, inp, *state, slot) if c.draft
                                 else self.model.gdn_mix(l, inp, *state))
            conv[slot], rec[slot] = c_new[0], r_new[0]
            o[r0:r0 + n] = o_p[0]
        return self.model.gdn_output(l, out.z, o, out.gdn.z)


def qfirst_engine(model: CausalLM, pool: Transport, *, num_shards: int = 1,
                  block_size: int = 16, wiring: str | None = None,
                  config: EngineConfig | None = None, eos_token_ids: tuple[int, ...] = (),
                  shard_names: list[str] | None = None, shards: list[KVShard] | None = None,
                  prefill_service=None, grammars=None, **config_fields) -> LLMEngine:
    """The engine of an attention service: the one `LLMEngine` and its scheduler, with a
    `QFirstRunner` over `num_shards` KV shards of `block_size`-token blocks each.
    `prefill_service`: RidgeFill in this process (it needs the whole model: the `local`
    transport's); its prompts are installed into the shards like a prefill replica's.
    `grammars`: structured outputs (`structured.Grammars`); their masks travel to the pool
    with each sampling row.
    `config_fields`: more `EngineConfig` fields (num_blocks, kv_cache_bytes, max_num_seqs,
    ...); its block size is `block_size · num_shards`."""
    config = config or EngineConfig(block_size=block_size * num_shards, **config_fields)
    return LLMEngine(model, config, eos_token_ids=eos_token_ids,
                     prefill_service=prefill_service, grammars=grammars,
                     runner=lambda layout: QFirstRunner(model, pool, layout, num_shards,
                                                        wiring, shard_names, shards))
