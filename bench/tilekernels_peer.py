"""DeepSeek's TileKernels (2.1.0, TileLang kernels) as the peer of our Triton templates for mHC, the
router, quantisation and Engram, at the same shapes and inputs in the same run.

Each pairing runs the two on the same tensors (triton_check.make_case at V4.1 widths), reports
how far TileKernels' output is from ours (a sanity check that the two compute the same thing:
max relative difference, or for the router and the hash the fraction of rows / ids that differ),
and times both. What each pairing covers (TileKernels' own API differs in places):
- hc_pre: TileKernels 2.1.0 has no mix GEMM (it moved to DeepGEMM), so its side is a torch fp32
  GEMM + sum of squares, `mhc_pre_big_fuse_fwd` (RMS, Sinkhorn, collapse) and `norm_forward`
  (the RMSNorm ours fuses). Its collapse uses the pre it just computed (V4 layout), ours the
  previous sub-layer's (V4.1): same work, different operand, so only post and M are compared.
- hc_expand: `mhc_post_fwd`, same maths.
- moe_router: `moe_topk_gate_forward` (sqrt-softplus, bias for selection, renorm, x1.5).
- quant_fp8 / rms_norm_quant_fp8: `per_token_cast` / `norm_forward_and_per_token_cast`, packed
  ue8m0 scales (byte-identical layout to ours).
- swiglu_quant_fp8 / swiglu_weighted_quant_fp8: `swiglu_forward_and_per_token_cast` on one
  [gate | up] tensor (made before timing); the weighted case takes per-row weights gathered before
  timing (ours gathers them in the kernel). TileKernels quantises the fp32 product where the
  spec rounds it to bf16 first.
- engram_hash: `engram_hash` for one layer (ours: one layer per launch).
- engram_gate: `engram_gate_fwd(save_for_backward=False)` with q_weight*k_weight fused once
  before timing (ours multiplies them in the kernel).
TileKernels compiles each kernel with nvcc on its first call; the warm-up call is not timed.
"""
import torch

from deepinfer.codegen.library import triton_check, triton_ops
from deepinfer.ir.quant import QTensor

SIZES = {"decode b1": 1, "decode b64": 64, "prefill 4K": 4096}
COVERED = ("hc_pre", "hc_expand", "moe_router", "quant_fp8", "rms_norm_quant_fp8", "swiglu_quant_fp8",
           "swiglu_weighted_quant_fp8", "engram_hash", "engram_gate")


