import math

import pytest
import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir import quant


def test_fp4_grid_round_to_nearest_even_and_saturate():
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 100.0])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    assert dt.fp4_decode(dt.fp4_encode(x)).tolist() == want
    assert dt.fp4_decode(dt.fp4_encode(-x)).tolist() == [-w for w in want]


def test_fp4_codes_and_sign_bit():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = dt.fp4_decode(codes).tolist()
    assert vals[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert vals[9:] == [-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert dt.fp4_encode(torch.tensor(vals[1:8])).tolist() == list(range(1, 8))


def test_fp4_nibble_order_low_nibble_is_even_element():
    packed = dt.fp4_pack(torch.tensor([[0x1, 0x2, 0xF, 0x0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert dt.fp4_unpack(packed).tolist() == [[1, 2, 15, 0]]
    # the checkpoint holds the bytes as I8: 0xF1 is -15 there and must unpack the same way
    as_i8 = torch.tensor([[-15]], dtype=torch.int8)
    assert dt.fp4_unpack(as_i8).tolist() == [[1, 15]]
    with pytest.raises(ValueError):
        dt.fp4_pack(torch.zeros(3, dtype=torch.uint8))


def test_fp4_pack_round_trip_random():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(dt.fp4_unpack(dt.fp4_pack(codes)), codes)


def test_e8m0_decoding():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = dt.e8m0_decode(b)
    assert v[3] == 1.0 and v[4] == 2.0 and v[2] == 0.5 and v[5] == 2.0**127
    assert v[0] == 2.0**-127 and v[1] == 2.0**-126
    assert math.isnan(v[6])
    assert dt.e8m0_encode_pow2(v[:6]).tolist() == [0, 1, 126, 127, 128, 254]


def test_e8m0_matches_torch_float8_e8m0fnu():
    b = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(dt.e8m0_decode(b), b.view(torch.float8_e8m0fnu).float())


def test_fp8_saturates_instead_of_nan():
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.1])
    y = dt.fp8_encode(x).float()
    assert y[:3].tolist() == [448.0, -448.0, 448.0]
    assert abs(y[3].item() - 0.1) < 0.01


def test_fp8_per32_scale_is_power_of_two_rounded_up():
    x = torch.zeros(64)
    x[0] = 448.0 * 1.5  # amax/448 = 1.5 -> scale 2
    x[32] = 448.0 * 0.25  # exactly a power of two -> scale 0.25
    q = quant.quant_fp8_32(x)
    assert dt.e8m0_decode(q.scale).tolist() == [2.0, 0.25]
    assert quant.dequant_fp8_32(q)[0] == 640.0  # 672/2 = 336 ties between e4m3 320 and 352: even wins
    zero = quant.quant_fp8_32(torch.zeros(32))  # the 1e-4 amax floor keeps the scale finite
    assert dt.e8m0_decode(zero.scale).item() == 2.0 ** math.ceil(math.log2(1e-4 / 448))


def test_fp4_scales_ue8m0_and_e4m3():
    x = torch.linspace(-3, 3, 32)
    q = quant.quant_fp4_ue8m0(x)
    assert dt.e8m0_decode(q.scale).item() == 0.5  # amax 3 / 6 = 0.5
    assert torch.equal(quant.dequant_fp4_ue8m0(q), dt.fp4_decode(dt.fp4_encode(x / 0.5)) * 0.5)
    y = torch.linspace(-5, 5, 16)
    qe = quant.quant_fp4_e4m3(y)
    assert qe.scale.dtype == torch.float8_e4m3fn
    s = qe.scale.float().item()
    assert s == dt.fp8_encode(torch.tensor(5.0 / 6)).float().item()  # nearest e4m3, not a power of two
    assert (quant.dequant_fp4_e4m3(qe) - y).abs().max() <= 0.5 * s * 2 + 1e-6


def test_fp8_weight_block_scales_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 100, generator=g) * 0.05
    q = quant.quant_fp8_weight(w)
    assert q.scale.shape == (3, 4) and q.data.dtype == torch.float8_e4m3fn
    back = quant.dequant_fp8_weight(q.data, q.scale)
    assert (back - w).abs().max() <= w.abs().max() / 8  # e4m3 has 3 mantissa bits


def test_dtype_table():
    assert dt.dtype("fp4e2m1").packed == 2 and dt.dtype("fp4e2m1").nbytes(64) == 32
    assert dt.dtype("bf16").nbytes(3) == 6
    with pytest.raises(ValueError, match="unknown dtype"):
        dt.dtype("fp6")
