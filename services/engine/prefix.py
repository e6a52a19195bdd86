"""The engine's side of the prefix cache: restore hits into sequences, store finished prompts.

    admit   the scheduler asks `cached_tokens(seq)`: one lookup(tokens, max_len = n − 1) per
            admission; the Hit stays pending (pinned) until the sequence is admitted. The
            scheduler allocates blocks for its m rows plus the first chunk, which starts at
            m (`ScheduledChunk.cached = m`).
    begin   before the step runs: rows [0, m) of every FA layer's KV go into the sequence's
            own blocks (on a worker thread, overlapping the replay) while Tail-Replay writes
            the GDN states of the sequence's slot; then the Hit is released.
    run     the runner keeps the FA output hiddens of capturing prefill chunks only.
    end     the chunk that completes a prompt: its KV rows are gathered from the blocks, the
            hiddens joined, and the insert runs on the insert thread; the next lookup waits
            for it, so a lookup sees every prompt this engine stored before it.
    forget  finish, abort or failure: a pending Hit is released, captured rows dropped.

Ownership: this module never allocates or frees KV blocks or state slots (the scheduler
does); it writes only into a sequence's own blocks and slot, and owns each pending Hit's
pins. It is called from the engine thread only; its two worker threads touch only tensors
handed to them and the thread-safe `PrefixCache`. A cache failure never fails a request:
lookups degrade to a miss and failed inserts are logged.

Sequences prefilled by the RidgeFill prefill service (`seq.fill`) bypass the cache:
the service computes their whole prompt, and their rows are not inserted (they would need
the service's hiddens and per-row provenance; TODO(issue 6): insert them as FILLED rows).
Rows computed after a replayed hit carry the replay's approximation and are stored like any
other; dense models and r = 1 stay exact.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from models.model import CausalLM
from services.engine.kv_cache import CacheStorage
from services.engine.scheduler import ScheduledChunk
from services.engine.sequence import Sequence
from services.prefix_cache import Hit, PrefixCache
from services.prefix_cache.replay import (TailReplayConfig, hidden_layers, replay_len,
                                          tail_replay)
from services.prefix_cache.replay_graph import GraphedTailReplay

log = logging.getLogger(__name__)


class PrefixReuse:
    def __init__(self, cache: PrefixCache, model: CausalLM, storage: CacheStorage,
                 replay: TailReplayConfig = TailReplayConfig()):
        self.cache, self.model, self.storage, self.replay = cache, model, storage, replay
        self.metrics = cache.metrics
        self.hidden_layers = hidden_layers(model.config) if model.config.is_hybrid else ()
        self._looked: dict[int, Hit | None] = {}       # seq_id -> its admission lookup
        self._rows: dict[int, list[torch.Tensor]] = {}  # seq_id -> hidden rows [G, n, H] so far
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="prefix-kv")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="prefix-insert")
        self._inserts: list[Future] = []
        cuda = storage.kv.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(storage.kv.device) if cuda else None
        self._graphed = (GraphedTailReplay(model, replay.ffn_skip)
                         if cuda and replay.cuda_graphs and model.config.is_hybrid else None)

    @staticmethod
    def uses(seq: Sequence) -> bool:
        return seq.fill is None

    def ratio(self, seq: Sequence) -> float:
        r = seq.params.replay_ratio
        return self.replay.replay_ratio if r is None else r

    # ---- admission (scheduler hook) ------------------------------------------------
    def cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` the engine will restore before its first chunk runs."""
        if not self.uses(seq) or seq.num_tokens < 2 or seq.params.prompt_logprobs is not None:
            return 0                  # (prompt log-probs need every prompt row computed)
        if seq.seq_id not in self._looked:
            self.drain()
            try:
                hit = self.cache.lookup(seq.tokens, max_len=seq.num_tokens - 1)
            except Exception:  # a cache bug must not fail the request: serve it as a miss
                log.exception("prefix cache lookup failed")
                hit = None
            self._looked[seq.seq_id] = hit
        hit = self._looked[seq.seq_id]
        return 0 if hit is None else hit.length

    # ---- before a step -------------------------------------------------------------
    def begin(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, Exception]]:
        """Restore the hits of newly admitted sequences and mark the chunks that capture
        hiddens; returns the sequences whose restore failed (the engine fails them)."""
        failed = []
        for c in chunks:
            seq = c.seq
            if not self.uses(seq):
                continue
            if c.start == c.cached:              # the first chunk since admission
                hit = self._looked.pop(seq.seq_id, None)
                capture = not seq.output_ids     # store each prompt once, at first prefill
                prefix_hidden = None
                try:
                    if hit is not None:
                        prefix_hidden = self._restore(seq, hit, capture)
                except Exception as exc:
                    log.exception("prefix cache restore failed")
                    failed.append((seq, exc))
                    continue
                finally:
                    if hit is not None:
                        hit.release()
                if capture:
                    self._rows[seq.seq_id] = [] if prefix_hidden is None else [prefix_hidden]
                else:
                    self._rows.pop(seq.seq_id, None)
            c.capture = bool(self.hidden_layers) and seq.seq_id in self._rows
        return failed

    def _restore(self, seq: Sequence, hit: Hit, capture: bool) -> torch.Tensor | None:
        """KV rows [0, m) into the blocks, GDN states into the slot; returns the hit's
        hiddens [G, m, H] when the prompt will be stored (None for dense models)."""
        hybrid = self.model.config.is_hybrid
        want_hidden = capture and bool(self.hidden_layers)
        job = None
        if hybrid and self.replay.overlap:
            job = self._copier.submit(self._copy_kv, seq, hit, want_hidden)
        else:
            prefix_hidden = self._copy_kv(seq, hit, want_hidden)
        if hybrid:
            try:
                self._replay(seq, hit)
            except BaseException:
                if job is not None:      # it reads the hit and writes the blocks: let it end
                    wait([job])
                raise
        if job is not None:
            prefix_hidden = job.result()
        return prefix_hidden

    def _replay(self, seq: Sequence, hit: Hit) -> None:
        start = time.perf_counter()
        m = hit.length
        k = replay_len(m, self.ratio(seq), self.model.config.linear_conv_kernel_dim)
        tail = torch.tensor(seq.tokens[m - k:m], dtype=torch.long)
        tail_hidden = hit.hidden(m - k) if self.hidden_layers and k else None
        states = (self._graphed(tail, tail_hidden) if self._graphed is not None
                  else tail_replay(self.model, tail, tail_hidden, self.replay.ffn_skip))
        self.storage.conv[:, seq.state_slot] = states.conv
        self.storage.recurrent[:, seq.state_slot] = states.recurrent
        self.metrics.replay_seconds.observe(time.perf_counter() - start)

    def _copy_kv(self, seq: Sequence, hit: Hit, want_hidden: bool) -> torch.Tensor | None:
        start = time.perf_counter()
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            kv = hit.kv_to(self.storage.kv.device)          # [F, 2, m, KV, D] (device tier)
            slots = self.storage.token_slots(seq.block_table, hit.length)
            self.storage.write_kv_all(slots, kv)
            if stream is not None:
                stream.synchronize()
        self.metrics.transfer_seconds.observe(time.perf_counter() - start)
        return hit.hidden() if want_hidden else None

    # ---- after a step --------------------------------------------------------------
    def end(self, chunks: list[ScheduledChunk]) -> None:
        """After the runner: collect captured hiddens; store prompts that completed."""
        for c in chunks:
            rows = self._rows.get(c.seq.seq_id)
            if rows is None:
                continue
            if c.capture:
                rows.append(torch.stack(c.hidden))              # [G, n, H]
                c.hidden = []
            if c.start + c.length >= len(c.seq.prompt_ids):
                del self._rows[c.seq.seq_id]
                try:
                    self._insert(c.seq, rows)
                except Exception:
                    log.exception("prefix cache insert failed")

    def _insert(self, seq: Sequence, rows: list[torch.Tensor]) -> None:
        n = len(seq.prompt_ids)
        slots = self.storage.token_slots(seq.block_table, n)
        kv = self.storage.read_rows(slots).cpu()                               # [F, 2, n, KV, D]
        # a hit's cached rows come from the cache (host memory), the rest from the device
        hidden = (torch.cat([r.cpu() for r in rows], dim=1)                     # [G, n, H]
                  if self.hidden_layers else None)
        provenance = torch.zeros(n, dtype=torch.uint8)
        self._inserts.append(self._writer.submit(self.cache.insert, list(seq.prompt_ids), kv,
                                                 hidden, provenance))

    def drain(self) -> None:
        """Wait for the inserts in flight (failures are logged, never raised)."""
        inserts, self._inserts = self._inserts, []
        for f in inserts:
            try:
                f.result()
            except Exception:
                log.exception("prefix cache insert failed")

    # ---- endings -------------------------------------------------------------------
    def forget(self, seq: Sequence) -> None:
        hit = self._looked.pop(seq.seq_id, None)
        if hit is not None:
            hit.release()
        self._rows.pop(seq.seq_id, None)

    def close(self) -> None:
        self.drain()
        self._copier.shutdown()
        self._writer.shutdown()
