"""A request inside the engine: its tokens, its KV blocks, its state slot, its status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kernels.sampling import TokenLogprob, skip
from services.common.messages import GenerationParams, PromptExport


class Status(enum.Enum):
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"   # its prompt is being prefilled
                                                        # elsewhere (a prefill replica)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: GenerationParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # tokens 1..P−1
    logits: list[torch.Tensor] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose KV / state is in the cache
    state_slot: int | None = None    # Gated DeltaNet state slot (hybrid models)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    generator: torch.Generator | None = None
    prefilled: PromptExport | None = None   # its prompt, prefilled elsewhere (installed
                                            # on admission, then dropped)
    fill: object | None = None     # FillSettings: the engine's prefill service prefills the
                                   # prompt (RidgeFill), resolved once by `LLMEngine.validate`
    remote: object | None = None   # WAITING_FOR_REMOTE_KVS: the prefill in flight elsewhere
                                   # (`done()`, `result()` -> PromptExport, `cancel()`)
    remote_s: float = 0.0          # how long it waited for that prefill
    arrival_s: float = field(default_factory=time.monotonic)   # add_request
    scheduled_s: float | None = None       # its first scheduling (not reset by preemption)
    first_token_s: float | None = None     # its first token in this engine
    matcher: object | None = None  # its grammar's state (`structured.Matcher`), if constrained
    draft: list[int] = field(default_factory=list)   # tokens proposed for its next step
                                                     # (speculative decoding), unverified
    draft_generators: list = field(default_factory=list)   # a seeded draft step's sampler
                                                           # for each row (`draft_generators`)
    draft_rate: float | None = None   # its per-token draft acceptance (`DraftPlanner`)

    def __post_init__(self):
        seed = self.params.sampling.seed
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    def skip_draws(self, n: int, vocab_size: int) -> None:
        """Advance a seeded sampler past `n` tokens drawn elsewhere (a migrated request):
        each sampled token is one draw over the vocabulary (`kernels.sampling.draw`)."""
        if self.generator is not None and not self.params.sampling.greedy and n > 0:
            skip(self.generator, vocab_size, n)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def whole_prefill(self) -> bool:
        """The prompt is prefilled in one piece (by the prefill service, or already
        elsewhere), not in chunks."""
        return self.num_computed == 0 and (self.prefilled is not None
                                           or self.fill is not None)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
