"""Hardware ceilings measured in the same run as the kernels they judge: device copy bandwidth
(bytes read + written), the bf16 and fp8 matmul peaks at 8192^3. Shared by the kernel benches."""
import torch


def measure_ceilings(bench, dev="cuda") -> dict:
    out = {}
    x = torch.empty(1 << 30, device=dev, dtype=torch.uint8).random_(0, 255)  # 1 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))  # noqa: F821  bench calls it before the del below
    out["copy_bytes_per_s"] = 2 * x.numel() / (t * 1e-3)
    del x, y
    n = 8192
    a = torch.randn(n, n, device=dev).bfloat16()
    b = torch.randn(n, n, device=dev).bfloat16()
    t = bench(lambda: a @ b)
    out["bf16_flops"] = 2 * n ** 3 / (t * 1e-3)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    t = bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    out["fp8_flops"] = 2 * n ** 3 / (t * 1e-3)
    return out
