"""TileLang templates on the GPU: numerics against each op's reference semantics and timing against
floors at ceilings measured in the same run. Not a test (tests/gpu/test_tilelang_kernels.py reuses
the cases); run on the H200 machine:

    python bench/kernels_tilelang.py --out bench/results/tilelang_h200.json [--check-only] [--tiny-only]

Every case draws fresh random inputs (valid codes of each format, never zeros), poisons the output
before the run, and reports max |out - ref| / max |ref| (the "max relative error" of docs/kernels.md)
and the norm-wise error. Floors: bytes / copy bandwidth and FLOPs / the matching measured peak;
the larger one is the floor, and the ratio floor / measured time is what docs/performance.md shows.
"""
import argparse
import datetime
import json
import os
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

from deepinfer.codegen.library import tilelang_attention as tla  # noqa: E402
from deepinfer.codegen.targets import get_target  # noqa: E402
from deepinfer.codegen.library import tilelang_gemm as tlg  # noqa: E402
from deepinfer.codegen.library import tilelang_indexer as tli  # noqa: E402
from deepinfer.codegen.library import tilelang_moe as tlm  # noqa: E402
from deepinfer.codegen.library import tilelang_moe_decode as tlmd  # noqa: E402
from deepinfer.codegen.library import tilelang_prefill_bf16 as tlmp  # noqa: E402
from deepinfer.codegen.library import tilelang_moe_prefill as tlmf  # noqa: E402
from deepinfer.codegen.library import tilelang_gemm_decode as tlgd  # noqa: E402
from deepinfer.codegen.library.triton_check import TILELANG_TOLERANCE  # noqa: E402
from deepinfer.ir.quant import QTensor  # noqa: E402
from deepinfer.ir.registry import get_op  # noqa: E402
from ceilings import measure_ceilings  # noqa: E402

DEV = "cuda"


# ---- random inputs in each format ----------------------------------------------------------------

def rand_fp8(*shape, dev=DEV):
    return (torch.randn(*shape, device=dev) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)


def rand_e8m0(*shape, lo=120, hi=128, dev=DEV):
    return torch.randint(lo, hi, shape, device=dev, dtype=torch.uint8)


def rand_fp4(*shape, dev=DEV):
    """Packed bytes: every byte is two valid e2m1 codes."""
    return torch.randint(0, 256, shape, device=dev, dtype=torch.uint8)


def rand_e4m3_scale(*shape, dev=DEV):
    return (torch.rand(*shape, device=dev) * 0.2 + 0.02).to(torch.float8_e4m3fn)


def rel_err(out, ref):
    o, r = out.double().cpu(), ref.double().cpu()
    fin = torch.isfinite(r)
    if not torch.equal(torch.isfinite(o), fin):
        return float("inf"), float("inf")
    if not fin.all():
        if not torch.equal(o[~fin], r[~fin]):
            return float("inf"), float("inf")
        o, r = o[fin], r[fin]
    if r.numel() == 0:
        return 0.0, 0.0
    d = (o - r).abs()
    return float(d.max() / r.abs().max().clamp_min(1e-30)), float(d.norm() / r.norm().clamp_min(1e-30))


# ---- cases ------------------------------------------------------------------------------------------
# A case is a dict: name, template, op, shape label, program (a zero-argument callable returning the
# TileLang program(s)), inputs (callable -> dict), run (kernels, inputs -> output), ref (inputs -> fp32
# reference), bytes, flops, peak ("fp8" | "bf16"), tol (max-rel tolerance).

