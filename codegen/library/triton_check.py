"""Checking the Triton templates against their ops' reference semantics: input cases at tiny and
at real V4.1 sizes, and the comparison rule per output kind. Shared by the CPU tests (interpreter,
tiny sizes), the GPU tests (H200, tiny and real sizes) and bench/runtime_sm90.local_check, and by
the measured tuner (autotune/bench.py), which makes a call's inputs at its own types
(`spec_case`) and holds each candidate to `judge` (these rules for Triton templates, max relative
error for TileLang ones) before it times it.

The tolerance rule (the kernels accumulate in fp32 where the references accumulate in fp64, and
use fp32 transcendentals where the references round fp64 ones once):
- fp32 outputs: |got - ref| <= 1e-3 * |ref| + 1e-3 * rms(ref). fp32 accumulation over <= 20480
  terms leaves ~1e-5 relative error; any indexing or formula error is O(1), so 1e-3 separates them.
- bf16 outputs: both sides round to nearest even from fp32 values that agree to a few fp32 ulps
  of the magnitude of the terms combined, so an element is either identical or one bf16 ulp apart
  when its fp32 value sat near a rounding boundary (probability ~ 1e-6 / 2^-8 ~ 3e-4 per element).
  Where the terms cancel (rope's re*c - im*s, mHC's post*y + sum M*R, Engram's R + gate*v, the
  collapse before a norm) the result is small and its bf16 ulp finer than that absolute fp32
  error, so the error is bounded in units of the row's scale, not of the element's own ulp.
  Allowed: every element within 1 ulp of itself plus ROW_FLOOR = 2^-16 of its row's largest
  reference magnitude (256 fp32 ulps of the row scale: fp32 sums over up to 16384 terms, the
  Sinkhorn divisions and the gate's square root near zero stay well inside it, while any
  indexing or formula error is of the row's own scale, 2^16 times larger), and at most
  max(2, 1%) elements not identical. Where the spec rounds an intermediate to bf16 on the way
  (hc_pre's collapse, then its RMSNorm), the two sides' intermediates may sit one bf16 ulp apart
  (the same boundary effect one step earlier), which the rest of the op carries to the output as
  up to 2^-7 of its magnitude: each such rounding adds 2^-7 * |ref| (INNER_ROUNDINGS).
- fp8 / fp4 quantised outputs: compared dequantised. The quantiser is bit-exact, so a difference
  can only come from a 1-ulp bf16 flip upstream landing on a different fp8/fp4 grid point (or, if
  it was the block's amax at a power-of-two boundary, a different block scale). Allowed: every
  element within one grid step of the coarser of the two block scales, at most max(2, 1%) of the
  elements not identical.
- integer outputs (selections, hashes, gathers, cache writes): exact; the router's selection may
  differ only in rows whose reference scores at the k-th place are within 1e-5 relative (a near
  tie that fp32 vs fp64 softplus may order differently), and such rows are reported.
"""
from __future__ import annotations

import math

import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.quant import QTensor

# ---- comparison --------------------------------------------------------------------------------


def _flip_budget(numel: int) -> int:
    return max(2, math.ceil(0.01 * numel))


def _pair(got, ref):
    """Both sides in fp64 on got's device: a prefill call's outputs are compared where they are
    (the GPU), not copied to the host (host comparisons of its [24576, 4608] outputs took minutes
    a step)."""
    got = got.double()
    return got, ref.double().to(got.device)


def compare_f32(got, ref, what="output"):
    got, ref = _pair(got, ref)
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)) or not torch.equal(got[~fin], ref[~fin]):
        return f"{what}: non-finite values differ"
    g, r = got[fin], ref[fin]
    if not r.numel():
        return None
    rms = r.pow(2).mean().sqrt().item()
    err = (g - r).abs()
    bad = err > 1e-3 * r.abs() + 1e-3 * rms
    if bad.any():
        return f"{what}: {int(bad.sum())} of {r.numel()} beyond 1e-3 (max abs err {err.max().item():.3g})"
    return None


def _bf16_ulp(v):
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, e - 7)


ROW_FLOOR = 2.0**-16
# op -> {output index: bf16 roundings of intermediates the spec pins on the way to that output}
INNER_ROUNDINGS = {"hc_pre": {0: 1}, "hc_collapse_norm": {0: 1}, "hc_collapse_norm_quant_fp8": {0: 1},
                   "compress_pool_norm": {0: 1}}


def compare_rounded(got, ref, what="output", inner=0):
    """bf16 (or f16) outputs: 1 ulp plus the row-scale floor (plus 2^-7 |ref| for each rounded
    intermediate), flips bounded."""
    if got.dtype in (torch.float32, torch.float64):
        return compare_f32(got, ref, what)
    g, r = _pair(got, ref)
    diff = g != r
    if not diff.any():
        return None
    ulp = _bf16_ulp(torch.maximum(g.abs(), r.abs())) * (8 if got.dtype == torch.float16 else 1)
    row = r.abs().amax(-1, keepdim=True) if r.dim() else r.abs()
    err = (g - r).abs()
    beyond = err > ulp * 1.0001 + ROW_FLOOR * row + inner * 2.0**-7 * r.abs()
    if beyond.any():
        worst = int(torch.argmax(torch.where(beyond, err / ulp, torch.zeros_like(err))))
        extra = f" + {inner} rounded intermediate" if inner else ""
        return (f"{what}: {int(beyond.sum())} elements beyond 1 ulp + 2^-16 of the row scale{extra} (worst: "
                f"got {g.flatten()[worst].item():.6g}, ref {r.flatten()[worst].item():.6g}, "
                f"row scale {row.expand_as(r).flatten()[worst].item():.3g})")
    if int(diff.sum()) > _flip_budget(r.numel()):
        return f"{what}: {int(diff.sum())} of {r.numel()} elements flipped (budget {_flip_budget(r.numel())})"
    return None


def _deq(q: QTensor):
    from deepinfer.ir.ops.quantized import dequant_value

    return dequant_value(QTensor(q[0].cpu(), q[1].cpu())).double()


