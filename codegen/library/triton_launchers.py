"""Host launchers of the Triton kernels (`triton_kernels`): op inputs (torch) -> op outputs, with
the op references' conventions. They allocate outputs and launch; inside `aot_kernels(provider)`
a launch goes to the provider (a plan's ahead-of-time cubins, or the compile-time recorder of a
host recipe) instead of Triton's JIT. Compile-time and test code: a serving runtime runs the
recipes the plan holds, not these."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton

from .triton_kernels import (compressed_write_kernel, engram_gate_kernel, engram_hash_kernel, gather_rows_kernel,
                             grouped_gemm_fp4_kernel, grouped_linear_kernel, hc_expand_kernel, hc_mix_split_kernel, hc_pre_kernel,
                             inverse_perm_kernel, moe_combine_kernel, split_sum_kernel, moe_router_kernel, quant_fp8_kernel,
                             split_sum_quant_kernel,
                             ring_write_kernel, rms_norm_kernel, rope_kernel, seq_newest_kernel, swiglu_quant_kernel)
from .triton_kernels import (compress_pool_norm_kernel, copy_cols_kernel, engram_ngram_ids_kernel, hc_mix_kernel,
                             hc_collapse_norm_kernel, hc_reduce_kernel, lookup_kernel, repeat_rows_kernel,
                             seq_first_kernel)
from .triton_kernels import gather_row_pairs_kernel, moe_combine_expand_kernel, rope_fp8_ring_kernel
from .triton_kernels import HC_PART, block_linear_mx_kernel, block_linear_rows_kernel
from .triton_kernels import moe_permute_count_kernel, moe_permute_kernel, moe_permute_scan_kernel
from .triton_kernels import indexer_block_map_kernel, indexer_score_kernel, indexer_select_kernel
from .triton_kernels import dspark_pick_kernel, dspark_step_kernel

_AOT = contextvars.ContextVar("deepinfer_triton_aot", default=None)


# Triton decides at import whether kernels are interpreted (TRITON_INTERPRET=1); the interpreter
# runs no inline PTX, so kernels with an ASM switch take their integer-op path there
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _k(fn):
    """The kernel a launcher launches: Triton's JIT function, or, inside `aot_kernels(...)`, the
    plan's ahead-of-time cubin of the same kernel (runtime/triton_aot.py)."""
    aot = _AOT.get()
    return fn if aot is None else aot.bind(fn)


@contextlib.contextmanager
def aot_kernels(provider):
    """Launchers inside this block launch `provider.bind(kernel)` instead of compiling."""
    token = _AOT.set(provider)
    try:
        yield
    finally:
        _AOT.reset(token)

def _p2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _rms_block(h: int, cfg) -> int:
    """The row chunk: the configured one, narrowed to the row (as triton_ops records the launch)."""
    return min(cfg["BLOCK_H"], _p2(h)) if h >= 32 else 32


