"""Triton templates for sm90 / sm100: the row-wise, gather and small ops (norm + quant, RoPE +
quant, mHC pre/expand, the router, SwiGLU + quant, cache writes, Engram hash and gate, row
gathers, the MoE combine). The kernels are in `triton_kernels`, their launchers in `triton_launchers`; a template
renders that module's source with the launch of one call: the kernels it runs, each with its
signature, specialisation (constexprs), warps, stages and grid, so the Triton build compiles it
ahead of time and a runtime launches it through the named launcher.

Not registered here: the `hc_mix_gemm` / `hc_sinkhorn` pieces (the fused `hc_pre` and `hc_mix`
cover them). The sampler is not an IR op and is not here.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ...ir import dtypes as dt
from ...ir.types import QuantType, TensorType
from ..targets import building
from ..template import KernelSource, KernelSpec, Template, batch_invariant, register

TARGETS = building("triton")
KERNELS_MODULE = "deepinfer.codegen.library.triton_kernels"

_PTR = {"bf16": "*bf16", "f16": "*fp16", "f32": "*fp32", "i32": "*i32", "i64": "*i64", "u8": "*u8",
        "e8m0": "*u8", "fp8e4m3": "*u8", "fp4e2m1": "*u8", "bool": "*i1"}


@functools.lru_cache(maxsize=1)
def kernels_source() -> str:
    from . import triton_kernels

    return inspect.getsource(triton_kernels)


def _ptr(t, part: str = "data") -> str:
    if isinstance(t, QuantType):
        t = t.data if part == "data" else t.scale
    return _PTR[t.dtype.name]


def _ints(shape) -> tuple[int, ...]:
    if not all(isinstance(d, int) for d in shape):
        raise ValueError(f"Triton templates render static shapes only, got {shape}")
    return tuple(shape)


def _rows(t) -> int:
    s = _ints(t.shape)
    out = 1
    for d in s[:-1]:
        out *= d
    return out


def _p2(x: int) -> int:
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a template: what the Triton AOT build compiles."""

    entry: str
    signature: dict
    constexprs: dict
    grid: tuple
    num_warps: int
    num_stages: int
    # pointer arguments the build may take as 16-byte aligned (Triton's JIT learns it per call;
    # an ahead-of-time build is told, and runtime/triton_aot.py checks it at each launch): what
    # lets Triton vectorise the loads of a weight stream
    aligned: tuple[str, ...] = ()

    def as_meta(self) -> dict:
        meta = {"entry": self.entry, "signature": dict(self.signature), "constexprs": dict(self.constexprs),
                "grid": list(self.grid), "num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.aligned:
            meta["aligned"] = list(self.aligned)
        return meta


def _launch(entry, args: dict, constexprs: dict, grid, cfg, aligned=()) -> Launch:
    sig = dict(args)
    sig.update({k: "constexpr" for k in constexprs})
    return Launch(entry, sig, dict(constexprs), tuple(int(g) for g in grid), int(cfg.get("num_warps", 4)),
                  int(cfg.get("num_stages", 1)), tuple(aligned))


# ---- per-op launches (signatures follow the kernels' argument order) ---------------------------

def _l_rms_norm(spec, cfg, quant=False):
    x, w = spec.in_types
    h = _ints(x.shape)[-1]
    out = spec.out_types[0]
    args = {"x_ptr": _ptr(x), "w_ptr": _ptr(w), "y_ptr": _ptr(x),
            "q_ptr": _ptr(out) if quant else _ptr(x), "s_ptr": _ptr(out, "scale") if quant else _ptr(x), "eps": "fp32"}
    return [_launch("rms_norm_kernel", args, {"H": h, "BLOCK_H": min(cfg["BLOCK_H"], _p2(h)) if h >= 32 else 32,
                                              "QUANT": quant}, (_rows(x),), cfg)]


def _l_quant_fp8(spec, cfg):
    (x,), blk = spec.in_types, spec.attr["block"]
    n = _ints(x.shape)[-1]
    bs, rows, r = max(cfg["BLOCK"], blk), _rows(x), cfg.get("ROWS", 1)
    args = {"x_ptr": _ptr(x), "q_ptr": "*u8", "s_ptr": "*u8"}
    return [_launch("quant_fp8_kernel", args, {"N": n, "BLOCK": bs, "BLK": blk, "NR": rows, "ROWS": r},
                    (_cdiv(rows, r), _cdiv(n, bs)), cfg)]


# Rows a program of the memory-bound row kernels takes (swiglu_quant_kernel, gather_row_pairs_kernel,
# quant_fp8_kernel): at prefill's row counts one row's chunk is too little work to hide a program's
# latency (these kernels ran at about 3x their bytes in the seventeenth session's prefill profile);
# decode-sized calls keep a row a program
ROWS_PER_PROGRAM, ROWS_PER_PROGRAM_PAST = 4, 256


def rows_per_program(rows: int) -> int:
    return ROWS_PER_PROGRAM if rows > ROWS_PER_PROGRAM_PAST else 1


def _by_rows_per_program(rows: int) -> dict:
    return {"ROWS": rows_per_program(rows)}


def _rows_by_target(tdef: dict, rows: int) -> dict:
    """A target's ROWS for the template's calls past ROWS_PER_PROGRAM_PAST rows, where its defaults
    name one (a plan variant timing the rows a program against each other)."""
    return {"ROWS": tdef["ROWS"]} if "ROWS" in tdef and rows > ROWS_PER_PROGRAM_PAST else {}


def _l_rope(spec, cfg):
    x, pos = spec.in_types[:2]
    a = spec.attr
    shape = _ints(x.shape)
    d = shape[-1]
    heads = 1
    for s in shape[1:-1]:
        heads *= s
    if spec.op == "rope":
        mode, blk = 0, (32 if d % 32 == 0 else 2)
    elif spec.op == "rope_quant_fp8":
        mode, blk = 1, a["block"]
    else:
        mode, blk = (2 if a["scale"] == "ue8m0" else 3), a["block"]
    out = spec.out_types[0]
    args = {"x_ptr": _ptr(x), "pos_ptr": _ptr(pos), "freq_ptr": "*fp32", "y_ptr": _ptr(x),
            "q_ptr": "*u8" if mode else _ptr(x), "s_ptr": _ptr(out, "scale") if mode else _ptr(x), "pos_offset": "i32"}
    ce = {"HEADS": heads, "D": d, "ROPE": a["rope_dim"], "INVERSE": bool(a.get("inverse", False)), "MODE": mode,
          "BLK": blk, "NB": _p2(_cdiv(d, blk))}
    return [_launch("rope_kernel", args, ce, (shape[0] * heads,), cfg)]


def _l_rope_ring(spec, cfg):
    """As _ring_launch: the sequences' newest positions first only when the call has more rows
    than the ring. norm_rope_quant_fp8_cache_write: the same kernel with the RMSNorm's weight."""
    norm = spec.op == "norm_rope_quant_fp8_cache_write"
    x, *rest = spec.in_types
    w = rest.pop(0) if norm else x
    pos, ring, seq, slots = rest
    n, d = _ints(x.shape)
    blk, ring_len = spec.attr["block"], _ints(ring.shape)[1]
    keep_all = n <= ring_len
    args = {"x_ptr": _ptr(x), "w_ptr": _ptr(w), "pos_ptr": _ptr(pos), "freq_ptr": "*fp32", "q_ptr": "*u8",
            "s_ptr": "*u8", "seq_ptr": _ptr(seq), "slots_ptr": _ptr(slots),
            "newest_ptr": _ptr(pos) if keep_all else "*i32", "ring_ptr": "*u8", "rings_ptr": "*u8",
            "pos_offset": "i32", "eps": "fp32"}
    ce = {"D": d, "ROPE": spec.attr["rope_dim"], "BLK": blk, "NB": _p2(_cdiv(d, blk)), "L": ring_len,
          "KEEP_ALL": int(keep_all), "NORM": int(norm)}
    write = _launch("rope_fp8_ring_kernel", args, ce, (n,), cfg)
    return [write] if keep_all else [_newest_launch(pos, seq, n), write]


def _with_mix_partials(main: Launch, r, fn, cfg, pre_in=None) -> list[Launch]:
    """An mHC entry's launches: with SPLIT > 1, hc_mix_split_kernel's partials first (and, with
    `pre_in`, hc_pre's collapse into its output)."""
    split = cfg.get("SPLIT", 1)
    if split == 1:
        return [main]
    n, c, h = _ints(r.shape)
    collapse = pre_in is not None
    args = {"r_ptr": _ptr(r), "fn_ptr": _ptr(fn), "part_ptr": "*fp32",
            "prein_ptr": _ptr(pre_in) if collapse else "*fp32", "xc_ptr": _ptr(r) if collapse else "*fp32", "n": "i32"}
    part = _launch("hc_mix_split_kernel", args,
                   {"C": c, "H": h, "SPLIT": split, "BM": cfg["BM"], "BK": cfg["BK"], "COLLAPSE": collapse,
                    "X2": int(bool(cfg.get("X2")))},
                   (_cdiv(n, cfg["BM"]), split), cfg)
    return [part, main]


def _l_hc_pre(spec, cfg):
    r, fn, scale, base, pre_in, nw = spec.in_types
    n, c, h = _ints(r.shape)
    split = _hc_split(cfg)
    args = {"r_ptr": _ptr(r), "fn_ptr": _ptr(fn), "scale_ptr": _ptr(scale), "base_ptr": _ptr(base),
            "prein_ptr": _ptr(pre_in), "nw_ptr": _ptr(nw), "x_ptr": _ptr(r), "pre_ptr": "*fp32", "post_ptr": "*fp32",
            "m_ptr": "*fp32", "part_ptr": "*fp32", "n": "i32", "eps": "fp32", "hc_eps": "fp32", "post_mult": "fp32"}
    ce = {"C": c, "H": h, "ITERS": spec.attr["iters"], "BM": cfg["BM"], "BK": cfg["BK"], "BH": cfg["BH"],
          "SPLIT": split}
    grid = (_cdiv(n, cfg["BM"]),) if split == 1 else (_cdiv(n, cfg["BM"]), max(cfg["BM"], _cdiv(h, cfg["BH"])))
    main = _launch("hc_pre_kernel", args, ce, grid, cfg)
    return _with_mix_partials(main, r, fn, cfg, pre_in)


def _l_hc_expand(spec, cfg):
    y, r, post, m = spec.in_types
    n, c, h = _ints(r.shape)
    args = {"y_ptr": _ptr(y), "r_ptr": _ptr(r), "post_ptr": _ptr(post), "m_ptr": _ptr(m), "out_ptr": _ptr(r)}
    return [_launch("hc_expand_kernel", args, {"C": c, "H": h, "BH": cfg["BH"]}, (n, _cdiv(h, cfg["BH"])), cfg)]


def _l_router(spec, cfg):
    return _router_launches(spec, 1, cfg)


# the router kernel's launch settings where it follows the logits GEMM in one instance
# (linear_moe_router: the instance's config is the GEMM's)
ROUTER_CONFIG = {"num_warps": 4, "num_stages": 1}


def _router_launches(spec, parts: int, cfg=ROUTER_CONFIG) -> list:
    """moe_router_kernel for moe_router's spec, or for linear_moe_router's after its GEMM (the
    logits as `parts` K-split partials when parts > 1)."""
    if spec.op == "linear_moe_router":
        x, w, bias, *vl = spec.in_types
        n, e = _rows(x), _ints(w.shape)[0]
        logits = "*fp32"
    else:
        lt, bias, *vl = spec.in_types  # with route_bias folded in: bias_vl and the token ids
        (n, e), logits = _ints(lt.shape), _ptr(lt)
    k = spec.attr["k"]
    args = {"logit_ptr": logits, "bias_ptr": _ptr(bias), "sel_ptr": "*i32", "w_ptr": "*fp32", "scale": "fp32",
            "vl_ptr": _ptr(vl[0]) if vl else _ptr(bias), "ids_ptr": _ptr(vl[1]) if vl else "*i32", "image_id": "i32"}
    return [_launch("moe_router_kernel", args, {"E": e, "K": k, "KP": _p2(k), "BLOCK_E": _p2(e),
                                                "RENORM": bool(spec.attr["renorm"] and k > 1),
                                                "BIAS_ROWS": bias.rank == 2, "IDS": bool(vl), "PARTS": parts},
                    (n,), cfg)]


def _swiglu_launch(args, ce, rows: int, f: int, cfg):
    r = cfg.get("ROWS", 1)
    return _launch("swiglu_quant_kernel", args, {**ce, "BLOCK": cfg["BLOCK"], "NR": rows, "ROWS": r},
                   (_cdiv(rows, r), _cdiv(f, cfg["BLOCK"])), cfg)


def _l_swiglu(spec, cfg):
    g, u = spec.in_types
    n, f = _ints(g.shape)
    args = {"g_ptr": _ptr(g), "u_ptr": _ptr(u), "wt_ptr": _ptr(g), "pair_ptr": _ptr(g), "q_ptr": "*u8",
            "s_ptr": "*u8", "limit": "fp32"}
    ce = {"F": f, "G_STRIDE": f, "U_OFF": 0, "WEIGHTED": False}
    return [_swiglu_launch(args, ce, n, f, cfg)]


def _l_swiglu_gu(spec, cfg):
    (gu,) = spec.in_types
    n, f2 = _ints(gu.shape)
    args = {"g_ptr": _ptr(gu), "u_ptr": _ptr(gu), "wt_ptr": _ptr(gu), "pair_ptr": _ptr(gu), "q_ptr": "*u8",
            "s_ptr": "*u8", "limit": "fp32"}
    ce = {"F": f2 // 2, "G_STRIDE": f2, "U_OFF": f2 // 2, "WEIGHTED": False}
    return [_swiglu_launch(args, ce, n, f2 // 2, cfg)]


def _l_swiglu_w(spec, cfg):
    gu, wt, pairs = spec.in_types
    m, f2 = _ints(gu.shape)
    args = {"g_ptr": _ptr(gu), "u_ptr": _ptr(gu), "wt_ptr": "*fp32", "pair_ptr": _ptr(pairs), "q_ptr": "*u8",
            "s_ptr": "*u8", "limit": "fp32"}
    ce = {"F": f2 // 2, "G_STRIDE": f2, "U_OFF": f2 // 2, "WEIGHTED": True}
    return [_swiglu_launch(args, ce, m, f2 // 2, cfg)]


def _l_combine(spec, cfg):
    """moe_combine(_shared), and moe_combine_hc_expand (the same sums expanded into the streams)."""
    y, pairs, offsets, like = spec.in_types[:4]
    shared = spec.in_types[4] if len(spec.in_types) > 4 else None
    m, h = _ints(y.shape)
    n = _ints(like.shape)[0]
    k = spec.attr["k"]
    scan = combine_scan(m)
    ce = {"H": h, "K": k, "KP": _p2(k), "BH": cfg["BH"]}
    inv = {"y_ptr": _ptr(y), "inv_ptr": _ptr(pairs) if scan else "*i32",
           "sh_ptr": _ptr(shared if shared is not None else y)}
    if spec.op == "moe_combine_hc_expand":
        r, post, mix = spec.in_types[5:]
        args = inv | {"r_ptr": _ptr(r), "post_ptr": _ptr(post), "m_ptr": _ptr(mix), "out_ptr": _ptr(r)}
        combine = _launch("moe_combine_expand_kernel", args, ce | {"C": _ints(r.shape)[1], "M": m if scan else 0,
                                                                    "SCAN": scan}, (n, _cdiv(h, cfg["BH"])), cfg)
    else:
        combine = _launch("moe_combine_kernel", inv | {"out_ptr": "*bf16" if shared is not None else "*fp32"},
                          ce | {"SHARED": shared is not None, "M": m if scan else 0, "SCAN": scan},
                          (n, _cdiv(h, cfg["BH"])), cfg)
    if scan:
        return [combine]
    return [_launch("inverse_perm_kernel", {"order_ptr": _ptr(pairs), "inv_ptr": "*i32", "n": "i32"},
                    {"BLOCK": 1024}, (_cdiv(m, 1024),), {"num_warps": 4, "num_stages": 1}), combine]


# the pairs a combine program searches for its token's instead of reading an inverse permutation:
# decode and verify calls (64 sequences of 6 experts: 384), one launch where prefill's 24576 take two
COMBINE_SCAN_MAX = 1024


def combine_scan(pairs: int) -> int:
    """moe_combine_kernel's SCAN for a call of `pairs` pairs: the power of two it loads, or 0."""
    return _p2(max(pairs, 1)) if pairs <= COMBINE_SCAN_MAX else 0


def _gather_launch(src_ptr, idx_ptr, count, width, div, cfg):
    return _launch("gather_rows_kernel", {"src_ptr": src_ptr, "idx_ptr": idx_ptr, "dst_ptr": src_ptr},
                   {"W": width, "DIV": div, "BLOCK": cfg["BLOCK"]}, (count, _cdiv(width, cfg["BLOCK"])), cfg)


def _l_embedding(spec, cfg):
    ids, table = spec.in_types
    count = 1
    for d in _ints(ids.shape):
        count *= d
    return [_gather_launch(_ptr(table), _ptr(ids), count, _ints(table.shape)[1], 1, cfg)]


def _l_gather_rows(spec, cfg):
    x, rows = spec.in_types
    shape = _ints(x.shape)
    w = 1
    for d in shape[1:]:
        w *= d
    return [_gather_launch(_ptr(x), _ptr(rows), _ints(rows.shape)[0], w, 1, cfg)]


def _gather_pair_launch(q, idx_ptr, count, div, cfg):
    """A quantised tensor's data rows and their scales in one launch (gather_row_pairs_kernel)."""
    wa, wb = _ints(q.data.shape)[-1], _ints(q.scale.shape)[-1]
    args = {"a_ptr": "*u8", "b_ptr": "*u8", "idx_ptr": idx_ptr, "da_ptr": "*u8", "db_ptr": "*u8"}
    r = cfg.get("ROWS", 1)
    return _launch("gather_row_pairs_kernel", args,
                   {"WA": wa, "WB": wb, "DIV": div, "BLOCK": cfg["BLOCK"], "BLOCK_B": _p2(wb), "NR": count, "ROWS": r},
                   (_cdiv(count, r), _cdiv(wa, cfg["BLOCK"])), cfg)


def _l_moe_gather(spec, cfg):
    x, pairs = spec.in_types
    return [_gather_pair_launch(x, _ptr(pairs), _ints(pairs.shape)[0], spec.attr["k"], cfg)]


def _l_engram_gather(spec, cfg):
    cols, table = spec.in_types
    count = _ints(cols.shape)[0] * _ints(cols.shape)[1]
    return [_gather_pair_launch(table, _ptr(cols), count, 1, cfg)]


def _newest_launch(pos, seq, n):
    return _launch("seq_newest_kernel", {"pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq), "newest_ptr": "*i32", "n": "i32"},
                   {"BLOCK": 1024}, (_cdiv(n, 1024),), {"num_warps": 4, "num_stages": 1})


def _ring_launch(a, b, pos, seq, slots, da, db, n, ce, cfg):
    """The ring write, after the sequences' newest positions unless the step's rows fit the ring
    (decode steps): then no sequence has more rows than the ring and every row is kept."""
    keep_all = n <= ce["L"]
    args = {"a_ptr": a, "b_ptr": b, "pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq), "slots_ptr": _ptr(slots),
            "newest_ptr": _ptr(pos) if keep_all else "*i32", "da_ptr": da, "db_ptr": db}
    write = _launch("ring_write_kernel", args, dict(ce, KEEP_ALL=int(keep_all)), (n,), cfg)
    return [write] if keep_all else [_newest_launch(pos, seq, n), write]


def _l_swa_write(spec, cfg):
    ring, kv, pos, seq, slots = spec.in_types
    n, d = _ints(kv.shape)
    ws = _ints(kv.scale.shape)[1]
    ce = {"L": _ints(ring.shape)[1], "WA": d, "WB": ws, "A_STRIDE": d, "A_OFF": 0, "B_STRIDE": ws, "B_OFF": 0,
          "BLOCK": cfg["BLOCK"]}
    return _ring_launch("*u8", "*u8", pos, seq, slots, "*u8", "*u8", n, ce, cfg)


def _l_state_write(spec, cfg):
    state, l, s, pos, seq, slots = spec.in_types
    n, d = _ints(l.shape)
    ce = {"L": _ints(state.shape)[1], "WA": d, "WB": d, "A_STRIDE": 2 * d, "A_OFF": 0, "B_STRIDE": 2 * d, "B_OFF": d,
          "BLOCK": cfg["BLOCK"]}
    return _ring_launch("*fp32", "*fp32", pos, seq, slots, "*fp32", "*fp32", n, ce, cfg)


def _l_hist_write(spec, cfg):
    hist, cids, pos, seq, slots = spec.in_types
    n = _ints(cids.shape)[0]
    ce = {"L": _ints(hist.shape)[1], "WA": 1, "WB": 0, "A_STRIDE": 1, "A_OFF": 0, "B_STRIDE": 1, "B_OFF": 0, "BLOCK": 32}
    return _ring_launch("*i64", "*i64", pos, seq, slots, "*i64", "*i64", n, ce, {"num_warps": 1, "num_stages": 1})


def _l_compressed_write(spec, cfg):
    cache, rows, pos, seq, bt = spec.in_types
    n = _ints(rows.shape)[0]
    args = {"a_ptr": "*u8", "b_ptr": "*u8", "pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq), "bt_ptr": _ptr(bt),
            "da_ptr": "*u8", "db_ptr": "*u8"}
    ce = {"RATIO": spec.attr["ratio"], "ENTRIES": _ints(cache.shape)[1], "BT_W": _ints(bt.shape)[1],
          # bytes per row as stored (fp4 rows hold two values a byte)
          "WA": _ints(rows.data.storage_shape())[1], "WB": _ints(rows.scale.storage_shape())[1], "BLOCK": cfg["BLOCK"]}
    return [_launch("compressed_write_kernel", args, ce, (n,), cfg)]


def _l_engram_hash(spec, cfg):
    (g,) = spec.in_types
    n, gs = _ints(g.shape)
    heads = spec.attr["heads"]
    args = {"g_ptr": "*i64", "mult_ptr": "*i64", "prime_ptr": "*i64", "off_ptr": "*i64", "out_ptr": "*i64"}
    return [_launch("engram_hash_kernel", args, {"G": gs, "HEADS": heads, "HP": _p2(heads)}, (n,), cfg)]


def _l_engram_gate(spec, cfg):
    r, kv, qw, kw, *ids = spec.in_types
    n, c, h = _ints(r.shape)
    with_ids = bool(ids) and spec.attr.get("image_token_id") is not None
    args = {"r_ptr": _ptr(r), "kv_ptr": _ptr(kv), "qw_ptr": _ptr(qw), "kw_ptr": _ptr(kw),
            "ids_ptr": _ptr(ids[0]) if with_ids else _ptr(r), "out_ptr": _ptr(r), "eps": "fp32", "image_id": "i32"}
    kw_rows = _ints(kw.shape)[0] if kw.rank == 2 else 1
    return [_launch("engram_gate_kernel", args, {"C": c, "H": h, "BH": cfg["BH"], "KW_ROWS": kw_rows,
                                                 "IDS": with_ids}, (n, c), cfg)]


# programs a decode GEMM's K split aims at: two per SM of the larger GPUs (132 on the H200, 148 on
# sm100), so the weight stream has loads in flight on every SM
SPLIT_PROGRAMS = 264


def block_linear_split(cfg, tiles: int, k: int) -> int:
    """cfg's K split; SPLIT 0 picks it from the shape alone (not the rows, so the same at every
    bucket): doubled up to 16 while the programs stay within SPLIT_PROGRAMS and each split keeps
    at least two K steps."""
    split = cfg.get("SPLIT", 1)
    if split:
        return split
    split = 1
    while split < 16 and tiles * split * 2 <= SPLIT_PROGRAMS and k // (split * 2) >= 2 * cfg["BK"]:
        split *= 2
    return split


def block_linear_f8(cfg, xq: bool, quant: bool) -> int:
    """Whether block_linear_mx_kernel runs lin8 on fp8 MMAs (F8): fp8 rows and weight, 16-row
    tiles only. Those take mma.sync; a 64-row tile takes wgmma, whose fp8 sums dropped low bits
    (on the H200 it failed the per-call check against the fp32 reference at 64 rows)."""
    return int(bool(cfg.get("F8", 0) and xq and quant and cfg["BM"] == 16))


def block_linear_rows(cfg, n: int, ng: int, kg: int, groups: int) -> dict | None:
    """block_linear_rows_kernel's tiles for a call of n rows (cfg's WL), or None where the call
    takes block_linear_mx_kernel: all rows in one tile of at most 64, NG whole BN tiles, and the K
    split (SPLIT 0: the largest that keeps whole BK steps and at most SPLIT_PROGRAMS programs)."""
    if not cfg.get("WL", 0):
        return None
    bn, bk, split = cfg["BN"], cfg["BK"], cfg.get("SPLIT", 0)
    if n > 64 or ng % bn or kg % bk:
        raise ValueError(f"WL needs at most 64 rows and whole {bn} x {bk} tiles (rows {n}, N {ng}, K {kg})")
    if not split:
        split = max(s for s in (1, 2, 4, 8, 16)
                    if s == 1 or (kg % (s * bk) == 0 and groups * (ng // bn) * s <= SPLIT_PROGRAMS))
    if kg % (split * bk):
        raise ValueError(f"WL's split {split} leaves a part of a {bk}-deep K step (K {kg})")
    return {"BR": max(16, _p2(n)), "BN": bn, "BK": bk, "SPLIT": split}


# wo_a and the LM head at decode rows on block_linear_rows_kernel: the fastest config of the H200's
# sweep at 1, 8 and 64 rows (bench/linear_rows_dq.py; wo_a 17.6 / 18.0 / 59.0 -> 13.9 / 14.2 / 20.9 us,
# the head 305 / 331 / 1022 -> 291 / 296 / 329 against a 314-320 us floor; docs/performance.md's
# fourteenth session). Narrow outputs keep the row-tiled block linear: fewer than WL_MIN_TILES
# 128-wide tiles leave most SMs idle even split 16 ways (the router's 96 experts, the 512-wide
# compressor, DSpark's 128-expert router).
BLOCK_LINEAR_WL = {"WL": 1, "BN": 128, "BK": 128, "SPLIT": 0, "num_warps": 8, "num_stages": 3}
WL_MIN_TILES = 16


def _block_linear_rows_by_spec(spec, n: int, tdef: dict | None = None) -> dict:
    if n > 64:
        return {}
    x, w = spec.in_types
    quant = isinstance(w, QuantType)
    rows_w, kg = _ints((w.data if quant else w).shape)
    if rows_w // BLOCK_LINEAR_WL["BN"] < WL_MIN_TILES:
        return {}
    try:
        block_linear_rows(BLOCK_LINEAR_WL, n, rows_w // spec.attr.get("groups", 1), kg, spec.attr.get("groups", 1))
    except ValueError:
        return {}
    return dict(BLOCK_LINEAR_WL)


def _l_grouped_linear(spec, cfg):
    """The block linear's launches; grouped_linear_quant_fp8: its rows quantised by the K split's
    sum (split_sum_quant_kernel), or by quant_fp8_kernel after an unsplit call (the launcher's)."""
    x, w = spec.in_types[:2]
    quant = isinstance(w, QuantType)
    data = w.data if quant else w
    rows_w, kg = _ints(data.shape)
    g = spec.attr.get("groups", 1)  # linear: one group
    n = _rows(x)
    out = spec.out_types[0]
    qblock = spec.attr["block"] if spec.op == "grouped_linear_quant_fp8" else 0
    partials = spec.op == "linear_moe_router"  # the router sums the K split
    if partials:
        out = _router_gemm(spec).out_types[0]

    def y_ptr(split):  # quantised: the main kernel writes the partials, or bf16 rows to quantise
        if qblock:
            return "*fp32" if split > 1 else "*bf16"
        return "*fp32" if partials and split > 1 else _ptr(out)

    ce = {"G": g, "KG": kg, "NG": rows_w // g, "SK": _cdiv(kg, 32)}
    wl = block_linear_rows(cfg, n, rows_w // g, kg, g)
    if wl is not None:
        xq = isinstance(x, QuantType)
        args = {"x_ptr": "*u8" if xq else _ptr(x), "sx_ptr": "*u8" if xq else _ptr(x),
                "w_ptr": "*u8" if quant else _ptr(w), "s_ptr": "*u8" if quant else _ptr(w),
                "y_ptr": y_ptr(wl["SPLIT"]), "part_ptr": "*fp32" if wl["SPLIT"] > 1 else y_ptr(1), "n": "i32"}
        # F32 (fp32 operands) is the CPU interpreter's: its launcher passes it there
        main = _launch("block_linear_rows_kernel", args, {**ce, "XQ": xq, "WQ": quant, **wl, "F32": False},
                       (g * (rows_w // g) // wl["BN"], wl["SPLIT"]), cfg, aligned=("w_ptr", "s_ptr", "y_ptr", "part_ptr"))
        return [main] + _linear_tail(wl["SPLIT"], n, rows_w, out, qblock, spec if partials else None)
    split = block_linear_split(cfg, g * _cdiv(rows_w // g, cfg["BN"]), kg)
    grid = (_cdiv(n, cfg["BM"]), g * _cdiv(rows_w // g, cfg["BN"]), split)
    tiles = {"BM": cfg["BM"], "BN": cfg["BN"], "BK": cfg["BK"], "SPLIT": split}
    part = "*fp32" if split > 1 else y_ptr(1)
    if cfg.get("MX", 0):
        xq = isinstance(x, QuantType)  # gemm_fp8: the fp8 activation with its per-32 scales
        args = {"x_ptr": "*u8" if xq else _ptr(x), "sx_ptr": "*u8" if xq else _ptr(x),
                "w_ptr": "*u8" if quant else _ptr(w), "s_ptr": "*u8" if quant else _ptr(w),
                "y_ptr": y_ptr(split), "part_ptr": part, "n": "i32"}
        # the weight stream and the launcher's own outputs are whole buffers (256-byte aligned)
        f8 = block_linear_f8(cfg, xq, quant)
        main = _launch("block_linear_mx_kernel", args, {**ce, "XQ": xq, "WQ": quant, **tiles, "F8": f8}, grid, cfg,
                       aligned=("w_ptr", "s_ptr", "y_ptr", "part_ptr"))
    else:
        args = {"x_ptr": _ptr(x), "w_ptr": "*u8" if quant else _ptr(w), "s_ptr": "*u8" if quant else _ptr(w),
                "y_ptr": y_ptr(split), "part_ptr": part, "n": "i32"}
        main = _launch("grouped_linear_kernel", args, {**ce, "QUANT": quant, **tiles}, grid, cfg)
    return [main] + _linear_tail(split, n, rows_w, out, qblock, spec if partials else None)


def _linear_tail(split: int, n: int, width: int, out, qblock: int, router=None) -> list:
    """After the main kernel: the K split's sum, quantising where qblock is set (an unsplit call's
    rows then quantised by quant_fp8_kernel), or (router: linear_moe_router's spec) the router
    kernel summing the split itself."""
    if router is not None:
        return _router_launches(router, split)
    if not qblock:
        return _split_sum(split, n * width, out)
    if split > 1:
        return [_launch("split_sum_quant_kernel", {"part_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*u8", "total": "i32"},
                        {"SPLIT": split, "BLOCK": 1024}, (_cdiv(n * width, 1024),), {"num_warps": 4, "num_stages": 1})]
    r = rows_per_program(n)
    return [_launch("quant_fp8_kernel", {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8"},
                    {"N": width, "BLOCK": 1024, "BLK": qblock, "NR": n, "ROWS": r}, (_cdiv(n, r), _cdiv(width, 1024)),
                    {"num_warps": 4, "num_stages": 1})]


def _split_sum(split: int, total: int, out) -> list:
    """The K split's sum in split order (none for one split)."""
    if split == 1:
        return []
    return [_launch("split_sum_kernel", {"part_ptr": "*fp32", "y_ptr": _ptr(out), "total": "i32"},
                    {"SPLIT": split, "BLOCK": 1024}, (_cdiv(total, 1024),), {"num_warps": 4, "num_stages": 1})]


def _l_grouped_gemm_fp4(spec, cfg):
    x, w, offs = spec.in_types
    mtot, k = _ints(x.shape)
    e, n, _ = _ints(w.shape)
    a = min(e, mtot)
    split = cfg.get("SPLIT", 1)
    out = spec.out_types[0]
    args = {"x_ptr": "*i16", "sx_ptr": "*u8", "w_ptr": "*u8", "sw_ptr": "*u8", "off_ptr": _ptr(offs),
            "y_ptr": _ptr(out), "part_ptr": "*fp32" if split > 1 else _ptr(out)}
    ce = {"MTOT": mtot, "N": n, "K": k, "E": e, "A": a, "EP": _p2(e), "BM": cfg["BM"], "BN": cfg["BN"],
          "BK": cfg["BK"], "SPLIT": split, "WORDS": cfg.get("WORDS", 0), "MX": cfg.get("MX", 0),
          # a plan's kernels run on the GPU: the PTX widening (ASM)
          "F8": cfg.get("F8", 0), "ASM": 1, "GEMV": cfg.get("GEMV", 0)}
    # every operand is a whole tensor (rows of K bytes, K a multiple of 32)
    main = _launch("grouped_gemm_fp4_kernel", args, ce, (_cdiv(n, cfg["BN"]), a + 1, split), cfg,
                   aligned=("x_ptr", "w_ptr", "sw_ptr", "y_ptr"))
    if split == 1:
        return [main]
    return [main, _launch("split_sum_kernel", {"part_ptr": "*fp32", "y_ptr": _ptr(out), "total": "i32"},
                          {"SPLIT": split, "BLOCK": 1024}, (_cdiv(mtot * n, 1024),), {"num_warps": 4, "num_stages": 1})]


def dspark_parts(rows: int) -> tuple[dict, dict]:
    """dspark_heads' RMSNorm and head-GEMM configs for `rows` block rows: those ops' own defaults."""
    return default_config("rms_norm", rows), default_config("linear", rows)


def _l_dspark_heads(spec, cfg):
    hb, first, norm, head, memb, mhead, proj = spec.in_types
    rows, h = _ints(hb.shape)
    n, block = _ints(first.shape)[0], spec.attr["block"]
    v, r = _ints(head.shape)[0], _ints(memb.shape)[1]
    rms_cfg, lin_cfg = dspark_parts(rows)
    f32 = TensorType(dt.f32, (rows, v))
    launches = _l_rms_norm(KernelSpec("rms_norm", (("eps", spec.attr["eps"]),), (hb, norm), (hb,)), rms_cfg)
    launches += _l_grouped_linear(KernelSpec("linear", (("compute", "f32"), ("out_dtype", "f32")), (hb, head), (f32,)),
                                  lin_cfg)
    nt = _cdiv(v, cfg["BV"])
    step = {"a_ptr": "*fp32", "first_ptr": _ptr(first), "drafts_ptr": "*i64", "memb_ptr": _ptr(memb),
            "mhead_ptr": _ptr(mhead), "pv_ptr": "*fp32", "pi_ptr": "*i32", "s": "i32"}
    pick = {"pv_ptr": "*fp32", "pi_ptr": "*i32", "hb_ptr": _ptr(hb), "first_ptr": _ptr(first), "drafts_ptr": "*i64",
            "memb_ptr": _ptr(memb), "proj_ptr": _ptr(proj), "conf_ptr": "*fp32", "s": "i32"}
    return launches + [
        _launch("dspark_step_kernel", step, {"V": v, "R": r, "S": block, "NT": nt, "BV": cfg["BV"], "BR": cfg["BR"]},
                (n, nt), cfg),
        _launch("dspark_pick_kernel", pick, {"H": h, "R": r, "RP": _p2(r), "S": block, "NT": nt, "BT": cfg["BT"],
                                             "BH": cfg["BH"]}, (n,), {"num_warps": 4, "num_stages": 1})]


def _dspark_heads_supports(t, spec):
    """bf16 hidden, head, Markov tables and confidence projection of static shapes."""
    hb, first, norm, head, memb, mhead, proj = spec.in_types
    if any(isinstance(x, QuantType) or not all(isinstance(d, int) for d in x.shape) for x in spec.in_types):
        return False
    return (all(x.dtype.name == "bf16" for x in (hb, norm, head, memb, mhead, proj))
            and first.dtype.name in ("i32", "i64") and proj.shape[0] == 1)


def _grouped_gemm_fp4_supports(t, spec):
    """Decode- and verify-sized calls (at most 32 rows per expert on average: a decode batch of 64
    over the medium model's 96 experts is 4, a verify step of 64 sequences x 6 rows 24) of fp8
    rows with ue8m0 per 32 and fp4 e2m1 experts with ue8m0 per row and 32; prefill stays on
    TileLang, unless the target's defaults say `prefill` (moe_prefill). (With the bound at 4, the
    H200's verify steps of 128 and 384 rows ran the TileLang program and took 6.8x and 8.1x a
    decode step of 64 rows: bench/results/speculative_sm90_medium-u_run_i.json.) A
    batch-invariant plan takes it at every row count:
    one call must run one template at every bucket, and the TileLang program at decode rows
    launches every expert's tiles (7x the decode step on the H200)."""
    x, w = spec.in_types[:2]
    if not (isinstance(x, QuantType) and isinstance(w, QuantType)) or w.rank != 3:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    mtot, k = x.shape
    return (x.data.dtype.name == "fp8e4m3" and x.scale.dtype.name == "e8m0" and tuple(x.block) == (1, 32)
            and w.data.dtype.name == "fp4e2m1" and w.scale.dtype.name == "e8m0" and tuple(w.block) == (1, 1, 32)
            and k % 32 == 0 and (not _moe_prefill_sized(mtot, w) or batch_invariant(t) or moe_prefill(t)))


def moe_prefill(t) -> bool:
    """Targets whose defaults say so run prefill-sized MoE calls on this template too, with the
    MOE_PREFILL tiles (sm90: tl.dot_scaled there ran 3.8x the TileLang widening program's rate on
    the H200, docs/performance.md, sixteenth session)."""
    return bool(t is not None and t.defaults.get("triton_grouped_gemm_fp4", {}).get("prefill"))


# Prefill-sized calls (over 32 rows per expert on average): 128 x 128 tiles, 64 deep, 4 warps, 3
# stages; the fastest passing point of 80 (BM 64/128, BN 128/256, BK 64/128, 4/8 warps, 3/4
# stages, tl.dot_scaled / fp8 MMAs / fp16 widening) at the medium model's 4096-token w13 call.
# Built ahead of time by Triton 3.9 it spills (255 registers), and the medium plan still
# prefilled 1.31x faster with it than with 8 warps, which do not spill (sixteenth session)
MOE_PREFILL = dict(BM=128, BN=128, BK=64, num_warps=4, num_stages=3, SPLIT=1, WORDS=0, MX=1, F8=0, GEMV=0)


def _moe_prefill_sized(rows: int, w) -> bool:
    """Over 32 rows per expert on average: a prefill's MoE call, not a decode or verify step's."""
    return rows > 32 * w.shape[0]


def _grouped_gemm_fp4_by_spec(spec, rows: int, tdef: dict | None = None) -> dict:
    """MOE_PREFILL for prefill-sized calls, with the knobs a target's `prefill` default gives as an
    object over them (to time tiles Triton builds without spills: 64 deep at 4 warps spills 220
    instructions, 32 deep none, under Triton 3.9 for sm90)."""
    if not _moe_prefill_sized(rows, spec.in_types[1]):
        return {}
    over = (tdef or {}).get("prefill")
    return dict(MOE_PREFILL, **(over if isinstance(over, dict) else {}))


def permute_blocks(pairs: int, experts: int, cfg) -> dict:
    """moe_permute's launch shape (its launcher reads it from here): one program when every pair
    fits a block, else blocks of cfg BLOCK pairs and scan programs of cfg EC experts."""
    ep = _p2(experts + 1)
    if pairs <= cfg["BLOCK"]:
        return {"single": True, "block": max(16, _p2(pairs)), "ep": ep}
    nb = _cdiv(pairs, cfg["BLOCK"])
    return {"single": False, "block": cfg["BLOCK"], "ep": ep, "nb": nb, "ec": min(cfg["EC"], ep),
            "nbt": max(1, min(_p2(nb), 8192 // ep))}


def _l_moe_permute(spec, cfg):
    (sel,) = spec.in_types
    n, e = _rows(sel) * _ints(sel.shape)[-1], spec.attr["n_experts"]
    s = permute_blocks(n, e, cfg)
    sp = _ptr(sel)
    place = {"sel_ptr": sp, "adj_ptr": "*i32", "order_ptr": "*i32", "off_ptr": "*i32"}
    if s["single"]:
        return [_launch("moe_permute_kernel", place, {"N": n, "E": e, "EP": s["ep"], "BLOCK": s["block"],
                                                      "SINGLE": True}, (1,), cfg)]
    nb = s["nb"]
    return [_launch("moe_permute_count_kernel", {"sel_ptr": sp, "cnt_ptr": "*i32", "adj_ptr": "*i32"},
                    {"N": n, "E": e, "EP": s["ep"], "BLOCK": s["block"]}, (nb,), cfg),
            _launch("moe_permute_scan_kernel", {"cnt_ptr": "*i32", "adj_ptr": "*i32", "off_ptr": "*i32"},
                    {"E": e, "NB": nb, "EP": s["ep"], "EC": s["ec"], "NBT": s["nbt"]}, (_cdiv(e + 1, s["ec"]),), cfg),
            _launch("moe_permute_kernel", place, {"N": n, "E": e, "EP": s["ep"], "BLOCK": s["block"], "SINGLE": False},
                    (nb,), cfg)]


def _moe_permute_supports(t, spec):
    """Expert ids as i32 / i64 (the sorting keys are int32: expert * block + position)."""
    (sel,) = spec.in_types
    return sel.dtype.name in ("i32", "i64") and sel.rank == 2 and (spec.attr["n_experts"] + 1) * 2048 <= 2**31


def _linear_supports(t, spec):
    """Linear on bf16 operands: fp32 compute (router, LM head, DSpark's router, the compressor's
    wkv / wgate once fold_cast_into_linear has them read their bf16 input), and bf16 compute at
    decode rows (the indexer's wk and weights_proj, a compressor's wkv): with bf16 operands both
    are exact products summed in fp32, and this kernel adds its K split in a fixed order where
    TileLang's split-K adds fp32 atomics, whose sums (and the top-k they feed) depend on timing.
    Prefill-sized bf16 GEMMs stay on TileLang's wgmma program, and so do a batch-invariant plan's
    decode ones: its prefill graph runs decode rows too, and TileLang there splits no K. An fp32 input stays on the torch
    reference: with full fp32 products (tl.dot ieee) the kernel took 361 us at decode and 13.4 ms
    at 4K rows on the H200 (bench/results/triton_h200_graphs_new_templates.json), against a
    1.2 / 23 us byte floor."""
    x, w = spec.in_types
    if isinstance(w, QuantType) or w.dtype.name != "bf16" or x.dtype.name != "bf16":
        return False
    compute = spec.attr["compute"]
    decode = (not batch_invariant(t) and all(isinstance(d, int) for d in x.shape)
              and _rows(x) <= DECODE_LINEAR_ROWS)
    return (compute == "f32" or (compute == "bf16" and decode)) and spec.out_types[0].dtype.name in ("bf16", "f32")


DECODE_LINEAR_ROWS = 64  # the largest decode bucket's rows: one row tile, the K split in order


def _linear_by_rows(n: int) -> dict:
    """Decode rows split K in 8 over 32-wide N tiles; more rows take 64 x 64 tiles."""
    return {"SPLIT": 8, "BN": 32} if n <= DECODE_LINEAR_ROWS else _BLOCK_LINEAR_ROWS


def _linear_by_target(tdef: dict, n: int) -> dict:
    """A target's `decode_split` for decode rows (0: from the shape, block_linear_split), over the
    fixed 8 of _linear_by_rows: 8 splits of the router's 3 tiles are 24 programs on 132 SMs.
    With `split_rows`, calls of more rows up to it split K too, in 64-row tiles: unsplit, a
    128-row decode step's router ran its 5120-deep K in 4 programs (docs/performance.md,
    twenty-sixth session)."""
    if "decode_split" not in tdef:
        return {}
    if n <= DECODE_LINEAR_ROWS:
        return {"SPLIT": tdef["decode_split"]}
    return dict(SPLIT_ROWS_TILES, SPLIT=tdef["decode_split"]) if n <= tdef.get("split_rows", 0) else {}


def _grouped_linear_by_target(tdef: dict, n: int) -> dict:
    """wo_a's `split_rows`: calls of more than the decode rows and at most this many split K 8
    ways in 64-row tiles, as _linear_by_target's."""
    return dict(SPLIT_ROWS_TILES, BN=128, SPLIT=8) if DECODE_LINEAR_ROWS < n <= tdef.get("split_rows", 0) else {}


SPLIT_ROWS_TILES = {"BM": 64, "BN": 32, "BK": 128}  # split_rows' tiles (64 < rows <= split_rows)


def _router_gemm(spec) -> KernelSpec:
    """linear_moe_router's logits GEMM as the linear it is (the router's inputs and attrs off)."""
    x, w = spec.in_types[:2]
    a = spec.attr
    out = TensorType(dt.dtype(a["out_dtype"]) if a["out_dtype"] else x.dtype, (_rows(x), _ints(w.shape)[0]))
    return KernelSpec("linear", (("compute", a["compute"]), ("out_dtype", a["out_dtype"])), (x, w), (out,))


def _decode_row_tile(n: int) -> int:
    return 16 if n <= 16 else 32 if n <= 32 else 64


def _gemm_fp8_supports(t, spec):
    """Decode row counts (one row tile, at most the target's `decode_rows`) of fp8 rows per 32 and
    an fp8 weight per 32x32, where the target names this template for them (sm90; sm100 keeps
    its block-scaled TileLang program); prefill stays on TileLang."""
    x, w = spec.in_types
    limit = t.defaults.get("triton_gemm_fp8", {}).get("decode_rows", 0)
    if not (isinstance(x, QuantType) and isinstance(w, QuantType)) or w.rank != 2:
        return False
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return False
    return (x.data.dtype.name == "fp8e4m3" and x.scale.dtype.name == "e8m0" and tuple(x.block)[-1] == 32
            and w.data.dtype.name == "fp8e4m3" and w.scale.dtype.name == "e8m0" and tuple(w.block) == (32, 32)
            and w.shape[1] % 32 == 0 and _rows(x) <= limit and spec.out_types[0].dtype.name in ("bf16", "f32"))


def _grouped_linear_supports(t, spec):
    x, w = spec.in_types
    if spec.attr["weight_dtype"] != "bf16" or x.dtype.name != "bf16":
        return False
    if isinstance(w, QuantType):  # fp8 with 32x32 ue8m0 blocks, the checkpoint's wo_a
        return w.data.dtype.name == "fp8e4m3" and w.scale.dtype.name == "e8m0" and tuple(w.block) == (32, 32)
    return w.dtype.name == "bf16"


def _first_launch(pos, seq, n):
    return _launch("seq_first_kernel", {"pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq), "first_ptr": "*i32", "n": "i32"},
                   {"BLOCK": 1024}, (_cdiv(n, 1024),), {"num_warps": 4, "num_stages": 1})


def _l_compress_pool_norm(spec, cfg):
    l, s, state, pos, seq, slots, nw = spec.in_types
    n, d = _ints(l.shape)
    ratio = spec.attr["ratio"]
    args = {"l_ptr": _ptr(l), "s_ptr": _ptr(s), "st_ptr": _ptr(state), "pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq),
            "slots_ptr": _ptr(slots), "first_ptr": "*i32", "nw_ptr": _ptr(nw), "y_ptr": "*bf16", "n": "i32",
            "eps": "fp32"}
    ce = {"RATIO": ratio, "RP": _p2(ratio), "RING": _ints(state.shape)[1], "D": d, "BD": _p2(d)}
    return [_first_launch(pos, seq, n), _launch("compress_pool_norm_kernel", args, ce, (n,), cfg)]


def _l_hc_mix(spec, cfg):
    r, fn, scale, base = spec.in_types
    n, c, h = _ints(r.shape)
    split = _hc_split(cfg)
    args = {"r_ptr": _ptr(r), "fn_ptr": _ptr(fn), "scale_ptr": _ptr(scale), "base_ptr": _ptr(base),
            "pre_ptr": "*fp32", "post_ptr": "*fp32", "m_ptr": "*fp32", "part_ptr": "*fp32", "n": "i32", "eps": "fp32",
            "hc_eps": "fp32", "post_mult": "fp32"}
    ce = {"C": c, "H": h, "ITERS": spec.attr["iters"], "BM": cfg["BM"], "BK": cfg["BK"], "SPLIT": split}
    grid = (_cdiv(n, cfg["BM"]),) if split == 1 else (_cdiv(n, cfg["BM"]), cfg["BM"])
    main = _launch("hc_mix_kernel", args, ce, grid, cfg)
    return _with_mix_partials(main, r, fn, cfg)


def _l_hc_reduce(spec, cfg):
    r = spec.in_types[0]
    n, c, h = _ints(r.shape)
    mean = spec.op == "hc_mean"
    args = {"r_ptr": _ptr(r), "mix_ptr": _ptr(r) if mean else _ptr(spec.in_types[1]), "out_ptr": _ptr(r)}
    return [_launch("hc_reduce_kernel", args, {"C": c, "H": h, "BH": cfg["BH"], "MEAN": mean},
                    (n, _cdiv(h, cfg["BH"])), cfg)]


def _l_hc_collapse_norm(spec, cfg):
    r, pre_in, nw = spec.in_types
    n, c, h = _ints(r.shape)
    quant = spec.op == "hc_collapse_norm_quant_fp8"
    out = spec.out_types[-1]
    args = {"r_ptr": _ptr(r), "prein_ptr": _ptr(pre_in), "nw_ptr": _ptr(nw), "x_ptr": _ptr(r),
            "q_ptr": _ptr(out) if quant else _ptr(r), "s_ptr": _ptr(out, "scale") if quant else _ptr(r), "eps": "fp32"}
    return [_launch("hc_collapse_norm_kernel", args, {"C": c, "H": h, "BH": _p2(h), "QUANT": quant}, (n,), cfg)]


def _l_hc_repeat(spec, cfg):
    (x,) = spec.in_types
    n, h = _ints(x.shape)
    return [_launch("repeat_rows_kernel", {"x_ptr": _ptr(x), "out_ptr": _ptr(x)},
                    {"W": h, "COPIES": spec.attr["copies"], "BLOCK": cfg["BLOCK"]}, (n, _cdiv(h, cfg["BLOCK"])), cfg)]


def _l_concat(spec, cfg):
    xs = spec.in_types
    ax = spec.attr["axis"] % xs[0].rank
    outer = 1
    for d in _ints(xs[0].shape)[:ax]:
        outer *= d
    widths = []
    for x in xs:
        w = 1
        for d in _ints(x.shape)[ax:]:
            w *= d
        widths.append(w)
    out, off = [], 0
    for x, w in zip(xs, widths):
        if outer and w:
            out.append(_launch("copy_cols_kernel", {"src_ptr": _ptr(x), "dst_ptr": _ptr(x)},
                               {"W_IN": w, "W_OUT": sum(widths), "OFF": off, "BLOCK": cfg["BLOCK"]},
                               (outer, _cdiv(w, cfg["BLOCK"])), cfg))
        off += w
    return out


def _concat_supports(t, spec):
    """Plain tensors of static shapes (a quantised concat, w13's, runs once at load)."""
    if any(isinstance(x, QuantType) or not x.shape or not all(isinstance(d, int) for d in x.shape)
           for x in spec.in_types):
        return False
    return any(min(x.shape) > 0 for x in spec.in_types)  # something to copy: the render has a launch


def _l_lookup(spec, cfg):
    table, ids = spec.in_types
    count = 1
    for d in _ints(ids.shape):
        count *= d
    dead = spec.attr["dead_ids"]
    args = {"table_ptr": _ptr(table), "ids_ptr": _ptr(ids), "dead_ptr": "*i64" if dead else _ptr(ids),
            "out_ptr": "*i64", "n": "i32"}
    return [_launch("lookup_kernel", args, {"V": _ints(table.shape)[0], "ND": len(dead), "BLOCK": cfg["BLOCK"]},
                    (_cdiv(count, cfg["BLOCK"]),), cfg)]


def _l_engram_ngram_ids(spec, cfg):
    cids, hist, pos, seq, slots = spec.in_types
    n = _ints(cids.shape)[0]
    r = spec.attr["max_ngram"]
    args = {"cids_ptr": _ptr(cids), "hist_ptr": _ptr(hist), "pos_ptr": _ptr(pos), "seq_ptr": _ptr(seq),
            "slots_ptr": _ptr(slots), "first_ptr": "*i32", "out_ptr": "*i64", "n": "i32", "pad": "i32"}
    return [_first_launch(pos, seq, n),
            _launch("engram_ngram_ids_kernel", args, {"R": r, "RP": _p2(r), "RING": _ints(hist.shape)[1]}, (n,), cfg)]


def indexer_topk_dims(n, h, d, pe, maxp, attrs: dict, cand_width: int | None, cfg) -> dict:
    """Constexprs (in the kernels' parameter order) and grids of the indexer_topk launches: the
    launcher makes them, the render records them. cand_width: the pool's width, None without one."""
    cap = maxp * pe
    bs, tb, k = attrs["block_size"], attrs["topk_blocks"], attrs["k"]
    nblk = -(-cap // bs)
    emit = bool(attrs["emit_candidates"])
    return {"score": dict(H=h, HP=max(16, _p2(h)), D=d, PE=pe, MAXP=maxp, RATIO=attrs["ratio"], CAP=cap, BS=bs,
                          NBLK=nblk, SCALE=attrs.get("w_scale") is not None, CAND=cand_width is not None, EMIT=emit,
                          BC=cfg["BC"]),
            "score_grid": (n, -(-cap // cfg["BC"])),
            "select": dict(RATIO=attrs["ratio"], CAP=cap, K=k, KK=min(k, cap), BS=bs, NBLK=nblk, TB=tb,
                           KB=min(tb, nblk), BLOCK=cfg["BLOCK"]),
            "select_grid": (n, 1 + emit),
            "map": dict(NC=cand_width or 0, NBLK=nblk, BLOCK=1024), "map_grid": (n, max(1, -(-(cand_width or 0) // 1024)))}


def _l_indexer_topk(spec, cfg):
    qi, w, ik, pos, seq, bt = spec.in_types[:6]
    cand = spec.in_types[6] if len(spec.in_types) > 6 else None
    n, h, d = _ints(qi.shape)
    dims = indexer_topk_dims(n, h, d, _ints(ik.shape)[1], _ints(bt.shape)[1], spec.attr,
                             _ints(cand.shape)[1] if cand is not None else None, cfg)
    out = []
    if cand is not None:
        out.append(_launch("indexer_block_map_kernel", {"cand_ptr": _ptr(cand), "map_ptr": "*u8"}, dims["map"],
                           dims["map_grid"], {"num_warps": 4, "num_stages": 1}))
    args = {"qd_ptr": "*u8", "qs_ptr": "*u8", "w_ptr": _ptr(w), "kd_ptr": "*u8", "ks_ptr": "*u8", "pos_ptr": _ptr(pos),
            "seq_ptr": _ptr(seq), "bt_ptr": _ptr(bt), "map_ptr": "*u8", "key_ptr": "*i32", "bkey_ptr": "*i32",
            "w_scale": "fp32"}
    out.append(_launch("indexer_score_kernel", args, dims["score"], dims["score_grid"], cfg))
    sel = {"key_ptr": "*i32", "bkey_ptr": "*i32", "pos_ptr": _ptr(pos), "top_ptr": "*i32", "pool_ptr": "*i32"}
    out.append(_launch("indexer_select_kernel", sel, dims["select"], dims["select_grid"],
                       {"num_warps": cfg["SEL_WARPS"], "num_stages": 1}))
    return out


def _indexer_topk_supports(t, spec):
    """fp4 e2m1 index q and keys with ue8m0 per 32 (what rope_quant_fp4 and the index-K cache
    hold), static widths, blocks of the pool inside one score tile. A pool emitted from scores
    restricted to another pool (which fuse_indexer never makes) would need the unrestricted
    block maxima: not covered."""
    qi, w, ik = spec.in_types[:3]
    if not (isinstance(qi, QuantType) and isinstance(ik, QuantType)) or qi.rank != 3 or ik.rank != 3:
        return False
    fmt = all(x.data.dtype.name == "fp4e2m1" and x.scale.dtype.name == "e8m0" and tuple(x.block)[-1] == 32
              for x in (qi, ik))
    static = all(isinstance(v, int) for v in (*qi.shape, *ik.shape, *spec.in_types[5].shape))
    return (fmt and static and qi.shape[2] % 32 == 0 and w.dtype.name in ("bf16", "f32")
            and INDEXER_DEFAULT["BC"] % spec.attr["block_size"] == 0
            and not (spec.attr["emit_candidates"] and len(spec.in_types) > 6))


INDEXER_DEFAULT = dict(BC=64, BLOCK=1024, num_warps=4, num_stages=1, SEL_WARPS=8)


# ---- templates ---------------------------------------------------------------------------------

ROW = {"num_warps": (2, 4, 8, 16), "num_stages": (1, 2)}
ROWS_KNOB = {"ROWS": (1, 2, 4, 8)}  # rows a program (rows_per_program)
BLOCK_LINEAR = dict(BM=(16, 32, 64, 128), BN=(32, 64, 128), BK=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4),
                    SPLIT=(1, 2, 4, 8))  # K split: decode calls have one row tile
_BLOCK_LINEAR_ROWS = {"BM": 64, "BN": 64, "BK": 32}


@dataclass(frozen=True)
class _Op:
    op: str
    launcher: str
    launches: Callable
    knobs: dict
    default: dict
    attrs: Callable[[dict], dict] = lambda a: dict(a)
    supports: Callable[[Any, KernelSpec], bool] = lambda t, s: True
    by_rows: Callable[[int], dict] = lambda n: {}  # default knobs that depend on the call's row count
    # ... and on the target: (target defaults for this template, rows) -> knobs over by_rows'
    by_target: Callable[[dict, int], dict] = lambda d, n: {}
    # ... and on the call's shapes (spec, rows) -> knobs over both
    by_spec: Callable[..., dict] = lambda spec, n, tdef=None: {}  # tdef: the target's defaults for it


def _rope_attrs(op):
    def f(a):
        out = {k: a[k] for k in ("rope_dim", "theta", "yarn", "pos_offset")}
        if op == "rope":
            out.update(inverse=a["inverse"], mode="rope")
        elif op == "rope_quant_fp8":
            out.update(mode="fp8", block=a["block"])
        else:
            out.update(mode="fp4", scale=a["scale"], block=a["block"])
        return out
    return f


# The MoE GEMM on the CUDA cores (GEMV) at the rows where a target names it (`gemv_rows`): the
# H200's in-plan profile at b1 (6 rows) had w13 at 58.4 us and w2 at 31.3 against 74.2 and 36.8
# on dot_scaled; the fastest of its isolated sweep (BM 1-2, BN 256-512, SPLIT 1-4), one row per
# pass, 256 columns, 4 K splits. At 48 and 384 rows (b8, b64) it lost to dot_scaled by 1.3-3x.
# GEMV and F8 are not tuning knobs: the cost model sees bytes and FLOPs, not the instruction mix
# that decides between them, and the measurements put each where the defaults do.
MOE_GEMV = dict(GEMV=1, MX=0, BM=1, BN=256, BK=64, num_warps=4, num_stages=3, SPLIT=4)


def _hc_pre_by_rows(n: int) -> dict:
    """Rows of a decode step split H over 160 programs. Up to 4 rows take one block on the CUDA
    cores' FMAs (no 16-row dot of mostly padding); more take 16-row tf32x3 dots, 32 columns of
    each copy a program, 4 warps, unstaged, which beat the FMA rows from 8 rows up and 8-warp
    staged dots at 64 and 128 on the H200 (docs/performance.md, seventeenth session)."""
    if n <= HC_PRE_FMA_ROWS:
        return {"SPLIT": 160, "BK": 32, "BM": _p2(n), "BH": 128, "num_warps": 4, "num_stages": 1}
    return {"SPLIT": 160, "BK": 32, "BM": 16, "BH": 128, "num_warps": 4, "num_stages": 1} \
        if n <= HC_PRE_SPLIT_ROWS else {}


HC_PRE_SPLIT_ROWS = 256
HC_PRE_FMA_ROWS = 4


def _hc_prefill_by_target(tdef: dict, n: int) -> dict:
    """A target's knobs for the prefill mix GEMM, under its defaults' `prefill` key, and over them
    its `prefill_wide` knobs for calls of at least their `min_rows` rows: a wide row block reads
    the mix weight from L2 fewer times, but leaves a short prefill few programs (docs/
    performance.md, thirty-fourth session)."""
    if n <= HC_PRE_SPLIT_ROWS:
        return {}
    wide = dict(tdef.get("prefill_wide", {}))
    cfg = dict(tdef.get("prefill", {}))
    if wide and "min_rows" not in wide:
        raise ValueError("triton_hc_mix's prefill_wide defaults need min_rows (the rows it starts at)")
    if wide and n >= wide.pop("min_rows"):
        cfg.update(wide)
    return cfg


def _hc_split(cfg) -> int:
    """cfg's K split; fewer than 16 rows a block only with one (the unsplit mix is a 16-row dot)."""
    split = cfg.get("SPLIT", 1)
    if split == 1 and cfg["BM"] < 16:
        raise ValueError(f"hc_pre / hc_mix: BM {cfg['BM']} < 16 needs SPLIT > 1")
    return split


def _hc_supports(t, spec):
    r = spec.in_types[0]
    return len(r.shape) == 3 and r.shape[1] == 4  # the mix columns make two 16-wide dots: C*C == 16


def _rope_supports(t, spec):
    a = spec.attr
    d = spec.in_types[0].shape[-1]
    return isinstance(d, int) and a["rope_dim"] % 2 == 0 and (spec.op == "rope" or d % a["block"] == 0)


OPS = [
    _Op("rms_norm", "launch_rms_norm", _l_rms_norm, dict(BLOCK_H=(256, 512, 1024, 2048), **ROW),
        dict(BLOCK_H=1024, num_warps=4, num_stages=1)),
    _Op("rms_norm_quant_fp8", "launch_rms_norm_quant_fp8", functools.partial(_l_rms_norm, quant=True),
        dict(BLOCK_H=(256, 512, 1024, 2048), **ROW), dict(BLOCK_H=1024, num_warps=4, num_stages=1),
        supports=lambda t, s: s.attr["block"] == 32),
    _Op("quant_fp8", "launch_quant_fp8", _l_quant_fp8, dict(BLOCK=(256, 512, 1024, 2048), **ROWS_KNOB, **ROW),
        dict(BLOCK=1024, ROWS=1, num_warps=4, num_stages=1), by_rows=_by_rows_per_program, by_target=_rows_by_target),
    _Op("rope", "launch_rope", _l_rope, ROW, dict(num_warps=2, num_stages=1), _rope_attrs("rope"), _rope_supports),
    _Op("rope_quant_fp8", "launch_rope", _l_rope, ROW, dict(num_warps=2, num_stages=1), _rope_attrs("rope_quant_fp8"),
        _rope_supports),
    _Op("rope_quant_fp8_cache_write", "launch_rope_fp8_ring", _l_rope_ring, ROW, dict(num_warps=2, num_stages=1),
        lambda a: {k: a[k] for k in ("rope_dim", "theta", "yarn", "pos_offset", "block")}, _rope_supports),
    _Op("norm_rope_quant_fp8_cache_write", "launch_norm_rope_fp8_ring", _l_rope_ring, ROW,
        dict(num_warps=2, num_stages=1),
        lambda a: {k: a[k] for k in ("eps", "rope_dim", "theta", "yarn", "pos_offset", "block")}, _rope_supports),
    _Op("rope_quant_fp4", "launch_rope", _l_rope, ROW, dict(num_warps=2, num_stages=1), _rope_attrs("rope_quant_fp4"),
        _rope_supports),
    _Op("hc_pre", "launch_hc_pre", _l_hc_pre,
        # SPLIT > 1 splits the mix GEMM's K over programs; the finishing programs sum the partials
        # in passes of 32 splits, then as a tree (a fixed order, no atomics)
        dict(BM=(1, 8, 16, 32, 64), BK=(32, 64, 128), BH=(128, 256, 512), num_warps=(4, 8), num_stages=(1, 2, 3),
             SPLIT=(1, 8, 20, 40, 80, 160)),
        dict(BM=16, BK=64, BH=256, num_warps=4, num_stages=2, SPLIT=1),
        lambda a: {k: a[k] for k in ("eps", "copies", "iters", "hc_eps", "post_mult")}, _hc_supports,
        # one program per 16 rows leaves decode batches with a handful of programs walking
        # K = 20480 alone; decode rows split H over programs (the mix columns of every copy and
        # the collapse of that range), then normalise x in BH chunks. Default from the H200
        # sweep of bench/kernels_triton.py --only hc_pre (SPLIT x BK at decode sizes)
        _hc_pre_by_rows),
    _Op("hc_expand", "launch_hc_expand", _l_hc_expand, dict(BH=(256, 512, 1024, 2048), **ROW),
        dict(BH=1024, num_warps=4, num_stages=1)),
    # the bias: one row, one per token, or bias / bias_vl picked by token id (route_bias folded in)
    _Op("moe_router", "launch_moe_router", _l_router, ROW, dict(num_warps=4, num_stages=1)),
    _Op("swiglu_quant_fp8", "launch_swiglu_quant_fp8", _l_swiglu, dict(BLOCK=(256, 512, 1024), **ROWS_KNOB, **ROW),
        dict(BLOCK=512, ROWS=1, num_warps=4, num_stages=1), supports=lambda t, s: s.attr["block"] == 32,
        by_rows=_by_rows_per_program, by_target=_rows_by_target),
    _Op("swiglu_gu_quant_fp8", "launch_swiglu_gu_quant_fp8", _l_swiglu_gu, dict(BLOCK=(256, 512, 1024), **ROWS_KNOB, **ROW),
        dict(BLOCK=512, ROWS=1, num_warps=4, num_stages=1), supports=lambda t, s: s.attr["block"] == 32,
        by_rows=_by_rows_per_program, by_target=_rows_by_target),
    _Op("swiglu_weighted_quant_fp8", "launch_swiglu_weighted_quant_fp8", _l_swiglu_w,
        dict(BLOCK=(256, 512, 1024), **ROWS_KNOB, **ROW), dict(BLOCK=512, ROWS=1, num_warps=4, num_stages=1),
        supports=lambda t, s: s.attr["block"] == 32, by_rows=_by_rows_per_program, by_target=_rows_by_target),
    _Op("moe_combine", "launch_moe_combine", _l_combine, dict(BH=(256, 512, 1024), **ROW),
        dict(BH=512, num_warps=4, num_stages=1)),
    # the shared expert's add and the bf16 rounding at the MoE block's end, in the combine
    _Op("moe_combine_shared", "launch_moe_combine", _l_combine, dict(BH=(256, 512, 1024), **ROW),
        dict(BH=512, num_warps=4, num_stages=1)),
    # and the residual streams' expansion of that row (fuse_combine_expand)
    _Op("moe_combine_hc_expand", "launch_moe_combine_hc_expand", _l_combine, dict(BH=(256, 512, 1024), **ROW),
        dict(BH=512, num_warps=4, num_stages=1)),
    _Op("embedding", "launch_embedding", _l_embedding, dict(BLOCK=(512, 1024, 2048), **ROW),
        dict(BLOCK=1024, num_warps=4, num_stages=1)),
    _Op("gather_rows", "launch_gather_rows", _l_gather_rows, dict(BLOCK=(512, 1024, 2048), **ROW),
        dict(BLOCK=1024, num_warps=4, num_stages=1)),
    _Op("moe_gather_rows", "launch_moe_gather_rows", _l_moe_gather, dict(BLOCK=(512, 1024, 2048), **ROWS_KNOB, **ROW),
        dict(BLOCK=1024, ROWS=1, num_warps=4, num_stages=1), by_rows=_by_rows_per_program, by_target=_rows_by_target),
    _Op("engram_gather", "launch_engram_gather", _l_engram_gather, dict(BLOCK=(256, 512), **ROW),
        dict(BLOCK=256, num_warps=2, num_stages=1)),
    _Op("engram_hash", "launch_engram_hash", _l_engram_hash, {"num_warps": (1, 2), "num_stages": (1,)},
        dict(num_warps=1, num_stages=1)),
    # with the token ids (a fifth operand), image tokens are gated off
    _Op("engram_gate", "launch_engram_gate", _l_engram_gate, dict(BH=(256, 512, 1024), **ROW),
        dict(BH=1024, num_warps=4, num_stages=1),
        lambda a: {"eps": a["eps"], "image_token_id": a.get("image_token_id")}),
    # wo_a (spec §4.4g): MX (block_linear_mx_kernel) hands each K chunk to tl.dot_scaled, bf16
    # MMAs on the exact bf16 values; MX 0 widens them to fp32 in registers for tf32 MMAs (with
    # fp32 operands, 64x128x128 tiles spill 1.5 KB and 64x64x64 up to 112 B on sm90 / sm100).
    # Decode row counts take 16-row tiles, more rows 64x64 tiles 32 deep;
    # decode row counts split K in 8 (H200, bench/results/triton_h200_block_linear_split.json: the
    # fastest of the SPLIT x BN sweep at batch 1 and 64 for both ops, 128-wide N tiles for wo_a,
    # 32-wide for the fp32-compute linear)
    _Op("grouped_linear", "launch_grouped_linear", _l_grouped_linear, dict(BLOCK_LINEAR, MX=(0, 1), WL=(0, 1)),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, MX=1, WL=0), supports=_grouped_linear_supports,
        by_rows=lambda n: {"SPLIT": 8, "BN": 128} if n <= DECODE_LINEAR_ROWS else _BLOCK_LINEAR_ROWS,
        by_target=_grouped_linear_by_target, by_spec=_block_linear_rows_by_spec),
    # wo_a at decode with wo_b's input quantisation (fuse_decode_linear_quant): the same programs,
    # the K split's sum quantising the rows
    _Op("grouped_linear_quant_fp8", "launch_grouped_linear_quant_fp8", _l_grouped_linear,
        dict(BLOCK_LINEAR, MX=(0, 1), WL=(0, 1)),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, MX=1, WL=0),
        supports=lambda t, s: _grouped_linear_supports(t, s) and s.attr["block"] == 32,
        by_rows=lambda n: {"SPLIT": 8, "BN": 128} if n <= DECODE_LINEAR_ROWS else _BLOCK_LINEAR_ROWS,
        by_target=_grouped_linear_by_target, by_spec=_block_linear_rows_by_spec),
    # the router's logits GEMM at decode with the router reading its K split (fuse_decode_router_linear)
    _Op("linear_moe_router", "launch_linear_moe_router", _l_grouped_linear, dict(BLOCK_LINEAR, MX=(0, 1), WL=(0, 1)),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, MX=1, WL=0),
        supports=lambda t, s: _linear_supports(t, _router_gemm(s)) and s.attr["out_dtype"] == "f32",
        by_rows=_linear_by_rows, by_target=_linear_by_target,
        by_spec=lambda s, n, tdef=None: _block_linear_rows_by_spec(_router_gemm(s), n, tdef)),
    _Op("linear", "launch_linear", _l_grouped_linear, dict(BLOCK_LINEAR, MX=(0, 1), WL=(0, 1)),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3, MX=1, WL=0),
        supports=_linear_supports,
        by_rows=_linear_by_rows, by_target=_linear_by_target,
        by_spec=_block_linear_rows_by_spec),
    # lin8 at decode rows (block_linear_mx_kernel): N tiles x K splits spread the weight stream
    # over the SMs (SPLIT 0: from the shape, block_linear_split); one row tile up to 64 rows
    _Op("gemm_fp8", "launch_gemm_fp8", _l_grouped_linear,
        dict(BM=(16, 32, 64), BN=(32, 64, 128), BK=(64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4, 5),
             SPLIT=(0, 1, 2, 4, 8, 16), MX=(1,)),
        dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, SPLIT=0, MX=1, F8=0, WL=0),
        lambda a: {"out_dtype": a["out_dtype"]}, _gemm_fp8_supports, by_rows=lambda n: {"BM": _decode_row_tile(n)}),
    # MoE experts (grid: N tiles x the busy experts, found on the device; tl.dot_scaled on the MX
    # operands, or fp4 and fp8 widened in registers to fp16 MMAs); prefill row counts go to
    # TileLang unless the target's defaults name `prefill` (moe_prefill)
    _Op("grouped_gemm_fp4", "launch_grouped_gemm_fp4", _l_grouped_gemm_fp4,
        dict(BM=(16, 32, 64, 128), BN=(32, 64, 128, 256), BK=(64, 128, 256), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4),
             SPLIT=(1, 2, 4, 8), WORDS=(0, 1), MX=(0, 1)),
        # H200, medium widths, 32 points per case (bench/results/moe_decode_mx_h200.json): tl.dot_scaled
        # on the MX operands (MX) was the fastest at every case, 1.27-1.54x the fastest widening
        # config (bytes or words). 64 deep, 4 warps: within 4% of the fastest MX point everywhere,
        # and, unlike 128 deep, without spills at any real-model shape on sm90 and sm100 (ptxas);
        # 256-wide N tiles, 3 stages from 16 rows (b8, b64), 128-wide, 4 stages below (b1). Before
        # MX: unsplit K was the fastest of 32 points in all six cases (moe_decode_h200_sweep.json).
        dict(BM=16, BN=128, BK=64, num_warps=4, num_stages=4, SPLIT=1, WORDS=0, MX=1, F8=0, GEMV=0), lambda a: {},
        _grouped_gemm_fp4_supports, by_rows=lambda n: {"BN": 256, "num_stages": 3} if n >= 16 else {},
        by_target=lambda d, n: dict(MOE_GEMV) if n <= d.get("gemv_rows", 0) else {},
        by_spec=_grouped_gemm_fp4_by_spec),
    # the draft block's tokens: the head GEMM once for all block rows, then per step the Markov
    # term and a two-level argmax over vocabulary tiles (BV wide, BR deep over the Markov rank)
    _Op("dspark_heads", "launch_dspark_heads", _l_dspark_heads,
        dict(BV=(32, 64, 128), BR=(32, 64), BT=(256, 1024), BH=(512, 1024), num_warps=(2, 4, 8), num_stages=(1, 2)),
        dict(BV=64, BR=64, BT=1024, BH=1024, num_warps=4, num_stages=1),
        lambda a: {"block": a["block"], "eps": a["eps"]}, _dspark_heads_supports),
    _Op("swa_write", "launch_swa_write", _l_swa_write, dict(BLOCK=(128, 256, 512), **ROW),
        dict(BLOCK=512, num_warps=2, num_stages=1)),
    _Op("compress_state_write", "launch_compress_state_write", _l_state_write, dict(BLOCK=(128, 256, 512), **ROW),
        dict(BLOCK=512, num_warps=2, num_stages=1)),
    _Op("engram_hist_write", "launch_engram_hist_write", _l_hist_write, {"num_warps": (1,), "num_stages": (1,)},
        dict(num_warps=1, num_stages=1)),
    _Op("compressed_write", "launch_compressed_write", _l_compressed_write, dict(BLOCK=(128, 256), **ROW),
        dict(BLOCK=256, num_warps=2, num_stages=1)),
    # one row of the latent per program (D = 512 in V4.1), the group's RATIO rows in registers
    _Op("compress_pool_norm", "launch_compress_pool_norm", _l_compress_pool_norm, ROW,
        dict(num_warps=4, num_stages=1), lambda a: {"ratio": a["ratio"], "eps": a["eps"]}),
    # hc_pre's mixes without its collapse (layer 0's attention); the same K split at decode rows
    _Op("hc_mix", "launch_hc_mix", _l_hc_mix,
        dict(BM=(1, 8, 16, 32, 64), BK=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3),
             SPLIT=(1, 8, 20, 40, 80, 160)),
        dict(BM=16, BK=64, num_warps=4, num_stages=2, SPLIT=1),
        lambda a: {k: a[k] for k in ("eps", "copies", "iters", "hc_eps", "post_mult")}, _hc_supports,
        _hc_pre_by_rows, by_target=_hc_prefill_by_target),
    # a row per program, the whole row in registers: 16 warps hold 5120 columns in 10 a thread
    _Op("hc_collapse_norm", "launch_hc_collapse_norm", _l_hc_collapse_norm, ROW, dict(num_warps=16, num_stages=1),
        lambda a: {"eps": a["eps"]}, supports=lambda t, s: s.in_types[0].rank == 3),
    # ... and its output quantised per 32 in the same program (the row's 32-column blocks)
    _Op("hc_collapse_norm_quant_fp8", "launch_hc_collapse_norm_quant_fp8", _l_hc_collapse_norm, ROW,
        dict(num_warps=16, num_stages=1), lambda a: {"eps": a["eps"], "block": a["block"]},
        supports=lambda t, s: s.in_types[0].rank == 3 and s.attr["block"] == 32),
    _Op("hc_collapse", "launch_hc_collapse", _l_hc_reduce, dict(BH=(256, 512, 1024, 2048), **ROW),
        dict(BH=1024, num_warps=4, num_stages=1), supports=lambda t, s: s.in_types[0].rank == 3),
    _Op("hc_mean", "launch_hc_mean", _l_hc_reduce, dict(BH=(256, 512, 1024, 2048), **ROW),
        dict(BH=1024, num_warps=4, num_stages=1), supports=lambda t, s: s.in_types[0].rank == 3),
    _Op("hc_repeat", "launch_hc_repeat", _l_hc_repeat, dict(BLOCK=(512, 1024, 2048), **ROW),
        dict(BLOCK=1024, num_warps=4, num_stages=1), supports=lambda t, s: s.in_types[0].rank == 2),
    # one copy launch per operand, into its column range of the output rows
    _Op("concat", "launch_concat", _l_concat, dict(BLOCK=(512, 1024, 2048), **ROW),
        dict(BLOCK=1024, num_warps=4, num_stages=1), supports=_concat_supports),
    _Op("lookup", "launch_lookup", _l_lookup, dict(BLOCK=(256, 512, 1024), **ROW),
        dict(BLOCK=256, num_warps=2, num_stages=1), lambda a: {"dead_ids": tuple(a["dead_ids"])},
        lambda t, s: s.in_types[0].rank == 1),
    _Op("engram_ngram_ids", "launch_engram_ngram_ids", _l_engram_ngram_ids, {"num_warps": (1, 2), "num_stages": (1,)},
        dict(num_warps=1, num_stages=1)),
    # a counting sort (triton_kernels says why): BLOCK pairs per sorting program (decode steps fit
    # one), EC experts per scan program
    _Op("moe_permute", "launch_moe_permute", _l_moe_permute,
        dict(BLOCK=(256, 512, 1024, 2048), EC=(16, 32, 64), **ROW), dict(BLOCK=1024, EC=32, num_warps=4, num_stages=1),
        supports=_moe_permute_supports),
    # the fused indexer (scores, pool, top-k): exact index outputs, one score tile per program
    # and one selecting program per row and output (a program walking one row's tiles was 4%
    # slower at a 4K prefill on an H100: docs/performance.md, twenty-eighth session)
    _Op("indexer_topk", "launch_indexer_topk", _l_indexer_topk,
        dict(BC=(32, 64, 128), BLOCK=(256, 512, 1024, 2048), num_warps=(4, 8), num_stages=(1, 2), SEL_WARPS=(4, 8, 16)),
        INDEXER_DEFAULT, lambda a: {k: a[k] for k in ("ratio", "k", "emit_candidates", "block_size", "topk_blocks",
                                                      "w_scale")}, _indexer_topk_supports),
]


def _make_render(o: _Op):
    def render(target, spec: KernelSpec, config) -> KernelSource:
        cfg = dict(o.default)
        cfg.update(config or {})
        launches = o.launches(spec, cfg)
        main = launches[-1]
        return KernelSource(
            language="triton", entry=main.entry, text=kernels_source(), grid=main.grid,
            block=(32 * main.num_warps,),
            meta={"module": KERNELS_MODULE, "launcher": o.launcher, "config": cfg,
                  "launch_attrs": o.attrs(spec.attr), "kernels": [k.as_meta() for k in launches]})
    return render


def _call_rows(spec: KernelSpec | None) -> int | None:
    n = spec.in_types[0].shape[0] if spec is not None and spec.in_types and spec.in_types[0].shape else None
    return n if isinstance(n, int) else None


def _target_defaults(op: str, target) -> dict:
    """A target's own defaults for op's template (none without a target)."""
    return target.defaults.get(f"triton_{op}", {}) if target is not None else {}


def default_config(op: str, rows: int | None = None, target=None) -> dict:
    """The op's default knobs for a call of `rows` rows (None: the row-independent default), with
    `target`'s own defaults for the template where it names them."""
    o = _BY_OP[op]
    if rows is None:
        return dict(o.default)
    tdef = _target_defaults(op, target)
    return {**o.default, **o.by_rows(rows), **o.by_target(tdef, rows)}


def _spec_default(o: _Op, target, spec: KernelSpec) -> dict:
    """A call's default knobs: by its rows and target, then by its shapes (a batch-invariant target
    takes the row-independent default: one config at every bucket)."""
    if batch_invariant(target):
        return default_config(o.op, None, target)
    rows = _call_rows(spec)
    cfg = default_config(o.op, rows, target)
    return {**cfg, **o.by_spec(spec, rows, _target_defaults(o.op, target))} if rows is not None else cfg


_BY_OP = {o.op: o for o in OPS}
TEMPLATES_BY_OP: dict[str, Template] = {}
for _o in OPS:
    TEMPLATES_BY_OP[_o.op] = register(Template(
        name=f"triton_{_o.op}", ops=(_o.op,), targets=TARGETS, knobs=_o.knobs, render=_make_render(_o),
        default_config=(lambda target, spec, _o=_o: _spec_default(_o, target, spec)), supports=_o.supports))
_ATTRS = {o.op: o.attrs for o in OPS}
LAUNCHERS = {o.op: o.launcher for o in OPS}


def launch_attrs(op: str, attrs: dict) -> dict:
    """The launcher's keyword arguments for an IR node's attrs."""
    return _ATTRS[op](attrs)