def _peer(op, ins, attrs):
    """(TileKernels callable, how to compare its result with ours) for one case; setup not timed."""
    from tile_kernels import engram, mhc, moe, quant

    dims = triton_check.REAL
    C, H = dims["C"], dims["H"]
    if op == "hc_pre":
        r, fn, scale, base, pre_in, norm_w = ins
        n = r.shape[0]
        post = torch.empty(n, C, device="cuda")
        comb = torch.empty(n, C * C, device="cuda")
        x = torch.empty(n, H, dtype=torch.bfloat16, device="cuda")

        def run():
            xf = r.view(n, C * H).float()
            mul = (xf @ fn.t()).unsqueeze(0)
            sq = xf.square().sum(-1).unsqueeze(0)
            mhc.mhc_pre_big_fuse_fwd(mul, sq, scale, base, r, post, comb, x, rms_eps=attrs["eps"],
                                     mhc_pre_eps=attrs["hc_eps"], mhc_sinkhorn_eps=attrs["hc_eps"],
                                     mhc_post_mult_value=attrs["post_mult"], sinkhorn_repeat=attrs["iters"],
                                     n_splits=1)
            return quant.norm_forward(x, norm_w, attrs["eps"])[0], post, comb.view(n, C, C)
        return run, lambda t, o: max(_rel(t[1], o[2]), _rel(t[2], o[3]))  # post and M
    if op == "hc_expand":
        y, r, post, m = ins
        n = r.shape[0]
        p4 = post.view(1, n, C, 1)
        return (lambda: mhc.mhc_post_fwd(y.unsqueeze(0), r.unsqueeze(0), p4, m.unsqueeze(0))[0]), _rel
    if op == "moe_router":
        logits, bias = ins
        return (lambda: moe.moe_topk_gate_forward(logits, attrs["k"], False, 0, attrs["scale"], 0, bias=bias)), \
            lambda t, o: float((t[0].int().sort(1)[0] != o[0].int().sort(1)[0]).any(1).float().mean())
    if op == "quant_fp8":
        (x,) = ins
        return (lambda: quant.per_token_cast(x, "e4m3", attrs["block"], round_sf=True, use_packed_ue8m0=True)), _qrel
    if op == "rms_norm_quant_fp8":
        x, w = ins
        return (lambda: quant.norm_forward_and_per_token_cast(x, w, attrs["eps"], "e4m3", attrs["block"], round_sf=True,
                                                              use_packed_ue8m0=True)[0]), _qrel
    if op == "swiglu_quant_fp8":
        gu = torch.cat(ins, 1).contiguous()
        return (lambda: quant.swiglu_forward_and_per_token_cast(gu, "e4m3", attrs["block"], round_sf=True,
                                                                use_packed_ue8m0=True, clamp_value=attrs["limit"])), _qrel
    if op == "swiglu_weighted_quant_fp8":
        gu, wt, pairs = ins
        rows = wt.reshape(-1)[pairs.long()].contiguous()
        return (lambda: quant.swiglu_forward_and_per_token_cast(gu, "e4m3", attrs["block"], topk_weights=rows,
                                                                round_sf=True, use_packed_ue8m0=True,
                                                                clamp_value=attrs["limit"])), _qrel
    if op == "engram_hash":
        from tile_kernels.torch import make_offsets

        (grams,) = ins
        g = grams.int().contiguous()
        mult = torch.tensor([attrs["multipliers"]], dtype=torch.int64, device="cuda")
        primes = torch.tensor([attrs["primes"]], dtype=torch.int32, device="cuda").view(1, 3, 8)
        offs = make_offsets(primes)
        return (lambda: engram.engram_hash(g, mult, primes, offs)), \
            lambda t, o: float((t[0].long() != o.long()).float().mean())  # fraction of ids that differ
    if op == "engram_gate":
        r, kv, qw, kw = ins
        n = r.shape[0]
        wf = engram.fused_weight(qw, kw)
        kv3 = kv.view(n, C + 1, H)
        return (lambda: engram.engram_gate_fwd(r, kv3, wf, eps=attrs["eps"], clamp_value=1e-6,
                                               save_for_backward=False)[0]), _rel
    raise KeyError(op)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _qrel(t, o) -> float:
    """Dequantised max relative difference; TileKernels packs four ue8m0 bytes per int32."""
    from deepinfer.ir.ops.quantized import dequant_value

    a = dequant_value(QTensor(t[0].cpu(), t[1].view(torch.uint8).view(t[0].shape[0], -1).cpu()))
    b = dequant_value(QTensor(o[0].cpu(), o[1].cpu()))
    return _rel(a, b)


def _warm_one(op_n):
    op, n = op_n
    try:
        ins, attrs = triton_check.make_case(op, triton_check.REAL, n, "cuda", seed=n)
        _peer(op, ins, attrs)[0]()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (the timed run reports it again)
        return f"{op}/{n}: {type(e).__name__}: {str(e)[-200:]}"


def warm(ops, workers=12):
    """Compile TileKernels' kernels for every case in parallel processes first (each compiles
    with nvcc on first use and caches on disk), so the timed run loads them."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(op, n) for op in COVERED if op in ops for n in SIZES.values()]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return [m for m in pool.map(_warm_one, jobs) if m]


def compare(bench, ceil, ops) -> list:
    from kernels_triton import launcher, moved_bytes

    rows = []
    for op in [o for o in COVERED if o in ops]:
        for label, n in SIZES.items():
            row = {"op": op, "case": label, "n": n}
            try:
                ins, attrs = triton_check.make_case(op, triton_check.REAL, n, "cuda", seed=n)
                cfg = triton_ops.default_config(op, n)
                kw = triton_ops.launch_attrs(op, attrs)
                ours = launcher(op)(*ins, **kw, cfg=cfg)
                run, diff = _peer(op, ins, attrs)
                theirs = run()
                torch.cuda.synchronize()
                row["tk_vs_ours"] = diff(theirs, ours)
                t_ours = bench(lambda: launcher(op)(*ins, **kw, cfg=cfg))
                t_tk = bench(run)
                floor = moved_bytes(op, ins, ours) / ceil["copy_bytes_per_s"]
                row.update(ours_us=t_ours * 1e3, tk_us=t_tk * 1e3, tk_over_ours=t_tk / t_ours,
                           floor_us=floor * 1e6, ours_floor_over_time=floor / (t_ours * 1e-3),
                           tk_floor_over_time=floor / (t_tk * 1e-3))
            except Exception as e:  # noqa: BLE001  (reported per case, the run goes on)
                row["error"] = f"{type(e).__name__}: {str(e).strip()[-300:]}"
            rows.append(row)
            print(row, flush=True)
    return rows