def gemm_fp8_case(label, M, N, K, config=None, mma=False, persistent=False, bf16=False, shipped=False):
    """The TileLang gemm_fp8 program (over gemm_default_config, or with `shipped` over the plan's
    gemm_fp8_default_config), or with `mma` the decode program on warp MMAs
    (tilelang_gemm_decode; the row count read off A, split partials added here in split order),
    or with `persistent` the 64-row program on a persistent grid (tilelang_gemm_decode; `config`
    its whole config), or with `bf16` the prefill program on bf16 MMAs (tilelang_prefill_bf16, over
    its ROWS_TILES: the rows dequantised by its second kernel first)."""
    if persistent:
        c = dict(config)
    elif bf16:
        c = dict(tlmp.ROWS_TILES, **(config or {}))
    elif mma:
        c = tlgd.mma_config(TARGET, N, K, {"split_k": 1, **(config or {})})
    else:
        base = tlg.gemm_fp8_default_config if shipped else tlg.gemm_default_config
        c = dict(base(TARGET, M, N, K), **(config or {}))

    def inputs():
        x = {"A": rand_fp8(M, K), "SA": rand_e8m0(M, K // 32), "B": rand_fp8(N, K),
             "SB": rand_e8m0(-(-N // 32), K // 32)}
        if c.get("words"):  # the scales read as 32-bit words (tilelang_gemm.scale_operands); the ref views back
            x["SA"], x["SB"] = x["SA"].view(torch.uint32), x["SB"].view(torch.uint32)
        return x

    def run(k, x):
        if persistent:  # rows a kernel argument (read off A); partials [split, 64, N] summed in order
            if c["split_k"] > 1:
                p = torch.full((c["split_k"], 64, N), float("nan"), device=DEV, dtype=torch.float32)
                k[0](x["A"], x["SA"], x["B"], x["SB"], p)
                return p[:, :M].sum(0).to(torch.bfloat16)
            out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            k[0](x["A"], x["SA"], x["B"], x["SB"], out)
            return out
        if mma:  # the warp-MMA program reads both operands as 32-bit words
            a, b = x["A"].view(torch.uint8).view(torch.uint32), x["B"].view(torch.uint8).view(torch.uint32)
            if tlgd.cluster_split(c):  # the cluster's first CTA adds the partials
                p = torch.full((c["split_k"], 64, N), float("nan"), device=DEV, dtype=torch.float32)
                out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                k[0](a, x["SA"], b, x["SB"], out, p)
                return out
            if c["split_k"] > 1:
                p = torch.full((c["split_k"], 64, N), float("nan"), device=DEV, dtype=torch.float32)
                k[0](a, x["SA"], b, x["SB"], p)
                return p[:, :M].sum(0).to(torch.bfloat16)
            out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            k[0](a, x["SA"], b, x["SB"], out)
            return out
        if bf16:  # the rows into bf16 first (the second kernel), then the GEMM on them
            a = torch.full((M, K), float("nan"), device=DEV, dtype=torch.bfloat16)
            k[1](x["A"], x["SA"], a)
            out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
            # (inflight reads the weight and its scales as 32-bit words)
            words = (lambda t: t.view(torch.uint8).view(torch.uint32)) if c.get("inflight") else (lambda t: t)
            k[0](a, words(x["B"]), words(x["SB"]), out)
            return out
        if c.get("split_k", 1) > 1:
            out = torch.zeros(M, N, device=DEV, dtype=torch.float32)
            k[0](x["A"], x["SA"], x["B"], x["SB"], out)
            return out.to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        k[0](x["A"], x["SA"], x["B"], x["SB"], out)
        return out

    def ref(x):
        sa, sb = x["SA"].view(torch.uint8), x["SB"].view(torch.uint8)
        return get_op("gemm_fp8").ref(QTensor(x["A"], sa), QTensor(x["B"], sb), out_dtype="f32")

    def program():
        if persistent:
            return [tlgd.gemm_fp8_rows_persistent_program(N, K, "bfloat16", rows=64, **c)]
        if bf16:
            return tlmp.gemm_programs(M, N, K, "bfloat16", c)
        if mma:
            return [tlgd.gemm_fp8_mma_rows_program(N, K, "bfloat16", rows=64, **c)]
        return [tlg.gemm_fp8_program(M, N, K, "bfloat16", **c)]

    kind = " persistent" if persistent else " mma" if mma else " bf16" if bf16 else ""
    return dict(name=f"gemm_fp8{kind} {label}",
                template="tilelang_gemm_fp8" + kind.replace(" ", "_"), shape=f"{M}x{N}x{K}", config=c,
                program=program, inputs=inputs, run=run, ref=ref,
                # (bf16: the dequantised rows written and read again, 4 bytes an element)
                bytes=M * K * 33 / 32 + N * K * (1 + 1 / 1024) + M * N * 2 + (4 * M * K if bf16 else 0),
                flops=2 * M * N * K, peak="bf16" if bf16 else "fp8",
                tol=1e-2)


def linear_case(label, M, N, K, config=None):
    c = dict(tlg.gemm_default_config(TARGET, M, N, K), block_K=64, **(config or {}))

    def inputs():
        return {"A": torch.randn(M, K, device=DEV).bfloat16(), "B": torch.randn(N, K, device=DEV).bfloat16()}

    def run(k, x):
        if c.get("split_k", 1) > 1:  # the bf16 program has no split
            out = torch.zeros(M, N, device=DEV, dtype=torch.float32)
            k[0](x["A"], x["B"], out)
            return out.to(torch.bfloat16)
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        k[0](x["A"], x["B"], out)
        return out

    def ref(x):
        return get_op("linear").ref(x["A"], x["B"], out_dtype="f32", compute="bf16")

    return dict(name=f"linear bf16 {label}", template="tilelang_linear", shape=f"{M}x{N}x{K}", config=c,
                program=lambda: [tlg.linear_program(M, N, K, "bfloat16", "bfloat16", **c)], inputs=inputs, run=run,
                ref=ref, bytes=2 * (M * K + N * K + M * N), flops=2 * M * N * K, peak="bf16", tol=1e-2)


def grouped_case(label, counts, N, K, E, config=None, mma=False, tail=0, bf16=False, sw=(118, 124)):
    """The widening program (tilelang_moe), with `mma` the decode program on warp MMAs
    (tilelang_moe_decode, its knobs from the sm90 defaults), with `bf16` the prefill program on
    bf16 MMAs (tilelang_moe_prefill, over its MOE_TILES; the rows dequantised first). `tail`: rows past the last expert's (as expert
    parallelism leaves them), which the op leaves zero. `sw`: the range of the weight's ue8m0 scales."""
    mtot = int(sum(counts)) + tail
    base = (TARGET.defaults["tilelang_grouped_gemm_fp4_mma"] if mma else tlmf.MOE_TILES if bf16 else
            tlm.moe_default_config(TARGET, mtot, N, K, E))
    c = dict(base, **(config or {}))
    make = (tlmd.decode_program if mma else tlm.grouped_gemm_fp4_program)
    active = sum(1 for v in counts if v)

    def inputs():
        offs = torch.zeros(E + 1, dtype=torch.int32)
        offs[1:] = torch.tensor(counts).cumsum(0)  # offsets[E] = mtot - tail
        return {"X": rand_fp8(mtot, K), "SX": rand_e8m0(mtot, K // 32), "W": rand_fp4(E, N, K // 2),
                "SW": rand_e8m0(E, N, K // 32, lo=sw[0], hi=sw[1]), "offs": offs.to(DEV)}

    def run(k, x):
        out = torch.full((mtot, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        if mma:  # its parameters read x and W through wider words
            k[0](x["X"].view(torch.uint8).view(torch.uint64), x["SX"], x["W"].view(torch.uint32), x["SW"], x["offs"],
                 out)
        elif bf16:  # the rows into bf16 first (the second kernel), then the GEMM on them; W as 32-bit words
            a = torch.full((mtot, K), float("nan"), device=DEV, dtype=torch.bfloat16)
            k[1](x["X"], x["SX"], a)
            k[0](a, x["W"].view(torch.uint32), x["SW"], x["offs"], out)
        else:
            k[0](x["X"], x["SX"], x["W"], x["SW"], x["offs"], out)
        return out

    def ref(x):
        # the op's reference, expert by expert, on the GPU in fp64 (same functions as the op's ref)
        from deepinfer.ir import numerics as nm
        from deepinfer.ir import quant as q
        xf = q.dequant_fp8_32(QTensor(x["X"], x["SX"]))
        out = torch.zeros(mtot, N, device=DEV)
        o = x["offs"].tolist()
        for e in range(E):
            if o[e + 1] > o[e]:
                out[o[e]:o[e + 1]] = nm.mm32(xf[o[e]:o[e + 1]], q.dequant_fp4_weight(x["W"][e], x["SW"][e]))
        return out

    kind = "mma" if mma else "bf16" if bf16 else ""
    return dict(name=f"grouped_gemm_fp4{' ' + kind if kind else ''} {label}",
                template="tilelang_grouped_gemm_fp4" + ("_" + kind if kind else ""),
                shape=f"rows={mtot} E={E} active={active} N={N} K={K}", config=c,
                program=lambda: ([tlmf.grouped_gemm_fp4_bf16_program(mtot, N, K, E, **c),
                                  tlmf.dequant_rows_program(mtot, K, rs=c.get("rs", 0))] if bf16
                                 else [make(mtot, N, K, E, **c)]),
                inputs=inputs, run=run, ref=ref,
                # (bf16: the dequantised rows written and read again, 4 bytes an element)
                bytes=mtot * K * 33 / 32 + active * N * K * (0.5 + 1 / 32) + mtot * N * 2 + (4 * mtot * K if bf16 else 0),
                flops=2 * mtot * N * K, peak="bf16" if bf16 else "fp8", tol=1e-2)


def grouped_linear_case(label, M, G, NG, KG, config=None):
    """The prefill grouped linear on bf16 MMAs (tilelang_prefill_bf16, over its ROWS_TILES): bf16
    rows against an e4m3 weight with ue8m0 per 32 x 32 block (wo_a)."""
    c = dict(tlmp.ROWS_TILES, **(config or {}))

    def inputs():
        return {"X": torch.randn(M, G * KG, device=DEV).bfloat16(), "W": rand_fp8(G * NG, KG),
                "SW": rand_e8m0(G * NG // 32, KG // 32)}

    def run(k, x):
        out = torch.full((M, G * NG), float("nan"), device=DEV, dtype=torch.bfloat16)
        k[0](x["X"], x["W"], x["SW"], out)
        return out

    def ref(x):
        return get_op("grouped_linear").ref(x["X"], QTensor(x["W"], x["SW"]), groups=G, weight_dtype="bf16")

    return dict(name=f"grouped_linear bf16 {label}", template="tilelang_grouped_linear_bf16",
                shape=f"{M}x{G}x{NG}x{KG}", config=c,
                program=lambda: [tlmp.rows_bf16_gemm_program(M, G, NG, KG, **c)], inputs=inputs, run=run,
                ref=ref, bytes=2 * M * G * KG + G * NG * KG * (1 + 1 / 1024) + 2 * M * G * NG,
                flops=2 * M * G * NG * KG, peak="bf16", tol=1e-2)


def attention_case(label, mode, seqs, H=64, D=512, window=128, R=134, topk=512, ratio=2, PE=64, config=None,
                   block=5, rope=0):
    """seqs: list of (start position, rows) per sequence of the step. rope: the op's rope_dim
    (fuse_attention_rope: q's RoPE and the output's inverse inside the kernel), at the medium
    model's YaRN constants."""
    from deepinfer.codegen.library.tilelang_host import rope_frequencies
    from deepinfer.ir.ops.attention import rotate_tail

    rope_attrs = dict(rope_dim=rope, rope_theta=10000.0, rope_yarn=(16, 65536, 32, 1)) if rope else {}
    n = sum(r for _, r in seqs)
    nseq = len(seqs)
    op = {"sparse": "sparse_attn", "window": "window_attn", "dspark": "dspark_block_attn"}[mode]
    maxlen = max(s + r for s, r in seqs)
    maxp = max(1, -(-(maxlen // ratio) // PE)) if mode == "sparse" else 1
    pages = nseq * maxp if mode == "sparse" else 1
    dims = dict(n=n, H=H, D=D, slots=nseq, R=R, window=window, nseq=nseq)
    if mode == "sparse":
        dims.update(topk=topk, pages=pages, PE=PE, maxp=maxp)
    if mode == "dspark":
        dims.update(max_block=32)

    class _Spec:  # enough of a KernelSpec for the default config
        pass
    nb = window // 64 + {"sparse": -(-topk // 64), "window": 0, "dspark": 1}[mode]
    splits = 1
    for s in (10, 5, 4, 2):
        if nb % s == 0 and n * s <= 2 * TARGET.cores and n < TARGET.cores:
            splits = s
            break
    # sm90's kwords as its plans have it; ATTN_BASE: a JSON object over every attention case's
    # config (the tiny cases with a knob on)
    kw = {"kwords": 1} if TARGET.defaults["tilelang_attention"].get("kwords") else {}
    c = dict({"block_I": 64, "splits": splits, "threads": 256}, **kw, **json.loads(os.environ.get("ATTN_BASE", "{}")),
             **(config or {}))
    as_words = tla.reads_words(mode, H, D, topk, c, rope)

    def inputs():
        pos, tseq = [], []
        for i, (s, r) in enumerate(seqs):
            pos += list(range(s, s + r))
            tseq += [i] * r
        x = {"q": torch.randn(n, H, D, device=DEV).bfloat16(), "kv": rand_fp8(n, D), "kvs": rand_e8m0(n, D // 32),
             "ring": rand_fp8(nseq, R, D), "rings": rand_e8m0(nseq, R, D // 32),
             "sink": torch.randn(H, device=DEV), "pos": torch.tensor(pos, device=DEV, dtype=torch.int64),
             "tseq": torch.tensor(tseq, device=DEV, dtype=torch.int32),
             "slots": torch.randperm(nseq, device=DEV).to(torch.int32)}
        if mode == "sparse":
            x["ckv"] = rand_fp4(pages, PE, D // 2)
            x["ckvs"] = rand_e4m3_scale(pages, PE, D // 16)
            x["bt"] = torch.randperm(pages, device=DEV).to(torch.int32).view(nseq, maxp)
            top = torch.full((n, topk), -1, dtype=torch.int32)
            for t in range(n):
                vis = (pos[t] + 1) // ratio
                kk = min(topk, vis)
                if kk:
                    sel = torch.sort(torch.randperm(vis)[:kk]).values
                    sel[torch.rand(kk) < 0.05] = -1  # a few unused slots
                    top[t, :kk] = sel.to(torch.int32)
            x["top"] = top.to(DEV)
        else:
            x["ckv"] = torch.zeros(1, 1, D // 2, device=DEV, dtype=torch.uint8)
            x["ckvs"] = torch.zeros(1, 1, D // 16, device=DEV).to(torch.float8_e4m3fn)
            x["bt"] = torch.zeros(nseq, 1, device=DEV, dtype=torch.int32)
            x["top"] = torch.zeros(n, 1, device=DEV, dtype=torch.int32)
        # the outputs (poisoned: the check reads the first call's) and the frequencies made here, so
        # that a call is the kernels alone (--graphs captures it: no host copy inside)
        sp = c["splits"]
        x["out"] = torch.full((n, H, D), float("nan"), device=DEV, dtype=torch.bfloat16)
        x["opart"] = torch.full((sp, n, H, D) if sp > 1 else (1, 1, 1, 1), float("nan"), device=DEV)
        x["ml"] = torch.full((sp, n, H, 2) if sp > 1 else (1, 1, 1, 2), float("nan"), device=DEV)
        x["freq"] = rope_frequencies(rope_attrs, DEV)
        return x

    def run(k, x):
        out, opart, ml, freq, sp = x["out"], x["opart"], x["ml"], x["freq"], c["splits"]
        words = (lambda v: v.view(torch.uint8).view(torch.uint32)) if as_words else (lambda v: v)  # noqa: E731
        k[0](x["q"], words(x["kv"]), words(x["kvs"]), words(x["ring"]), words(x["rings"]), words(x["ckv"]),
             words(x["ckvs"]), x["top"], x["sink"], x["pos"], x["tseq"], x["slots"], x["bt"], out, opart, ml, freq)
        if sp > 1:
            k[1](opart, ml, x["sink"], out, x["pos"], freq)
        return out

    def ref(x):
        cpu = {k: v.cpu() for k, v in x.items()}
        kv, ring = QTensor(cpu["kv"], cpu["kvs"]), QTensor(cpu["ring"], cpu["rings"])
        meta = (cpu["pos"], cpu["tseq"], cpu["slots"])
        if mode == "sparse":
            return get_op(op).ref(cpu["q"], kv, ring, QTensor(cpu["ckv"], cpu["ckvs"]), cpu["top"], cpu["sink"], *meta,
                                  cpu["bt"], window=window, ratio=ratio, topk=topk, **rope_attrs).float()
        return get_op(op).ref(cpu["q"], kv, ring, cpu["sink"], *meta, window=window, **rope_attrs).float()

    def rotated(v, pos, inverse=False):
        """The op's rotation of v's tail (on the CPU, where rotate_tail makes its constants)."""
        if not rope:
            return v
        return rotate_tail(v.cpu(), pos.cpu().long(), rope, 10000.0, (16, 65536, 32, 1), inverse).to(v.device)

    def ref_gpu(x):
        """The same semantics as the op's reference (window keys from the step or the ring, top-k
        entries through the block table, sink in the denominator), batched on the GPU in fp64 for
        shapes whose CPU reference would take minutes; cross-checked against the op's reference
        on the tiny case of the same run."""
        from deepinfer.ir import quant as q
        pos, ts = x["pos"], x["tseq"].long()
        kvf = q.dequant_fp8_32(QTensor(x["kv"], x["kvs"])).double()
        ringf = q.dequant_fp8_32(QTensor(x["ring"], x["rings"])).double()
        ckvf = q.dequant_fp4_e4m3(QTensor(x["ckv"], x["ckvs"])).double() if mode == "sparse" else None
        out = torch.empty(n, H, D, device=DEV)
        qr = rotated(x["q"], pos)
        for a in range(0, n, 512):
            t = torch.arange(a, min(n, a + 512), device=DEV)
            p = pos[t].unsqueeze(1)
            kp = p - window + 1 + torch.arange(window, device=DEV).unsqueeze(0)
            rr = t.unsqueeze(1) - (p - kp)
            step = (rr >= 0) & (ts[rr.clamp_min(0)] == ts[t].unsqueeze(1))
            slot = x["slots"].long()[ts[t]].unsqueeze(1)
            keys = torch.where(step.unsqueeze(-1), kvf[rr.clamp_min(0)], ringf[slot, kp.clamp_min(0) % R])
            valid = kp >= 0
            if mode == "sparse":
                c = x["top"][t].long()
                page = x["bt"].long()[ts[t].unsqueeze(1), c.clamp_min(0) // PE]
                keys = torch.cat([keys, ckvf[page, c.clamp_min(0) % PE]], 1)
                valid = torch.cat([valid, c >= 0], 1)
            s = torch.einsum("rhd,rkd->rhk", qr[t].double(), keys) * D ** -0.5
            s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
            m = s.amax(-1, keepdim=True)
            pr = torch.exp(s - m)
            den = pr.sum(-1, keepdim=True) + torch.exp(x["sink"].double().view(1, -1, 1) - m)
            # the probabilities rounded to bf16 before P.V, the denominator of the unrounded ones (the op's)
            pv = pr.float().bfloat16().double()
            out[t] = (torch.einsum("rhk,rkd->rhd", pv, keys) / den).float()
        return rotated(out.bfloat16(), pos, inverse=True).float() if rope else out

    nkeys = window + (topk if mode == "sparse" else (block if mode == "dspark" else 0))
    key_bytes = window * (D + D // 32) + (topk * (D // 2 + D // 16) if mode == "sparse" else 0)
    if mode == "sparse" and n > nseq:  # prefill: step window keys are read once per sequence, not per row
        key_bytes_total = n * D * 33 / 32 + n * topk * (D // 2 + D // 16)
    else:
        key_bytes_total = n * key_bytes
    progs = lambda: ([tla.attention_program(mode, **dims, **c, rope=rope)]  # noqa: E731  rebuilt per call
                     + ([tla.combine_program(n, H, D, c["splits"], rope=rope)] if c["splits"] > 1 else []))
    use_gpu_ref = mode == "sparse" and n > 256
    return dict(name=f"{op} {label}" + (" rope" if rope else ""), template=f"tilelang_{op}",
                shape=f"rows={n} seqs={nseq} H={H} D={D}",
                pass_configs=getattr(tla, "ATTN_PASS_CONFIGS", None),
                config=c, program=progs, inputs=inputs, run=run, ref=ref_gpu if use_gpu_ref else ref,
                ref_gpu=ref_gpu if mode != "dspark" else None,
                bytes=n * H * D * 4 + key_bytes_total, flops=4 * n * H * D * nkeys, peak="bf16", tol=2e-2)


def indexer_case(label, seqs, H=32, Dq=128, ratio=1, PE=128, cand_blocks=0, block_size=8):
    n = sum(r for _, r in seqs)
    nseq = len(seqs)
    maxlen = max(s + r for s, r in seqs)
    maxp = max(1, -(-(maxlen // ratio) // PE))
    pages = nseq * maxp
    cap = maxp * PE

    def inputs():
        pos, tseq = [], []
        for i, (s, r) in enumerate(seqs):
            pos += list(range(s, s + r))
            tseq += [i] * r
        x = {"qi": rand_fp4(n, H, Dq // 2), "qs": rand_e8m0(n, H, Dq // 32),
             "w": torch.randn(n, H, device=DEV).bfloat16(), "ik": rand_fp4(pages, PE, Dq // 2),
             "iks": rand_e8m0(pages, PE, Dq // 32), "pos": torch.tensor(pos, device=DEV, dtype=torch.int64),
             "tseq": torch.tensor(tseq, device=DEV, dtype=torch.int32),
             "bt": torch.randperm(pages, device=DEV).to(torch.int32).view(nseq, maxp)}
        nb = -(-cap // block_size)
        if cand_blocks:
            cand = torch.full((n, cand_blocks), -1, dtype=torch.int32)
            for t in range(n):
                kk = min(cand_blocks, nb // 2)
                cand[t, :kk] = torch.sort(torch.randperm(nb)[:kk]).values.to(torch.int32)
            x["cand"] = cand.to(DEV)
        else:
            x["cand"] = torch.zeros(n, 1, device=DEV, dtype=torch.int32)
        return x

    def run(k, x):
        out = torch.full((n, cap), float("nan"), device=DEV)
        k[0](x["qi"], x["qs"], x["w"], x["ik"], x["iks"], x["pos"], x["tseq"], x["bt"], x["cand"], out)
        return out

    def ref(x):
        cpu = {k: v.cpu() for k, v in x.items()}
        s = get_op("indexer_scores").ref(QTensor(cpu["qi"], cpu["qs"]), cpu["w"], QTensor(cpu["ik"], cpu["iks"]),
                                         cpu["pos"], cpu["tseq"], cpu["bt"], ratio=ratio)
        if cand_blocks:
            s = get_op("candidate_mask").ref(s, cpu["cand"], block_size=block_size)
        return s

    return dict(name=f"indexer_scores {label}", template="tilelang_indexer_scores",
                shape=f"rows={n} seqs={nseq} cap={cap}" + (f" pool={cand_blocks}" if cand_blocks else ""),
                config={"block_C": 64, "threads": 128},
                program=lambda: [tli.indexer_scores_program(n, H, Dq, pages, PE, nseq, maxp, ratio,
                                                            cand_blocks=cand_blocks, block_size=block_size)],
                inputs=inputs, run=run, ref=ref,
                bytes=n * H * (Dq // 2 + Dq // 32) + nseq * cap * (Dq // 2 + Dq // 32) + n * cap * 4,
                flops=2 * n * H * Dq * cap, peak="bf16", tol=TILELANG_TOLERANCE["tilelang_indexer_scores"])


def tiny_cases():
    return [
        gemm_fp8_case("tiny", 3, 96, 64),
        gemm_fp8_case("tiny split-K", 5, 64, 256, {"split_k": 2, "block_K": 128}),
        gemm_fp8_case("tiny", 11, 256, 512, mma=True),  # 11 rows: two passes of 8
        gemm_fp8_case("tiny split-K", 3, 256, 1024, {"split_k": 2, "RT": 2}, mma=True),
        # 4 tiles a pass: 11 rows skip two tiles, 40 rows take a second pass of one tile
        gemm_fp8_case("tiny 4 tiles", 11, 256, 512, {"NT": 4, "RT": 2}, mma=True),
        gemm_fp8_case("tiny 4 tiles split-K", 40, 256, 1024, {"NT": 4, "RT": 2, "split_k": 2}, mma=True),
        # split-K in a cluster whose first CTA adds the partials; 11 rows: two passes
        gemm_fp8_case("tiny cluster split-K", 11, 256, 1024, {"split_k": 4, "RT": 2, "CLUSTER": 1}, mma=True),
        # the MMAs as f16 pairs (tilelang_warp_mma's f16): two passes, and four tiles split
        gemm_fp8_case("tiny f16 MMAs", 11, 256, 512, {"F16": 1}, mma=True),
        gemm_fp8_case("tiny 4 tiles split-K f16 MMAs", 40, 256, 1024, {"NT": 4, "RT": 2, "split_k": 2, "F16": 1},
                      mma=True),
        # prefill tiles dequantised into bf16 for one wgmma chain (two row tiles, two column tiles)
        gemm_fp8_case("tiny bf16", 256, 256, 512, bf16=True),
        # the weight's e4m3 bytes widened into the register operand, MMAs in flight (inflight):
        # two row tiles, the second past M (200 rows), two column tiles
        gemm_fp8_case("tiny bf16 inflight", 200, 256, 512, {"inflight": 1, "block_K": 64, "stages": 4}, bf16=True),
        # prefill tiles with each block's scaling overlapped with the next block's wgmma
        gemm_fp8_case("tiny overlapped scaling", 200, 256, 512, {"overlap": 1}),
        # the scales read as 32-bit words by cp.async (tilelang_gemm.scale_operands): a partial row
        # tile, plain and overlapped
        gemm_fp8_case("tiny word scales", 200, 256, 512, {"words": 1}),
        gemm_fp8_case("tiny word scales overlapped", 200, 256, 512, {"words": 1, "overlap": 1}),
        # the persistent grid: two tiles a CTA through one pipeline, with and without a K split
        gemm_fp8_case("tiny persistent split-K", 11, 256, 1024,
                      {"block_N": 64, "block_K": 128, "stages": 3, "split_k": 2, "group": 2}, persistent=True),
        gemm_fp8_case("tiny persistent", 40, 512, 512,
                      {"block_N": 128, "block_K": 128, "stages": 3, "split_k": 1, "group": 4}, persistent=True),
        linear_case("tiny", 7, 64, 96),
        # wo_a's grouped product on bf16 MMAs: two groups, two row tiles, two column tiles a group
        grouped_linear_case("tiny", 256, 2, 256, 512),
        grouped_linear_case("tiny scales once", 256, 2, 256, 512, {"scales_once": 1}),
        grouped_case("tiny", [3, 0, 7, 1], 64, 128, 4, {"block_M": 64, "block_N": 64, "threads": 128}),
        grouped_case("tiny", [3, 0, 12, 1], 64, 256, 4, mma=True),  # 12 rows: two passes of 8
        grouped_case("tiny direct", [3, 0, 12, 1], 64, 256, 4, {"STAGES": 0, "RT": 1}, mma=True),
        grouped_case("tiny x per lane", [3, 0, 12, 1], 64, 256, 4, {"XS": 0}, mma=True),
        grouped_case("tiny f16 MMAs", [3, 0, 12, 1], 64, 256, 4, {"F16": 1}, mma=True),
        # the weight's words widened into bf16 tiles, the rows dequantised first: several row tiles
        # of an expert, one empty, one ending mid-tile; 64-, 128- and 256-row tiles; scales past
        # 2^1 (the widening's second factor)
        grouped_case("tiny", [70, 0, 131, 5], 256, 512, 4, bf16=True),
        grouped_case("tiny shared-memory", [70, 0, 131, 5], 256, 512, 4, tlmf.SS_TILES, bf16=True),
        grouped_case("tiny 64-row tiles", [70, 0, 131, 5], 256, 512, 4,
                     dict(tlmf.SS_TILES, block_M=64, block_K=128, threads=128), bf16=True),
        grouped_case("tiny 256-row tiles", [70, 0, 300, 5], 256, 512, 4, dict(tlmf.SS_TILES, block_M=256), bf16=True),
        grouped_case("tiny large scales", [70, 0, 131, 5], 256, 512, 4, bf16=True, sw=(126, 131)),
        # a warpgroup past the expert's end skips its MMAs (experts of 70, 131 and 5 rows)
        grouped_case("tiny skip", [70, 0, 131, 5], 256, 512, 4, dict(tlmf.SS_TILES, skip_empty=1), bf16=True),
        # the weight as the register operand (rs): 64 and 128 deep, scales past 2^1
        grouped_case("tiny rs", [70, 0, 131, 5], 256, 512, 4, dict(tlmf.SS_TILES, rs=1, block_K=64, stages=3),
                     bf16=True),
        grouped_case("tiny rs 128 deep", [70, 0, 131, 5], 256, 512, 4, dict(tlmf.SS_TILES, rs=1), bf16=True,
                     sw=(126, 131)),
        # the register operand with each step's MMAs in flight while the next is widened (inflight):
        # 256- and 128-row tiles, an expert over two tiles, the last rows past Mtot, scales past 2^1
        grouped_case("tiny rs inflight", [70, 0, 300, 5], 256, 512, 4,
                     {"rs": 1, "inflight": 1, "block_M": 256, "block_K": 64, "stages": 4, "ragged": 0}, bf16=True,
                     sw=(126, 131)),
        grouped_case("tiny rs inflight 128-row", [70, 0, 131, 5], 256, 512, 4,
                     {"rs": 1, "inflight": 1, "block_M": 128, "block_K": 64, "stages": 5}, bf16=True),
        # an expert's last tile on the narrowest program that holds its rest (ragged): rests of
        # 70, 44 (300 - 256), 131 - 128 = 3 and 5 rows
        grouped_case("tiny rs inflight ragged", [70, 0, 300, 5, 131], 256, 512, 5,
                     {"rs": 1, "inflight": 1, "block_M": 128, "block_K": 64, "stages": 4, "ragged": 32}, bf16=True),
        grouped_case("tiny f16 MMAs x per lane, 2 tiles", [3, 0, 12, 1], 64, 256, 4, {"F16": 1, "XS": 0, "NT": 2},
                     mma=True),
        # CTAs over the experts with rows: fewer of them than slots; 200 experts over two passes of
        # 128 threads, the busy ones on both sides of the pass
        grouped_case("tiny over active experts", [0, 5, 0, 0], 64, 256, 4, {"ACT": 1}, mma=True),
        # rows past offsets[E] written as zeros by the kernel (the host does not fill), with and
        # without the expert search
        grouped_case("tiny uncovered rows", [3, 0, 12, 1], 64, 256, 4, {"ACT": 0}, mma=True, tail=21),
        # (ACT needs min(experts, rows) at most a quarter of the experts: 200 experts)
        grouped_case("tiny uncovered rows over active experts",
                     [3 if e in (0, 31, 127, 128, 150, 199) else 0 for e in range(200)], 64, 256, 200, {"ACT": 1},
                     mma=True, tail=5),
        grouped_case("tiny every row uncovered", [0] * 200, 64, 256, 200, {"ACT": 1}, mma=True, tail=9),
        grouped_case("tiny over active experts of 200", [3 if e in (0, 31, 127, 128, 150, 199) else 0 for e in range(200)],
                     64, 256, 200, {"ACT": 1}, mma=True),
        attention_case("tiny", "sparse", [(200, 3), (40, 2)], D=128, window=64, R=70, topk=64, ratio=2, PE=16),
        attention_case("tiny", "window", [(90, 2), (3, 1)], D=128, window=64, R=70),
        # the top-k blocks pipelined (prefill's unsplit program, stages 2): three blocks, the first
        # rows with fewer visible entries than the top-k (masked keys), one split
        attention_case("tiny pipelined", "sparse", [(200, 3), (40, 2)], D=128, window=64, R=70, topk=192, ratio=2,
                       PE=16, config={"splits": 1, "stages": 2}),
        attention_case("tiny", "dspark", [(150, 5), (10, 5)], D=128, window=64, R=70),
        # the RoPEs folded in: split rows (the combine de-rotates), unsplit and pipelined (the
        # attention program does), every mode; positions past 65536 reach angles of ~1e5 rad
        attention_case("tiny", "sparse", [(70000, 3), (40, 2)], D=128, window=64, R=70, topk=64, ratio=2, PE=16,
                       rope=32),
        attention_case("tiny pipelined", "sparse", [(200, 3), (40, 2)], D=128, window=64, R=70, topk=192, ratio=2,
                       PE=16, config={"splits": 1, "stages": 2}, rope=32),
        attention_case("tiny", "window", [(90, 2), (3, 1)], D=128, window=64, R=70, rope=32),
        attention_case("tiny unsplit", "window", [(90, 2), (3, 1)], D=128, window=64, R=70, config={"splits": 1},
                       rope=32),
        attention_case("tiny", "dspark", [(150, 5), (10, 5)], D=128, window=64, R=70, rope=32),
        # prefill's program with its roles apart (ws): window keys from the step's rows, the ring
        # and before position 0, three top-k blocks with masked entries; positions past 65536
        attention_case("tiny ws", "sparse", [(0, 100), (300, 40), (40, 2)], D=256, window=64, R=70, topk=192,
                       ratio=2, PE=16, config={"splits": 1, "ws": 1}),
        attention_case("tiny ws", "sparse", [(70000, 3), (200, 60)], D=256, window=64, R=70, topk=192, ratio=2,
                       PE=16, config={"splits": 1, "ws": 1}, rope=32),
        indexer_case("tiny", [(300, 2), (50, 1)], PE=32),
        indexer_case("tiny pool", [(300, 2), (50, 1)], PE=32, cand_blocks=8),
    ]


def real_cases():
    """V4.1-Flash shapes: hidden 5120, q_lora 1280, wo_b 8192 -> 5120, experts 384 x (2304, 5120),
    64 heads x 512, window 128, ring 134, top-k 512, index 32 heads x 128."""
    out = []
    for m in (1, 64):
        out.append(gemm_fp8_case(f"decode b{m} wo_b", m, 5120, 8192))
        out.append(gemm_fp8_case(f"decode b{m} wq_a", m, 1280, 5120))
        out.append(gemm_fp8_case(f"decode b{m} wo_b", m, 5120, 8192, {"split_k": 2}, mma=True))
        out.append(gemm_fp8_case(f"decode b{m} wq_a", m, 1280, 5120, {"split_k": 8}, mma=True))
        out.append(gemm_fp8_case(f"decode b{m} wq_a cluster", m, 1280, 5120, {"split_k": 8, "CLUSTER": 1}, mma=True))
        out.append(gemm_fp8_case(f"decode b{m} wo_b f16 MMAs", m, 5120, 8192, {"split_k": 2, "F16": 1}, mma=True))
    out.append(gemm_fp8_case("prefill 4K wo_b", 4096, 5120, 8192))
    out.append(gemm_fp8_case("prefill 4K wq_b", 4096, 32768, 1280))
    # FP8_GEMM_CONFIGS: a JSON list of configs over the plan's prefill config (overlapped scaling
    # where sm90 sets it), each a further wo_b / wq_b / shared-expert pair; [] for none
    for over in json.loads(os.environ.get("FP8_GEMM_CONFIGS", "[]")):
        tag = " shipped" + "".join(f" {a}{b}" for a, b in sorted(over.items()))
        for name, n, k in (("wo_b", 5120, 8192), ("wq_b", 32768, 1280), ("shared w13", 4608, 5120)):
            out.append(gemm_fp8_case(f"prefill 4K {name}{tag}", 4096, n, k, over, shipped=True))
    for over in [{}] + json.loads(os.environ.get("BF16_GEMM_CONFIGS", "[]")):
        tag = "".join(f" {a}{b}" for a, b in sorted(over.items()))
        out.append(gemm_fp8_case("prefill 4K wo_b" + tag, 4096, 5120, 8192, over, bf16=True))
        out.append(gemm_fp8_case("prefill 4K wq_b" + tag, 4096, 32768, 1280, over, bf16=True))
    out.append(linear_case("prefill 4K 5120->4096", 4096, 4096, 5120))
    # wo_a at prefill (8 groups of 4096 -> 1024); BF16_LINEAR_CONFIGS: configs over ROWS_TILES
    for over in [{}] + json.loads(os.environ.get("BF16_LINEAR_CONFIGS", "[]")):
        tag = "".join(f" {a}{b}" for a, b in sorted(over.items()))
        out.append(grouped_linear_case("prefill 4K wo_a" + tag, 4096, 8, 1024, 4096, over))
    g = torch.Generator().manual_seed(0)
    for b in (1, 64):
        sel = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(b)])
        counts = torch.bincount(sel.flatten(), minlength=384).tolist()
        out.append(grouped_case(f"decode b{b} w1", counts, 2304, 5120, 384))
        out.append(grouped_case(f"decode b{b} w13", counts, 4608, 5120, 384, mma=True))
        out.append(grouped_case(f"decode b{b} w2", counts, 5120, 2304, 384, mma=True))
        out.append(grouped_case(f"decode b{b} w13 x per lane", counts, 4608, 5120, 384, {"XS": 0}, mma=True))
        out.append(grouped_case(f"decode b{b} w13 f16 MMAs", counts, 4608, 5120, 384, {"F16": 1}, mma=True))
        out.append(grouped_case(f"decode b{b} w2 f16 MMAs", counts, 5120, 2304, 384, {"F16": 1}, mma=True))
        out.append(grouped_case(f"decode b{b} w13 over active experts", counts, 4608, 5120, 384, {"ACT": 1},
                                mma=True))
    sel = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(4096)])
    counts = torch.bincount(sel.flatten(), minlength=384).tolist()
    out.append(grouped_case("prefill 4K w1", counts, 2304, 5120, 384))
    # the plan's prefill MoE GEMMs (w13 fused, w2) on bf16 MMAs; BF16_MOE_CONFIGS: a JSON list of
    # configs over tlmp.MOE_TILES, each a further pair
    out.append(grouped_case("prefill 4K w13", counts, 4608, 5120, 384))
    # the medium config's 96 experts: about 256 rows an expert at 4K
    sel96 = torch.stack([torch.randperm(96, generator=g)[:6] for _ in range(4096)])
    counts96 = torch.bincount(sel96.flatten(), minlength=96).tolist()
    for over in [{}] + json.loads(os.environ.get("BF16_MOE_CONFIGS", "[]")):
        tag = "".join(f" {a}{b}" for a, b in sorted(over.items()))
        out.append(grouped_case("prefill 4K w13" + tag, counts, 4608, 5120, 384, over, bf16=True))
        out.append(grouped_case("prefill 4K w2" + tag, counts, 5120, 2304, 384, over, bf16=True))
        out.append(grouped_case("prefill 4K medium w13" + tag, counts96, 4608, 5120, 96, over, bf16=True))
        out.append(grouped_case("prefill 4K medium w2" + tag, counts96, 5120, 2304, 96, over, bf16=True))
    # MMA_MOE_CONFIGS: a JSON list of configs over sm90's decode MoE defaults, each the medium
    # config's (96 experts) w13 and w2 at 1, 8 and 64 tokens ('[{}]': the defaults alone)
    sel_b = {b: torch.bincount(torch.stack([torch.randperm(96, generator=g)[:6] for _ in range(b)]).flatten(),
                               minlength=96).tolist() for b in (1, 8, 64)}
    for over in json.loads(os.environ.get("MMA_MOE_CONFIGS", "[]")):
        tag = "".join(f" {a}{b}" for a, b in sorted(over.items()))
        for b, cnt in sel_b.items():
            out.append(grouped_case(f"decode b{b} medium w13{tag}", cnt, 4608, 5120, 96, over, mma=True))
            out.append(grouped_case(f"decode b{b} medium w2{tag}", cnt, 5120, 2304, 96, over, mma=True))
    for b in (1, 64):
        out.append(attention_case(f"decode b{b}", "sparse", [(8000 + 37 * i, 1) for i in range(b)]))
    # ATTN_CONFIGS: a JSON list of config objects over the default, each a further sparse decode
    # case at 1, 8 and 64 rows and a window one at 1 and 64, with the RoPEs folded in as the plans
    # have them (a sweep of the split, the key block and the threads; '[{}]' for the defaults)
    for i, over in enumerate(json.loads(os.environ.get("ATTN_CONFIGS", "[]"))):
        for b in (1, 8, 64):
            out.append(attention_case(f"decode b{b} cfg{i}", "sparse", [(8000 + 37 * j, 1) for j in range(b)],
                                      config=over, rope=64))
        for b in (1, 64):
            out.append(attention_case(f"decode b{b} cfg{i}", "window", [(8000 + 37 * j, 1) for j in range(b)],
                                      config=over, rope=64))
    out.append(attention_case("prefill 4K", "sparse", [(2048, 4096)]))
    out.append(attention_case("prefill 4K pipelined", "sparse", [(2048, 4096)], config={"stages": 2}))
    # the RoPEs folded in (fuse_attention_rope): against the programs above in the same run, and
    # against the two rope kernels they replace (triton_rope's 316 us a 4K call in the profile)
    for b in (1, 64):
        out.append(attention_case(f"decode b{b}", "sparse", [(8000 + 37 * i, 1) for i in range(b)], rope=64))
    out.append(attention_case("prefill 4K", "sparse", [(2048, 4096)], rope=64))
    out.append(attention_case("prefill 4K pipelined", "sparse", [(2048, 4096)], config={"stages": 2}, rope=64))
    out.append(attention_case("prefill 4K ws", "sparse", [(2048, 4096)], config={"ws": 1}))
    out.append(attention_case("prefill 4K ws", "sparse", [(2048, 4096)], config={"ws": 1}, rope=64))
    out.append(attention_case("decode b64", "window", [(8000 + 37 * i, 1) for i in range(64)]))
    out.append(attention_case("draft b64", "dspark", [(8000 + 37 * i, 5) for i in range(64)]))
    out.append(indexer_case("decode b64 ctx 8K", [(8000 + 37 * i, 1) for i in range(64)]))
    out.append(indexer_case("decode b64 ctx 8K pool", [(8000 + 37 * i, 1) for i in range(64)], cand_blocks=512))
    return out


TARGET = get_target("sm90")  # the templates' defaults and the SM count are the sm90 manifest's


# ---- compile (in parallel: lowering + nvcc dominate, and TileLang caches the result on disk) ------

def _warm(args):
    kind, idx, tiny = args
    cases = tiny_cases() if tiny else real_cases()
    try:
        for p in cases[idx]["program"]():
            tlg.compile_kernel(p, pass_configs=cases[idx].get("pass_configs"))
        return None
    except Exception as e:  # reported again by the main process
        return f"{type(e).__name__}: {e}"


def compile_all(cases, tiny_flags, workers):
    """Each case's programs compiled in worker processes first (TileLang's disk cache keeps
    them), then loaded here. Prints the workers' failures and every case this process had to
    compile again (a twenty-sixth-session sweep spent its 300 s so, cause not found)."""
    jobs = [("c", i, t) for i, t in tiny_flags]
    t0 = time.time()
    # spawned, not forked: the parent has CUDA up by now, and a forked child cannot start it again
    # (every warm-up failed so, and the main process compiled every case itself)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        failed = [(c["name"], e) for c, e in zip(cases, ex.map(_warm, jobs)) if e]
    print(f"warm-up: {len(jobs)} cases in {workers} workers, {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
    for name, e in failed[:5]:
        print(f"  warm-up of {name} failed: {e[:300]}", flush=True)
    kernels = []
    for c in cases:
        t = time.time()
        try:
            kernels.append([tlg.compile_kernel(p, pass_configs=c.get("pass_configs")) for p in c["program"]()])
        except Exception as e:
            kernels.append(e)
        if time.time() - t > 5:
            print(f"  {c['name']}: {time.time() - t:.0f} s to load here (the disk cache missed it)", flush=True)
    return kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tilelang_h200.json"))
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--tiny-only", action="store_true")
    ap.add_argument("--only", default="", help="substring filter on case names ('|' between alternatives)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--graphs", action="store_true",
                    help="time each call replayed from a CUDA graph, as a plan's decode steps run (the host's "
                         "launch cost out of microsecond kernels)")
    args = ap.parse_args()
    import triton
    import tilelang

    def eager(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def bench(fn):
        if args.graphs:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return eager(fn)

    torch.manual_seed(1234)
    tiny, real = tiny_cases(), ([] if args.tiny_only else real_cases())
    flags = [(i, True) for i in range(len(tiny))] + [(i, False) for i in range(len(real))]
    cases = tiny + real
    sel = [k for k, c in enumerate(cases) if any(p in c["name"] for p in args.only.split("|"))]
    cases = [cases[k] for k in sel]
    flags = [flags[k] for k in sel]
    t0 = time.time()
    kernels = compile_all(cases, flags, args.workers)
    print(f"compiled {len(cases)} cases in {time.time() - t0:.0f} s", flush=True)
    # eager: a 1 GiB copy replayed from a graph reads slower (bench/kernels_triton.py)
    ceil = {} if args.check_only else measure_ceilings(eager, DEV)
    rows = []
    for c, k in zip(cases, kernels):
        row = {"name": c["name"], "template": c["template"], "shape": c["shape"], "config": c["config"]}
        if isinstance(k, Exception):
            row.update(status="build-error", error=f"{type(k).__name__}: {str(k)[-400:]}")
            rows.append(row)
            print(row["name"], row["error"], flush=True)
            continue
        try:
            x = c["inputs"]()
            out = c["run"](k, x)
            torch.cuda.synchronize()
            ref = c["ref"](x)
            mx, nrm = rel_err(out.float(), ref.float())
            if c.get("ref_gpu") is not None and c["ref"] is not c["ref_gpu"]:
                row["gpu_ref_vs_op_ref"] = rel_err(c["ref_gpu"](x).float(), ref.float())[0]
            row.update(max_rel=mx, norm_rel=nrm, status="pass" if mx <= c["tol"] else "FAIL", tol=c["tol"])
            if not args.check_only and ("tiny" not in c["name"]):
                t = bench(lambda: c["run"](k, x))
                peak = ceil["fp8_flops"] if c["peak"] == "fp8" else ceil["bf16_flops"]
                tb, tf = c["bytes"] / ceil["copy_bytes_per_s"], c["flops"] / peak
                floor = max(tb, tf)
                row.update(time_us=t * 1e3, bytes=c["bytes"], flops=c["flops"], floor_us=floor * 1e6,
                           bound="bytes" if tb >= tf else "flops", floor_over_time=floor / (t * 1e-3),
                           hbm_frac=(c["bytes"] / (t * 1e-3)) / ceil["copy_bytes_per_s"],
                           peak_frac=(c["flops"] / (t * 1e-3)) / peak)
        except Exception as e:
            row.update(status="run-error", error=f"{type(e).__name__}: {str(e)[-400:]}")
        rows.append(row)
        print({k2: v for k2, v in row.items() if k2 != "config"}, flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tilelang": getattr(tilelang, "__version__", "?"), "cuda": torch.version.cuda,
           "date": datetime.date.today().isoformat(), "ceilings": ceil, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("\n%-40s %-6s %9s %9s %8s %6s %6s %6s" % ("case", "status", "max_rel", "time_us", "floor", "f/t",
                                                  "hbm", "peak"))
    for r in rows:
        print("%-40s %-6s %9.2e %9s %8s %6s %6s %6s" % (
            r["name"][:40], r["status"][:6], r.get("max_rel", float("nan")),
            "%.1f" % r["time_us"] if "time_us" in r else "-", "%.1f" % r["floor_us"] if "floor_us" in r else "-",
            "%.2f" % r["floor_over_time"] if "floor_over_time" in r else "-",
            "%.2f" % r["hbm_frac"] if "hbm_frac" in r else "-", "%.2f" % r["peak_frac"] if "peak_frac" in r else "-"))
    if ceil:
        print("ceilings: copy %.2f TB/s, bf16 %.0f TFLOP/s, fp8 %.0f TFLOP/s" % (
            ceil["copy_bytes_per_s"] / 1e12, ceil["bf16_flops"] / 1e12, ceil["fp8_flops"] / 1e12))
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