def compare_quant(got, ref, what="output"):
    """QTensor outputs (fp8 per-32, fp4 per-32 ue8m0 or per-16 e4m3), compared dequantised."""
    g, r = _deq(got), _deq(ref)
    diff = g != r
    if not diff.any():
        return None
    gd, gs, rs = got[0].cpu(), got[1].cpu(), ref[1].cpu()
    fp8 = gd.dtype == torch.float8_e4m3fn
    block = g.shape[-1] // gs.shape[-1]

    def scale_val(s):
        return s.float() if s.dtype == torch.float8_e4m3fn else dt.e8m0_decode(s)

    s = torch.maximum(scale_val(gs), scale_val(rs)).double().repeat_interleave(block, -1)
    v = torch.maximum(g.abs(), r.abs()) / s
    if fp8:
        step = torch.where(v < 2.0**-6, torch.full_like(v, 2.0**-9),
                           torch.pow(2.0, torch.floor(torch.log2(v.clamp_min(2.0**-6))) - 3))
    else:
        step = torch.where(v <= 2, torch.full_like(v, 0.5), torch.where(v <= 4, torch.ones_like(v), torch.full_like(v, 2.0)))
    beyond = (g - r).abs() > step * s * 1.0001
    if beyond.any():
        return f"{what}: {int(beyond.sum())} elements beyond one grid step (max {(g - r).abs().max().item():.3g})"
    if int(diff.sum()) > _flip_budget(r.numel()):
        return f"{what}: {int(diff.sum())} of {r.numel()} quantised elements differ (budget {_flip_budget(r.numel())})"
    return None


def compare_exact(got, ref, what="output"):
    if isinstance(ref, tuple):
        for i, (a, b) in enumerate(zip(got, ref)):
            m = compare_exact(a, b, f"{what}[{i}]")
            if m:
                return m
        return None
    a, b = got.cpu(), ref.cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
        return f"{what}: not equal ({int((a != b.to(a.dtype)).sum()) if a.shape == b.shape else 'shape'} differ)"
    return None


def router_logits_bias(op: str, ins, attrs: dict):
    """(the reference's logits, the bias) of a router call, for compare_router's near ties:
    linear_moe_router's logits from its x and gate weight by the linear's reference."""
    if op == "linear_moe_router":
        from deepinfer.ir.registry import get_op

        logits = get_op("linear").ref(ins[0], ins[1], out_dtype=attrs.get("out_dtype", "f32"),
                                      compute=attrs.get("compute", "f32"))
        return logits, ins[2]
    return ins[0], ins[1]


def compare_router(got, ref, logits, bias):
    sel, w = got[0].cpu().long(), got[1].cpu()
    rsel, rw = ref[0].cpu().long(), ref[1].cpu()
    from deepinfer.ir import numerics as nm

    s = torch.sqrt(nm.softplus32(logits.cpu().float())) + bias.cpu().float()
    srt = torch.sort(s, dim=-1, descending=True).values
    k = rsel.shape[1]
    top = srt[:, : k + 1]  # the k picked and the first one left out (none when k is every expert)
    gaps = (top[:, :-1] - top[:, 1:]).abs() <= 1e-5 * top.abs().amax(-1, keepdim=True)
    near = gaps.any(-1)
    same = (sel == rsel).all(-1)
    if (~same & ~near).any():
        return f"router: {int((~same & ~near).sum())} rows select other experts without a near tie"
    return compare_f32(w[same], rw[same], "router weights")


# ---- one call's outputs ------------------------------------------------------------------------

# TileLang templates are held to their max-relative bounds of tests/gpu (their fp8 / fp4 MMAs
# accumulate in another order than the reference, beyond the rounding rules above). Index scores are
# bf16 values: an fp32 sum in another order can move one to the next bf16, up to 2^-7 of the largest
TILELANG_TOLERANCE = {"tilelang_gemm_fp8": 1e-2, "tilelang_linear": 1e-2, "tilelang_grouped_gemm_fp4": 1e-2,
                      "tilelang_sparse_attn": 2e-2, "tilelang_window_attn": 2e-2, "tilelang_dspark_block_attn": 2e-2,
                      "tilelang_indexer_scores": 1e-2}


