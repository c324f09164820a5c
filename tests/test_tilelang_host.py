"""The host side of the TileLang GEMM templates pads a call's rows up to its instance's rows
(decode calls share the 64-row, or 2E-row, instance) and returns the call's own rows. Checked on
the CPU with the kernel stood in by its op's reference over the padded buffers."""
import torch

from deepinfer.codegen.library import tilelang_host as th
from deepinfer.codegen.library.tilelang_gemm import canonical_rows
from deepinfer.codegen.library.tilelang_moe import canonical_rows as grouped_canonical_rows
from deepinfer.codegen.targets import get_target
from deepinfer.codegen.template import KernelSpec
from deepinfer.ir import quant
from deepinfer.ir.quant import QTensor
from deepinfer.ir.registry import get_op
from deepinfer.ir.types import quantized, tensor


def _gemm_launch(i, A, SA, B, SB, C):
    C[:] = get_op("gemm_fp8").ref(QTensor(A, SA), QTensor(B, SB), out_dtype="f32").to(C.dtype)


def test_gemm_rows_are_padded_to_the_instance_and_cut_back():
    torch.manual_seed(0)
    x = quant.quant_fp8_32(torch.randn(3, 2, 64))  # 6 rows as [3, 2, 64]
    w = quant.quant_fp8_weight(torch.randn(96, 64) * 0.1)
    want = get_op("gemm_fp8").ref(x, w, out_dtype="bf16")
    for split in (1, 4):
        got = th.host_gemm_fp8(_gemm_launch, (x, w), {"out_dtype": "bf16"}, {"split_k": split},
                               {"mnk": (64, 96, 64)})
        assert got.shape == want.shape and torch.equal(got, want)


def test_decode_gemm_reads_the_live_rows_and_sums_the_splits_in_order():
    """The decode program (`rows_argument`): the host passes the call's m rows unpadded and m
    itself; a split K gets an fp32 partial buffer of the instance's 64 rows per split (no zeroing:
    rows past m hold garbage here and must not reach the output), summed by the second kernel."""
    torch.manual_seed(2)
    x = quant.quant_fp8_32(torch.randn(3, 128))
    w = quant.quant_fp8_weight(torch.randn(96, 128) * 0.1)
    want = get_op("gemm_fp8").ref(x, w, out_dtype="f32")
    seen = []

    def launch(i, **b):
        seen.append((i, sorted(b), b["m"]))
        if i == 1:
            b["C"][:] = b["P"][:, : b["m"]].sum(0).to(b["C"].dtype)  # in split order
            return
        a, sa, split = b["A"], b["SA"], b["C"].shape[0] if b["C"].dim() == 3 else 1
        assert a.shape[0] == sa.shape[0] == b["m"] == 3
        if split == 1:
            b["C"][:] = get_op("gemm_fp8").ref(QTensor(a, sa), QTensor(b["B"], b["SB"]), out_dtype="f32")
            return
        b["C"][:] = float("nan")  # rows past m: whatever the kernel leaves there
        step = a.shape[1] // split
        for s_ in range(split):
            ks = slice(s_ * step, (s_ + 1) * step)
            part = QTensor(a[:, ks].contiguous(), sa[:, s_ * step // 32:(s_ + 1) * step // 32].contiguous())
            wp = QTensor(b["B"][:, ks].contiguous(), b["SB"][:, s_ * step // 32:(s_ + 1) * step // 32].contiguous())
            b["C"][s_, : b["m"]] = get_op("gemm_fp8").ref(part, wp, out_dtype="f32")

    for split in (1, 2):
        seen.clear()
        got = th.host_gemm_fp8(launch, (x, w), {"out_dtype": "f32"}, {"split_k": split},
                               {"mnk": (64, 96, 128), "rows_argument": True})
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert seen == ([(0, ["A", "B", "C", "SA", "SB", "m"], 3)] if split == 1 else
                        [(0, ["A", "B", "C", "SA", "SB", "m"], 3), (1, ["C", "P", "m"], 3)])


def test_decode_gemm_specs_share_the_64_row_instance():
    target = get_target("sm90")
    w = quantized("fp8e4m3", (96, 64), "e8m0", (32, 32))
    specs = [KernelSpec("gemm_fp8", (("out_dtype", "bf16"),), (quantized("fp8e4m3", (m, 64), "e8m0", (1, 32)), w),
                        (tensor("bf16", m, 96),)) for m in (1, 5, 40, 64)]
    canon = {canonical_rows(target, s).key() for s in specs}
    assert len(canon) == 1 and "fp8e4m3[64,64]" in canon.pop()
    big = KernelSpec("gemm_fp8", (("out_dtype", "bf16"),), (quantized("fp8e4m3", (512, 64), "e8m0", (1, 32)), w),
                     (tensor("bf16", 512, 96),))
    assert canonical_rows(target, big) == big  # prefill shapes keep their own instance


def test_grouped_rows_are_padded_to_2e():
    torch.manual_seed(1)
    e, n, k = 4, 64, 128
    x = quant.quant_fp8_32(torch.randn(5, k))
    w = quant.quant_fp4_ue8m0(torch.randn(e * n, k) * 0.1)
    w = QTensor(w.data.view(e, n, k // 2), w.scale.view(e, n, k // 32))
    offsets = torch.tensor([0, 2, 2, 5, 5], dtype=torch.int32)
    want = get_op("grouped_gemm_fp4").ref(x, w, offsets)

    def launch(i, X, SX, W, SW, offsets, C):
        C[: X.shape[0]] = get_op("grouped_gemm_fp4").ref(QTensor(X, SX), QTensor(W, SW), offsets).to(C.dtype)

    got = th.host_grouped_gemm_fp4(launch, (x, w, offsets), {}, {}, {"dims": {"rows": 2 * e}})
    assert got.shape == want.shape and torch.equal(got, want)
    spec = KernelSpec("grouped_gemm_fp4", (), (quantized("fp8e4m3", (5, k), "e8m0", (1, 32)),
                                               quantized("fp4e2m1", (e, n, k), "e8m0", (1, 1, 32)),
                                               tensor("i32", e + 1)), (tensor("bf16", 5, n),))
    assert "fp8e4m3[8,128]" in grouped_canonical_rows(get_target("sm90"), spec).key()
