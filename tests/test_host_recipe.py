"""Host recipes (codegen/host_recipe.py records, runtime/host_recipe.py replays): a recipe recorded
on meta tensors and replayed on real ones does exactly what the host code does.

- Every Triton launcher: recorded at a check case's shapes, the recipe (through JSON) replayed
  under the Triton interpreter with the JIT kernels gives the launcher's own outputs bit for bit,
  and those outputs agree with the op's reference (triton_check's rule: the templates' interpreted
  check, made here from the same launch). Triton fixes interpretation when it is first imported,
  so this runs in fresh processes, the cases in a few chunks that the test workers share.
- Every TileLang host: the replay binds the same buffers (shapes, dtypes, values) to the same
  launches and returns the same outputs as the host, with a stand-in kernel that writes its
  outputs deterministically.
- A launch the instance did not render, or over another grid, is refused at compile time."""
import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.codegen import host_recipe as hr
from deepinfer.codegen.library import tilelang_host as th
from deepinfer.ir.quant import QTensor
from deepinfer.runtime.host_recipe import HostRecipe


_meta = hr._like  # a meta tensor of the same layout (of a real or a meta tensor)


def _equal(a, b) -> bool:
    if isinstance(a, QTensor) or isinstance(b, QTensor):
        return _equal(a[0], b[0]) and _equal(a[1], b[1])
    if isinstance(a, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                                if b.dtype.itemsize == 1 else b))
    return a == b


# ---- Triton launchers, in an interpreter process ------------------------------------------------

def _per_output(out) -> tuple:
    return tuple(out) if isinstance(out, tuple) and not isinstance(out, QTensor) else (out,)


def _group(out, quantised) -> tuple:
    """A launcher's result as one value per op output (a quantised output comes as data, scale)."""
    flat, res = list(_per_output(out)), []
    for q in quantised:
        v = flat.pop(0)
        res.append(QTensor(v, flat.pop(0)) if q and not isinstance(v, QTensor) else v)
    return tuple(res)


def _triton_worker(cases):
    """Runs in a TRITON_INTERPRET=1 process: one JSON line, case -> {"reference": None or how the
    launcher's outputs differ from the op's reference, "replay": None or how the replayed recipe's
    differ from the launcher's}."""
    from deepinfer.codegen.library import triton_check as tc
    from deepinfer.codegen.library import triton_kernels, triton_launchers, triton_ops

    dims = dict(tc.TINY)
    # the _long combine cases past a search limit of 64 pairs, not 1024: the same inverse-permutation
    # path at 22 token rows instead of 342 (each an interpreted program; 155 s of the 215 s all cases
    # took). The GPU suite (tests/gpu/test_triton_ops.py) runs them at the real limit.
    triton_ops.COMBINE_SCAN_MAX = 64
    out = {}
    for case in cases:
        op = tc.case_op(case)
        verdict = out[case] = {"reference": "not run", "replay": "not run"}
        try:
            ins, attrs = tc.make_case(case, dims, dims["n"])
            cfg = dict(triton_ops.default_config(op, dims["n"]), **{k: v for k, v in tc.SMALL_BLOCKS.items()
                                                                   if k in triton_ops.default_config(op)})
            kw = triton_ops.launch_attrs(op, attrs)
            launcher = getattr(triton_launchers, triton_ops.LAUNCHERS[op])
            want = launcher(*[tc.clone_value(v) for v in ins], **kw, cfg=cfg)
            verdict["reference"] = tc.check_outputs(case, ins, attrs, want)
            # the launches the template makes at this case, as a render records them
            seen = []

            class Spy:
                def bind(self, fn):
                    class K:
                        def __getitem__(self, grid):
                            def go(*args, **k):
                                names = fn.arg_names
                                sig = {a: ("constexpr" if i >= len(args) else
                                           ("*u8" if isinstance(args[i], torch.Tensor) else "i32"))
                                       for i, a in enumerate(names)}
                                launch = {"entry": fn.__name__, "grid": [int(g) for g in grid], "signature": sig,
                                          "constexprs": {a: k[a] for a in names if sig[a] == "constexpr"},
                                          "num_warps": k.get("num_warps", 4)}
                                if launch not in seen:
                                    seen.append(launch)
                            return go
                    return K()
            with triton_launchers.aot_kernels(Spy()):
                launcher(*[tc.clone_value(v) for v in ins], **kw, cfg=cfg)
            if case.startswith("moe_combine") and case.endswith("_long") and \
                    "inverse_perm_kernel" not in [ln["entry"] for ln in seen]:
                verdict["reference"] = "the _long case searched its pairs instead of reading the inverse permutation"
            kernel = {"template": f"triton_{op}", "meta": {"kernels": seen, "launch_attrs": kw, "config": cfg}}
            from deepinfer.ir.registry import get_op

            ref = get_op(op).ref(*[tc.clone_value(v) for v in ins], **attrs)
            quantised = [isinstance(r, QTensor) for r in _per_output(ref)]
            with torch.device("meta"):
                rec, _ = hr.record_triton(launcher, kernel, [_meta(v) for v in ins], quantised)
            rec = json.loads(json.dumps(rec))

            def launch(i, grid, args, seen=seen):
                ln = seen[i]
                fn = getattr(triton_kernels, ln["entry"])
                names = [a for a in fn.arg_names if ln["signature"][a] != "constexpr"]
                fn[tuple(grid)](**dict(zip(names, args)), **ln["constexprs"], num_warps=ln["num_warps"])
            got = HostRecipe(rec, launch, torch.device("cpu"), case)(*[tc.clone_value(v) for v in ins])
            want_t = _group(want, quantised)
            same = len(got) == len(want_t) and all(_equal(a, b) for a, b in zip(got, want_t))
            verdict["replay"] = None if same else f"outputs differ ({len(got)} vs {len(want_t)})"
        except Exception as e:  # noqa: BLE001  (reported per case)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            verdict.update({k: why for k, v in verdict.items() if v == "not run"})
    print(json.dumps(out))