def max_rel(got, ref) -> float:
    """max |got - ref| / max |ref| over the finite reference values (inf where the non-finite
    ones differ)."""
    g, r = _pair(got, ref)
    fin = torch.isfinite(r)
    if not torch.equal(fin, torch.isfinite(g)):
        return float("inf")
    if not fin.any():
        return 0.0
    return float((g[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30))


def judge(op: str, template: str | None, got, ref, ins, attrs: dict | None = None) -> tuple[bool, str]:
    """One call's output against its op's reference on the same inputs (`ins`: its first three
    inputs, which the router's rule reads: the logits, or linear_moe_router's x and gate weight,
    whose logits `attrs` make, then the bias): Triton templates by the per-output rules above,
    TileLang ones by max relative error, torch references run on both sides by the f32 / exact
    rules. (ok, the reason or the max relative error)."""
    got_t = got if isinstance(got, tuple) and not isinstance(got, QTensor) else (got,)
    ref_t = ref if isinstance(ref, tuple) and not isinstance(ref, QTensor) else (ref,)
    if template in TILELANG_TOLERANCE:
        r = max(max_rel(a, b) for a, b in zip(got_t, ref_t))
        return r <= TILELANG_TOLERANCE[template], f"max rel {r:.2e}"
    kind = OUTPUT_KINDS.get(op) if template and template.startswith("triton_") else None
    if kind == "router":
        m = compare_router(got_t, ref_t, *router_logits_bias(op, ins, attrs or {}))
    else:
        m = None
        for i, (a, b) in enumerate(zip(got_t, ref_t)):
            if isinstance(b, QTensor):
                m = compare_quant((a.data, a.scale), (b.data, b.scale), f"output {i}")
            elif b.dtype.is_floating_point and b.dtype != torch.float32 and kind != "f32":
                m = compare_rounded(a, b, f"output {i}", INNER_ROUNDINGS.get(op, {}).get(i, 0))
            elif b.dtype.is_floating_point:
                m = compare_f32(a, b, f"output {i}")
            else:
                m = compare_exact(a, b, f"output {i}")
            if m:
                break
    rel = max((max_rel(a.data if isinstance(a, QTensor) else a, b.data if isinstance(b, QTensor) else b)
               for a, b in zip(got_t, ref_t) if (b.data if isinstance(b, QTensor) else b).dtype.is_floating_point),
              default=0.0)
    return m is None, m or f"max rel {rel:.2e}"


# ---- cases -------------------------------------------------------------------------------------

TINY = dict(n=5, H=96, C=4, D=128, rope=64, heads=2, index_dim=128, E=24, k=3, F=64, ring=8, slots=3, pages=6, entries=4,
            vocab=50, hc_iters=20, o_groups=2, o_in=128, o_rank=64, index_topk=16, topk_blocks=4, index_cap=160,
            mrank=32, dblock=5)
# real V4.1-Flash widths (spec §1); n is set per case (decode 1 / 64, prefill 4096). index_cap: the
# indexer's compressed entries per row (32768: a 32K context at ratio 1, 4096 blocks > the 2048 kept)
REAL = dict(H=5120, C=4, D=512, rope=64, heads=32, index_dim=128, E=384, k=6, F=2304, ring=128, slots=64, pages=512,
            entries=64, vocab=129280, hc_iters=20, o_groups=8, o_in=4096, o_rank=1024, index_topk=512,
            topk_blocks=2048, index_cap=32768, mrank=256, dblock=5)
YARN = (16, 65536, 32, 1)


def _meta(n, seqs, device, start=(0, 9, 200)):
    """positions / token_seq / seq_slots for n rows split over `seqs` sequences."""
    per = [n // seqs + (1 if i < n % seqs else 0) for i in range(seqs)]
    pos, ts = [], []
    for s, cnt in enumerate(per):
        base = start[s % len(start)] + 37 * s
        pos += list(range(base, base + cnt))
        ts += [s] * cnt
    positions = torch.tensor(pos, dtype=torch.int32, device=device)
    token_seq = torch.tensor(ts, dtype=torch.int32, device=device)
    seq_slots = torch.tensor(list(reversed(range(seqs))), dtype=torch.int32, device=device)
    return positions, token_seq, seq_slots


def make_case(op: str, dims: dict, n: int, device="cpu", seed=0):
    """(inputs, attrs) for `op` with n rows at the given widths; inputs on `device`."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    H, C, D = dims["H"], dims["C"], dims["D"]
    if op == "rms_norm":
        return [rn(n, H, scale=3), rn(H)], {"eps": 1e-20}
    if op == "rms_norm_quant_fp8":
        return [rn(n, H, scale=3), rn(H)], {"eps": 1e-20, "block": 32}
    if op == "quant_fp8":
        return [rn(n, H, scale=2)], {"block": 32}
    if op in ("rope", "rope_quant_fp8", "rope_quant_fp4"):
        pos = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32).to(device)
        rope = {"rope_dim": dims["rope"], "theta": 160000.0, "yarn": YARN, "pos_offset": 0}
        if op == "rope":
            return [rn(n, dims["heads"], D), pos], dict(rope, inverse=False)
        if op == "rope_quant_fp8":
            return [rn(n, D), pos], dict(rope, block=32)
        return [rn(n, dims["heads"], dims["index_dim"]), pos], dict(rope, block=32, scale="ue8m0")
    if op == "norm_rope_quant_fp8_cache_write":  # the same rows before their RMSNorm, and its weight
        ins, attrs = make_case("rope_quant_fp8_cache_write", dims, n, device, seed)
        return [rn(n, D, scale=3), rn(D), *ins[1:]], dict(attrs, eps=1e-20)
    if op in ("rope_quant_fp8_cache_write", "rope_quant_fp8_cache_write_long"):  # positions past 2^16
        seqs = min(3, n)
        positions, token_seq, seq_slots = _meta(n, seqs, device, start=(70000, 9, 200))
        from deepinfer.ir.quant import quant_fp8_32

        # _long: a one-entry ring, shorter than the step's rows (the newest-position path)
        ring_len = 1 if op.endswith("_long") else dims["ring"]
        ring = quant_fp8_32(torch.randn(max(dims["slots"], seqs), ring_len, D, generator=g))
        return [rn(n, D), positions, QTensor(ring.data.to(device), ring.scale.to(device)), token_seq, seq_slots], \
            {"rope_dim": dims["rope"], "theta": 160000.0, "yarn": YARN, "pos_offset": 0, "block": 32}
    if op == "rope_quant_fp4_e4m3":
        pos = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32).to(device)
        return [rn(n, D), pos], {"rope_dim": dims["rope"], "theta": 160000.0, "yarn": YARN, "pos_offset": -1,
                                 "block": 16, "scale": "e4m3"}
    if op == "hc_pre":
        mix = 2 * C + C * C
        return [rn(n, C, H), rn(mix, C * H, scale=0.02, dtype=torch.float32),
                rn(3, scale=0.5, dtype=torch.float32), rn(mix, scale=0.5, dtype=torch.float32),
                torch.rand(n, C, generator=g).to(device), rn(H)], \
            {"eps": 1e-20, "copies": C, "iters": dims["hc_iters"], "hc_eps": 1e-6, "post_mult": 2.0}
    if op in ("hc_collapse_norm", "hc_collapse_norm_quant_fp8"):
        return [rn(n, C, H), torch.rand(n, C, generator=g).to(device), rn(H)], \
            {"eps": 1e-20} | ({"block": 32} if op.endswith("fp8") else {})
    if op == "hc_expand":
        m = torch.rand(n, C, C, generator=g).to(device)
        return [rn(n, H), rn(n, C, H), torch.rand(n, C, generator=g).to(device) * 2, m], {}
    if op in ("linear_moe_router", "linear_moe_router_image_bias"):  # logits from a bf16 gate GEMM
        gemm = [rn(n, H), rn(dims["E"], H, scale=2 / H ** 0.5)]
        attrs = {"out_dtype": "f32", "compute": "f32"}
        if op.endswith("_image_bias"):
            ins, a = make_case("moe_router_image_bias", dims, n, device, seed)
            return [*gemm, *ins[1:]], dict(a, **attrs)
        return [*gemm, rn(dims["E"], scale=0.1, dtype=torch.float32)], \
            dict(attrs, k=dims["k"], scale=2.5, renorm=True)
    if op == "moe_router":
        return [rn(n, dims["E"], scale=2, dtype=torch.float32), rn(dims["E"], scale=0.1, dtype=torch.float32)], \
            {"k": dims["k"], "scale": 1.5, "renorm": True}
    if op == "grouped_linear_quant_fp8":  # wo_a's case, its rows quantised per 32
        ins, attrs = make_case("grouped_linear", dims, n, device, seed)
        return ins, dict(attrs, block=32)
    if op == "grouped_linear":  # wo_a: fp8 weight, 32x32 ue8m0 blocks, G groups of the input
        from deepinfer.ir.quant import quant_fp8_weight

        G, kg, ng = dims["o_groups"], dims["o_in"], dims["o_rank"]
        w = quant_fp8_weight(torch.randn(G * ng, kg, generator=g) * 0.05)
        return [rn(n, G * kg), QTensor(w.data.to(device), w.scale.to(device))], {"groups": G, "weight_dtype": "bf16"}
    if op == "dspark_heads":  # the draft block: n sequences of `dblock` rows, vocabulary-wide head
        V, R, S = dims["vocab"], dims["mrank"], dims["dblock"]
        first = torch.randint(0, V, (n,), generator=g).to(device)
        return [rn(n * S, H, scale=3), first, rn(H), rn(V, H, scale=0.05), rn(V, R), rn(V, R, scale=0.2),
                rn(1, H + R, scale=0.05)], {"block": S, "eps": 1e-20}
    if op == "linear":  # fp32 compute on a bf16 weight: the router's logits
        return [rn(n, H), rn(dims["E"], H, scale=0.05)], {"out_dtype": "f32", "compute": "f32"}
    if op == "linear_bf16":  # bf16 compute, bf16 out: the indexer's projections at decode rows
        return [rn(n, H), rn(dims["E"], H, scale=0.05)], {"out_dtype": "bf16", "compute": "bf16"}
    if op == "moe_router_row_bias":  # a bias per row (route_bias: the image tokens' own bias)
        return [rn(n, dims["E"], scale=2, dtype=torch.float32), rn(n, dims["E"], scale=0.1, dtype=torch.float32)], \
            {"k": dims["k"], "scale": 1.5, "renorm": True}
    if op == "moe_router_image_bias":  # route_bias folded in: image tokens (every third row) use bias_vl
        ids = torch.randint(3, 1000, (n,), generator=g)
        ids[::3] = 999_999
        return [rn(n, dims["E"], scale=2, dtype=torch.float32), rn(dims["E"], scale=0.1, dtype=torch.float32),
                rn(dims["E"], scale=0.1, dtype=torch.float32), ids.to(device)], \
            {"k": dims["k"], "scale": 1.5, "renorm": True, "image_token_id": 999_999}
    if op == "moe_permute":  # k distinct experts per token, as the router selects them
        E = dims["E"]
        sel = torch.stack([torch.randperm(E, generator=g)[: dims["k"]] for _ in range(n)]).to(torch.int32)
        return [sel.to(device)], {"n_experts": E}
    if op == "moe_permute_skewed":  # blocks of pairs to merge, crowded and empty experts
        E, tokens = dims["E"], max(n, 400)
        sel = (torch.rand(tokens, dims["k"], generator=g).pow(3) * (E - 3)).to(torch.int32)
        return [sel.to(device)], {"n_experts": E}
    if op == "swiglu_quant_fp8":
        return [rn(n, dims["F"], scale=4), rn(n, dims["F"], scale=4)], {"limit": 10.0, "block": 32}
    if op == "swiglu_gu_quant_fp8":
        return [rn(n, 2 * dims["F"], scale=4)], {"limit": 10.0, "block": 32}
    if op == "swiglu_weighted_quant_fp8":
        k = dims["k"]
        m = n * k
        pairs = torch.randperm(m, generator=g).to(torch.int32).to(device)
        return [rn(m, 2 * dims["F"], scale=4), torch.rand(n, k, generator=g).to(device), pairs], \
            {"limit": 10.0, "k": k, "block": 32}
    if op in ("moe_combine_hc_expand", "moe_combine_hc_expand_long"):  # the combine's case, then hc_expand's streams
        ins, attrs = make_case("moe_combine_shared" + op[len("moe_combine_hc_expand"):], dims, n, device, seed)
        rows = ins[3].shape[0]
        mix = torch.rand(rows, C, C, generator=g).to(device)
        return [*ins, rn(rows, C, H), torch.rand(rows, C, generator=g).to(device) * 2, mix], attrs
    if op in ("moe_combine", "moe_combine_shared", "moe_combine_shared_long"):
        k, E = dims["k"], dims["E"]
        # _long: more pairs than a program searches (triton_ops.COMBINE_SCAN_MAX), so the combine
        # reads the inverse permutation a first kernel writes, as a prefill call does
        if op == "moe_combine_shared_long":
            from .triton_ops import COMBINE_SCAN_MAX

            n = COMBINE_SCAN_MAX // k + 1
        sel = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]).to(torch.int32)
        from deepinfer.ir.ops.fused import moe_permute

        order, offs = moe_permute(sel, n_experts=E)
        shared = [rn(n, H).to(torch.bfloat16)] if op.startswith("moe_combine_shared") else []
        return [rn(n * k, H), order.to(device), offs.to(device), rn(n, H), *shared], {"k": k}
    if op == "embedding":
        return [torch.randint(0, dims["vocab"], (n,), generator=g).to(device), rn(dims["vocab"], H)], {}
    if op == "gather_rows":
        return [rn(n, H), torch.randint(0, n, (max(n // 2, 1),), generator=g, dtype=torch.int32).to(device)], {}
    if op == "moe_gather_rows":
        from deepinfer.ir.quant import quant_fp8_32

        k = dims["k"]
        x = quant_fp8_32(torch.randn(n, H, generator=g))
        pairs = torch.randperm(n * k, generator=g).to(torch.int32)
        return [QTensor(x.data.to(device), x.scale.to(device)), pairs.to(device)], {"k": k}
    if op == "engram_gather":
        from deepinfer.ir.quant import quant_fp8_32

        rows = 97
        t = quant_fp8_32(torch.randn(rows, 256, generator=g))
        return [torch.randint(0, rows, (n, 6), generator=g).to(device), QTensor(t.data.to(device), t.scale.to(device))], {}
    if op == "engram_hash":
        grams = torch.randint(0, 99092, (n, 4), generator=g)
        primes = [16000057 + 20 * i for i in range(24)]  # distinct moduli; primality does not matter here
        offs = [0] + list(torch.tensor(primes).cumsum(0)[:-1].tolist())
        mult = [2 * int(v) + 1 for v in torch.randint(0, 2**40, (4,), generator=g)]
        return [grams.to(device)], {"multipliers": mult, "primes": primes, "offsets": offs, "heads": 8}
    if op == "engram_gate":
        # one k_weight row per copy, as the model holds it (a single shared row broadcast is the
        # other layout the kernel reads)
        return [rn(n, C, H, scale=2), rn(n, (C + 1) * H), rn(C, H), rn(C, H)], {"eps": 1e-20}
    if op == "engram_gate_ids":  # with the token ids: image tokens (every third row here) keep R
        ids = torch.randint(3, 1000, (n,), generator=g)
        ids[::3] = 999_999
        return [rn(n, C, H, scale=2), rn(n, (C + 1) * H), rn(C, H), rn(C, H), ids.to(device)], \
            {"eps": 1e-20, "image_token_id": 999_999}
    if op.startswith("grouped_gemm_fp4"):
        E, k, F = dims["E"], dims["k"], dims["F"]
        n_out, k_in = (H, F) if op == "grouped_gemm_fp4_w2" else (2 * F, H)
        if op == "grouped_gemm_fp4_spans":
            return grouped_fp4_inputs(spans_counts(E), n_out, k_in, device, seed, lead=2, tail=3), {}
        tokens = 1 if op == "grouped_gemm_fp4_one_token" else n
        return grouped_fp4_inputs(routed_counts(tokens, E, k, g), n_out, k_in, device, seed), {}
    if op in ("swa_write", "swa_write_long", "compress_state_write", "compressed_write", "engram_hist_write"):
        seqs = min(3, n)
        positions, token_seq, seq_slots = _meta(n, seqs, device)
        slots = max(dims["slots"], seqs)
        seq_slots = torch.tensor(list(reversed(range(seqs))), dtype=torch.int32, device=device)
        if op.startswith("swa_write"):
            from deepinfer.ir.quant import quant_fp8_32

            # _long: a one-entry ring, shorter than the step's rows, so the kernel takes the path
            # that reads the sequences' newest positions (the plain case's rows fit its ring)
            ring = quant_fp8_32(torch.randn(slots, 1 if op == "swa_write_long" else dims["ring"], D, generator=g))
            kv = quant_fp8_32(torch.randn(n, D, generator=g))
            return [QTensor(ring.data.to(device), ring.scale.to(device)), QTensor(kv.data.to(device), kv.scale.to(device)),
                    positions, token_seq, seq_slots], {}
        if op == "compress_state_write":
            st = torch.randn(slots, dims["ring"], 2, D, generator=g).to(device)
            return [st, rn(n, D, dtype=torch.float32), rn(n, D, dtype=torch.float32), positions, token_seq, seq_slots], {}
        if op == "engram_hist_write":
            hist = torch.randint(0, 1000, (slots, dims["ring"]), generator=g).to(device)
            return [hist, torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32).to(device), positions,
                    token_seq, seq_slots], {}
        from deepinfer.ir.quant import quant_fp4_e4m3

        entries = dims["entries"]
        need = -(-(int(positions.max()) + 1) // (2 * entries))
        pages = max(dims["pages"], seqs * need)
        cache = quant_fp4_e4m3(torch.randn(pages, entries, D, generator=g), 16)
        rows = quant_fp4_e4m3(torch.randn(n, D, generator=g), 16)
        bt = torch.randperm(pages, generator=g)[: seqs * need].view(seqs, need).to(torch.int32)
        return [QTensor(cache.data.to(device), cache.scale.to(device)), QTensor(rows.data.to(device), rows.scale.to(device)),
                positions, token_seq, bt.to(device)], {"ratio": 2}
    if op == "compress_pool_norm":
        # sequence 0 starts at an odd position: its first group reads the earlier step's row from
        # the state ring; the others complete groups within the step or leave rows open
        seqs = min(3, n)
        positions, token_seq, seq_slots = _meta(n, seqs, device, start=(1, 9, 200))
        positions = positions.long()  # the graph's i64 positions
        slots = max(dims["slots"], seqs)
        st = torch.randn(slots, dims["ring"], 2, D, generator=g).to(device)
        return [rn(n, D, dtype=torch.float32), rn(n, D, scale=2, dtype=torch.float32), st, positions, token_seq,
                seq_slots, rn(D)], {"ratio": 2, "eps": 1e-20}
    if op == "hc_mix":
        mix = 2 * C + C * C
        return [rn(n, C, H), rn(mix, C * H, scale=0.02, dtype=torch.float32), rn(3, scale=0.5, dtype=torch.float32),
                rn(mix, scale=0.5, dtype=torch.float32)], \
            {"eps": 1e-20, "copies": C, "iters": dims["hc_iters"], "hc_eps": 1e-6, "post_mult": 2.0}
    if op == "hc_collapse":
        return [rn(n, C, H, scale=2), torch.rand(n, C, generator=g).to(device)], {}
    if op == "hc_mean":
        return [rn(n, C, H, scale=2)], {}
    if op == "hc_repeat":
        return [rn(n, H)], {"copies": C}
    if op == "concat":  # the DSpark taps' layout, with one narrower operand
        return [rn(n, H), rn(n, 32), rn(n, H)], {"axis": -1}
    if op == "lookup":
        vocab = dims["vocab"]
        ids = torch.randint(0, vocab, (n,), generator=g)
        ids[0], ids[-1] = vocab + 3, 7  # outside the table; the dead id
        return [torch.randint(0, 99092, (vocab,), generator=g, dtype=torch.int32).to(device), ids.to(device)], \
            {"dead_ids": (7,)}
    if op == "engram_ngram_ids":
        seqs = min(3, n)
        positions, token_seq, seq_slots = _meta(n, seqs, device)
        slots = max(dims["slots"], seqs)
        cids = torch.randint(0, 1000, (n,), generator=g)
        cids[n // 2] = -1  # an image token: n-grams through it are blocked
        hist = torch.randint(0, 1000, (slots, dims["ring"]), generator=g)
        hist[:, 7] = -1  # a ring entry of an image token, three back from the last row
        return [cids.to(device), hist.to(device), positions.long(), token_seq, seq_slots], {"max_ngram": 4, "pad": 2}
    if op.startswith("indexer_topk"):
        return indexer_case(op, dims, n, device, g)
    if op == "gemm_fp8":  # lin8: an fp8 activation per 1x32, an fp8 [F, H] weight per 32x32
        from deepinfer.ir.quant import quant_fp8_32, quant_fp8_weight

        x = quant_fp8_32((torch.randn(n, H, generator=g) * 2).to(device))
        return [x, quant_fp8_weight((torch.randn(dims["F"], H, generator=g) * 0.05).to(device))], {"out_dtype": "bf16"}
    if op in ATTENTION_OPS:
        return attention_case(op, dims, n, device, g)
    raise KeyError(f"no check case for {op!r}")


ATTENTION_OPS = ("sparse_attn", "window_attn", "dspark_block_attn")


def attention_case(op: str, dims: dict, n: int, device, g: torch.Generator):
    """Attention inputs: n rows over dims["seqs"] sequences (one row each at decode, a block each
    for DSpark), each ending at a random position past its first full window and, for sparse
    attention, inside what its block table can hold (`maxp` pages of `entries` compressed entries
    at `ratio`); a top-k list is a sorted sample of the entries its row sees, a few slots unused
    (-1). Keys, rings and caches are random valid codes of their formats."""
    heads, D, window = dims["heads"], dims["D"], dims.get("window", 128)
    seqs = dims.get("seqs") or min(3, n)
    slots = max(dims["slots"], seqs)
    sparse = op == "sparse_attn"
    ratio, pe = dims.get("ratio", 2), dims["entries"]
    maxp = dims.get("maxp") or 4
    top_pos = maxp * pe * ratio if sparse else 4 * window
    per = [n // seqs + (1 if i < n % seqs else 0) for i in range(seqs)]
    pos, ts = [], []
    for s, cnt in enumerate(per):
        low = max(cnt - 1, min(window + cnt, top_pos) - 1)
        last = int(torch.randint(low, max(low + 1, top_pos), (1,), generator=g))
        pos += list(range(last - cnt + 1, last + 1))
        ts += [s] * cnt

    def fp8(*shape):
        return QTensor((torch.randn(*shape, generator=g) * 2).to(torch.float8_e4m3fn).to(device),
                       torch.randint(120, 128, (*shape[:-1], shape[-1] // 32), generator=g, dtype=torch.uint8).to(device))

    positions = torch.tensor(pos, dtype=torch.int64)
    meta = [positions.to(device), torch.tensor(ts, dtype=torch.int32, device=device),
            torch.randperm(slots, generator=g)[:seqs].to(torch.int32).to(device)]
    q, kv, ring = torch.randn(n, heads, D, generator=g).to(torch.bfloat16).to(device), fp8(n, D), fp8(slots, dims["ring"], D)
    sink = torch.randn(heads, generator=g).to(device)
    if not sparse:
        return [q, kv, ring, sink, *meta], {"window": window}
    pages, k = dims["pages"], dims["index_topk"]
    ckv = QTensor(torch.randint(0, 256, (pages, pe, D // 2), generator=g, dtype=torch.uint8).to(device),
                  (torch.rand(pages, pe, D // 16, generator=g) * 0.2 + 0.02).to(torch.float8_e4m3fn).to(device))
    vis = ((positions + 1) // ratio).unsqueeze(1)
    cols = torch.arange(maxp * pe).unsqueeze(0)
    pick = torch.rand(n, maxp * pe, generator=g).masked_fill(cols >= vis, -1.0).topk(k, -1)
    top = torch.where(pick.values >= 0, pick.indices, -1)
    top = torch.where(torch.rand(n, k, generator=g) < 0.05, -1, top)
    top = torch.sort(torch.where(top < 0, maxp * pe, top), -1).values  # the unused (-1) slots last
    top = torch.where(top == maxp * pe, -1, top).to(torch.int32)
    bt = torch.randint(0, pages, (seqs, maxp), generator=g, dtype=torch.int32)
    return [q, kv, ring, ckv, top.to(device), sink, *meta, bt.to(device)], \
        {"window": window, "ratio": ratio, "topk": k}


def spec_case(op: str, in_types, attrs: dict, device="cpu", seed: int = 0):
    """(inputs, attrs) for one kernel call at its own static types (a tuner's candidate, run at
    its instance's shapes): the case of `make_case` at the widths and row counts the types give,
    with the call's attributes (its kernel was built for them). LookupError where no case makes
    inputs of these types."""
    case, dims, n = spec_dims(op, in_types, attrs)
    ins, _ = make_case(case, dims, n, device, seed)
    want = [_type_layout(t) for t in in_types]
    got = [_value_layout(v) for v in ins]
    if got != want:
        bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else len(got)
        raise LookupError(f"the {case} input case does not make input {bad} of {op}{tuple(map(str, in_types))}")
    return ins, dict(attrs)


def _shape(t) -> tuple:
    return tuple(getattr(t, "data", t).shape)


def spec_dims(op: str, ts, attrs: dict) -> tuple[str, dict, int]:
    """(case, dims, rows) that make `op`'s inputs at the types `ts`; LookupError for an op no
    case covers this way (cheap: a tuner asks before it builds)."""
    dims = dict(REAL)
    n = _shape(ts[0])[0] if ts else 0
    if op in ("rms_norm", "rms_norm_quant_fp8", "quant_fp8"):
        dims["H"] = _shape(ts[0])[1]
    elif op in ("hc_pre", "hc_collapse_norm"):
        n, dims["C"], dims["H"] = _shape(ts[0])
    elif op in ("grouped_linear", "grouped_linear_quant_fp8"):
        rows, dims["o_in"] = _shape(ts[1])
        dims.update(o_groups=attrs["groups"], o_rank=rows // attrs["groups"])
    elif op == "grouped_gemm_fp4":
        # the routing's k is not in the types: the rows pick one expert each, as spread as decode's
        E, n_out, k_in = _shape(ts[1])
        dims.update(E=E, k=1, F=n_out // 2, H=k_in)
    elif op == "gemm_fp8":
        dims.update(H=_shape(ts[0])[1], F=_shape(ts[1])[0])
    elif op in ATTENTION_OPS:
        n, dims["heads"], dims["D"] = _shape(ts[0])
        dims.update(slots=_shape(ts[2])[0], ring=_shape(ts[2])[1], window=attrs["window"])
        dims["seqs"] = _shape(ts[8] if op == "sparse_attn" else ts[6])[0]
        if op == "sparse_attn":
            dims.update(pages=_shape(ts[3])[0], entries=_shape(ts[3])[1], index_topk=_shape(ts[4])[1],
                        maxp=_shape(ts[9])[1], ratio=attrs["ratio"])
    else:
        raise LookupError(f"no input case makes {op} inputs from their types")
    return op, dims, n


def _type_layout(t):
    if hasattr(t, "scale"):
        return (_type_layout(t.data), _type_layout(t.scale))
    from deepinfer.ir import shapes as sh

    return (t.dtype.storage, tuple(sh.evaluate(t.storage_shape(), {})))


def _value_layout(v):
    if isinstance(v, QTensor):
        return (_value_layout(v.data), _value_layout(v.scale))
    return (v.dtype, tuple(v.shape))


def indexer_case(case: str, dims: dict, n: int, device, g: torch.Generator, cap: int | None = None):
    """indexer_topk inputs: ratio 2 (plain), or ratio 1 emitting the pool or scoring inside one.
    A sequence per row at decode sizes, a few multi-row sequences (prefill) otherwise; ends chosen
    to give rows with nothing visible, exactly k, k + 1 and every entry visible; keys drawn from a
    few distinct rows (exact score ties at the k-th place); pages past a sequence's end are -1;
    pools of every size down to one block (visible -inf entries then make up the top-k). `cap`:
    the entries per row (default: dims' index_cap_fixed, else bounded by the CPU reference's cost
    at n rows)."""
    ratio = 2 if case == "indexer_topk" else 1
    H, D, k, tb = dims["heads"], dims["index_dim"], dims["index_topk"], dims["topk_blocks"]
    pe = dims["entries"] * (2 if ratio == 1 else 1)
    cap = cap or dims.get("index_cap_fixed") or max(2 * k, min(dims["index_cap"], (1 << 21) // max(n, 1)))
    maxp = -(-cap // pe)
    cap = maxp * pe
    seqs = max(1, min(n, 64) - 2)
    per = [n // seqs + (1 if i < n % seqs else 0) for i in range(seqs)]
    ends = [cap, 0, k, k + 1]
    pos, ts, bt = [], [], torch.full((seqs, maxp), -1, dtype=torch.int32)
    pages = torch.randperm(seqs * maxp + 3, generator=g).to(torch.int32)
    for s, cnt in enumerate(per):
        vis = ends[s] if s < len(ends) else int(torch.randint(0, cap + 1, (1,), generator=g))
        last = max((vis + 1) * ratio - 2, cnt - 1, 0)  # the newest row sees vis entries
        pos += list(range(last - cnt + 1, last + 1))
        ts += [s] * cnt
        used = -(-((last + 1) // ratio) // pe)
        bt[s, :used] = pages[s * maxp: s * maxp + used]
    npages = seqs * maxp + 3
    distinct = max(8, cap // 16)
    kd = torch.randint(0, 256, (distinct, D // 2), generator=g, dtype=torch.uint8)
    ksc = torch.randint(118, 131, (distinct, D // 32), generator=g, dtype=torch.uint8)
    pick = torch.randint(0, distinct, (npages, pe), generator=g)
    qd = torch.randint(0, 256, (n, H, D // 2), generator=g, dtype=torch.uint8)
    qs = torch.randint(118, 131, (n, H, D // 32), generator=g, dtype=torch.uint8)
    w = torch.randn(n, H, generator=g).to(torch.bfloat16)
    kd, ksc = kd[pick], ksc[pick]
    if case == "indexer_topk_twins":
        kd, ksc, qd, qs, w = _twin_keys(kd, qd, w)
    ins = [QTensor(qd.to(device), qs.to(device)), w.to(device), QTensor(kd.to(device), ksc.to(device)),
           torch.tensor(pos, dtype=torch.int64, device=device), torch.tensor(ts, dtype=torch.int32, device=device),
           bt.to(device)]
    attrs = {"ratio": ratio, "k": k, "emit_candidates": case == "indexer_topk_pool", "block_size": 8,
             "topk_blocks": tb if case == "indexer_topk_pool" else 0,
             "w_scale": {"indexer_topk": (128 ** -0.5) * (32 ** -0.5), "indexer_topk_cand": 0.0625}.get(case)}
    if case == "indexer_topk_cand":
        nblk = -(-cap // 8)
        cand = torch.full((n, tb), -1, dtype=torch.int32)
        for r in range(n):
            size = min(nblk, tb, [tb, 1, max(1, tb // 2)][r % 3] if r < 3 else int(torch.randint(1, tb + 1, (1,), generator=g)))
            cand[r, :size] = torch.randperm(nblk, generator=g)[:size].sort().values.to(torch.int32)
        ins.append(cand.to(device))
        attrs["topk_blocks"] = 0
    return ins, attrs


def _twin_keys(kd, qd, w):
    """Near-ties below bf16's resolution: positive codes and weights (every dot counts), and in each
    page slots 2i+1 and 2i+2 hold one key, the second with one code of its last block (scaled 2^-9
    where the others are 2^0) a step up. Their fp32 scores differ by far less than a bf16 step of
    the score, so where the op's bf16 scores tie (lowest position wins) an fp32 score picks the
    later twin: the case fails a kernel that skips the op's roundings (ir/numerics.py)."""
    kd = kd & 0x77
    qd = (qd & 0x77) | 0x11  # no zero codes: the bumped element always moves the dot
    b = kd.shape[2] - 16  # the first byte of the last 32-element block
    for r in range(1, kd.shape[1] - 1, 2):
        kd[:, r, b] = (kd[:, r, b] & 0x70) | 5  # e2m1 3.0
        kd[:, r + 1] = kd[:, r]
        kd[:, r + 1, b] += 1  # 4.0
    ksc = torch.full(kd.shape[:2] + (kd.shape[2] // 16,), 127, dtype=torch.uint8)
    ksc[..., -1] = 118
    qs = torch.full(qd.shape[:2] + (qd.shape[2] // 16,), 127, dtype=torch.uint8)
    return kd, ksc, qd, qs, w.abs()


def routed_counts(tokens: int, E: int, k: int, g: torch.Generator) -> list[int]:
    """Rows per expert when each token picks k distinct experts at random (decode routing)."""
    sel = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    return torch.bincount(sel.flatten(), minlength=E).tolist()


def spans_counts(E: int) -> list[int]:
    """An expert spanning two 16-row tiles and part of a third, empty experts between, one single
    row, and the last expert spanning a tile and one row."""
    if E < 7:
        raise ValueError(f"the spans case needs at least 7 experts, got {E}")
    counts = [0] * E
    counts[1], counts[5], counts[E - 1] = 35, 1, 17
    return counts


def grouped_fp4_inputs(counts, n_out: int, k_in: int, device="cpu", seed=0, lead=0, tail=0):
    """[rows (fp8, ue8m0 per 32), experts (fp4 e2m1 [E, n_out, k_in/2], ue8m0 per row and 32),
    offsets] for `counts` rows per expert; `lead` rows before the first expert's and `tail` after
    the last one's are covered by none. Drawn on `device` (the real sizes hold GBs of weights)."""
    from deepinfer.ir.quant import quant_fp8_32

    E = len(counts)
    mtot = lead + sum(counts) + tail
    g = torch.Generator(device=device).manual_seed(seed)
    x = quant_fp8_32(torch.randn(mtot, k_in, generator=g, device=device) * 2)
    w = torch.randint(0, 256, (E, n_out, k_in // 2), generator=g, device=device, dtype=torch.uint8)
    sw = torch.randint(118, 125, (E, n_out, k_in // 32), generator=g, device=device, dtype=torch.uint8)
    offs = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0) + lead
    return [QTensor(x.data, x.scale), QTensor(w, sw), offs.to(torch.int32).to(device)]


def clone_value(v):
    if isinstance(v, QTensor):
        return QTensor(v.data.clone(), v.scale.clone())
    return v.clone() if isinstance(v, torch.Tensor) else v


def check(op: str, launch, dims: dict, n: int, device="cpu", cfg=None, seed=0):
    """Run `launch` (a triton_launchers launcher) and the op's reference on the same case; returns
    None when they agree by the rule above, else a one-line reason."""
    from . import triton_ops

    ins, attrs = make_case(op, dims, n, device, seed)
    cfg = dict(cfg or triton_ops.default_config(case_op(op), n))
    got = launch(*[clone_value(v) for v in ins], **triton_ops.launch_attrs(case_op(op), attrs), cfg=cfg)
    return check_outputs(op, ins, attrs, got)


def check_outputs(op: str, ins, attrs: dict, got):
    """check's rule for a launcher's outputs `got` on the case's inputs `ins` (as make_case gave
    them, before any launch wrote into them): the op's reference runs on copies of them."""
    from deepinfer.ir.registry import get_op

    ref_op = case_op(op)
    cpu_ins = [QTensor(v.data.cpu(), v.scale.cpu()) if isinstance(v, QTensor) else
               (v.cpu() if isinstance(v, torch.Tensor) else v) for v in ins]
    want = get_op(ref_op).ref(*[clone_value(v) for v in cpu_ins], **attrs)
    kind = OUTPUT_KINDS[ref_op]
    if kind == "router":
        logits, bias = router_logits_bias(ref_op, cpu_ins, attrs)
        rest = cpu_ins[3 if ref_op == "linear_moe_router" else 2:]
        if rest:  # the bias each row selected with
            bias = get_op("route_bias").ref(rest[1], bias, rest[0], image_token_id=attrs["image_token_id"])
        return compare_router(got, want, logits, bias)
    if kind == "quant":
        return compare_quant(tuple(got), tuple(want))
    if kind == "quant_ring":  # a quantised output and the ring it was written into (data, scale each)
        return (compare_quant((got[0], got[1]), tuple(want[0]), "output 0")
                or compare_quant((got[2], got[3]), tuple(want[1]), "ring"))
    if kind == "rounded_quant":  # a bf16 output and its quantisation (the launcher: x, data, scale)
        return (compare_rounded(got[0], want[0], "output 0", INNER_ROUNDINGS.get(ref_op, {}).get(0, 0))
                or compare_quant((got[1], got[2]), tuple(want[1]), "output 1"))
    if kind == "rounded":
        if isinstance(want, tuple):
            for i, (a, b) in enumerate(zip(got, want)):
                m = compare_rounded(a, b, f"output {i}", INNER_ROUNDINGS.get(ref_op, {}).get(i, 0))
                if m:
                    return m
            return None
        return compare_rounded(got, want, inner=INNER_ROUNDINGS.get(ref_op, {}).get(0, 0))
    if kind == "f32":
        return compare_f32(got, want)
    if kind == "drafts":  # argmax tokens exactly (random logits leave no near tie), confidences in fp32
        return compare_exact(got[0], want[0], "drafts") or compare_f32(got[1], want[1], "confidence")
    return compare_exact(tuple(got) if isinstance(got, tuple) else got, tuple(want) if isinstance(want, tuple) else want)


OUTPUT_KINDS = {
    "rms_norm": "rounded", "rms_norm_quant_fp8": "quant", "quant_fp8": "quant", "rope": "rounded",
    "rope_quant_fp8": "quant", "rope_quant_fp4": "quant", "rope_quant_fp8_cache_write": "quant_ring", "norm_rope_quant_fp8_cache_write": "quant_ring",
    "hc_pre": "rounded", "hc_expand": "rounded",
    "moe_router": "router", "linear_moe_router": "router", "swiglu_quant_fp8": "quant", "swiglu_gu_quant_fp8": "quant",
    "swiglu_weighted_quant_fp8": "quant",
    "moe_combine": "f32", "moe_combine_shared": "exact", "moe_combine_hc_expand": "rounded", "embedding": "exact", "gather_rows": "exact", "moe_gather_rows": "exact",
    "engram_gather": "exact", "engram_hash": "exact", "engram_gate": "rounded", "swa_write": "exact",
    "compress_state_write": "exact", "compressed_write": "exact", "engram_hist_write": "exact",
    "grouped_linear": "rounded", "grouped_linear_quant_fp8": "quant", "linear": "rounded", "grouped_gemm_fp4": "rounded", "moe_permute": "exact",
    "compress_pool_norm": "rounded", "hc_mix": "rounded", "hc_collapse": "rounded", "hc_collapse_norm": "rounded",
    "hc_collapse_norm_quant_fp8": "rounded_quant",
    "hc_mean": "rounded",
    "hc_repeat": "exact", "concat": "exact", "lookup": "exact", "engram_ngram_ids": "exact",
    "indexer_topk": "exact", "dspark_heads": "drafts", "gemm_fp8": "rounded",
}
# further cases of an op, in another of the layouts its template reads: case name -> op
VARIANTS = {"rope_quant_fp4_e4m3": "rope_quant_fp4", "moe_router_row_bias": "moe_router",
            "engram_gate_ids": "engram_gate", "grouped_gemm_fp4_w2": "grouped_gemm_fp4",
            "grouped_gemm_fp4_one_token": "grouped_gemm_fp4", "grouped_gemm_fp4_spans": "grouped_gemm_fp4",
            "moe_router_image_bias": "moe_router", "linear_moe_router_image_bias": "linear_moe_router",
            "moe_permute_skewed": "moe_permute",
            "indexer_topk_pool": "indexer_topk", "indexer_topk_cand": "indexer_topk", "indexer_topk_twins": "indexer_topk",
            "swa_write_long": "swa_write", "moe_combine_shared_long": "moe_combine_shared", "moe_combine_hc_expand_long": "moe_combine_hc_expand",
            "rope_quant_fp8_cache_write_long": "rope_quant_fp8_cache_write",
            "linear_bf16": "linear"}
CASES = sorted(OUTPUT_KINDS) + sorted(VARIANTS)


def case_op(case: str) -> str:
    return VARIANTS.get(case, case)


def launcher(case: str):
    """The host launcher that runs `case` (triton_launchers is imported here, not at module level:
    the interpreter decides per process whether kernels are interpreted)."""
    from . import triton_launchers, triton_ops

    return getattr(triton_launchers, triton_ops.LAUNCHERS[case_op(case)])


# ---- interpreter runs --------------------------------------------------------------------------

SMALL_BLOCKS = dict(BLOCK_H=64, BLOCK=64, BH=32, BK=32, BM=16)  # loops over chunks and partial tiles run


def run_interpreted(ops, dims: dict, n: int, overrides: dict | None = None, timeout: float = 600,
                    force: dict | None = None) -> dict:
    """Check `ops` under TRITON_INTERPRET=1 in a fresh interpreter process: Triton decides
    interpretation when `triton.language` is first imported (its own jit helpers, e.g. tl.zeros,
    are fixed then), so a process that already imported Triton cannot interpret. `overrides`
    replace the knobs an op's default config has; `force` sets its knobs whether it has them or
    not (a target default's knob, off by default: X2). Returns op -> None (agrees) or a one-line
    reason."""
    import json
    import os
    import subprocess
    import sys

    job = json.dumps({"ops": list(ops), "dims": dims, "n": n, "overrides": overrides or {}, "force": force or {}})
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", "from deepinfer.codegen.library.triton_check import _interp_main; "
                        "_interp_main()"], input=job, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"interpreter run failed: {tail}")
    return json.loads(lines[-1])


def _interp_main():
    import json
    import sys

    from . import triton_launchers, triton_ops

    job = json.loads(sys.stdin.read())
    out = {}
    for op in job["ops"]:
        ref_op = case_op(op)
        cfg = dict(triton_ops.default_config(ref_op, job["n"]))
        cfg.update({k: v for k, v in job["overrides"].items() if k in cfg}, **job["force"])
        try:
            out[op] = check(op, getattr(triton_launchers, triton_ops.LAUNCHERS[ref_op]), job["dims"], job["n"], cfg=cfg)
        except Exception as e:  # noqa: BLE001  (reported per case, the run goes on)
            out[op] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    print(json.dumps(out))
