"""The Triton kernels of `triton_chunked` and their launches (imports Triton: CUDA only).

Layouts: q, k [B, T, HK, Dk] and v [B, T, HV, Dv] as given (last dim contiguous), beta
[B, T, HV]; the buffers between kernels are [B·HV, Tp, *] fp32 with Tp = chunks · C, the
per-chunk states [B·HV, chunks, Dk, Dv] and the output [B, T, HV, Dv], both fp32.
Every product accumulates in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_keys(ptr, ib, ihk, rows, rmask, sb, st, sh, ok, DK: tl.constexpr,
               L2NORM: tl.constexpr):
    x = tl.load(ptr + ib * sb + rows[:, None] * st + ihk * sh + ok[None, :],
                mask=rmask[:, None] & (ok[None, :] < DK), other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _wy_kernel(k_ptr, v_ptr, beta_ptr, gam_ptr, w_ptr, u_ptr, T, TP, HV, R,
               skb, skt, skh, svb, svt, svh, sbb, sbt, sbh,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    ic = tl.program_id(0)
    ibh = tl.program_id(1)
    ib = ibh // HV
    ih = ibh % HV
    oc = tl.arange(0, C)
    rows = ic * C + oc
    rmask = rows < T
    ok = tl.arange(0, BK)
    kk = _load_keys(k_ptr, ib, ih // R, rows, rmask, skb, skt, skh, ok, DK, L2NORM)
    bt = tl.load(beta_ptr + ib * sbb + rows * sbt + ih * sbh, mask=rmask,
                 other=0.0).to(tl.float32)
    gam = tl.load(gam_ptr + ibh * TP + rows)
    lower = oc[:, None] > oc[None, :]
    a = tl.dot(kk * bt[:, None], tl.trans(kk), input_precision=PREC)
    a = tl.where(lower, a * tl.exp(tl.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
    # T = (I + A)⁻¹ by forward substitution, A strictly lower: T_i = e_i − Σ_{j<i} A_ij T_j.
    # `tinv` holds T − I in rows < i and −A in the rows not yet reached.
    tinv = -a
    for i in range(1, C):
        sel = oc == i
        row = tl.sum(tl.where(sel[:, None], tinv, 0.0), 0)
        row = row + tl.where(oc < i, tl.sum(row[:, None] * tinv, 0), 0.0)
        tinv = tl.where(sel[:, None], row[None, :], tinv)
    tinv = tl.where(oc[:, None] == oc[None, :], tinv + 1.0, tinv)
    w = tl.dot(tinv, kk * (bt * tl.exp(gam))[:, None], input_precision=PREC)
    tl.store(w_ptr + (ibh * TP + rows)[:, None] * DK + ok[None, :], w,
             mask=ok[None, :] < DK)
    for v0 in range(0, DV, BV):
        ov = v0 + tl.arange(0, BV)
        vmask = ov < DV
        vv = tl.load(v_ptr + ib * svb + rows[:, None] * svt + ih * svh + ov[None, :],
                     mask=rmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        uu = tl.dot(tinv, vv * bt[:, None], input_precision=PREC)
        tl.store(u_ptr + (ibh * TP + rows)[:, None] * DV + ov[None, :], uu,
                 mask=vmask[None, :])


@triton.jit
def _state_kernel(k_ptr, gam_ptr, w_ptr, u_ptr, s0_ptr, st_ptr, h_ptr, vn_ptr,
                  T, TP, NC, HV, R, skb, skt, skh,
                  DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_INIT: tl.constexpr, STORE: tl.constexpr,
                  L2NORM: tl.constexpr, PREC: tl.constexpr):
    ibh = tl.program_id(0)
    iv = tl.program_id(1)
    ib = ibh // HV
    ih = ibh % HV
    oc = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = iv * BV + tl.arange(0, BV)
    kmask = ok < DK
    vmask = ov < DV
    smask = kmask[:, None] & vmask[None, :]
    soff = ok[:, None] * DV + ov[None, :]
    if HAS_INIT:
        s = tl.load(s0_ptr + ibh * DK * DV + soff, mask=smask, other=0.0)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for ic in range(0, NC):
        rows = ic * C + oc
        if STORE:
            tl.store(h_ptr + (ibh * NC + ic) * DK * DV + soff, s, mask=smask)
        w = tl.load(w_ptr + (ibh * TP + rows)[:, None] * DK + ok[None, :],
                    mask=kmask[None, :], other=0.0)
        u = tl.load(u_ptr + (ibh * TP + rows)[:, None] * DV + ov[None, :],
                    mask=vmask[None, :], other=0.0)
        vn = u - tl.dot(w, s, input_precision=PREC)
        if STORE:
            tl.store(vn_ptr + (ibh * TP + rows)[:, None] * DV + ov[None, :], vn,
                     mask=vmask[None, :])
        kk = _load_keys(k_ptr, ib, ih // R, rows, rows < T, skb, skt, skh, ok, DK, L2NORM)
        gam = tl.load(gam_ptr + ibh * TP + rows)
        last = tl.load(gam_ptr + ibh * TP + ic * C + C - 1)
        kd = kk * tl.exp(last - gam)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(kd), vn, input_precision=PREC)
    tl.store(st_ptr + ibh * DK * DV + soff, s, mask=smask)


@triton.jit
def _output_kernel(q_ptr, k_ptr, gam_ptr, h_ptr, vn_ptr, idx_ptr, o_ptr,
                   T, TP, NC, HV, R, sqb, sqt, sqh, skb, skt, skh, scale,
                   DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, INDEXED: tl.constexpr, L2NORM: tl.constexpr,
                   PREC: tl.constexpr):
    ic = tl.program_id(0)
    if INDEXED:
        ic = tl.load(idx_ptr + ic)
    ibh = tl.program_id(1)
    iv = tl.program_id(2)
    ib = ibh // HV
    ih = ibh % HV
    oc = tl.arange(0, C)
    ok = tl.arange(0, BK)
    ov = iv * BV + tl.arange(0, BV)
    vmask = ov < DV
    rows = ic * C + oc
    rmask = rows < T
    qq = _load_keys(q_ptr, ib, ih // R, rows, rmask, sqb, sqt, sqh, ok, DK, L2NORM) * scale
    kk = _load_keys(k_ptr, ib, ih // R, rows, rmask, skb, skt, skh, ok, DK, L2NORM)
    gam = tl.load(gam_ptr + ibh * TP + rows)
    s = tl.load(h_ptr + (ibh * NC + ic) * DK * DV + ok[:, None] * DV + ov[None, :],
                mask=(ok[:, None] < DK) & vmask[None, :], other=0.0)
    vn = tl.load(vn_ptr + (ibh * TP + rows)[:, None] * DV + ov[None, :],
                 mask=vmask[None, :], other=0.0)
    incl = oc[:, None] >= oc[None, :]
    qk = tl.dot(qq, tl.trans(kk), input_precision=PREC)
    qk = tl.where(incl, qk * tl.exp(tl.where(incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
    o = tl.dot(qq * tl.exp(gam)[:, None], s, input_precision=PREC)
    o += tl.dot(qk, vn, input_precision=PREC)
    tl.store(o_ptr + ((ib * T + rows) * HV + ih)[:, None] * DV + ov[None, :], o,
             mask=rmask[:, None] & vmask[None, :])


def wy(p, k, v, beta, gam, w, u, l2norm: bool) -> None:
    _wy_kernel[p.wy_grid](
        k, v, beta, gam, w, u, p.t, p.padded_t, p.hv, p.group,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
        DK=p.dk, DV=p.dv, C=p.chunk, BK=p.block_k, BV=p.block_v, L2NORM=l2norm,
        PREC=p.precision, num_warps=p.num_warps)


def state(p, k, gam, w, u, s0, final, states, vn, l2norm: bool) -> None:
    """`states`, `vn` None: a state-only sweep (nothing stored per chunk)."""
    store = states is not None
    _state_kernel[p.state_grid](
        k, gam, w, u, final if s0 is None else s0, final, states if store else final,
        vn if store else u, p.t, p.padded_t, p.n_chunks, p.hv, p.group,
        k.stride(0), k.stride(1), k.stride(2),
        DK=p.dk, DV=p.dv, C=p.chunk, BK=p.block_k, BV=p.block_v, HAS_INIT=s0 is not None,
        STORE=store, L2NORM=l2norm, PREC=p.precision, num_warps=p.num_warps)


def output(p, q, k, gam, states, vn, index, n_wanted: int, out, scale: float,
           l2norm: bool) -> None:
    """`index` int32 [n_wanted] chunk ids, or None for every chunk."""
    _output_kernel[p.output_grid(n_wanted)](
        q, k, gam, states, vn, out if index is None else index, out,
        p.t, p.padded_t, p.n_chunks, p.hv, p.group,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), scale,
        DK=p.dk, DV=p.dv, C=p.chunk, BK=p.block_k, BV=p.block_v, INDEXED=index is not None,
        L2NORM=l2norm, PREC=p.precision, num_warps=p.num_warps)
