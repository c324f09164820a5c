"""Target manifests, builds and the compile cache, on the CPU machine: Triton AOT for cc 90 and 100,
nvcc cubins with their ptxas report, Ascend rendering with capacity checks (bisheng is absent
here, so Ascend sources stay `unbuilt`)."""
import json
import shutil
import time

import pytest

from deepinfer.codegen import build as B
from deepinfer.codegen.instances import render_many
from deepinfer.codegen.targets import MANIFESTS, TARGETS, UnknownTargetError, get_manifest
from deepinfer.codegen.template import KernelSource, KernelSpec, select, templates
from deepinfer.ir.registry import get_op
from deepinfer.ir.types import quantized, tensor


def spec(op, ins, attrs):
    a = get_op(op).check_attrs(attrs)
    return KernelSpec(op, tuple(sorted(a.items())), tuple(ins), tuple(get_op(op).infer_types(ins, a)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    return B.CompileCache(tmp_path)


NORM_Q = spec("rms_norm_quant_fp8", [tensor("bf16", 64, 5120), tensor("bf16", 5120)], {"eps": 1e-20})
ROPE4 = spec("rope_quant_fp4", [tensor("bf16", 64, 32, 128), tensor("i32", 64)],
             {"rope_dim": 64, "theta": 160000.0, "yarn": [16, 65536, 32, 1], "block": 32, "scale": "ue8m0"})


def render(target, template, s):
    """As the compile driver renders: the template's default config, through the render cache."""
    return render_many([(template, s, templates()[template].default_config(target, s))], target)[0]


def test_one_manifest_per_target_with_its_pipeline():
    from deepinfer.passes.pipelines import pipeline

    assert set(MANIFESTS) == set(TARGETS)
    for name, m in MANIFESTS.items():
        assert m.target is TARGETS[name] and m.name == name
        assert [n for n, _ in pipeline(name, variant="decode")][-1] == "select_kernels"
        assert set(m.operand_formats) == set(MANIFESTS["sm90"].operand_formats)
    assert get_manifest("sm90").languages == ("cuda", "triton")
    assert get_manifest("ascend950").languages == ("ascendc",)
    # a target-specific pass is listed by its target alone
    assert [n for n, m in MANIFESTS.items() if "row_weight_scales" in m.passes] == ["ascend950"]
    with pytest.raises(UnknownTargetError, match="unknown target 'sm80'"):
        get_manifest("sm80")
    with pytest.raises(ValueError, match="unknown pipeline variant"):
        pipeline("sm90", variant="chunked")


def test_template_targets_come_from_the_manifests():
    """Templates name the language they render (and the defaults table they read), not targets."""
    assert all(set(t.targets) <= set(MANIFESTS) for t in templates().values())
    assert templates()["tilelang_gemm_fp8"].targets == ("sm90", "sm100")
    assert templates()["triton_rms_norm"].targets == ("sm90", "sm100")
    assert templates()["ascend_linear"].targets == ("ascend950",)
    assert templates()["torch_ref"].targets == ("cpu",)
    assert templates()["torch_device"].targets == ("sm90", "sm100", "ascend950")


def test_selection_prefers_the_target_templates():
    assert select(TARGETS["sm90"], NORM_Q).name == "triton_rms_norm_quant_fp8"
    assert select(TARGETS["sm100"], ROPE4).name == "triton_rope_quant_fp4"
    norm = spec("rms_norm", [tensor("bf16", 8, 5120), tensor("bf16", 5120)], {"eps": 1e-20})
    assert select(TARGETS["ascend950"], norm).name == "ascend_rms_norm"
    assert select(TARGETS["cpu"], norm).name == "torch_ref"


PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm_kernel' for 'sm_90a'
ptxas info    : Function properties for gemm_kernel
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers
"""


def test_ptxas_report_parsed():
    r = B.parse_ptxas_report(PTXAS)
    assert r["gemm_kernel"] == {"stack_bytes": 8, "spill_stores": 4, "spill_loads": 12, "registers": 168,
                                "barriers": 1, "smem_bytes": 1024}
    assert r["other"]["registers"] == 32 and r["other"]["spill_stores"] == 0


def test_cache_is_atomic_content_addressed_and_rejects_damage(cache):
    src = KernelSource("cuda", "k", "__global__ void k() {}")
    k90, k100 = B.cache_key(src, TARGETS["sm90"]), B.cache_key(src, TARGETS["sm100"])
    assert k90 != k100 and k90 == B.cache_key(src, TARGETS["sm90"])
    m = cache.put(k90, {"status": "built"}, {"cubin": ("k.cubin", b"\x7fELF")})
    assert open(m["files"]["cubin"], "rb").read() == b"\x7fELF"
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".")]  # no temporary left behind
    assert json.loads((cache.path(k90) / "meta.json").read_text())["status"] == "built"
    (cache.path(k90) / "k.cubin").unlink()
    assert cache.get(k90) is None  # a damaged entry is a miss, never a hit


def test_triton_aot_cc90_cc100_and_second_build_is_cached(cache):
    for name in ("sm90", "sm100"):
        b = get_manifest(name)
        srcs = [render(b.target, f"triton_{s.op}", s) for s in (NORM_Q, ROPE4)]
        res = B.build_for(b, srcs, cache=cache)
        for r in res:
            assert r.status == "built", r.reason
            (k,) = r.resources.values()
            assert k["n_regs"] > 0 and k["n_spills"] == 0 and "shared_bytes" in k
            launches = json.loads(open(r.files["launches"]).read())
            assert launches[0]["metadata"]["arch"] == name
            assert open(r.files["cubin0"], "rb").read()[:4] == b"\x7fELF"
            assert r.pdl and launches[0]["metadata"]["launch_pdl"]
            _assert_waits_first(open(r.files["ptx0"]).read())
        t0 = time.perf_counter()
        again = B.build_for(b, srcs, cache=cache)
        assert all(r.cached and r.pdl for r in again) and time.perf_counter() - t0 < 1.0


def test_parallel_triton_builds(cache):
    b = get_manifest("sm90")
    ops = [spec("moe_router", [tensor("f32", 64, 384), tensor("f32", 384)], {"k": 6, "scale": 1.5}),
           spec("hc_expand", [tensor("bf16", 64, 5120), tensor("bf16", 64, 4, 5120), tensor("f32", 64, 4),
                              tensor("f32", 64, 4, 4)], {})]
    srcs = [render(b.target, f"triton_{s.op}", s) for s in ops]
    # the first source twice: two instances that render the same text share one cache entry, which
    # one worker builds (two workers writing one entry raced, and one found it missing)
    res = B.build_for(b, srcs + srcs[:1], jobs=2, cache=cache)
    assert [r.status for r in res] == ["built", "built", "built"], [r.reason for r in res]
    assert res[2] is res[0] and not res[0].cached


def _assert_waits_first(ptx: str) -> None:
    """The entry's first instructions are the grid-dependency wait, then the trigger."""
    body = ptx[ptx.index(".entry"):]
    body = body[body.index("\n{\n") + 3:].splitlines()
    ins = [ln.strip() for ln in body if ln.strip() and not ln.strip().startswith(B._PTX_DECL)
           and not ln.strip().endswith(":")]
    assert ins[:2] == list(B.GRID_DEPENDENCY), ins[:4]
    assert ptx.count("griddepcontrol.wait;") == 1


def test_grid_dependency_goes_first_in_each_kernel():
    ptx = ".version 8.7\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n.reqntid 128\n{\n\t.reg .b32 \t%r<4>;\n" \
          "\t.reg .b64 \t%rd<2>;\n\n$L__func_begin0:\n\tld.param.u64 \t%rd1, [k_param_0];\n\tret;\n}\n"
    out = B.grid_dependency_ptx(ptx)
    _assert_waits_first(out)
    assert out.index("griddepcontrol.wait;") > out.index("%rd<2>")
    cu = B.grid_dependency_cuda(CUDA_SRC + CUDA_SRC.replace("scale_rows", "other"))
    assert cu.count('asm volatile("griddepcontrol.wait;') == 2
    assert cu.index("griddepcontrol.wait") < cu.index("__shared__ float buf")
    with pytest.raises(B.BuildError, match="without a __global__"):
        B.grid_dependency_cuda("__device__ float f(float x) { return x; }")


CUDA_SRC = """extern "C" __global__ void scale_rows(const float* x, float* y, int n) {
  __shared__ float buf[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  buf[threadIdx.x] = i < n ? x[i] : 0.f;
  __syncthreads();
  if (i < n) y[i] = 2.f * buf[threadIdx.x];
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_nvcc_cubin_with_ptxas_report(cache):
    b = get_manifest("sm90")
    (r,) = B.build_for(b, [KernelSource("cuda", "scale_rows", CUDA_SRC, grid=(4,), block=(256,))], cache=cache)
    assert r.status == "built", r.reason
    assert r.resources["scale_rows"]["smem_bytes"] == 1024 and r.resources["scale_rows"]["registers"] > 0
    assert open(r.files["cubin"], "rb").read()[:4] == b"\x7fELF"
    assert r.pdl and json.loads((cache.path(r.key) / "meta.json").read_text())["pdl"]
    (bad,) = B.build_for(b, [KernelSource("cuda", "broken", "__global__ void broken( {")], cache=cache)
    assert bad.status == "failed" and "nvcc failed on broken" in bad.reason and "\n" not in bad.reason


def test_cuda_capacity_checks():
    b = get_manifest("sm90")
    assert "shared memory" in b.check(KernelSource("cuda", "k", "", block=(128,), smem_bytes=300 * 1024), None)
    assert "threads per block" in b.check(KernelSource("cuda", "k", "", block=(2048,)), None)
    assert "registers" in b.check(KernelSource("cuda", "k", "", block=(1024,)), {"k": {"registers": 128}})


def test_ascend_render_capacity_checks_and_unbuilt_without_bisheng(cache):
    b = get_manifest("ascend950")
    norm = spec("rms_norm", [tensor("bf16", 4096, 5120), tensor("bf16", 5120)], {"eps": 1e-20})
    src = render(b.target, "ascend_rms_norm", norm)
    assert src.language == "ascendc" and "__global__" in src.text and "rms_norm_kernel" in src.text
    assert b.check(src, None) is None and src.grid == (64,)
    (r,) = B.build_for(b, [src], cache=cache)
    if shutil.which("bisheng"):
        assert r.status == "built", r.reason
    else:
        assert r.status == "unbuilt" and "bisheng" in r.reason
        assert open(r.files["source"]).read() == src.text
    too_big = KernelSource("ascendc", "k", "", grid=(8,), meta={"buffers": {"ub": [200 * 1024, 64 * 1024]}})
    assert "exceed" in b.check(too_big, None)
    assert "aligned" in b.check(KernelSource("ascendc", "k", "", grid=(1,), meta={"buffers": {"ub": [100]}}), None)
    assert "AI cores" in b.check(KernelSource("ascendc", "k", "", grid=(65,), meta={"buffers": {"l1": [64]}}), None)
    assert "l0c" in b.check(KernelSource("ascendc", "k", "", grid=(1,), meta={"buffers": {"l0c": [512 * 1024]}}), None)
    # a row whose bytes are not 32-byte granular is not supported (the template declines it)
    odd = spec("rms_norm", [tensor("bf16", 4, 24), tensor("bf16", 24)], {"eps": 1e-20})
    assert not templates()["ascend_rms_norm"].supports(TARGETS["ascend950"], odd)


def test_cuda_invalid_build_is_reported_not_cached(cache):
    b = get_manifest("sm90")
    (r,) = B.build_for(b, [KernelSource("cuda", "k", "x", block=(128,), smem_bytes=10**6)], cache=cache)
    assert r.status == "invalid" and "shared memory" in r.reason
    assert not cache.root.exists() or not any(cache.root.iterdir())


def test_swa_write_renders_the_newest_positions_only_for_more_rows_than_the_ring():
    b = get_manifest("sm100")

    def entries(rows):
        s = spec("swa_write", [quantized("fp8e4m3", (64, 128, 512), "e8m0", (1, 1, 32)),
                               quantized("fp8e4m3", (rows, 512), "e8m0", (1, 32)),
                               tensor("i32", rows), tensor("i32", rows), tensor("i32", 64)], {})
        src = render(b.target, "triton_swa_write", s)
        assert src.meta["kernels"][-1]["constexprs"]["L"] == 128
        return [k["entry"] for k in src.meta["kernels"]]

    assert entries(64) == entries(128) == ["ring_write_kernel"]
    assert entries(129) == ["seq_newest_kernel", "ring_write_kernel"]


def test_ascend_linear_renders_a_cube_gemm_within_capacity():
    """bf16 linears on ascend950 (router, LM head, the bf16 GEMMs) render a cube-core GEMM whose
    L1 / L0A / L0B / L0C plan passes the capacity check, at decode and prefill rows; rendered
    only, never run."""
    from deepinfer.codegen.library.ascend_gemm import gemm_plan

    b, t, tgt = get_manifest("ascend950"), templates()["ascend_linear"], TARGETS["ascend950"]
    router = spec("linear", [tensor("bf16", 1, 5120), tensor("bf16", 384, 5120)], {"compute": "f32", "out_dtype": "f32"})
    wide = spec("linear", [tensor("bf16", 4096, 5120), tensor("bf16", 4096, 5120)], {"compute": "bf16"})
    for s in (router, wide):
        assert select(tgt, s).name == "ascend_linear"
        src = render(tgt, t.name, s)
        assert src.language == "ascendc" and "linear_kernel" in src.text and "ascend_gemm_l1" in src.text
        assert b.check(src, None) is None
    # one decode row still spreads over the AI cores (narrow N tiles), a prefill takes them all
    assert render(tgt, t.name, router).grid == (24,) and render(tgt, t.name, wide).grid == (64,)
    assert gemm_plan(1, 384, 5120, t.default_config(tgt, router), tgt.cores)["block_M"] == 16
    # the plan the check reads grows with the tile: a 256x256 fp32 accumulator fills L0C, more fails
    assert "l0c" in b.check(KernelSource("ascendc", "k", "", grid=(1,), meta={"buffers": gemm_plan(
        4096, 4096, 5120, {"block_M": 256, "block_N": 512, "block_K": 64, "stages": 2}, 64)["buffers"]}), None)
    odd = spec("linear", [tensor("bf16", 4, 5120), tensor("bf16", 100, 5120)], {"compute": "f32"})
    fp8 = KernelSpec("linear", router.attrs, (tensor("bf16", 1, 5120), quantized("fp8e4m3", (384, 5120), "e8m0", (32, 32))),
                     router.out_types)
    assert not t.supports(tgt, odd) and not t.supports(tgt, fp8)


def test_ascend_fp8_gemm_is_an_mx_block_scaled_cube_gemm():
    """gemm_fp8 on ascend950 with per-row weight scales (the pipeline repeats the 32x32 block
    scales at load) renders TileLang-Ascend's block-scaled GEMM within capacity; weights still in
    32x32 blocks, or scale rows that are not whole 32-byte granules, are declined. Rendered only."""
    b, t, tgt = get_manifest("ascend950"), templates()["ascend_gemm_mxfp8"], TARGETS["ascend950"]

    def gemm(m, n, k, wblock=(1, 32)):
        return spec("gemm_fp8", [quantized("fp8e4m3", (m, k), "e8m0", (1, 32)), quantized("fp8e4m3", (n, k), "e8m0", wblock)],
                    {"out_dtype": "bf16"})

    for s in (gemm(1, 1280, 5120), gemm(4096, 4096, 5120)):
        assert select(tgt, s).name == "ascend_gemm_mxfp8"
        src = render(tgt, t.name, s)
        assert "gemm_fp8_kernel" in src.text and b.check(src, None) is None and src.grid == (64,)
        assert len(src.meta["buffers"]["l1"]) == 8  # A, B and both scale tiles, double-buffered
    assert not t.supports(tgt, gemm(64, 4096, 5120, (32, 32)))
    assert not t.supports(tgt, gemm(64, 32768, 1280))  # 40-byte scale rows


def test_quick_render_misses_stay_in_process_and_slow_ones_go_to_the_pool(cache, monkeypatch):
    """render_many renders quick misses (Triton templates, never cached) in its own process: a
    compile from the caches starts no process pool for them. Once its renders have taken
    IN_PROCESS_RENDER_S (a TileLang lowering takes seconds), the rest of the misses go to the pool."""
    from deepinfer.codegen import instances

    sm90 = TARGETS["sm90"]
    started = []

    class NoPool:
        def __init__(self, *a, **k):
            started.append(True)
            raise AssertionError("a process pool was started")

    monkeypatch.setattr(instances.cf, "ProcessPoolExecutor", NoPool)
    items = [("triton_rms_norm_quant_fp8", NORM_Q, templates()["triton_rms_norm_quant_fp8"].default_config(sm90, NORM_Q)),
             ("triton_rope_quant_fp4", ROPE4, templates()["triton_rope_quant_fp4"].default_config(sm90, ROPE4))]
    got = render_many(items, sm90, jobs=2)
    assert all(s is not None and s.language == "triton" for s in got) and not started
    # misses past the in-process budget go to the pool
    monkeypatch.setattr(instances, "IN_PROCESS_RENDER_S", 0.0)
    with pytest.raises(AssertionError, match="process pool was started"):
        render_many(items, sm90, jobs=2)
    assert started
