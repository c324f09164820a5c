"""The decode MoE GEMM on warp MMAs (codegen/library/tilelang_moe_decode.py): its register-level
widening and K permutation, emulated lane by lane on the CPU against the scale block's dot product;
which calls take it; its render, build and host recipe. (On the GPU: tests/gpu/test_tilelang_kernels.py.)"""
import shutil

import pytest
import torch

from deepinfer.codegen.library import tilelang_moe_decode as md
from deepinfer.codegen.targets import get_target
from deepinfer.codegen.template import KernelSpec, select
from deepinfer.ir.types import quantized, tensor

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


class IntT:
    """The TileLang names the widening helpers use, on Python ints (32-bit words)."""
    @staticmethod
    def bitwise_or(a, b):
        return a | b

    @staticmethod
    def bitwise_and(a, b):
        return a & b

    @staticmethod
    def shift_left(a, b):
        return (a << b) & 0xFFFFFFFF

    @staticmethod
    def shift_right(a, b):
        return a >> b

    @staticmethod
    def uint32(v):
        return v


def e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def e4m3(bytes_: list[int]) -> list[float]:
    return torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()


def word_bytes(w: int) -> list[int]:
    return [(w >> (8 * i)) & 0xFF for i in range(4)]


def byte_perm(x: int, y: int, s: int) -> int:
    b = word_bytes(x) + word_bytes(y)
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


def test_widening_is_exact_for_every_code():
    """Every byte (two codes) widens to the e4m3 bytes of each code's value times 2^-6."""
    for byte in range(256):
        w = byte * 0x01010101
        lo, hi = e4m3(word_bytes(md.fp4_lo_e4m3(IntT, w))), e4m3(word_bytes(md.fp4_hi_e4m3(IntT, w)))
        assert lo == [e2m1(byte & 15) / 64] * 4, byte
        assert hi == [e2m1(byte >> 4) / 64] * 4, byte


