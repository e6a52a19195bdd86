"""The exact reference engine: one process, continuous batching over a paged cache.

    step():  out = scheduler.schedule()
             logits = runner.run(out)
             return postprocess(out, logits)

Requests go in with `add_request` (validated there, so a bad request fails alone) and come
back as `StepOutput`s. `abort` and failures free the request's blocks and state slot at once.
With a `prefix_cache`, admitted prompts start after their cached prefix (restored by
`prefix.PrefixReuse` before the step runs) and completed prompts are stored.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from kernels.sampling import sample
from models.model import CausalLM
from services.engine.block_manager import BlockManager, SlotPool
from services.engine.kv_cache import CacheStorage
from services.engine.prefix import PrefixReuse
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import (GenerationParams, RequestError, Sequence, Status,
                                      check_request)
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

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class StepOutput:
    seq_id: int
    token: int | None            # None when the request ended without a new token
    logprob: float | None
    finished: bool
    finish_reason: str | None
    error: str | None = None
    export: PromptExport | None = None   # `params.export_prompt`: with the first token
    top_logprobs: list[tuple[int, float]] | None = None   # `params.logprobs`: (token, log-prob)
    prompt_logprobs: list | None = None   # `params.prompt_logprobs`: with the first token,
                                          # a TokenLogprob per prompt token after the first


@dataclass
class PromptExport:
    """A prefilled prompt, for decode elsewhere: what the attention service stores."""
    kv: torch.Tensor                      # [F, 2, N, KV, D] every full-attention layer's K/V
    conv: torch.Tensor | None             # [Lg, conv_dim, Kc − 1] GDN states after row N − 1
    recurrent: torch.Tensor | None        # [Lg, HV, Dk, Dv] fp32
    logits: torch.Tensor | None = None    # [V] of row N − 1 (the first token's distribution)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(),
                 eos_token_ids: tuple[int, ...] = (), prefill_service=None,
                 prefix_cache: PrefixCache | None = None, replay_ratio: float = 0.1,
                 replay_overlap: bool | None = None, ffn_skip: bool = True):
        """`prefix_cache`: reuse cached prompt prefixes (Tail-Replay for hybrid models, with
        `replay_ratio` r unless a request sets its own, the KV write overlapping the replay
        (default: on CUDA only) and the tail-FFN skip); None: every prompt is prefilled in
        full."""
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
        self.cache = CacheStorage(cfg, num_blocks, config.block_size, config.max_num_seqs,
                                  model.dtype, model.device)
        if replay_overlap is None:
            # a side stream overlaps the KV copy on a GPU; on CPU the copy thread only takes
            # cores from the replay (bench/tailreplay_ttft.py: overlap on is slower there)
            replay_overlap = torch.device(model.device).type == "cuda"
        replay = TailReplayConfig(replay_ratio, replay_overlap, ffn_skip)
        self.prefix = (PrefixReuse(prefix_cache, model, self.cache, replay)
                       if prefix_cache is not None else None)
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk,
                                   cached_tokens=self.prefix.cached_tokens if self.prefix else None)
        self.runner = ModelRunner(model, self.cache, config.attention_backend,
                                  keep_hidden=self.prefix.hidden_layers if self.prefix else ())
        self.eos_token_ids = tuple(eos_token_ids)
        self.seqs: dict[int, Sequence] = {}
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: GenerationParams = GenerationParams(),
                    seq_id: int | None = None) -> int:
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
        if params.prefill is not None:
            if self.prefill_service is None:
                raise RequestError("prefill_mode", "ridgefill", "this engine has no prefill "
                                   "service")
            try:
                self.prefill_service.check(params.prefill, len(prompt_ids))
            except ValueError as err:
                raise RequestError("ridgefill", params.prefill, str(err)) from err
        seq_id = next(self._ids) if seq_id is None else seq_id
        if seq_id in self.seqs:
            raise RequestError("seq_id", seq_id, "is already in use")
        seq = Sequence(seq_id, list(prompt_ids), params)
        self.seqs[seq_id] = seq
        self.scheduler.add(seq)
        return seq_id

    def abort(self, seq_id: int) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pop(self, seq_id: int) -> Sequence:
        """Forget a finished sequence (the caller has read its outputs)."""
        return self.seqs.pop(seq_id)

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if out.empty:
            return []
        failed: list[StepOutput] = []
        if self.prefix is not None:
            failed = [self._fail(seq, f"{type(exc).__name__}: {exc}")
                      for seq, exc in self.prefix.begin(out.prefill)]
            if failed:
                out = SchedulerOutput(out.decode, [c for c in out.prefill if not c.seq.finished],
                                      out.preempted)
        whole = [c for c in out.prefill if c.seq.params.prefill is not None and c.start == 0]
        if whole:
            failed += self._prefill_out_of_band(whole)
            out = SchedulerOutput(out.decode, [c for c in out.prefill if not c.seq.finished],
                                  out.preempted)
        inner = SchedulerOutput(out.decode, [c for c in out.prefill if c not in whole], [])
        try:
            logits = self.runner.run(inner) if not inner.empty else None
        except Exception as exc:  # a failed step fails only the requests in it
            log.exception("engine step failed")
            return failed + [self._fail(c.seq, f"{type(exc).__name__}: {exc}")
                             for c in inner.chunks]
        if self.prefix is not None:     # before postprocess frees the blocks of finished ones
            self.prefix.end(inner.prefill)
        exports = self._exports(out)
        if whole:   # sampled rows in out.chunks order: decode, then prefill chunks
            ext = {id(c): c.logits for c in whole if not c.seq.finished}
            rows, it = [], iter(logits if logits is not None else [])
            for c in out.chunks:
                if c.sample:
                    rows.append(ext[id(c)] if id(c) in ext else next(it))
            logits = torch.stack(rows) if rows else None
        return failed + (self._postprocess(out, logits, exports) if logits is not None else [])

    def _exports(self, out: SchedulerOutput) -> dict[int, PromptExport]:
        """Prompts of `export_prompt` requests completed by this step, read from their
        blocks and slot before postprocess can free them."""
        exports = {}
        for c in out.prefill:
            seq = c.seq
            if (not seq.params.export_prompt or seq.finished or seq.output_ids
                    or c.start + c.length < len(seq.prompt_ids)):
                continue
            slots = self.cache.token_slots(seq.block_table, len(seq.prompt_ids))
            conv = rec = None
            if seq.state_slot is not None:
                conv = self.cache.conv[:, seq.state_slot].clone()
                rec = self.cache.recurrent[:, seq.state_slot].clone()
            exports[seq.seq_id] = PromptExport(self.cache.read_rows(slots), conv, rec)
        return exports

    def _prefill_out_of_band(self, chunks) -> list[StepOutput]:
        """Whole-prompt prefills by the prefill service, written into this cache."""
        failed = []
        for c in chunks:
            seq = c.seq
            try:
                res = self.prefill_service.prefill(seq.tokens, seq.params.prefill)
                res.write(self.cache, seq.block_table, seq.state_slot)
                c.logits = res.logits[-1]
            except Exception as exc:  # fails this request only
                log.exception("prefill failed")
                failed.append(self._fail(seq, f"{type(exc).__name__}: {exc}"))
        return failed

    def _postprocess(self, out: SchedulerOutput, logits: torch.Tensor,
                     exports: dict[int, PromptExport] | None = None) -> list[StepOutput]:
        sampling = [c for c in out.chunks if c.sample]
        for c in out.chunks:
            c.seq.num_computed = c.start + c.length
        if not sampling:
            return []
        seqs = [c.seq for c in sampling]
        tokens, logprobs = sample(logits, [s.params.sampling for s in seqs],
                                  [s.generator for s in seqs],
                                  [s.params.history(s.prompt_ids, s.output_ids,
                                                    self.eos_token_ids) for s in seqs])
        results = []
        for i, seq in enumerate(seqs):
            tok, lp = int(tokens[i]), float(logprobs[i])
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            if seq.params.return_logits:
                seq.logits.append(logits[i].clone())
            export = exports.get(seq.seq_id) if exports else None
            if export is not None:
                export.logits = logits[i].clone()
            reason = self._stop_reason(seq, tok)
            if reason:
                self._finish(seq, reason)
            prompt = (list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None
                      and len(seq.output_ids) == 1 else None)
            results.append(StepOutput(seq.seq_id, tok, lp, seq.finished, seq.finish_reason,
                                      export=export,
                                      top_logprobs=seq.params.top_logprobs(logits[i]),
                                      prompt_logprobs=prompt))
        return results

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if p.stops(seq.output_ids, tok, self.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

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
