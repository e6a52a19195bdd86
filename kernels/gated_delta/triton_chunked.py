"""Chunked gated delta rule on CUDA in three fused Triton kernels (flash-linear-attention's
chunked algorithm); the same contract as `chunked.chunk_gated_delta_rule`.

    gamma   chunk-local cumsum of g (torch, fp64 then fp32; padded rows carry g = 0)
    wy      grid (chunks, B·HV): A = strict_lower((β K Kᵀ) ⊙ Γ), T = (I + A)⁻¹ by forward
            substitution, W = T (β ⊙ e^γ ⊙ K), U = T (β ⊙ V)           -> w, u [B·HV, Tp, *]
    state   grid (B·HV, Dv blocks), sequential over chunks: Vn = U − W S,
            S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ Vn; stores S per chunk and Vn when outputs
            are wanted                                                  -> final state
    output  grid (wanted chunks, B·HV, Dv blocks):
            O = (Q ⊙ e^γ) S + ((Q Kᵀ) ⊙ Γ) Vn                            -> o [B, T, HV, Dv]

A prefill with initial and final state runs all three; a state-only sweep (no wanted row:
RidgeFill's filled rows in upper layers) runs gamma, wy and state without storing per-chunk
states; a Tail-Replay is a prefill from a zero state. Grouped key heads (HK dividing HV) are
read in place: value head h reads key head h // (HV / HK).

The launch shapes (`plan`) are plain Python and tested on the CPU; the kernels themselves
(`triton_kernels`, which imports Triton) load on the first CUDA call only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256       # one key block holds a whole key head (the l2norm needs all of it)
MIN_BLOCK = 16           # tl.dot needs every dimension >= 16
MIN_STATE_PROGRAMS = 128 # about one state-sweep program per streaming multiprocessor


class TritonPlanError(ValueError):
    """Shapes or dtypes the Triton kernel does not take; carries the offending value."""

    def __init__(self, name: str, value, expected: str):
        super().__init__(f"{name} must be {expected}, got {value!r}")
        self.name, self.value = name, value


@dataclass(frozen=True)
class LaunchPlan:
    b: int
    t: int
    hk: int                   # key heads
    hv: int                   # value heads (HK divides HV)
    dk: int
    dv: int
    chunk: int                # C: rows per chunk (a power of two >= 16)
    n_chunks: int             # ceil(T / C)
    padded_t: int             # n_chunks · C: rows of the w, u, gamma buffers
    block_k: int              # BK: next power of two >= Dk (one block: the whole key head)
    block_v: int              # BV: Dv columns per program of the state and output kernels
    v_blocks: int             # ceil(Dv / BV)
    num_warps: int
    precision: str            # tl.dot input precision: "ieee" for fp32 inputs, else "tf32"

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.hv // self.hk

    @property
    def wy_grid(self) -> tuple[int, int]:
        return (self.n_chunks, self.b * self.hv)

    @property
    def state_grid(self) -> tuple[int, int]:
        return (self.b * self.hv, self.v_blocks)

    def output_grid(self, wanted_chunks: int) -> tuple[int, int, int]:
        return (wanted_chunks, self.b * self.hv, self.v_blocks)

    def state_bytes(self) -> int:
        """Device bytes of the per-chunk states an output pass stores (fp32)."""
        return self.b * self.hv * self.n_chunks * self.dk * self.dv * 4


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(q_shape, k_shape, v_shape, dtype: torch.dtype, chunk_size: int = 64) -> LaunchPlan:
    """The launch shapes for q, k [B, T, HK, Dk], v [B, T, HV, Dv] of `dtype`; raises
    `TritonPlanError` for what the kernels do not take (the caller then runs the torch form)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TritonPlanError("dtype", dtype, "float32, bfloat16 or float16")
    if len(q_shape) != 4 or tuple(q_shape) != tuple(k_shape):
        raise TritonPlanError("q/k shape", (tuple(q_shape), tuple(k_shape)),
                              "equal [B, T, HK, Dk]")
    b, t, hk, dk = k_shape
    if len(v_shape) != 4 or tuple(v_shape[:2]) != (b, t):
        raise TritonPlanError("v shape", tuple(v_shape), f"[{b}, {t}, HV, Dv]")
    hv, dv = v_shape[2], v_shape[3]
    if hk < 1 or hv % hk:
        raise TritonPlanError("value heads", hv, f"a multiple of the {hk} key heads")
    for name, d in (("Dk", dk), ("Dv", dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise TritonPlanError(name, d, f"in [1, {MAX_HEAD_DIM}]")
    if chunk_size < MIN_BLOCK or chunk_size & (chunk_size - 1) or chunk_size > 128:
        raise TritonPlanError("chunk_size", chunk_size, "a power of two in [16, 128]")
    if t < 1 or b < 1:
        raise TritonPlanError("B, T", (b, t), "at least 1 each")
    n = -(-t // chunk_size)
    bk = max(MIN_BLOCK, next_pow2(dk))
    # the state kernel holds S [BK, BV] in registers across the chunk loop (a narrower value
    # block for wide key heads) and is the only sequential part: its programs are B·HV times
    # the value blocks, so few heads get narrower blocks, down to 16, to fill the device
    bv = max(MIN_BLOCK, min(next_pow2(dv), 64 if bk <= 64 else 32))
    while bv > MIN_BLOCK and b * hv * -(-dv // bv) < MIN_STATE_PROGRAMS:
        bv //= 2
    warps = 4 if bk * bv <= 64 * 64 else 8
    return LaunchPlan(b, t, hk, hv, dk, dv, chunk_size, n, n * chunk_size, bk, bv,
                      -(-dv // bv), warps, "ieee" if dtype == torch.float32 else "tf32")


def wanted_chunks(out_rows: torch.Tensor | None, t: int, chunk: int) -> list[int]:
    """Indices of the chunks holding a wanted output row (all of them for None)."""
    n = -(-t // chunk)
    if out_rows is None:
        return list(range(n))
    if out_rows.shape != (t,):
        raise TritonPlanError("out_rows", tuple(out_rows.shape), f"bool [{t}]")
    want = F.pad(out_rows.detach().to("cpu", torch.bool), (0, n * chunk - t)).view(n, chunk)
    return want.any(-1).nonzero().flatten().tolist()


def chunk_gamma(g: torch.Tensor, p: LaunchPlan) -> torch.Tensor:
    """g [B, T, HV] -> γ [B·HV, Tp] fp32: the cumsum of g inside each chunk, rows past T with
    g = 0 (so the last chunk's γ_C is its last real row's). The cumsum runs in fp64: γ grows to
    hundreds in strongly decaying heads, and its in-chunk differences would lose low digits."""
    gp = F.pad(g.double(), (0, 0, 0, p.padded_t - p.t))                      # [B, Tp, HV]
    gam = gp.view(p.b, p.n_chunks, p.chunk, p.hv).cumsum(2).float()
    return gam.permute(0, 3, 1, 2).reshape(p.b * p.hv, p.padded_t).contiguous()


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> bool:
    """Whether the Triton path takes these inputs: CUDA, no autograd, a plan exists."""
    if not q.is_cuda or (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return False
    try:
        plan(q.shape, k.shape, v.shape, q.dtype, chunk_size)
    except TritonPlanError:
        return False
    return True


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, *, scale=None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64,
                           out_rows: torch.Tensor | None = None, block_chunks=None):
    """Same contract as `chunked.chunk_gated_delta_rule` (q, k [B, T, HK, Dk], v [B, T, HV,
    Dv], g, beta [B, T, HV], state [B, HV, Dk, Dv]) -> (o [B, T, HV, Dv] fp32, state fp32);
    rows of chunks without a wanted row are zero. `block_chunks` is the torch form's and
    ignored here. CUDA tensors only; no autograd."""
    from kernels.gated_delta import triton_kernels as tk   # imports Triton: CUDA only

    p = plan(q.shape, k.shape, v.shape, q.dtype, chunk_size)
    scale = p.dk ** -0.5 if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    beta = beta if beta.stride(-1) == 1 else beta.contiguous()
    dev = k.device
    gam = chunk_gamma(g, p)
    w = torch.empty(p.b * p.hv, p.padded_t, p.dk, device=dev, dtype=torch.float32)
    u = torch.empty(p.b * p.hv, p.padded_t, p.dv, device=dev, dtype=torch.float32)
    tk.wy(p, k, v, beta, gam, w, u, use_qk_l2norm)
    chunks = wanted_chunks(out_rows, p.t, p.chunk)
    s0 = (None if initial_state is None
          else initial_state.to(torch.float32).reshape(p.b * p.hv, p.dk, p.dv).contiguous())
    final = torch.empty(p.b * p.hv, p.dk, p.dv, device=dev, dtype=torch.float32)
    out = (torch.empty if out_rows is None else torch.zeros)(
        p.b, p.t, p.hv, p.dv, device=dev, dtype=torch.float32)
    if chunks:
        states = torch.empty(p.b * p.hv, p.n_chunks, p.dk, p.dv, device=dev,
                             dtype=torch.float32)
        vn = torch.empty_like(u)
        tk.state(p, k, gam, w, u, s0, final, states, vn, use_qk_l2norm)
        # all chunks: the grid's chunk id is the chunk (no host tensor: CUDA-graph capturable)
        index = (None if out_rows is None
                 else torch.tensor(chunks, dtype=torch.int32).to(dev, non_blocking=True))
        tk.output(p, q, k, gam, states, vn, index, len(chunks), out, scale, use_qk_l2norm)
    else:
        tk.state(p, k, gam, w, u, s0, final, None, None, use_qk_l2norm)
    return out, final.view(p.b, p.hv, p.dk, p.dv)
