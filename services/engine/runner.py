"""Runs one scheduled step through the model's stage API against the cache.

The step's tokens are flattened into rows `[N, hidden]` for every projection and MLP. The
sequence mixers are the only per-sequence part:

    rows:  | decode d0 d1 .. d(B-1) | prefill chunk s0 ........ | chunk s1 .... |
    FA:      one batched paged sweep   one sweep per chunk (causal, offset = start)
    GDN:     one batched recurrent     one chunked delta-rule call per chunk
             step over state slots     starting from the chunk's slot state

Returns the logits of the rows that sample (decode rows and chunks ending their sequence).
Prefill chunks marked `capture` also get the FA output hiddens of the `keep_hidden` layers
(the prefix cache's Tail-Replay groups); decode rows are never copied.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kernels.attention import get_backend
from kernels.attention.naive import PagedPlan
from kernels.sampling import History, SamplingParams, as_entries, sample, score_rows
from models.config import FULL_ATTENTION
from models.gdn import GDNInputs
from models.model import CausalLM
from services.engine import compiled_decode, decode_graph
from services.engine.kv_cache import CacheStorage
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.common.messages import PromptExport

log = logging.getLogger(__name__)


class CacheLayout(NamedTuple):
    """What the engine's allocators hand out, which a runner's storage must hold."""
    num_blocks: int
    block_size: int      # tokens per block
    num_slots: int       # Gated DeltaNet state slots (one per running sequence)


class SamplingRows(NamedTuple):
    """How each sampling row of a step draws its token, in `out.chunks` order."""
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[History]


class Sampled(NamedTuple):
    tokens: torch.Tensor       # [S] long
    logprobs: torch.Tensor     # [S] fp32, of the chosen tokens
    logits: torch.Tensor       # [S, V] fp32


class Runner(Protocol):
    """Executes scheduled steps against the storage it owns. The engine owns block ids
    and state slots; the runner only reads and writes what they index. Called by the
    engine thread only."""

    # True: `execute` may get its sampling rows as a Future, resolved only when it samples,
    # so the engine fills the grammars' masks on a thread while the layers run
    defers_sampling: bool

    def execute(self, out: SchedulerOutput,
                sampling: SamplingRows | Future[SamplingRows]) -> Sampled:
        """Run the step's chunks and draw a token for each chunk that samples."""

    def install(self, table: list[int], slot: int | None, export: PromptExport) -> None:
        """Store a prompt prefilled elsewhere (KV into the blocks of `table`, GDN states
        into `slot`)."""

    def keep_draft(self, slot: int, rows: int) -> None:
        """After a speculative step of a hybrid model's sequence: its GDN states in `slot`
        become those after the step's first `rows` rows (the accepted draft)."""


class DraftStates:
    """A runner's Gated DeltaNet states of its speculative steps' rows: a draft chunk's
    recurrence runs a row at a time (as plain decoding runs it), and the state after each
    row is kept until the engine says how many rows were accepted (`keep`), so a rejected
    draft rolls back."""

    def __init__(self, model: CausalLM, gdn_index: dict[int, int]):
        self.model, self.gdn_index = model, gdn_index
        self.pending: dict[tuple[int, int], tuple[list, list]] = {}  # (slot, gi) -> states

    def mix(self, l: int, inp: GDNInputs, conv: torch.Tensor, rec: torch.Tensor, slot: int):
        """`model.gdn_mix` over the draft chunk [1, n] of the sequence in `slot`."""
        outs, convs, recs = [], [], []
        for i in range(inp.z.shape[1]):
            o, conv, rec = self.model.gdn_mix(l, GDNInputs(*(t[:, i:i + 1] for t in inp)),
                                              conv, rec)
            outs.append(o)
            convs.append(conv[0])
            recs.append(rec[0])
        self.pending[(slot, self.gdn_index[l])] = (convs, recs)
        return torch.cat(outs, 1), conv, rec

    def keep(self, conv: torch.Tensor, rec: torch.Tensor, slot: int, rows: int) -> None:
        """conv, rec [G, slots, ...]: slot's states after its draft step's first `rows`."""
        for gi in range(conv.shape[0]):
            convs, recs = self.pending.pop((slot, gi))
            conv[gi, slot], rec[gi, slot] = convs[rows - 1], recs[rows - 1]