def test_fragments_hold_the_scale_block_dot_product():
    """One m16n8k32 MMA as PTX lays out its fragments, filled as the kernel fills them (lane
    (g, q): weight words at byte 4q of rows g and g + 8, x's bytes 8q..8q+7 of row g picked by the
    two selectors): its C is each (weight row, x row) dot product over the block's 32 codes / 64."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 32), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).tolist()  # [16 rows, 16 bytes], low nibble even
    xb = torch.randint(0, 0x7F, (8, 32), generator=g)  # finite e4m3 bytes
    xb |= torch.randint(0, 2, (8, 32), generator=g) << 7
    xv = torch.tensor(e4m3(xb.flatten().tolist()), dtype=torch.float64).view(8, 32)
    xb = xb.tolist()

    def word(row, at):
        return sum(packed[row][at + i] << (8 * i) for i in range(4))

    A = torch.zeros(16, 32, dtype=torch.float64)
    B = torch.zeros(32, 8, dtype=torch.float64)
    for lane in range(32):
        gg, q = lane // 4, lane % 4
        w0, w1 = word(gg, 4 * q), word(gg + 8, 4 * q)
        regs = [md.fp4_lo_e4m3(IntT, w0), md.fp4_lo_e4m3(IntT, w1), md.fp4_hi_e4m3(IntT, w0),
                md.fp4_hi_e4m3(IntT, w1)]
        for r, (row, col) in enumerate([(gg, 4 * q), (gg + 8, 4 * q), (gg, 16 + 4 * q), (gg + 8, 16 + 4 * q)]):
            A[row, col:col + 4] = torch.tensor(e4m3(word_bytes(regs[r])), dtype=torch.float64)
        xl = sum(xb[gg][8 * q + i] << (8 * i) for i in range(4))
        xh = sum(xb[gg][8 * q + 4 + i] << (8 * i) for i in range(4))
        for r, (sel, k0) in enumerate([(md.X_EVEN, 4 * q), (md.X_ODD, 16 + 4 * q)]):
            B[k0:k0 + 4, gg] = torch.tensor(e4m3(word_bytes(byte_perm(xl, xh, sel))), dtype=torch.float64)
    wv = torch.tensor([[e2m1(c) for c in row] for row in codes.tolist()], dtype=torch.float64)
    torch.testing.assert_close((A @ B) * 64, wv @ xv.T, rtol=0, atol=0)


def test_f16_pairs_hold_the_k32_product():
    """The f16 path of the warp-MMA programs (tilelang_warp_mma.A_PAIRS / X_PAIRS, scaled_mma's two
    m16n8k16 MMAs): lane by lane, the f16 pairs of the k32 e4m3 fragments, placed as PTX lays out
    m16n8k16's fragments, give the k32 MMA's product exactly."""
    from deepinfer.codegen.library import tilelang_warp_mma as wm

    g = torch.Generator().manual_seed(1)
    ab = torch.randint(0, 0x7F, (16, 32), generator=g) | (torch.randint(0, 2, (16, 32), generator=g) << 7)
    bb = torch.randint(0, 0x7F, (32, 8), generator=g) | (torch.randint(0, 2, (32, 8), generator=g) << 7)
    av = torch.tensor(e4m3(ab.flatten().tolist()), dtype=torch.float64).view(16, 32)
    bv = torch.tensor(e4m3(bb.flatten().tolist()), dtype=torch.float64).view(32, 8)
    a16 = torch.zeros(2, 16, 16, dtype=torch.float64)
    b16 = torch.zeros(2, 16, 8, dtype=torch.float64)
    for lane in range(32):
        gg, q = lane // 4, lane % 4
        # m16n8k32's fragments as values: A words (row, first K slot), B words (first K slot)
        aw = [av[r, k0:k0 + 4] for r, k0 in ((gg, 4 * q), (gg + 8, 4 * q), (gg, 16 + 4 * q), (gg + 8, 16 + 4 * q))]
        bw = [bv[k0:k0 + 4, gg] for k0 in (4 * q, 16 + 4 * q)]
        ah = [aw[w][2 * h:2 * h + 2] for w, h in wm.A_PAIRS]
        bh = [bw[j][2 * h:2 * h + 2] for j, h in wm.X_PAIRS]
        for m in range(2):  # the k16 MMA m reads a[4 + 4m ..] and x's pairs 2m, 2m + 1
            for r, (row, col) in enumerate(((gg, 2 * q), (gg + 8, 2 * q), (gg, 8 + 2 * q), (gg + 8, 8 + 2 * q))):
                a16[m, row, col:col + 2] = ah[4 * m + r]
            b16[m, 2 * q:2 * q + 2, gg] = bh[2 * m]
            b16[m, 8 + 2 * q:8 + 2 * q + 2, gg] = bh[2 * m + 1]
    torch.testing.assert_close(a16[0] @ b16[0] + a16[1] @ b16[1], av @ bv, rtol=0, atol=0)


def moe_spec(rows, n=4608, k=5120, experts=96):
    return KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (rows, k), "e8m0", (1, 32)),
                                               quantized("fp4e2m1", (experts, n, k), "e8m0", (1, 1, 32)),
                                               tensor("i32", experts + 1)), (tensor("bf16", rows, n),))


def test_sm90_decode_calls_take_it_prefill_and_other_targets_do_not():
    sm90 = get_target("sm90")
    for rows in (6, 48, 384, 32 * 96):
        assert select(sm90, moe_spec(rows)).name == "tilelang_grouped_gemm_fp4_mma", rows
    # prefill-sized calls: the prefill program on bf16 MMAs (tilelang_moe_prefill)
    assert select(sm90, moe_spec(32 * 96 + 1)).name == "tilelang_grouped_gemm_fp4_bf16"
    assert select(get_target("sm100"), moe_spec(6)).name != "tilelang_grouped_gemm_fp4_mma"
    # K the warps cannot split evenly, N off the CTA's rows: the Triton decode template
    assert select(sm90, moe_spec(6, k=5120 + 32)).name == "triton_grouped_gemm_fp4"
    assert select(sm90, moe_spec(6, n=4608 + 16)).name == "triton_grouped_gemm_fp4"


def test_batch_invariant_plans_keep_one_template():
    from dataclasses import replace

    from deepinfer.codegen.template import BATCH_INVARIANT

    t = get_target("sm90")
    bi = replace(t, features=tuple(t.features) + (BATCH_INVARIANT,))
    assert select(bi, moe_spec(6)).name == "triton_grouped_gemm_fp4"


def test_host_launches_once_without_a_fill():
    """The kernel writes rows past offsets[E] as zeros itself (bench/kernels_tilelang.py's
    uncovered-rows cases check it on the GPU): the host allocates and launches, no fill."""
    from deepinfer.codegen.host_recipe import record_tilelang
    from deepinfer.ir.quant import QTensor

    params = [[n, "void*"] for n in ("C", "SW", "SX", "W", "X", "offsets")]
    kernel = {"template": "tilelang_grouped_gemm_fp4_mma", "config": {}, "meta": {"params": params},
              "grid": [72, 96, 1], "language": "cuda"}
    with torch.device("meta"):
        x = QTensor(torch.empty(6, 5120, dtype=torch.float8_e4m3fn), torch.empty(6, 160, dtype=torch.uint8))
        w = QTensor(torch.empty(96, 4608, 2560, dtype=torch.uint8), torch.empty(96, 4608, 160, dtype=torch.uint8))
        offs = torch.empty(97, dtype=torch.int32)
        rec, (out,) = record_tilelang(md.host_grouped_gemm_fp4_mma, kernel, [x, w, offs], {}, [False])
    assert tuple(out.shape) == (6, 4608) and out.dtype == torch.bfloat16
    launches = [s for s in rec["steps"] if "launch" in s]
    assert len(launches) == 1 and launches[0]["grid"] == [72, 96, 1]
    assert not any(s.get("op", "").startswith(("aten.zeros", "aten.zero_", "aten.fill_")) for s in rec["steps"])


@pytest.mark.parametrize("over", [{}, {"XS": 0}, {"ACT": 0}, {"ACT": 1}, {"F16": 1}])
def test_renders_and_builds_without_spills(over):
    pytest.importorskip("tilelang")
    t = get_target("sm90")
    for spec in (moe_spec(6), moe_spec(384, n=5120, k=2304)):
        tpl = select(t, spec)
        cfg = dict(tpl.default_config(t, spec), **over)
        src = tpl.render(t, spec, cfg)
        n = spec.in_types[1].shape[1]
        rows = spec.in_types[0].shape[0]
        # ACT: CTAs for at most min(experts, rows) experts with rows, each finding its own, where
        # that is at most a quarter of the experts (6 rows: yes; 384: every expert, no search)
        act = bool(cfg["ACT"]) and 4 * min(96, rows) <= 96
        assert src.grid == (n // (16 * cfg["RT"]), min(96, rows) if act else 96, 1)
        assert src.block == (32 * cfg["WK"], 1, 1)
        assert ("__ballot_sync" in src.text) == act
        if cfg.get("F16"):  # f16 MMAs on pairs converted by the prelude's functions
            assert "kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, 16" in src.text
            assert "cvt.rn.f16x2.e4m3x2" in src.text and "16, 8, 32" not in src.text
        else:
            assert "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 16, 8, 32" in src.text
        assert "__byte_perm" in src.text and "cp_async" in src.text
        # x through the pipeline: its 16-byte pieces guarded at the rows' end (XS), or loaded per lane
        assert ("uint64_t*)Xs)" in src.text) == bool(cfg["XS"])
        assert {p for p, _ in src.meta["params"]} == {"C", "SW", "SX", "W", "X", "offsets"}
        assert "offsets[96]" in src.text  # the first slot's CTAs zero the rows past the last expert's
        if shutil.which("nvcc"):
            from deepinfer.codegen.library.tilelang_gemm import nvcc_report

            rep = nvcc_report(src.text, t.arch)
            assert rep["ok"], rep["log"]
            assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def test_warpgroup_fragments_hold_the_scale_block_dot_product():
    """The warpgroup program (WG): each warp's A fragment is the warp-MMA program's (16 weight
    rows, the same permuted K order), and x's staged block (xp_word: the stage_x pass's byte_perms
    of its two 16-byte pieces) read as `wgmma`'s B operand through the no-swizzle descriptor (column
    n's K slots 0..15 at core matrix 0 row n, 16..31 at core matrix 1, 128 bytes on) meets each slot
    with the x byte of the same code: the product is the block's dot product / 64."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (64, 32), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).tolist()
    xb = torch.randint(0, 0x7F, (8, 32), generator=g) | (torch.randint(0, 2, (8, 32), generator=g) << 7)
    xv = torch.tensor(e4m3(xb.flatten().tolist()), dtype=torch.float64).view(8, 32)
    xb = xb.tolist()
    smem = {}  # word index -> value, as stage_x writes block 0 of the pass
    for r in range(8):
        for h in range(2):
            w = [sum(xb[r][16 * h + 4 * j + i] << (8 * i) for i in range(4)) for j in range(4)]
            for odd, sel in ((0, md.X_EVEN), (1, md.X_ODD)):
                smem[md.xp_word(0, r, odd, 2 * h)] = byte_perm(w[0], w[1], sel)
                smem[md.xp_word(0, r, odd, 2 * h + 1)] = byte_perm(w[2], w[3], sel)
    raw = b"".join(smem[i].to_bytes(4, "little") for i in range(64))
    B = torch.zeros(32, 8, dtype=torch.float64)
    for n in range(8):
        for s in range(32):  # core matrix s // 16 (128 bytes apart), row n, byte s % 16
            B[s, n] = e4m3([raw[(s // 16) * 128 + n * 16 + s % 16]])[0]
    A = torch.zeros(64, 32, dtype=torch.float64)
    for warp in range(4):
        for lane in range(32):
            gg, q = lane // 4, lane % 4
            r0 = 16 * warp + gg
            w0 = sum(packed[r0][4 * q + i] << (8 * i) for i in range(4))
            w1 = sum(packed[r0 + 8][4 * q + i] << (8 * i) for i in range(4))
            regs = [md.fp4_lo_e4m3(IntT, w0), md.fp4_lo_e4m3(IntT, w1), md.fp4_hi_e4m3(IntT, w0),
                    md.fp4_hi_e4m3(IntT, w1)]
            for reg, (row, col) in zip(regs, [(r0, 4 * q), (r0 + 8, 4 * q), (r0, 16 + 4 * q), (r0 + 8, 16 + 4 * q)]):
                A[row, col:col + 4] = torch.tensor(e4m3(word_bytes(reg)), dtype=torch.float64)
    wv = torch.tensor([[e2m1(c) for c in row] for row in codes.tolist()], dtype=torch.float64)
    torch.testing.assert_close((A @ B) * 64, wv @ xv.T, rtol=0, atol=0)


@pytest.mark.parametrize("rows,over", [(6, {}), (384, {}), (6, {"WGS": 2}), (6, {"BATCH": 1, "XR": 1, "WGS": 2}),
                                       (384, {"BATCH": 1, "XR": 1})])
def test_warpgroup_program_renders_and_builds_without_spills(rows, over):
    """WG: WGS warpgroups a CTA, each 64 weight rows over its expert's whole K, warpgroup MMAs
    with A in registers (the prelude's wgmma, B through the staged x's descriptor after a proxy
    fence); BATCH: a step's MMAs in one group, waited on once; XR: x's step tile through the
    pipeline, put in order each step (the whole pass's x is not staged)."""
    pytest.importorskip("tilelang")
    t = get_target("sm90")
    spec = moe_spec(rows) if rows == 6 else moe_spec(rows, n=5120, k=2304)
    tpl = select(t, spec)
    wgs = over.get("WGS", 1)
    cfg = dict(tpl.default_config(t, spec), WG=1, **over)
    assert tpl.supports(t, spec)
    src = tpl.render(t, spec, cfg)
    n = spec.in_types[1].shape[1]
    act = 4 * min(96, rows) <= 96
    assert src.grid == (n // (64 * wgs), min(96, rows) if act else 96, 1) and src.block == (128 * wgs, 1, 1)
    assert "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3" in src.text
    body = src.text[src.text.index("__global__ void __launch_bounds__"):]
    mma = "deepinfer_wgmma_mma(" if over.get("BATCH") else "deepinfer_wgmma_e4m3_n8("
    assert body.index("deepinfer_fence_proxy_async();") < body.index(mma)
    assert "mma_sync" not in body and "red[" not in body  # no warp MMAs, no sum across warps
    assert ("deepinfer_wgmma_commit_wait();" in body) == bool(over.get("BATCH"))
    assert ("uint64_t*)Xr)" in body) == bool(over.get("XR"))
    assert {p for p, _ in src.meta["params"]} == {"C", "SW", "SX", "W", "X", "offsets"}
    if shutil.which("nvcc"):
        from deepinfer.codegen.library.tilelang_gemm import nvcc_report

        rep = nvcc_report(src.text, t.arch)
        assert rep["ok"], rep["log"]
        assert rep["spill_bytes"] == 0 and rep["stack_bytes"] == 0, rep["log"]


@pytest.mark.parametrize("rows", [6, 48])
def test_warpgroup_rows_keep_the_warpgroup_program_to_small_calls(rows):
    """WG_ROWS 8: a b1 step's 6 rows take the warpgroup program, a b8 step's 48 the warp-MMA one
    (its WG-only knobs dropped, not passed to it)."""
    pytest.importorskip("tilelang")
    t = get_target("sm90")
    spec = moe_spec(rows)
    tpl = select(t, spec)
    cfg = dict(tpl.default_config(t, spec), WG=1, WG_ROWS=8, BATCH=1, XR=1, WGS=2)
    src = tpl.render(t, spec, cfg)
    assert src.entry == ("grouped_gemm_fp4_wgmma_kernel" if rows <= 8 else "grouped_gemm_fp4_mma_kernel")
    assert src.block == ((256 if rows <= 8 else 128), 1, 1)
