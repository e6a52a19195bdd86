"""The engine: one request lifecycle for every deployment, continuous batching over a paged
cache.

    step():  out = scheduler.schedule()
             sampled = runner.execute(out, sampling rows)
             return postprocess(out, sampled)

Requests go in with `add_request` (validated there, so a bad request fails alone) and come
back as `StepOutput`s. `abort` and failures free the request's blocks and state slot at once.
What executes a step is the runner (vLLM v1's executor / nano-vllm's `ModelRunner`): the
monolithic `ModelRunner` by default (embedded server, prefill replicas), or the Q-First
runner of an attention service (`services.attention.runner`), built by `runner` from the
cache layout the engine's allocators hand out. With a `prefix_cache` (monolithic only),
admitted prompts start after their cached prefix (restored by `prefix.PrefixReuse` before
the step runs) and completed prompts are stored. A prompt prefilled elsewhere
(`add_request(..., prefilled=export)`, or `remote=` while that prefill is in flight: the
WAITING_FOR_REMOTE_KVS state) and a prompt this engine's RidgeFill prefill service prefills
are installed the same way, by the runner on admission, the first token sampled from the
export's logits. A request's prefill fields are resolved once, in `validate`.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kernels.sampling import sample
from models.model import CausalLM
from services.common.messages import (GenerationParams, PrefillRequest, PromptExport,
                                      RequestError, StepOutput, check_prompt_ids,
                                      check_request)
from services.engine import structured
from services.engine.block_manager import BlockManager, SlotPool
from services.engine.kv_cache import CacheStorage
from services.engine.metrics import StepStats
from services.engine.prefix import PrefixReuse
from services.engine.runner import (CacheLayout, ModelRunner, Runner, RunnerFactory, Sampled,
                                    SamplingRows)
from services.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from services.engine.sequence import Sequence, Status
from services.engine.speculative import (DraftPlanner, NgramConfig, SpecStats,
                                         draft_generators, drafts, propose)
from services.prefix_cache import PrefixCache
from services.prefix_cache.replay import TailReplayConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None        # default: kv_cache_bytes worth of blocks
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_prefill_chunk: int = 512
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    attention_backend: str | None = None
    compile_decode: bool = False         # decode-only steps as compiled graphs (CPU, dense FA)
    compile_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)   # batch sizes with a graph
    compile_in_background: bool = False  # build the graphs while steps run eagerly
    remote_prefill_timeout_s: float = 600.0   # a prompt prefilled elsewhere fails after this
    speculative: NgramConfig | None = None   # n-gram speculative decoding (`speculative`)
    # torch threads for a step that prefills at least PREFILL_ROWS prompt rows (None: the
    # process's, as for every other step): a prefill's products are large enough that
    # another core pays, where a decode step's many small ones stall on a preempted thread
    prefill_threads: int | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


PREFILL_ROWS = 16


@contextlib.contextmanager
def torch_threads(n: int | None):
    """`n` torch threads inside (None: unchanged)."""
    before = None if n is None else torch.get_num_threads()
    if n is None or n == before:           # every decode step: nothing to change
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(),
                 eos_token_ids: tuple[int, ...] = (), prefill_service=None,
                 prefix_cache: PrefixCache | None = None, replay_ratio: float = 0.1,
                 replay_overlap: bool | None = None, ffn_skip: bool = True,
                 runner: RunnerFactory | None = None, grammars=None):
        """`prefix_cache`: reuse cached prompt prefixes (Tail-Replay for hybrid models, with
        `replay_ratio` r unless a request sets its own, the KV write overlapping the replay
        (default: on CUDA only) and the tail-FFN skip); None: every prompt is prefilled in
        full. `runner`: builds the step executor for the engine's cache layout (default:
        the monolithic `ModelRunner`). `grammars`: compiles requests' structured outputs
        (`structured.Grammars`, which needs the tokenizer); None: such requests are
        refused."""
        self.grammars = grammars
        self._masker: ThreadPoolExecutor | None = None     # see `_deferred_rows`
        self.model = model
        self.prefill_service = prefill_service     # RidgeFill / out-of-band prefill
        self.config = config
        cfg = model.config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_bytes // max(1, CacheStorage.bytes_per_block(
                cfg, config.block_size, model.dtype)))
        num_blocks = min(num_blocks, config.max_num_seqs * -(-self.max_model_len // config.block_size))
        # a request may never need more blocks than exist: cap the context to the cache
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.slots = SlotPool(config.max_num_seqs) if cfg.is_hybrid else None
        layout = CacheLayout(num_blocks, config.block_size, config.max_num_seqs)
        self.cache: CacheStorage | None = None      # the monolithic runner's storage
        self.prefix = None
        if runner is None:
            self.cache = CacheStorage(cfg, num_blocks, config.block_size, config.max_num_seqs,
                                      model.dtype, model.device)
            if prefix_cache is not None:
                if replay_overlap is None:
                    # a side stream overlaps the KV copy on a GPU; on CPU the copy thread only
                    # takes cores from the replay (bench/tail_replay/ttft.py: slower there)
                    replay_overlap = torch.device(model.device).type == "cuda"
                replay = TailReplayConfig(replay_ratio, replay_overlap, ffn_skip)
                self.prefix = PrefixReuse(prefix_cache, model, self.cache, replay)
            self.runner: Runner = ModelRunner(
                model, self.cache, config.attention_backend,
                keep_hidden=self.prefix.hidden_layers if self.prefix else (),
                compile_buckets=self._compile_buckets(config),
                compile_in_background=config.compile_in_background)
        else:
            if prefix_cache is not None:
                raise ValueError("the prefix cache runs beside the monolithic runner (on the "
                                 "prefill replicas of a disaggregated deployment)")
            self.runner = runner(layout)
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk,
                                   cached_tokens=self.prefix.cached_tokens if self.prefix else None)
        self.eos_token_ids = tuple(eos_token_ids)
        self.seqs: dict[int, Sequence] = {}
        self.spec_stats = SpecStats()
        self.draft_planner = DraftPlanner()
        self.stats = StepStats()                     # services.engine.metrics exports both
        self._ids = itertools.count()

    @staticmethod
    def _compile_buckets(config: EngineConfig) -> tuple[int, ...]:
        """The batch buckets to compile: those up to the first that holds max_num_seqs."""
        if not config.compile_decode:
            return ()
        buckets = sorted(config.compile_buckets)
        if not buckets or buckets[0] < 1:
            raise ValueError(f"compile_buckets must be >= 1, got {config.compile_buckets}")
        kept = [b for b in buckets if b < config.max_num_seqs]
        kept += [b for b in buckets if b >= config.max_num_seqs][:1]
        return tuple(kept)

    # ---- requests ------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: GenerationParams, remote: bool = False):
        """Refuse what this engine can never run; returns the prompt's resolved fill
        settings (None: exact). `remote`: the prompt is prefilled elsewhere, whose engine
        resolves its prefill fields. Reads only fixed sizes and the prefill service's
        settings, so any thread may call it (an attention service checks a request before
        paying for its prefill)."""
        check_request(prompt_ids, params, self.model.config.vocab_size)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError("max_tokens", params.max_tokens,
                               f"prompt ({len(prompt_ids)} tokens) + max_tokens exceeds the "
                               f"context length {self.max_model_len}")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise RequestError("max_tokens", params.max_tokens,
                               f"needs {self.blocks.blocks_for(total)} KV blocks, the cache "
                               f"has {self.blocks.num_blocks}")
        if remote and params.prompt_logprobs is not None:
            raise RequestError("echo", True,
                               "the prompt's log-probs need this engine's own prefill; this "
                               "deployment prefills on prefill replicas")
        fill = None if remote else self._resolve_fill(params.prefill, len(prompt_ids))
        if params.prompt_logprobs is not None and fill is not None:
            raise RequestError("prompt_logprobs", params.prompt_logprobs,
                               "needs the exact prefill: RidgeFill computes only some prompt "
                               "rows through the upper layers")
        if params.export_prompt and self.cache is None:
            raise RequestError("export_prompt", True, "needs the monolithic runner")
        return fill

    def _resolve_fill(self, request: PrefillRequest | None, n: int):
        """The one place a request's prefill fields are checked: -> the `FillSettings` its
        prompt is prefilled with by this engine's prefill service (the server's defaults
        with the request's overrides), or None for the engine's own exact prefill."""
        if self.prefill_service is None:
            if request is not None and request.asks_for_fill:
                raise RequestError("prefill_mode" if request.mode not in (None, "exact")
                                   else "ridgefill", request.mode or request.overrides,
                                   "this server has no RidgeFill prefill service (start it "
                                   "with --maps)")
            return None
        mode, overrides = (request.mode, request.overrides) if request else (None, None)
        try:
            return self.prefill_service.resolve(mode, overrides, n)
        except ValueError as err:        # FillError, MapsError: a message naming the setting
            raise RequestError("ridgefill", overrides, str(err)) from err

    def add_request(self, prompt_ids: list[int], params: GenerationParams = GenerationParams(),
                    seq_id: int | None = None, prefilled: PromptExport | None = None,
                    output_ids: list[int] = (), remote=None, grammar=None) -> int:
        """`prefilled`: the prompt's KV, GDN states and logits, prefilled elsewhere (a
        prefill replica); stored on admission, and the first token sampled from the logits.
        `remote`: that prefill, still in flight (`done()`, `result()` -> `PromptExport`,
        `cancel()`): the request waits in WAITING_FOR_REMOTE_KVS until it arrives (or
        fails, or `remote_prefill_timeout_s` passes), then goes on as with `prefilled`.
        `output_ids`: tokens this request already generated elsewhere (a migrated request):
        they are prefilled with the prompt and count as output (`max_tokens`, penalties,
        `min_tokens`, stop checks), and a seeded sampler skips their draws, so the request
        continues exactly as an uninterrupted run would. `grammar`: `params.structured`
        compiled already (off this thread, by `compile_grammar`); else it is compiled
        here."""
        fill = self.validate(prompt_ids, params, remote=remote is not None)
        matcher = None
        if params.structured is not None:
            if grammar is None:
                grammar = self.compile_grammar(params)
            matcher = self.grammars.matcher(grammar, params.structured.after)
        output_ids = list(output_ids)
        if output_ids:
            check_prompt_ids(output_ids, self.model.config.vocab_size, "output_ids")
            if len(output_ids) >= params.max_tokens:
                raise RequestError("output_ids", len(output_ids),
                                   f"a request with max_tokens={params.max_tokens} has "
                                   "nothing left to generate")
        if prefilled is not None and prefilled.num_tokens != len(prompt_ids) + len(output_ids):
            raise RequestError("prompt", len(prompt_ids) + len(output_ids),
                               f"the prefill covers {prefilled.num_tokens} tokens")
        seq_id = next(self._ids) if seq_id is None else seq_id
        if seq_id in self.seqs:
            raise RequestError("seq_id", seq_id, "is already in use")
        seq = Sequence(seq_id, list(prompt_ids), params, output_ids=output_ids,
                       prefilled=prefilled, fill=None if prefilled is not None else fill,
                       remote=remote)
        if remote is not None:
            seq.status = Status.WAITING_FOR_REMOTE_KVS
        if matcher is not None:
            for tok in output_ids:                 # a migrated request: its grammar's place
                matcher.accept(tok)
            seq.matcher = matcher
            if self.grammars.metrics is not None:
                self.grammars.metrics.admitted(params.structured.kind)
        seq.skip_draws(len(output_ids), self.model.config.vocab_size)
        self.seqs[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def compile_grammar(self, params: GenerationParams):
        """`params.structured` compiled (None without one), for `add_request(grammar=)`;
        thread-safe, so callers run it off the step loop. Raises `RequestError` when the
        spec cannot compile or this engine has no grammars."""
        spec = params.structured
        if spec is None:
            return None
        if self.grammars is None:
            raise RequestError(spec.field, spec.kind, "structured outputs need the engine's "
                               "tokenizer, which this deployment's engine does not have")
        return self.grammars.compile(spec)

    def abort(self, seq_id: int) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.remote)

    def has_work(self) -> bool:
        """Whether a step now would do something: a request to schedule, or a prefill that
        arrived (or timed out) elsewhere. A driver with none waits for a command or
        `remote` completion instead of spinning."""
        return self.scheduler.has_work() or any(self._remote_settled(s)
                                                for s in self.scheduler.remote)

    def _remote_settled(self, seq: Sequence) -> bool:
        return (seq.remote.done() or time.monotonic() - seq.arrival_s
                > self.config.remote_prefill_timeout_s)

    def _collect_remote(self) -> list[StepOutput]:
        """Requests whose prefill arrived from elsewhere queue for admission with it; those
        whose prefill failed or timed out fail."""
        failed = []
        for seq in [s for s in self.scheduler.remote if self._remote_settled(s)]:
            remote, seq.remote = seq.remote, None
            seq.remote_s = time.monotonic() - seq.arrival_s
            if not remote.done():
                remote.cancel()
                failed.append(self._fail(seq, "the prefill elsewhere did not finish in "
                                              f"{self.config.remote_prefill_timeout_s:.0f} s"))
                continue
            try:
                seq.prefilled = remote.result()
            except Exception as exc:  # noqa: BLE001 — fails this request only
                failed.append(self._fail(seq, f"{type(exc).__name__}: {exc}"))
                continue
            self.scheduler.remote_done(seq)
        return failed

    def pop(self, seq_id: int) -> Sequence:
        """Forget a finished sequence (the caller has read its outputs)."""
        return self.seqs.pop(seq_id)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        failed = self._collect_remote() if self.scheduler.remote else []
        if self.config.speculative is not None:
            self._propose()
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if out.empty:
            return failed
        self.stats.iteration_tokens.observe(sum(c.length for c in out.chunks))
        now = time.monotonic()
        for c in out.prefill:
            if c.seq.scheduled_s is None:
                c.seq.scheduled_s = now
        if self.prefix is not None:
            failed += [self._fail(seq, f"{type(exc).__name__}: {exc}")
                       for seq, exc in self.prefix.begin(out.prefill)]
        whole = [c for c in out.prefill if c.start == 0 and not c.seq.finished
                 and (c.seq.prefilled is not None or c.seq.fill is not None)]
        failed += self._prefill_out_of_band(whole)
        out = SchedulerOutput([c for c in out.decode if not c.seq.finished],
                              [c for c in out.prefill if not c.seq.finished], out.preempted)
        inner = SchedulerOutput(out.decode, [c for c in out.prefill if c.logits is None], [])
        sampled = None
        if not inner.empty:
            prefill_rows = sum(c.length for c in inner.prefill)
            rows = self._deferred_rows(inner)
            try:
                started = time.perf_counter()
                with torch_threads(self.config.prefill_threads
                                   if prefill_rows >= PREFILL_ROWS else None):
                    sampled = self.runner.execute(inner, rows or self._sampling_rows(inner))
                if self.config.speculative is not None and all(c.draft for c in inner.prefill):
                    self.draft_planner.observe_step(len(inner.decode) + prefill_rows,
                                                    time.perf_counter() - started)
            except Exception as exc:  # a failed step fails only the requests in it
                if rows is not None:
                    wait([rows])         # its matchers are not read after the step
                log.exception("engine step failed")
                failed += [self._fail(c.seq, f"{type(exc).__name__}: {exc}")
                           for c in inner.chunks]
                out = SchedulerOutput([], [c for c in out.prefill if c.logits is not None], [])
        if self.prefix is not None and sampled is not None:   # before postprocess frees
            self.prefix.end(inner.prefill)                     # the blocks of finished ones
        exports = self._exports(out)
        return failed + self._postprocess(out, self._merge(out, sampled), exports)

    def _propose(self) -> None:
        """Each running greedy request about to decode drafts its next tokens (n-gram
        lookup), as many as its `max_tokens` and the context leave room for."""
        spec = self.config.speculative
        running = self.scheduler.running
        busy = spec.disable_by_batch_size is not None and len(running) > spec.disable_by_batch_size
        drafting, rows = [], 0
        for seq in running:
            seq.draft = []
            rows += seq.num_uncomputed == 1
            if not busy and seq.num_uncomputed == 1 and drafts(seq):
                room = min(seq.params.max_tokens - len(seq.output_ids) - 1,
                           self.max_model_len - seq.num_tokens)
                seq.draft = propose(seq.tokens, spec, room)
                if seq.draft:
                    drafting.append(seq)
        if drafting and spec.adaptive:
            self.draft_planner.trim(drafting, rows)

    def _deferred_rows(self, out: SchedulerOutput) -> Future | None:
        """The step's sampling rows computed on the mask thread while the runner runs the
        layers, when the runner takes them late (`Runner.defers_sampling`) and a row has a
        grammar to mask; else None (computed here, before the layers)."""
        if not getattr(self.runner, "defers_sampling", False) or not any(
                c.sample and c.seq.matcher is not None and c.seq.matcher.active
                for c in out.chunks):
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masker.submit(self._sampling_rows, out)

    def _sampling_rows(self, out: SchedulerOutput) -> SamplingRows:
        """One row per sampling chunk, 1 + k for a speculative step's: its row i reads the
        history a plain decode would have after the draft's first i tokens."""
        chunks = [c for c in out.chunks if c.sample]
        allowed = structured.masks([c.seq.matcher for c in chunks],
                                   self.grammars.metrics if self.grammars else None)
        params, generators, histories = [], [], []
        for c, a in zip(chunks, allowed):
            s = c.seq
            if c.draft:
                s.draft_generators = draft_generators(s.generator, c.draft,
                                                      self.model.config.vocab_size)
            for i in range(1 + c.draft):
                params.append(s.params.sampling)
                generators.append(s.draft_generators[i] if c.draft else s.generator)
                histories.append(s.params.history(
                    s.prompt_ids, s.output_ids + s.draft[:i] if i else s.output_ids,
                    self.eos_token_ids, a))
        return SamplingRows(params, generators, histories)

    def _merge(self, out: SchedulerOutput, sampled: Sampled | None) -> list[tuple]:
        """(token, log-prob, logits) of each sampling row in `out.chunks` order (1 + k for
        a speculative step): the runner's rows, and chunks prefilled out of band sampled
        here from their logits."""
        ext = [c for c in out.chunks if c.sample and c.logits is not None]
        drawn = {}
        if ext:
            logits = torch.stack([c.logits for c in ext]).float()
            tokens, logprobs = sample(logits, *self._sampling_rows(SchedulerOutput(ext, [], [])))
            drawn = {id(c): (int(tokens[i]), float(logprobs[i]), logits[i])
                     for i, c in enumerate(ext)}
        rows, i = [], 0
        for c in out.chunks:
            if not c.sample:
                continue
            if id(c) in drawn:
                rows.append(drawn[id(c)])
                continue
            for _ in range(1 + c.draft):
                rows.append((int(sampled.tokens[i]), float(sampled.logprobs[i]),
                             sampled.logits[i]))
                i += 1
        return rows

    def _exports(self, out: SchedulerOutput) -> dict[int, PromptExport]:
        """Prompts of `export_prompt` requests completed by this step, read from their
        blocks and slot before postprocess can free them."""
        return {c.seq.seq_id: self.runner.export(c.seq.block_table, c.seq.state_slot,
                                                 len(c.seq.prompt_ids))
                for c in out.prefill
                if c.seq.params.export_prompt and not c.seq.finished and not c.seq.output_ids
                and c.start + c.length >= len(c.seq.prompt_ids)}

    def _prefill_out_of_band(self, chunks: list[ScheduledChunk]) -> list[StepOutput]:
        """Whole prompts, installed one way: a prompt prefilled elsewhere (a prefill
        replica's export), or one this engine's prefill service prefills now (RidgeFill),
        goes into the cache through the runner's `install`, whichever runner it is. Each
        chunk then carries its logits."""
        failed = []
        for c in chunks:
            seq = c.seq
            try:
                export, seq.prefilled = seq.prefilled, None   # recomputed if preempted
                if export is None:
                    export = self.prefill_service.prefill(seq.tokens, seq.fill).export()
                self.runner.install(seq.block_table, seq.state_slot, export)
                c.logits = export.logits
            except Exception as exc:  # fails this request only
                log.exception("prefill failed")
                failed.append(self._fail(seq, f"{type(exc).__name__}: {exc}"))
        return failed

    def _postprocess(self, out: SchedulerOutput, rows: list[tuple],
                     exports: dict[int, PromptExport]) -> list[StepOutput]:
        for c in out.chunks:
            c.seq.num_computed = c.start + c.length
        results, rows = [], iter(rows)
        for c in [c for c in out.chunks if c.sample]:
            chunk_rows = [next(rows) for _ in range(1 + c.draft)]
            slot = c.seq.state_slot                 # (a sequence that finishes frees it)
            for i, (tok, lp, logits) in enumerate(chunk_rows):
                results.append(self._emit(c, tok, lp, logits, exports))
                if c.seq.finished or i == c.draft or tok != c.seq.draft[i]:
                    break
            if c.draft:
                self._verified(c, i + 1, slot)
        return results

    def _verified(self, c: ScheduledChunk, emitted: int, slot: int | None) -> None:
        """After a speculative step that emitted `emitted` tokens (the accepted draft
        tokens and one more): the cache holds the sequence up to its new last token, the
        Gated DeltaNet states in `slot` are those after its last kept row, and blocks taken
        for rejected draft tokens go back."""
        seq = c.seq
        self.spec_stats.drafts += 1
        self.spec_stats.draft_tokens += c.draft
        self.spec_stats.accepted_tokens += emitted - 1
        self.draft_planner.observe_draft(seq, c.draft, emitted - 1)
        seq.draft = []
        if slot is not None:
            self.runner.keep_draft(slot, emitted)
        if seq.finished:
            return
        if seq.generator is not None:      # where a plain decode of `emitted` tokens leaves it
            seq.generator.set_state(seq.draft_generators[emitted - 1].get_state())
        seq.draft_generators = []
        seq.num_computed = c.start + emitted
        keep = self.blocks.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.blocks.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _emit(self, c: ScheduledChunk, tok: int, lp: float, logits: torch.Tensor,
              exports: dict[int, PromptExport]) -> StepOutput:
        """`tok`, sampled for `c`'s sequence: appended, checked for its ends, reported."""
        seq = c.seq
        seq.output_ids.append(tok)
        seq.logprobs.append(lp)
        if seq.matcher is not None and not seq.matcher.accept(tok):
            log.warning("request %s: token %s is outside its grammar", seq.seq_id, tok)
        if seq.params.return_logits:
            seq.logits.append(logits.clone())
        export = exports.get(seq.seq_id)
        if export is not None:
            export.logits = logits.clone()
        reason = self._stop_reason(seq, tok)
        if reason:
            self._finish(seq, reason)
        prompt = (list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None
                  and len(seq.output_ids) == 1 else None)
        result = StepOutput(seq.seq_id, tok, lp, seq.finished, seq.finish_reason,
                            export=export, top_logprobs=seq.params.top_logprobs(logits),
                            prompt_logprobs=prompt)
        if seq.first_token_s is None:      # a prefill elsewhere counts as prefill
            seq.first_token_s = time.monotonic()
            result.queue_s = seq.scheduled_s - seq.arrival_s - seq.remote_s
            result.prefill_s = seq.first_token_s - seq.scheduled_s + seq.remote_s
        return result

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if p.stops(seq.output_ids, tok, self.eos_token_ids) or (
                seq.matcher is not None and seq.matcher.done):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.remote is not None:          # aborted while its prompt was on its way
            seq.remote.cancel()
            seq.remote = None
        self.scheduler.remove(seq)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.prefilled = None

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        self._finish(seq, "error")
        seq.error = error
        return StepOutput(seq.seq_id, None, None, True, "error", error)

    # ---- convenience ---------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: GenerationParams | list[GenerationParams]
                 = GenerationParams()) -> list[Sequence]:
        """Run `prompts` to completion (continuous batching) and return their sequences."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, pp) for p, pp in zip(prompts, plist)]
        while self.has_unfinished():
            self.step()
        return [self.pop(i) for i in ids]