RunnerFactory = Callable[[CacheLayout], Runner]


def score_chunk(c: ScheduledChunk, x: torch.Tensor, scorer) -> None:
    """A chunk's prompt rows x [length, h]: each one's log-prob of the prompt token that
    follows it, appended to the sequence's `prompt_logprobs` (row j holds entry j; rows a
    preempted sequence computes again are not scored twice). `scorer(x, targets, k)` ->
    (log-probs, top tokens, top log-probs), as `kernels.sampling.score_rows`."""
    seq = c.seq
    j0 = max(len(seq.prompt_logprobs), c.start)
    j1 = min(c.start + c.length, len(seq.prompt_ids) - 1)
    if j0 >= j1:
        return
    if j0 != len(seq.prompt_logprobs):       # a gap would misalign the entries
        raise RuntimeError(f"prompt rows {len(seq.prompt_logprobs)}..{j0} were not scored")
    targets = torch.tensor(seq.prompt_ids[j0 + 1:j1 + 1], device=x.device)
    seq.prompt_logprobs += as_entries(targets, *scorer(
        x[j0 - c.start:j1 - c.start], targets, seq.params.prompt_logprobs))


@dataclass
class StepTensors:
    """Everything the layers need, built once per step from plain block tables."""
    ids: torch.Tensor             # [N]
    positions: torch.Tensor       # [N]
    slots: torch.Tensor           # [N] flat cache slot of each row
    num_decode: int
    dec_plan: PagedPlan | None    # the paged rows' view of the cache (shared by layers)
    dec_state_slots: torch.Tensor  # [Bd]
    # (row0, len, plan, state slot, draft tokens): a speculative step's chunk has a draft
    prefill: list[tuple[int, int, PagedPlan | None, int | None, int]]
    sample_rows: torch.Tensor     # [S]
    # the rows `dec_plan` attends for, when not just the decode rows [0, num_decode): those
    # and every row of each draft chunk, each a one-row query over its sequence's prefix
    paged_rows: torch.Tensor | None = None


