"""Continuous-batching scheduler: decode rows first, then prefill chunks in the token budget.

One step mixes every running sequence's next decode token with as many prompt chunks as fit
in `max_num_batched_tokens` (a long prompt is prefilled in chunks of `max_prefill_chunk`
across steps, so decodes never stall behind it). Blocks and state slots are taken here, at
schedule time; when a decode row cannot get a block, the newest running sequence is
preempted (its blocks and slot are freed and it is recomputed later).

A request whose prompt is prefilled elsewhere waits in `remote` (WAITING_FOR_REMOTE_KVS,
vLLM's state of that name) until the engine sees its prefill arrive (`remote_done`), then
queues for admission with its KV to install.

With a prefix cache, admission asks `cached_tokens(seq)` how many leading tokens the engine
will restore from the cache (at most n − 1). Their blocks are taken with the first chunk's,
`num_computed` starts there, and the chunk carries `cached` so the engine writes those rows
before the step runs:

    prompt    | cached: restored by the engine | first chunk | later chunks ...
    blocks    taken at admission ............................ | taken as chunks go
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager, SlotPool
from services.engine.sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int       # first position computed this step (== seq.num_computed)
    length: int      # tokens computed this step
    sample: bool     # the chunk reaches the sequence's end: sample a token from its last row
    logits: object = None   # set by an out-of-band (prefill service) prefill
    cached: int = 0         # first chunk after admission: rows [0, cached) come from the
                            # prefix cache (start == cached); 0 otherwise
    capture: bool = False   # keep this chunk's FA output hiddens (set by the engine)
    hidden: list = field(default_factory=list)  # [G] of [length, H], filled by the runner
    draft: int = 0          # a speculative step: the sequence's last token then its first
                            # `draft` draft tokens (length 1 + draft), every row sampled


@dataclass
class SchedulerOutput:
    decode: list[ScheduledChunk]     # length-1 chunks, batched together
    prefill: list[ScheduledChunk]    # longer chunks, one attention call each (a speculative
                                     # step's chunk among them)
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decode + self.prefill


class Scheduler:
    def __init__(self, blocks: BlockManager, slots: SlotPool | None, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_chunk: int,
                 cached_tokens: Callable[[Sequence], int] | None = None):
        self.blocks = blocks
        self.cached_tokens = cached_tokens   # prefix-cache hook, see the module docstring
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.remote: list[Sequence] = []     # WAITING_FOR_REMOTE_KVS, not schedulable yet

    def add(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING_FOR_REMOTE_KVS:
            self.remote.append(seq)
        else:
            self.waiting.append(seq)

    def remote_done(self, seq: Sequence) -> None:
        """`seq`'s prompt arrived from elsewhere: it waits for admission like any other."""
        self.remote.remove(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Give back everything `seq` holds; safe to call once per admission."""
        self.blocks.free(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None
        seq.num_computed = 0

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.remote:
            self.remote.remove(seq)

    def _preempt_newest(self, out: SchedulerOutput, protect: Sequence) -> bool:
        for victim in reversed(self.running):
            if victim is not protect:
                self.running.remove(victim)
                self.release(victim)
                victim.status = Status.WAITING
                self.waiting.appendleft(victim)
                out.preempted.append(victim)
                out.decode = [c for c in out.decode if c.seq is not victim]
                out.prefill = [c for c in out.prefill if c.seq is not victim]
                return True
        return False

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_once()
        # Running prefills can hold every block between them and all stall; give the
        # oldest room by recomputing the newest, until one of them can move.
        while out.empty and len(self.running) > 1:
            preempted = out.preempted
            self._preempt_newest(out, protect=self.running[0])
            out = self._schedule_once()
            out.preempted = preempted + out.preempted
        return out

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        # 1. decode rows and partial prefills of running sequences, oldest first
        for seq in list(self.running):
            if seq not in self.running:
                continue                     # preempted by an older sequence this step
            todo = seq.num_uncomputed
            if todo == 1 and seq.draft:
                chunk = self._take_draft(seq, budget)
                if chunk:
                    out.prefill.append(chunk)
                    budget -= chunk.length
                    continue
            if todo == 1:
                while not self.blocks.can_allocate(
                        max(0, self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table))):
                    if not self._preempt_newest(out, protect=seq):
                        break
                if seq not in self.running:
                    continue
                self.blocks.grow(seq.block_table, seq.num_tokens)
                out.decode.append(ScheduledChunk(seq, seq.num_computed, 1, True))
                budget -= 1
            elif todo > 1 and budget > 0:
                chunk = self._take_chunk(seq, budget)
                if chunk:
                    out.prefill.append(chunk)
                    budget -= chunk.length
        # 2. admit waiting sequences while budget, seats, blocks and slots allow
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.slots is not None and self.slots.num_free == 0:
                break
            if seq.whole_prefill:
                # the prefill service takes the whole prompt at once: it needs every block
                # now and the step's prefill budget to itself
                if out.prefill or not self.blocks.can_allocate(
                        self.blocks.blocks_for(seq.num_uncomputed)):
                    break
                self._admit(seq)
                self.blocks.grow(seq.block_table, seq.num_tokens)
                out.prefill.append(ScheduledChunk(seq, 0, seq.num_tokens, True))
                budget = 0
                break
            cached = self.cached_tokens(seq) if self.cached_tokens is not None else 0
            n = min(seq.num_uncomputed - cached, self.max_prefill_chunk, budget)
            if not self.blocks.can_allocate(self.blocks.blocks_for(cached + n)):
                break
            self._admit(seq)
            self.blocks.grow(seq.block_table, cached)
            seq.num_computed = cached
            chunk = self._take_chunk(seq, budget)
            chunk.cached = cached
            out.prefill.append(chunk)
            budget -= chunk.length
        return out

    def _admit(self, seq: Sequence) -> None:
        """The head of the queue starts running, with a state slot for hybrid models."""
        self.waiting.popleft()
        if self.slots is not None:
            seq.state_slot = self.slots.allocate()
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _take_draft(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """A speculative step for `seq`: its last token and its draft, when the budget and
        free blocks hold them (never preempting for a draft); else its draft is dropped and
        it decodes one token."""
        k = len(seq.draft)
        need = self.blocks.blocks_for(seq.num_tokens + k) - len(seq.block_table)
        if budget < 1 + k or not self.blocks.can_allocate(need):
            seq.draft = []
            return None
        self.blocks.grow(seq.block_table, seq.num_tokens + k)
        return ScheduledChunk(seq, seq.num_computed, 1 + k, True, draft=k)

    def _take_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        n = min(seq.num_uncomputed, self.max_prefill_chunk, budget)
        free_room = len(seq.block_table) * self.blocks.block_size - seq.num_computed
        extra = self.blocks.blocks_for(max(0, n - free_room))
        if not self.blocks.can_allocate(extra):
            n = free_room + self.blocks.num_free * self.blocks.block_size
            n = min(n, seq.num_uncomputed)
            if n <= 0:
                return None
        self.blocks.grow(seq.block_table, seq.num_computed + n)
        return ScheduledChunk(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens)
