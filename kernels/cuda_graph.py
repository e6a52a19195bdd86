"""CUDA graphs for steps whose shapes vary: one graph per shape bucket, captured on first use.

A step of size n runs at the smallest bucket >= n on static input buffers the caller fills
(padding the rest); sizes past the largest bucket run eagerly. Without capture (CPU, or
`capture=False`) the same buckets and buffers run eagerly, so the padding logic a graph
relies on is exercised everywhere:

    n = 300   buckets 64 128 256 512 1024 ...
                                   ^ 512: rows [0, 212) padding, [212, 512) the step's rows
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from the one >= lo to the one >= hi."""
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got {lo}, {hi}")
    out, b = [], 1 << (lo - 1).bit_length()
    while True:
        out.append(b)
        if b >= hi:
            return tuple(out)
        b *= 2


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (buckets ascending); None past the largest or for n < 1."""
    if n < 1:
        return None
    return next((b for b in buckets if b >= n), None)


class GraphCache:
    """`fn(*inputs) -> tuple[Tensor, ...]` captured once per bucket on static inputs.

    `make_inputs(bucket)` allocates a bucket's static input tensors; `run(bucket, fill)`
    calls `fill(inputs)` to write the step's values into them, replays the bucket's graph
    and returns its static outputs: valid until the next `run` of that bucket (copy them to
    keep them). Graphs share one memory pool. A step that cannot be captured (one that
    syncs with the host, such as a MoE layer listing its experts) turns capture off and
    runs eagerly from then on. Not thread-safe: one caller (the engine thread).
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]],
                 make_inputs: Callable[[Hashable], tuple[torch.Tensor | None, ...]],
                 *, capture: bool, warmup: int = 2):
        self.fn, self.make_inputs, self.capture, self.warmup = fn, make_inputs, capture, warmup
        self._inputs: dict[Hashable, tuple] = {}
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = None

    @property
    def used(self) -> tuple:
        """Buckets run so far (captured or not)."""
        return tuple(self._inputs)

    @property
    def captured(self) -> tuple:
        return tuple(sorted(self._graphs))

    def run(self, bucket: Hashable, fill: Callable[[tuple], None]) -> tuple[torch.Tensor, ...]:
        """`bucket`: any key of a shape (an int, or a tuple of sizes)."""
        inputs = self._inputs.get(bucket)
        if inputs is None:
            inputs = self._inputs[bucket] = self.make_inputs(bucket)
        fill(inputs)
        if not self.capture:
            return self.fn(*inputs)
        graph = self._graphs.get(bucket)
        if graph is None:
            try:
                graph = self._graphs[bucket] = self._capture(inputs)
            except RuntimeError as err:
                log.warning("CUDA graph capture failed (%s); running eagerly", err)
                self.capture = False
                return self.fn(*inputs)
        graph[0].replay()
        return graph[1]

    def _capture(self, inputs: tuple) -> tuple[torch.cuda.CUDAGraph, tuple]:
        # warm-up on a side stream first (lazy inits, Triton compiles, cuBLAS workspaces),
        # as torch.cuda.graphs asks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.fn(*inputs)
        self._pool = graph.pool()
        return graph, outputs