def prepare(out: SchedulerOutput, block_size: int, device, backend) -> StepTensors:
    ids, positions, slots = [], [], []
    for c in out.chunks:
        ids.extend(c.seq.tokens[c.start:c.start + c.length - c.draft] + c.seq.draft[:c.draft])
        for p in range(c.start, c.start + c.length):
            positions.append(p)
            slots.append(c.seq.block_table[p // block_size] * block_size + p % block_size)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    # one-row queries over the paged cache: the decode rows, and a draft chunk's rows (row
    # i of a chunk at `start` sees positions <= start + i, its own k, v written first), so
    # a speculative step attends as its decode steps would, in one kernel call per layer
    paged = [(c.seq.block_table, c.start + 1) for c in out.decode]
    paged_rows = list(range(len(out.decode)))
    prefill, row, sample_rows = [], len(out.decode), list(range(len(out.decode)))
    for c in out.prefill:
        plan = None
        if c.draft:
            paged += [(c.seq.block_table, c.start + 1 + i) for i in range(c.length)]
            paged_rows += range(row, row + c.length)
        elif c.start > 0:   # continues a sequence: attend over its cached prefix as well
            plan = backend.plan_paged(as_long([c.seq.block_table]), as_long([c.start + c.length]),
                                      block_size, c.length, as_long([c.start]))
        prefill.append((row, c.length, plan, c.seq.state_slot, c.draft))
        row += c.length
        if c.sample:        # the last row; every row of a speculative step
            sample_rows.extend(range(row - 1 - c.draft, row))
    dec_plan = None
    if paged:
        width = max(len(table) for table, _ in paged)
        tables = [table + [-1] * (width - len(table)) for table, _ in paged]
        dec_plan = backend.plan_paged(as_long(tables).view(len(tables), width),
                                      as_long([n for _, n in paged]), block_size, 1)
    return StepTensors(
        as_long(ids), as_long(positions), as_long(slots), len(out.decode), dec_plan,
        as_long([c.seq.state_slot if c.seq.state_slot is not None else 0 for c in out.decode]),
        prefill, as_long(sample_rows),
        as_long(paged_rows) if len(paged_rows) > len(out.decode) else None)


class ModelRunner:
    """The monolithic runner: the whole model in this process, the cache in a
    `CacheStorage` (embedded server, prefill replicas)."""

    defers_sampling = True       # the masks are filled while the forward runs

    def __init__(self, model: CausalLM, cache: CacheStorage, attention_backend: str | None = None,
                 keep_hidden: tuple[int, ...] = (), compile_buckets: tuple[int, ...] = (),
                 compile_in_background: bool = False):
        """`compile_buckets`: run decode-only steps of up to the largest bucket through
        `torch.compile`d graphs, one per bucket, built here (`compiled_decode`; CPU, dense
        full-attention models; others keep the eager step and log why), or with
        `compile_in_background` on a thread while steps run eagerly."""
        self.model = model
        self.cache = cache
        self.drafts = DraftStates(model, cache.gdn_index)
        self.attn = get_backend(attention_backend, model.device)
        self.keep_hidden = frozenset(keep_hidden)   # layers whose output capturing chunks keep
        # decode-only steps through CUDA graphs (SPLITSTACK_DECODE_GRAPHS=1, CUDA only)
        self.decode_graphs = None
        if decode_graph.enabled(model.device):
            max_len = min(model.config.max_position_embeddings,
                          cache.kv.shape[2] * cache.block_size)
            self.decode_graphs = decode_graph.DecodeGraphs(self, max_len)
        self.compiled = None
        if compile_buckets:
            reason = compiled_decode.unsupported(model)
            if reason:
                log.warning("decode steps run eagerly: %s", reason)
            else:
                self.compiled = compiled_decode.CompiledDecode(self, compile_buckets)
                if compile_in_background:
                    self.compiled.warm_in_background()
                else:
                    try:
                        log.info("compiled the decode step in %.0f s (batch buckets %s)",
                                 self.compiled.warm(), self.compiled.batch_buckets)
                    except Exception:   # inductor needs a C++ toolchain; serve without it
                        log.warning("compiling the decode step failed; decode steps run "
                                    "eagerly", exc_info=True)
                        self.compiled = None

    def execute(self, out: SchedulerOutput,
                sampling: SamplingRows | Future[SamplingRows]) -> Sampled:
        logits = self.run(out)
        if isinstance(sampling, Future):
            sampling = sampling.result()
        return Sampled(*sample(logits, *sampling), logits)

    def install(self, table: list[int], slot: int | None, export: PromptExport) -> None:
        self.cache.write_kv_all(self.cache.token_slots(table, export.num_tokens), export.kv)
        if slot is not None:
            self.cache.conv[:, slot] = export.conv
            self.cache.recurrent[:, slot] = export.recurrent

    def keep_draft(self, slot: int, rows: int) -> None:
        self.drafts.keep(self.cache.conv, self.cache.recurrent, slot, rows)

    def export(self, table: list[int], slot: int | None, num_tokens: int) -> PromptExport:
        """A copy of positions [0, num_tokens) and the state slot, for decode elsewhere."""
        conv = rec = None
        if slot is not None:
            conv = self.cache.conv[:, slot].clone()
            rec = self.cache.recurrent[:, slot].clone()
        return PromptExport(self.cache.read_rows(self.cache.token_slots(table, num_tokens)),
                            conv, rec)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.applies(out):
            return self.decode_graphs.run(out)
        if self.compiled is not None and self.compiled.applies(out):
            return self.compiled.run(out)
        st = prepare(out, self.cache.block_size, self.model.device, self.attn)
        for c in out.prefill:
            if c.start == 0 and c.seq.state_slot is not None:
                self.cache.reset_slot(c.seq.state_slot)
        keep = [(row, n, c) for (row, n, *_), c in zip(st.prefill, out.prefill) if c.capture]
        x = self.forward(st, keep)
        for (row, n, *_), c in zip(st.prefill, out.prefill):
            if c.seq.params.prompt_logprobs is not None:
                score_chunk(c, x[row:row + n],
                            lambda h, t, k: score_rows(self.model.final, h, t, k))
        return self.model.final(x[st.sample_rows]).float()

    def forward(self, st: StepTensors, keep=()) -> torch.Tensor:
        """Every layer over the step's rows -> the last layer's output [N, H]. `keep`:
        (row, length, chunk) of capturing prefill chunks, whose FA output hiddens of the
        `keep_hidden` layers go to `chunk.hidden`."""
        x, h = self.model.embed(st.ids), None
        for l, layer in enumerate(self.model.model.layers):
            if layer.kind == FULL_ATTENTION:
                h = self._full_attention(l, x, st, h)
            else:
                h = self._gated_deltanet(l, x, st)
            x = self.model.mlp(l, h)
            if keep and l in self.keep_hidden:
                for row, n, c in keep:
                    c.hidden.append(x[row:row + n].clone())
        return x

    def decode_step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    plan: PagedPlan, state_slots: torch.Tensor) -> torch.Tensor:
        """A decode-only step from tensors already on the device (what a captured CUDA
        graph replays, `decode_graph`): each row's logits [B, V] in fp32."""
        st = StepTensors(ids, positions, slots, ids.shape[0], plan, state_slots, [], None)
        return self.model.final(self.forward(st)).float()

    def _full_attention(self, l: int, x: torch.Tensor, st: StepTensors,
                        u: torch.Tensor | None) -> torch.Tensor:
        a = self.model.attn_inputs(l, x, st.positions, u=u)
        self.cache.write_kv(l, st.slots, a.k, a.v)
        k_cache, v_cache = self.cache.k(l), self.cache.v(l)
        o = torch.empty_like(a.q)
        nd = st.num_decode
        if st.paged_rows is not None:    # decode rows and draft rows, one query each
            rows = st.paged_rows
            o_rows = self.attn.run_paged(a.q[rows, None], k_cache, v_cache, st.dec_plan)[0]
            o[rows] = o_rows[:, 0].to(o.dtype)
        elif nd:
            o[:nd] = self.attn.run_paged(a.q[:nd, None], k_cache, v_cache, st.dec_plan)[0][:, 0]
        for row, n, plan, _, draft in st.prefill:
            if draft:
                continue
            q = a.q[row:row + n][None]
            if plan is None:   # fresh prompt: its keys are exactly this chunk's rows
                o_seq, _ = self.attn.attention_lse(q, a.k[row:row + n][None],
                                                   a.v[row:row + n][None], causal=True)
            else:
                o_seq, _ = self.attn.run_paged(q, k_cache, v_cache, plan)
            o[row:row + n] = o_seq[0]
        return self.model.attn_output(l, x, o, a.gate)

    def _gated_deltanet(self, l: int, x: torch.Tensor, st: StepTensors) -> torch.Tensor:
        inp = self.model.gdn_inputs(l, x)
        gi = self.cache.gdn_index[l]
        conv, rec = self.cache.conv[gi], self.cache.recurrent[gi]
        o = torch.empty_like(inp.z)
        nd = st.num_decode
        if nd:
            sl = st.dec_state_slots
            dec = GDNInputs(*(t[:nd, None] for t in inp))
            o_dec, conv[sl], rec[sl] = self.model.gdn_mix(l, dec, conv[sl], rec[sl])
            o[:nd] = o_dec[:, 0]
        for row, n, _, slot, draft in st.prefill:
            seq_in = GDNInputs(*(t[row:row + n][None] for t in inp))
            state = conv[slot:slot + 1], rec[slot:slot + 1]
            o_seq, c_new, r_new = (self.drafts.mix(l, seq_in, *state, slot) if draft
                                   else self.model.gdn_mix(l, seq_in, *state))
            conv[slot], rec[slot] = c_new[0], r_new[0]
            o[row:row + n] = o_seq[0]
        return self.model.gdn_output(l, x, o, inp.z)