def launch_rms_norm(x, w, *, eps, cfg):
    h = x.shape[-1]
    y = torch.empty_like(x)
    rows = x.numel() // h
    _k(rms_norm_kernel)[(rows,)](x, w, y, y, y, eps, H=h, BLOCK_H=_rms_block(h, cfg), QUANT=False,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def launch_rms_norm_quant_fp8(x, w, *, eps, block, cfg):
    h = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[:-1] + (h // 32,), dtype=torch.uint8, device=x.device)
    rows = x.numel() // h
    _k(rms_norm_kernel)[(rows,)](x, w, x, _u8(q), s, eps, H=h, BLOCK_H=_rms_block(h, cfg), QUANT=True,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return q, s


def launch_quant_fp8(x, *, block, cfg):
    n = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[:-1] + (n // block,), dtype=torch.uint8, device=x.device)
    rows = x.numel() // n
    bs = max(cfg["BLOCK"], block)
    r = cfg.get("ROWS", 1)
    _k(quant_fp8_kernel)[(triton.cdiv(rows, r), triton.cdiv(n, bs))](x, _u8(q), s, N=n, BLOCK=bs, BLK=block, NR=rows,
                                                                   ROWS=r, num_warps=cfg["num_warps"],
                                                                   num_stages=cfg["num_stages"])
    return q, s


def rope_freqs(rope_dim, theta, yarn, device):
    """f_i exactly as the reference computes them (a handful of fp32 values per layer)."""
    return _on_device(_rope_freqs(rope_dim, theta, tuple(yarn) if yarn else None), torch.device(device))


@functools.lru_cache(maxsize=None)
def _rope_freqs(rope_dim, theta, yarn):
    from deepinfer.ir.ops.attention import yarn_freqs

    with torch.device("cpu"):  # real values, whatever device context the caller runs under
        return yarn_freqs(rope_dim, theta, yarn)


def _int64_const(values: tuple, device) -> torch.Tensor:
    return _on_device(_cpu_int64(values), torch.device(device))


@functools.lru_cache(maxsize=None)
def _cpu_int64(values: tuple) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cpu")


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-made constant on `device`: copied once per GPU (a copy inside a CUDA graph capture
    is not allowed), and copied afresh onto meta, where a host recipe is being recorded and the
    copy of real values is what records the constant."""
    if device.type == "cuda":
        return _cached_copy(t, device)
    return t.to(device)


@functools.lru_cache(maxsize=None)
def _cached_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device)


def rope_mode(mode: str, scale: str | None = None, block: int = 32):
    if mode == "rope":
        return 0, 32
    if mode == "fp8":
        return 1, block
    return (2, block) if scale == "ue8m0" else (3, block)


def launch_rope(x, positions, *, rope_dim, theta, yarn, inverse=False, pos_offset=0, mode="rope",
                scale=None, block=32, cfg):
    d = x.shape[-1]
    heads = x.numel() // (d * x.shape[0])
    code, blk = rope_mode(mode, scale, block)
    if code == 0 and d % 32:
        blk = 2
    nb = _p2(triton.cdiv(d, blk))
    f = rope_freqs(rope_dim, theta, yarn, x.device)
    grid = (x.numel() // d,)
    kw = dict(HEADS=heads, D=d, ROPE=rope_dim, INVERSE=bool(inverse), MODE=code, BLK=blk, NB=nb,
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if code == 0:
        y = torch.empty_like(x)
        _k(rope_kernel)[grid](x, positions, f, y, y, y, pos_offset, **kw)
        return y
    if code == 1:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(x.shape[:-1] + (d // blk,), dtype=torch.uint8, device=x.device)
        _k(rope_kernel)[grid](x, positions, f, x, _u8(q), s, pos_offset, **kw)
        return q, s
    q = torch.empty(x.shape[:-1] + (d // 2,), dtype=torch.uint8, device=x.device)
    sdt = torch.uint8 if code == 2 else torch.float8_e4m3fn
    s = torch.empty(x.shape[:-1] + (d // blk,), dtype=sdt, device=x.device)
    _k(rope_kernel)[grid](x, positions, f, x, q, _u8(s), pos_offset, **kw)
    return q, s


def launch_rope_fp8_ring(x, positions, ring, token_seq, seq_slots, *, rope_dim, theta, yarn, pos_offset=0, block=32,
                         cfg):
    """RoPE + fp8 quantisation of window key rows, also written into the ring in place (its
    output aliases input 2): the key (bytes, scales) and the ring (data, scales)."""
    return _rope_fp8_ring(x, None, positions, ring, token_seq, seq_slots, 0.0, rope_dim, theta, yarn, pos_offset,
                          block, cfg)


def launch_norm_rope_fp8_ring(x, w, positions, ring, token_seq, seq_slots, *, eps, rope_dim, theta, yarn,
                              pos_offset=0, block=32, cfg):
    """launch_rope_fp8_ring of the rows' RMSNorm (weight w), in the same program."""
    return _rope_fp8_ring(x, w, positions, ring, token_seq, seq_slots, eps, rope_dim, theta, yarn, pos_offset,
                          block, cfg)


def _rope_fp8_ring(x, w, positions, ring, token_seq, seq_slots, eps, rope_dim, theta, yarn, pos_offset, block, cfg):
    data, scale = ring
    n, d = x.shape
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((n, d // block), dtype=torch.uint8, device=x.device)
    if n:
        f = rope_freqs(rope_dim, theta, yarn, device=x.device)
        newest, keep_all = _newest(positions, token_seq, data.shape[1])
        _k(rope_fp8_ring_kernel)[(n,)](x, x if w is None else w, positions, f, _u8(q), s, token_seq, seq_slots, newest,
                                   _u8(data), _u8(scale), pos_offset, eps, D=d, ROPE=rope_dim, BLK=block,
                                   NB=_p2(triton.cdiv(d, block)), L=data.shape[1], KEEP_ALL=keep_all,
                                   NORM=int(w is not None), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return q, s, data, scale


def _hc_mix_partials(r, fn, cfg, unused, pre_in=None, x=None):
    """With SPLIT > 1: the mix GEMM's per-range partials (hc_mix_split_kernel), which the main
    kernel sums in split order, and with `pre_in` (hc_pre) the rounded collapse left in `x`; else
    `unused` (the main kernel does not read it)."""
    n, c, h = r.shape
    split = cfg.get("SPLIT", 1)
    if split == 1:
        return unused
    part = torch.empty(split, n, HC_PART.value, dtype=torch.float32, device=r.device)
    collapse = pre_in is not None
    _k(hc_mix_split_kernel)[(triton.cdiv(n, cfg["BM"]), split)](
        r, fn, part, pre_in if collapse else part, x if collapse else part, n, C=c, H=h, SPLIT=split, BM=cfg["BM"],
        BK=cfg["BK"], COLLAPSE=collapse, X2=cfg.get("X2", 0), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return part


def launch_hc_pre(r, fn, scale, base, pre_in, norm_w, *, eps, copies, iters, hc_eps, post_mult, cfg):
    n, c, h = r.shape
    x = torch.empty(n, h, dtype=r.dtype, device=r.device)
    pre = torch.empty(n, c, dtype=torch.float32, device=r.device)
    post = torch.empty_like(pre)
    m = torch.empty(n, c, c, dtype=torch.float32, device=r.device)
    bm, split = cfg["BM"], cfg.get("SPLIT", 1)
    part = _hc_mix_partials(r, fn, cfg, m, pre_in, x)
    grid = (triton.cdiv(n, bm),) if split == 1 else (triton.cdiv(n, bm), max(bm, triton.cdiv(h, cfg["BH"])))
    _k(hc_pre_kernel)[grid](r, fn, scale, base, pre_in, norm_w, x, pre, post, m, part, n, eps,
                            hc_eps, post_mult, C=c, H=h, ITERS=iters, BM=bm, BK=cfg["BK"],
                            BH=cfg["BH"], SPLIT=split, num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
    return x, pre, post, m


def launch_hc_expand(y, r, post, m, *, cfg):
    n, c, h = r.shape
    out = torch.empty_like(r)
    _k(hc_expand_kernel)[(n, triton.cdiv(h, cfg["BH"]))](y, r, post, m, out, C=c, H=h, BH=cfg["BH"],
                                                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def launch_moe_router(logits, bias, bias_vl=None, ids=None, *, k, scale, renorm, image_token_id=None, cfg):
    return _router(logits, 1, bias, bias_vl, ids, k, scale, renorm, image_token_id, cfg)


def launch_linear_moe_router(x, w, bias, bias_vl=None, ids=None, *, out_dtype, compute, k, scale, renorm,
                             image_token_id=None, cfg):
    """The gate's logits GEMM, its K-split partials summed by the router kernel (linear_moe_router)."""
    from .triton_ops import ROUTER_CONFIG

    logits = _block_linear(x, w, 1, _TORCH_DTYPES[out_dtype] if out_dtype else x.dtype, cfg, partials=True)
    parts = logits.shape[0] if logits.dim() == 3 else 1  # _block_linear's partials: [split, rows, E]
    return _router(logits, parts, bias, bias_vl, ids, k, scale, renorm, image_token_id, ROUTER_CONFIG)


def _router(logits, parts, bias, bias_vl, ids, k, scale, renorm, image_token_id, cfg):
    """moe_router_kernel on [n, E] logits, or (parts > 1) on a K split's [parts, n, E] partials."""
    n, e = logits.shape[-2:]
    sel = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    w = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    with_ids = ids is not None
    _k(moe_router_kernel)[(n,)](logits, bias, sel, w, scale, bias_vl if with_ids else bias, ids if with_ids else sel,
                            int(image_token_id) if with_ids else 0, E=e, K=k, KP=_p2(k), BLOCK_E=_p2(e),
                            RENORM=bool(renorm and k > 1), BIAS_ROWS=bias.dim() == 2, IDS=with_ids, PARTS=parts,
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return sel, w


def _swiglu(g, u, wt, pairs, q, s, limit, rows, f, g_stride, u_off, weighted, cfg):
    """swiglu_quant_kernel on its grid: (blocks of ROWS rows, chunks of BLOCK columns)."""
    r = cfg.get("ROWS", 1)
    _k(swiglu_quant_kernel)[(triton.cdiv(rows, r), triton.cdiv(f, cfg["BLOCK"]))](
        g, u, wt, pairs, _u8(q), s, limit, F=f, G_STRIDE=g_stride, U_OFF=u_off, WEIGHTED=weighted, BLOCK=cfg["BLOCK"],
        NR=rows, ROWS=r, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def launch_swiglu_quant_fp8(g, u, *, limit, block, cfg):
    n, f = g.shape
    if u.stride() != g.stride():
        raise ValueError("swiglu_quant_fp8 kernel wants gate and up with the same row stride")
    q = torch.empty(n, f, dtype=torch.float8_e4m3fn, device=g.device)
    s = torch.empty(n, f // 32, dtype=torch.uint8, device=g.device)
    _swiglu(g, u, g, g, q, s, limit, n, f, g.stride(0), 0, False, cfg)
    return q, s


def launch_swiglu_gu_quant_fp8(gu, *, limit, block, cfg):
    n, f2 = gu.shape
    f = f2 // 2
    q = torch.empty(n, f, dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(n, f // 32, dtype=torch.uint8, device=gu.device)
    _swiglu(gu, gu, gu, gu, q, s, limit, n, f, f2, f, False, cfg)
    return q, s


def launch_swiglu_weighted_quant_fp8(gu, wt, pairs, *, limit, k, block, cfg):
    m, f2 = gu.shape
    f = f2 // 2
    q = torch.empty(m, f, dtype=torch.float8_e4m3fn, device=gu.device)
    s = torch.empty(m, f // 32, dtype=torch.uint8, device=gu.device)
    _swiglu(gu, gu, wt.float().contiguous(), pairs, q, s, limit, m, f, f2, f, True, cfg)
    return q, s


def launch_moe_combine(y, pairs, offsets, like, shared=None, *, k, cfg):
    n = like.shape[0]
    h = y.shape[1]
    m, inv, scan = _combine_positions(pairs, y.device)
    out = torch.empty(n, h, dtype=torch.float32 if shared is None else torch.bfloat16, device=y.device)
    _k(moe_combine_kernel)[(n, triton.cdiv(h, cfg["BH"]))](
        y, inv, y if shared is None else shared.contiguous(), out, H=h, K=k, KP=_p2(k), BH=cfg["BH"],
        SHARED=shared is not None, M=m if scan else 0, SCAN=scan, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out


def launch_moe_combine_hc_expand(y, pairs, offsets, like, shared, r, post, m_mix, *, k, cfg):
    """The MoE block's combine (moe_combine_shared's bf16 row) expanded into the residual streams
    in the same program (moe_combine_expand_kernel)."""
    n, c, h = r.shape
    m, inv, scan = _combine_positions(pairs, y.device)
    out = torch.empty_like(r)
    _k(moe_combine_expand_kernel)[(n, triton.cdiv(h, cfg["BH"]))](
        y, inv, shared.contiguous(), r, post, m_mix, out, H=h, K=k, KP=_p2(k), BH=cfg["BH"], C=c,
        M=m if scan else 0, SCAN=scan, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _combine_positions(pairs, device):
    """(pairs, what the combine reads for them, SCAN): a call of few pairs searches the pairs
    themselves; a larger one reads their inverse permutation, made by a first kernel."""
    from .triton_ops import combine_scan

    m = pairs.shape[0]
    scan = combine_scan(m)
    if scan:  # the combine finds each token's pairs itself
        return m, pairs, scan
    inv = torch.empty(m, dtype=torch.int32, device=device)
    _k(inverse_perm_kernel)[(triton.cdiv(m, 1024),)](pairs, inv, m, BLOCK=1024)
    return m, inv, scan


def _gather(src2d, idx, div, cfg):
    w = src2d.shape[1]
    out = torch.empty((idx.numel(), w), dtype=src2d.dtype, device=src2d.device)
    if idx.numel():
        _k(gather_rows_kernel)[(idx.numel(), triton.cdiv(w, cfg["BLOCK"]))](src2d, idx.reshape(-1), out, W=w, DIV=div,
                                                                       BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return out


def _rows2d(t):
    return t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)


def launch_embedding(ids, table, *, cfg):
    return _gather(table, ids, 1, cfg).view(*ids.shape, table.shape[1])


def launch_gather_rows(x, rows, *, cfg):
    return _gather(_rows2d(x), rows, 1, cfg).view(rows.shape[0], *x.shape[1:])


def _gather_pair(q, idx, div, cfg):
    """Rows idx // div of a quantised tensor's data and scales, both in one launch."""
    data, scale = _u8(q[0]), _u8(q[1])
    wa, wb = data.shape[1], scale.shape[1]
    d = torch.empty((idx.numel(), wa), dtype=data.dtype, device=data.device)
    s = torch.empty((idx.numel(), wb), dtype=scale.dtype, device=scale.device)
    if idx.numel():
        r = cfg.get("ROWS", 1)
        _k(gather_row_pairs_kernel)[(triton.cdiv(idx.numel(), r), triton.cdiv(wa, cfg["BLOCK"]))](
            data, scale, idx.reshape(-1), d, s, WA=wa, WB=wb, DIV=div, BLOCK=cfg["BLOCK"],
            BLOCK_B=triton.next_power_of_2(wb), NR=idx.numel(), ROWS=r, num_warps=cfg["num_warps"])
    return d.view(q[0].dtype), s.view(q[1].dtype)


def launch_moe_gather_rows(x, pairs, *, k, cfg):
    return _gather_pair(x, pairs, k, cfg)


def launch_engram_gather(cols, table, *, cfg):
    n = cols.shape[0]
    d, s = _gather_pair(table, cols, 1, cfg)
    return d.reshape(n, -1), s.reshape(n, -1)


def _newest(positions, token_seq, ring_len):
    """(newest position per sequence, KEEP_ALL) for ring_write_kernel: a step with at most
    ring_len rows keeps every row, so the positions stand in for the unread newest buffer."""
    n = positions.shape[0]
    if n <= ring_len:
        return positions, 1
    newest = torch.full((n,), -1, dtype=torch.int32, device=positions.device)
    _k(seq_newest_kernel)[(triton.cdiv(n, 1024),)](positions, token_seq, newest, n, BLOCK=1024)
    return newest, 0


def launch_swa_write(ring, kv, positions, token_seq, seq_slots, *, cfg):
    """Writes into `ring` in place (the op's output aliases input 0) and returns it."""
    data, scale = ring
    n, d = kv.data.shape
    if n:
        newest, keep_all = _newest(positions, token_seq, data.shape[1])
        _k(ring_write_kernel)[(n,)](_u8(kv.data), _u8(kv.scale), positions, token_seq, seq_slots,
                                newest, _u8(data), _u8(scale), L=data.shape[1], WA=d,
                                WB=kv.scale.shape[1], A_STRIDE=d, A_OFF=0, B_STRIDE=kv.scale.shape[1], B_OFF=0,
                                BLOCK=cfg["BLOCK"], KEEP_ALL=keep_all, num_warps=cfg["num_warps"])
    return ring


def launch_compress_state_write(state, l, s, positions, token_seq, seq_slots, *, cfg):
    n, d = l.shape
    if n:
        newest, keep_all = _newest(positions, token_seq, state.shape[1])
        _k(ring_write_kernel)[(n,)](l.float().contiguous(), s.float().contiguous(), positions, token_seq, seq_slots,
                                newest, state, state, L=state.shape[1], WA=d, WB=d,
                                A_STRIDE=2 * d, A_OFF=0, B_STRIDE=2 * d, B_OFF=d, BLOCK=cfg["BLOCK"],
                                KEEP_ALL=keep_all, num_warps=cfg["num_warps"])
    return state


def launch_engram_hist_write(hist, cids, positions, token_seq, seq_slots, *, cfg):
    n = cids.shape[0]
    if n:
        c = cids.long().contiguous()
        newest, keep_all = _newest(positions, token_seq, hist.shape[1])
        _k(ring_write_kernel)[(n,)](c, c, positions, token_seq, seq_slots, newest, hist, hist,
                                L=hist.shape[1], WA=1, WB=0, A_STRIDE=1, A_OFF=0, B_STRIDE=1, B_OFF=0,
                                BLOCK=32, KEEP_ALL=keep_all, num_warps=1)
    return hist


def launch_compressed_write(cache, rows_q, positions, token_seq, block_table, *, ratio, cfg):
    data, scale = cache
    n = rows_q.data.shape[0]
    if n:
        _k(compressed_write_kernel)[(n,)](_u8(rows_q.data), _u8(rows_q.scale), positions, token_seq, block_table,
                                      _u8(data), _u8(scale), RATIO=ratio, ENTRIES=data.shape[1],
                                      BT_W=block_table.shape[1], WA=rows_q.data.shape[1], WB=rows_q.scale.shape[1],
                                      BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return cache


def launch_engram_hash(grams, *, multipliers, primes, offsets, heads, cfg):
    n, g = grams.shape
    dev = grams.device
    out = torch.empty(n, len(primes), dtype=torch.int64, device=dev)
    if n:
        _k(engram_hash_kernel)[(n,)](grams.long().contiguous(), _int64_const(tuple(multipliers), dev),
                                     _int64_const(tuple(primes), dev), _int64_const(tuple(offsets), dev), out,
                                     G=g, HEADS=heads, HP=_p2(heads), num_warps=cfg["num_warps"])
    return out


def launch_engram_gate(r, kv, q_weight, k_weight, ids=None, *, eps, image_token_id=None, cfg):
    n, c, h = r.shape
    out = torch.empty_like(r)
    with_ids = ids is not None and image_token_id is not None
    _k(engram_gate_kernel)[(n, c)](r, kv, q_weight, k_weight, ids if with_ids else r, out, eps,
                                   int(image_token_id) if with_ids else 0, C=c, H=h, BH=cfg["BH"],
                                   KW_ROWS=k_weight.numel() // h, IDS=with_ids,
                                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _block_linear(x, w, groups, out_dtype, cfg, quant_block=0, partials=False):
    """The block linear's launches; quant_block (32): its bf16 rows quantised to fp8 per 32 as the
    K split's sum writes them (split_sum_quant_kernel; one split: quant_fp8_kernel after it);
    partials: a K split's [split, rows, N] fp32 partials returned unsummed (their reader sums)."""
    quant = isinstance(w, tuple)
    data = w[0] if quant else w
    xq = isinstance(x, tuple)  # gemm_fp8: fp8 rows and their per-32 scales
    xd = x[0] if xq else x
    ng, kg = data.shape[0] // groups, data.shape[1]
    x2 = xd.reshape(-1, xd.shape[-1])
    n = x2.shape[0]
    from .triton_ops import block_linear_f8, block_linear_rows, block_linear_split  # as the template rendered them

    wl = block_linear_rows(cfg, n, ng, kg, groups)
    split = wl["SPLIT"] if wl else block_linear_split(cfg, groups * triton.cdiv(ng, cfg["BN"]), kg)
    if split == 1:
        y = part = torch.empty(n, data.shape[0], dtype=out_dtype, device=xd.device)
    else:
        part = torch.empty(split, n, data.shape[0], dtype=torch.float32, device=xd.device)
        # quantised or left to their reader, the split's rows are never summed here: no y
        y = part if quant_block or partials else torch.empty(n, data.shape[0], dtype=out_dtype, device=xd.device)
    tiles = dict(G=groups, KG=kg, NG=ng, SK=triton.cdiv(kg, 32))
    wq, ws = (_u8(data), _u8(w[1])) if quant else (data, data)
    # the MX and WL kernels take the rows (raw fp8 bytes where quantised) and their scales apart
    xs = (_u8(x2), _u8(x[1].reshape(n, -1))) if xq else (x2, x2)
    warps = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if wl:
        # the interpreter's bf16 dot is not exact: fp32 operands there (the same products)
        _k(block_linear_rows_kernel)[(groups * ng // wl["BN"], split)](
            *xs, wq, ws, y, part, n, **tiles, XQ=xq, WQ=quant, **wl, F32=INTERPRETED, **warps)
    else:
        grid = (triton.cdiv(n, cfg["BM"]), groups * triton.cdiv(ng, cfg["BN"]), split)
        run = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SPLIT=split, **warps)
        if cfg.get("MX", 0):
            _k(block_linear_mx_kernel)[grid](*xs, wq, ws, y, part, n, **tiles, XQ=xq, WQ=quant,
                                             F8=block_linear_f8(cfg, xq, quant), **run)
        else:
            _k(grouped_linear_kernel)[grid](x2, wq, ws, y, part, n, **tiles, QUANT=quant, **run)
    rows = (*xd.shape[:-1], data.shape[0])
    if quant_block:
        total = n * data.shape[0]
        q = torch.empty(rows, dtype=torch.float8_e4m3fn, device=xd.device)
        sc = torch.empty((*rows[:-1], data.shape[0] // quant_block), dtype=torch.uint8, device=xd.device)
        if split > 1:
            _k(split_sum_quant_kernel)[(triton.cdiv(total, 1024),)](part, _u8(q), sc, total, SPLIT=split, BLOCK=1024,
                                                                   num_warps=4)
        else:
            from .triton_ops import rows_per_program  # as the template rendered the launch

            r = rows_per_program(n)
            _k(quant_fp8_kernel)[(triton.cdiv(n, r), triton.cdiv(data.shape[0], 1024))](
                y, _u8(q), sc, N=data.shape[0], BLOCK=1024, BLK=quant_block, NR=n, ROWS=r, num_warps=4)
        return q, sc
    if split > 1 and partials:
        return part
    if split > 1:
        _k(split_sum_kernel)[(triton.cdiv(y.numel(), 1024),)](part, y, y.numel(), SPLIT=split, BLOCK=1024,
                                                             num_warps=4)
    return y.view(rows)


def launch_grouped_linear(x, w, *, groups, weight_dtype, cfg):
    return _block_linear(x, w, groups, x.dtype, cfg)


def launch_grouped_linear_quant_fp8(x, w, *, groups, weight_dtype, block, cfg):
    return _block_linear(x, w, groups, x.dtype, cfg, quant_block=block)


def launch_linear(x, w, *, out_dtype, compute, cfg):
    """Linear on bf16 operands (fp32 compute: router, compressor, LM head; bf16 compute at decode
    rows: the indexer's projections): the one-group block linear, the same sums for both."""
    return _block_linear(x, w, 1, _TORCH_DTYPES[out_dtype] if out_dtype else x.dtype, cfg)


def launch_gemm_fp8(x, w, *, out_dtype, cfg):
    """Decode-sized lin8 (fp8 rows per 32, fp8 weight per 32x32) through tl.dot_scaled: the
    one-group block linear with a quantised activation."""
    return _block_linear(x, w, 1, _TORCH_DTYPES[out_dtype], cfg)


def launch_dspark_heads(hb, first, norm, head, markov_embed, markov_head, conf_proj, *, block, eps, cfg):
    """The draft block's tokens (dspark_heads): RMSNorm of every block row and the head's logits of
    all of them in one GEMM (rms_norm_kernel, the fp32-compute block linear), then per step s the
    Markov term of the previous token and the argmax over vocabulary tiles, and the confidence."""
    from .triton_ops import dspark_parts  # the sub-launches' configs the template rendered

    n, h, v, r = first.shape[0], hb.shape[-1], head.shape[0], markov_embed.shape[1]
    rms_cfg, lin_cfg = dspark_parts(n * block)
    a = _block_linear(launch_rms_norm(hb, norm, eps=eps, cfg=rms_cfg), head, 1, torch.float32, lin_cfg)
    nt = triton.cdiv(v, cfg["BV"])
    pv = torch.empty(n, nt, dtype=torch.float32, device=hb.device)
    pi = torch.empty(n, nt, dtype=torch.int32, device=hb.device)
    drafts = torch.empty(n, block, dtype=torch.int64, device=hb.device)
    conf = torch.empty(n, block, dtype=torch.float32, device=hb.device)
    for s in range(block):
        _k(dspark_step_kernel)[(n, nt)](a, first, drafts, markov_embed, markov_head, pv, pi, s, V=v, R=r, S=block,
                                        NT=nt, BV=cfg["BV"], BR=cfg["BR"], num_warps=cfg["num_warps"],
                                        num_stages=cfg["num_stages"])
        _k(dspark_pick_kernel)[(n,)](pv, pi, hb, first, drafts, markov_embed, conf_proj, conf, s, H=h, R=r, RP=_p2(r),
                                     S=block, NT=nt, BT=cfg["BT"], BH=cfg["BH"], num_warps=4, num_stages=1)
    return drafts, conf


def launch_grouped_gemm_fp4(x, w, offsets, *, cfg):
    """Decode-sized grouped fp4 GEMM: grid (N tiles, min(E, rows) + 1), the last program of each N
    tile zeroing the rows no expert covers (triton_kernels.grouped_gemm_fp4_kernel)."""
    xd, xs = x
    wd, ws = w
    mtot, k = xd.shape
    e, n = wd.shape[0], wd.shape[1]
    y = torch.empty(mtot, n, dtype=torch.bfloat16, device=xd.device)
    a = min(e, mtot)
    split = cfg.get("SPLIT", 1)
    part = torch.empty(split, mtot, n, dtype=torch.float32, device=xd.device) if split > 1 else y
    _k(grouped_gemm_fp4_kernel)[(triton.cdiv(n, cfg["BN"]), a + 1, split)](
        _u8(xd.contiguous()).view(torch.int16), _u8(xs), _u8(wd), _u8(ws), offsets, y, part, MTOT=mtot, N=n, K=k,
        E=e, A=a, EP=_p2(e), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], SPLIT=split, WORDS=cfg.get("WORDS", 0),
        MX=cfg.get("MX", 0), F8=cfg.get("F8", 0), ASM=int(not INTERPRETED), GEMV=cfg.get("GEMV", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        _k(split_sum_kernel)[(triton.cdiv(y.numel(), 1024),)](part, y, y.numel(), SPLIT=split, BLOCK=1024,
                                                             num_warps=4)
    return y


_TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _first(positions, token_seq):
    n = positions.shape[0]
    first = torch.full((n,), 2**31 - 1, dtype=torch.int32, device=positions.device)
    _k(seq_first_kernel)[(triton.cdiv(n, 1024),)](positions, token_seq, first, n, BLOCK=1024)
    return first


def launch_compress_pool_norm(l, s, state, positions, token_seq, seq_slots, norm_w, *, ratio, eps, cfg):
    n, d = l.shape
    y = torch.empty(n, d, dtype=torch.bfloat16, device=l.device)
    if n:
        _k(compress_pool_norm_kernel)[(n,)](l, s, state, positions, token_seq, seq_slots, _first(positions, token_seq),
                                            norm_w, y, n, eps, RATIO=ratio, RP=_p2(ratio), RING=state.shape[1], D=d,
                                            BD=_p2(d), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def launch_hc_mix(r, fn, scale, base, *, eps, copies, iters, hc_eps, post_mult, cfg):
    n, c, h = r.shape
    pre = torch.empty(n, c, dtype=torch.float32, device=r.device)
    post = torch.empty_like(pre)
    m = torch.empty(n, c, c, dtype=torch.float32, device=r.device)
    bm, split = cfg["BM"], cfg.get("SPLIT", 1)
    part = _hc_mix_partials(r, fn, cfg, m)
    grid = (triton.cdiv(n, bm),) if split == 1 else (triton.cdiv(n, bm), bm)
    _k(hc_mix_kernel)[grid](r, fn, scale, base, pre, post, m, part, n, eps, hc_eps, post_mult, C=c, H=h, ITERS=iters,
                            BM=bm, BK=cfg["BK"], SPLIT=split, num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
    return pre, post, m


def _hc_reduce(r, mix, cfg):
    n, c, h = r.shape
    out = torch.empty(n, h, dtype=r.dtype, device=r.device)
    _k(hc_reduce_kernel)[(n, triton.cdiv(h, cfg["BH"]))](r, r if mix is None else mix, out, C=c, H=h, BH=cfg["BH"],
                                                         MEAN=mix is None, num_warps=cfg["num_warps"],
                                                         num_stages=cfg["num_stages"])
    return out


def launch_hc_collapse(r, mix, *, cfg):
    return _hc_reduce(r, mix, cfg)


def launch_hc_collapse_norm(r, pre_in, nw, *, eps, cfg):
    n, c, h = r.shape
    x = torch.empty(n, h, dtype=r.dtype, device=r.device)
    _k(hc_collapse_norm_kernel)[(n,)](r, pre_in, nw, x, x, x, eps, C=c, H=h, BH=triton.next_power_of_2(h),
                                      QUANT=False, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return x


def launch_hc_collapse_norm_quant_fp8(r, pre_in, nw, *, eps, block, cfg):
    n, c, h = r.shape
    x = torch.empty(n, h, dtype=r.dtype, device=r.device)
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn, device=r.device)
    s = torch.empty(n, h // block, dtype=torch.uint8, device=r.device)
    _k(hc_collapse_norm_kernel)[(n,)](r, pre_in, nw, x, _u8(q), s, eps, C=c, H=h, BH=triton.next_power_of_2(h),
                                      QUANT=True, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return x, q, s


def launch_hc_mean(r, *, cfg):
    return _hc_reduce(r, None, cfg)


def launch_hc_repeat(x, *, copies, cfg):
    n, h = x.shape
    out = torch.empty(n, copies, h, dtype=x.dtype, device=x.device)
    _k(repeat_rows_kernel)[(n, triton.cdiv(h, cfg["BLOCK"]))](x, out, W=h, COPIES=copies, BLOCK=cfg["BLOCK"],
                                                              num_warps=cfg["num_warps"])
    return out


def launch_concat(*xs, axis, cfg):
    ax = axis % xs[0].dim()
    shape = list(xs[0].shape)
    shape[ax] = sum(x.shape[ax] for x in xs)
    out = torch.empty(shape, dtype=xs[0].dtype, device=xs[0].device)
    outer = 1
    for d in shape[:ax]:
        outer *= d
    w_out = out.numel() // max(outer, 1)
    off = 0
    for x in xs:
        w = x.numel() // max(outer, 1)
        if outer and w:
            _k(copy_cols_kernel)[(outer, triton.cdiv(w, cfg["BLOCK"]))](x, out, W_IN=w, W_OUT=w_out, OFF=off,
                                                                        BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
        off += w
    return out


def launch_lookup(table, ids, *, dead_ids, cfg):
    n = ids.numel()
    out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    dead = _int64_const(tuple(int(d) for d in dead_ids), ids.device) if dead_ids else ids
    if n:
        _k(lookup_kernel)[(triton.cdiv(n, cfg["BLOCK"]),)](table, ids, dead, out, n, V=table.shape[0], ND=len(dead_ids),
                                                           BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return out


def launch_engram_ngram_ids(cids, hist, positions, token_seq, seq_slots, *, max_ngram, pad, cfg):
    n = cids.shape[0]
    out = torch.empty(n, max_ngram, dtype=torch.int64, device=cids.device)
    if n:
        _k(engram_ngram_ids_kernel)[(n,)](cids, hist, positions, token_seq, seq_slots, _first(positions, token_seq),
                                          out, n, pad, R=max_ngram, RP=_p2(max_ngram), RING=hist.shape[1],
                                          num_warps=cfg["num_warps"])
    return out
def launch_moe_permute(sel, *, n_experts, cfg):
    from .triton_ops import permute_blocks  # the launch shape the template rendered

    n, e = sel.numel(), n_experts
    flat = sel.reshape(-1)
    order = torch.empty(n, dtype=torch.int32, device=sel.device)
    offsets = torch.empty(e + 1, dtype=torch.int32, device=sel.device)
    s = permute_blocks(n, e, cfg)
    kw = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if s["single"]:
        _k(moe_permute_kernel)[(1,)](flat, order, order, offsets, N=n, E=e, EP=s["ep"], BLOCK=s["block"],
                                     SINGLE=True, **kw)
        return order, offsets
    nb = s["nb"]
    cnt = torch.empty(nb, e, dtype=torch.int32, device=sel.device)
    adj = torch.empty(nb, e, dtype=torch.int32, device=sel.device)
    _k(moe_permute_count_kernel)[(nb,)](flat, cnt, adj, N=n, E=e, EP=s["ep"], BLOCK=s["block"], **kw)
    _k(moe_permute_scan_kernel)[(triton.cdiv(e + 1, s["ec"]),)](cnt, adj, offsets, E=e, NB=nb, EP=s["ep"],
                                                                EC=s["ec"], NBT=s["nbt"], **kw)
    _k(moe_permute_kernel)[(nb,)](flat, adj, order, offsets, N=n, E=e, EP=s["ep"], BLOCK=s["block"], SINGLE=False,
                                  **kw)
    return order, offsets


def launch_indexer_topk(qi, w, ik, positions, token_seq, block_table, cand=None, *, ratio, k, emit_candidates,
                        block_size, topk_blocks, w_scale=None, cfg):
    """The fused indexer (ir/ops/fused.py indexer_topk): keys of every visible score into an
    [n, cap] scratch (and the pool blocks' maxima at the candidate source), then one program
    per row and output selects (triton_kernels)."""
    from .triton_ops import indexer_topk_dims

    qd, qs = qi
    kd, ks = ik
    n, h, half = qd.shape
    attrs = {"ratio": ratio, "k": k, "emit_candidates": emit_candidates, "block_size": block_size,
             "topk_blocks": topk_blocks, "w_scale": w_scale}
    dims = indexer_topk_dims(n, h, 2 * half, kd.shape[1], block_table.shape[1], attrs,
                             cand.shape[1] if cand is not None else None, cfg)
    cap, nblk = dims["score"]["CAP"], dims["score"]["NBLK"]
    emit = dims["score"]["EMIT"]
    dev = qd.device
    top = torch.empty(n, k, dtype=torch.int32, device=dev)
    pool = torch.empty(n, topk_blocks, dtype=torch.int32, device=dev) if emit else top
    if n == 0:
        return (top, pool) if emit else top
    keys = torch.empty(n, cap, dtype=torch.int32, device=dev)
    bkeys = torch.empty(n, nblk, dtype=torch.int32, device=dev) if emit else keys
    bmap = _u8(qd)  # not read without a pool
    if cand is not None:
        bmap = torch.zeros(n, nblk, dtype=torch.uint8, device=dev)
        _k(indexer_block_map_kernel)[dims["map_grid"]](cand, bmap, **dims["map"])
    _k(indexer_score_kernel)[dims["score_grid"]](
        _u8(qd), _u8(qs), w, _u8(kd), _u8(ks), positions, token_seq, block_table, bmap, keys, bkeys,
        float(w_scale if w_scale is not None else 1.0), **dims["score"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    _k(indexer_select_kernel)[dims["select_grid"]](keys, bkeys, positions, top, pool, **dims["select"],
                                                   num_warps=cfg["SEL_WARPS"])
    return (top, pool) if emit else top