CHUNKS = 3  # the cases in this many processes, so that the two test workers share them


def _chunk(i: int) -> list[str]:
    from deepinfer.codegen.library import triton_check

    return triton_check.CASES[i::CHUNKS]


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_triton_template_matches_its_reference_and_replays_from_its_recipe(chunk):
    pytest.importorskip("triton")
    cases = _chunk(chunk)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", "import runpy; runpy.run_path(%r, run_name='__recipe_worker__')"
                        % __file__, *cases], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    got = json.loads(lines[-1])
    assert set(got) == set(cases)
    bad = {k: v for k, v in got.items() if v["reference"] is not None or v["replay"] is not None}
    assert not bad, bad


def test_the_chunks_cover_every_case_once():
    from deepinfer.codegen.library import triton_check

    together = [c for i in range(CHUNKS) for c in _chunk(i)]
    assert sorted(together) == sorted(triton_check.CASES) and len(together) == len(set(together))


# ---- TileLang hosts -----------------------------------------------------------------------------

_OUT_PARAMS = {"C", "O", "OP", "ML", "S"}


def _fake_kernel(calls):
    """A stand-in kernel: records its buffers, writes its outputs as a function of their shape."""
    def launch(i, grid, args, names):
        for n, a in zip(names, args):
            if n in _OUT_PARAMS:
                a.copy_((torch.arange(a.numel(), dtype=torch.float32).reshape(a.shape) % 7).to(a.dtype))
        calls.append((i, list(grid), [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
    return launch


def _tilelang_case(host, inputs, attrs, config, meta, grids):
    # the parameter lists a lowering would give: the buffers the host binds, sorted by name
    names = []
    host(lambda i, **b: names.append((i, sorted(b))), tuple(_meta(v) for v in inputs), attrs, config, meta)
    params = [[[n, "void*"] for n in ns] for _, ns in sorted(dict(names).items())]
    kernel = {"template": host.__name__, "grid": grids[0], "config": config,
              "meta": dict(meta, params=params[0])}
    if len(params) > 1:
        kernel["meta"]["combine"] = {"params": params[1], "grid": grids[1]}
    quantised = [False]
    with torch.device("meta"):
        rec, outs = hr.record_tilelang(host, kernel, [_meta(v) for v in inputs], attrs, quantised)
    direct_calls, replay_calls = [], []
    fk = _fake_kernel(direct_calls)
    want = host(lambda i, **b: fk(i, grids[i], [b[n] for n, _ in params[i]], [n for n, _ in params[i]]),
                tuple(inputs), attrs, config, meta)
    fk2 = _fake_kernel(replay_calls)
    got = HostRecipe(json.loads(json.dumps(rec)), lambda i, grid, args: fk2(i, grid, args, [n for n, _ in params[i]]),
                     torch.device("cpu"), host.__name__)(*inputs)
    assert len(direct_calls) == len(replay_calls) >= 1
    for (i, g, a), (j, h, b) in zip(direct_calls, replay_calls):
        assert (i, g) == (j, h)
        assert all(_equal(x, y) for x, y in zip(a, b))
    assert _equal(got[0], want) and outs[0].shape == want.shape
    return rec


def _q(shape, block=32, dtype=torch.float8_e4m3fn):
    data = torch.randn(shape).clamp(-4, 4).to(dtype)
    return QTensor(data, torch.randint(120, 130, shape[:-1] + (shape[-1] // block,), dtype=torch.uint8))


@pytest.mark.parametrize("split_k", [1, 2])
def test_gemm_fp8_recipe_pads_rows_and_binds_by_name(split_k):
    torch.manual_seed(0)
    x = _q((3, 256))
    w = QTensor(torch.randn(128, 256).to(torch.float8_e4m3fn), torch.randint(120, 130, (4, 8), dtype=torch.uint8))
    rec = _tilelang_case(th.host_gemm_fp8, [x, w], {"out_dtype": "bf16"}, {"split_k": split_k},
                         {"mnk": [64, 128, 256]}, [[2, 1, 1]])
    ops = [s["op"] for s in rec["steps"] if "op" in s]
    assert ("aten.zeros.default" in ops) == (split_k > 1) or "aten.zeros.default" in ops  # padding zeroes rows


def test_grouped_gemm_and_attention_recipes_match_their_hosts():
    torch.manual_seed(0)
    e, n, k, rows = 4, 64, 128, 6
    x = _q((rows, k))
    w = QTensor(torch.randint(0, 255, (e, n, k // 2), dtype=torch.uint8),
                torch.randint(120, 130, (e, n, k // 32), dtype=torch.uint8))
    offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    _tilelang_case(th.host_grouped_gemm_fp4, [x, w, offsets], {}, {}, {"dims": {"rows": 8}}, [[1, e, 1]])
    # window attention with a split (two kernels: the attention and its combine)
    nq, h, d = 2, 4, 64
    q = torch.randn(nq, h, d).to(torch.bfloat16)
    kv = _q((nq, d))
    ring = _q((3, 8, d))
    sink = torch.randn(h)
    pos, tseq, slots = torch.tensor([3, 5]), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1],
                                                                                                  dtype=torch.int32)
    rec = _tilelang_case(th.host_attention, [q, kv, ring, sink, pos, tseq, slots], {}, {"splits": 2}, {},
                         [[1, 2, 1], [1, 1, 1]])
    # the buffers a window call's kernel declares and never reads are constants, not fills every call
    assert [s["op"] for s in rec["steps"] if "op" in s and not s["op"].startswith("aten.empty")] == []
    # with the RoPEs folded in (fuse_attention_rope): both kernels get the positions and the
    # frequencies, a constant of the recipe with the op's values
    rope = {"rope_dim": 16, "rope_theta": 10000.0, "rope_yarn": [16, 65536, 32, 1]}
    rec = _tilelang_case(th.host_attention, [q, kv, ring, sink, pos, tseq, slots], rope, {"splits": 2}, {},
                         [[1, 2, 1], [1, 1, 1]])
    from deepinfer.ir.ops.attention import yarn_freqs

    want = yarn_freqs(16, 10000.0, (16, 65536, 32, 1)).tolist()
    assert [c["values"] for c in rec["consts"].values() if c["shape"] == [8]] == [want]


def test_a_launch_the_instance_did_not_render_is_refused():
    from deepinfer.codegen.library import triton_launchers as tl

    def rendered(rows, grid):
        return {"entry": "quant_fp8_kernel", "constexprs": {"N": 64, "BLOCK": 1024, "BLK": 32, "NR": rows, "ROWS": 1},
                "grid": grid, "signature": {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "N": "constexpr",
                                            "BLOCK": "constexpr", "BLK": "constexpr", "NR": "constexpr",
                                            "ROWS": "constexpr"}}

    def kernel(cfg, rows=3, grid=(3, 1)):
        return {"template": "triton_quant_fp8", "meta": {"kernels": [rendered(rows, list(grid))],
                                                          "launch_attrs": {"block": 32}, "config": cfg}}
    x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    cfg = {"BLOCK": 1024, "ROWS": 1, "num_warps": 4, "num_stages": 1}
    with torch.device("meta"):
        rec, _ = hr.record_triton(tl.launch_quant_fp8, kernel(cfg), [x], [True])
        assert [s["launch"] for s in rec["steps"] if "launch" in s] == [0]
        with pytest.raises(hr.RecipeError, match="not rendered"):
            hr.record_triton(tl.launch_quant_fp8, kernel(dict(cfg, BLOCK=512)), [x], [True])
        with pytest.raises(hr.RecipeError, match="not rendered"):  # another row count: another NR
            hr.record_triton(tl.launch_quant_fp8, kernel(cfg), [torch.empty(5, 64, dtype=torch.bfloat16,
                                                                              device="meta")], [True])
        with pytest.raises(hr.RecipeError, match="grid"):  # the kernel rendered, launched on another grid
            hr.record_triton(tl.launch_quant_fp8, kernel(cfg, rows=5), [torch.empty(5, 64, dtype=torch.bfloat16,
                                                                                      device="meta")], [True])


def test_constants_travel_in_the_recipe_and_strides_are_checked():
    """A real tensor a host makes (hash primes) is stored by value; an input with other strides
    than recorded is refused at its first replay."""
    def host(rec):
        x = inputs[0]
        primes = torch.tensor([3, 5, 7], dtype=torch.int64, device="cpu").to(x.device)
        return x + primes
    inputs = [torch.empty(2, 3, dtype=torch.int64, device="meta")]
    with torch.device("meta"):
        rec, _ = hr.record(host, inputs, [False])
    rec = json.loads(json.dumps(rec))
    assert list(rec["consts"].values())[0]["values"] == [3, 5, 7]
    r = HostRecipe(rec, None, torch.device("cpu"), "t")
    assert torch.equal(r(torch.ones(2, 3, dtype=torch.int64))[0], torch.tensor([[4, 6, 8], [4, 6, 8]]))
    from deepinfer.runtime.plan_file import PlanError

    with pytest.raises(PlanError, match="strides"):
        HostRecipe(rec, None, torch.device("cpu"), "t")(torch.ones(3, 2, dtype=torch.int64).t())


if __name__ == "__recipe_worker__":
    _triton_worker(sys.argv[1:])
