"""Render and build cache keys follow the code that decides their output: an edit of a shared
helper re-keys every template that imports it (transitively, relative and function-level imports
included), an edit of a Triton launcher re-keys nothing, an edit of the Triton kernels re-keys
every Triton instance. Edits are simulated through the source reader, never made in the tree."""
import ast
import dataclasses

import pytest

from deepinfer.codegen import build as B
from deepinfer.codegen import instances as I
from deepinfer.codegen.library import triton_ops
from deepinfer.codegen.targets import TARGETS
from deepinfer.codegen.template import KernelSpec, templates
from deepinfer.ir.types import tensor

from test_codegen_backends import spec

LIB = "deepinfer.codegen.library"
SM90 = TARGETS["sm90"]


NORM = spec("rms_norm", [tensor("bf16", 64, 5120), tensor("bf16", 5120)], {"eps": 1e-6})
ANY = KernelSpec("any", (), (), ())  # a render key hashes the spec's text only
TRITON = sorted(t for t in templates() if t.startswith("triton_"))


@pytest.fixture
def reader(monkeypatch):
    """edit(module, text): the render keys from now on see `text` as that module's source."""
    edits: dict[str, str] = {}
    real = I.read_module_source

    def read(name):
        src = real(name)
        return src._replace(text=edits[name]) if src is not None and name in edits else src

    monkeypatch.setattr(I, "read_module_source", read)
    I._module_code.cache_clear()

    def edit(module, text):
        edits[module] = text
        I._module_code.cache_clear()

    yield edit
    I._module_code.cache_clear()


def keys(names, spec_=ANY):
    return {t: I.render_key(t, spec_, {}, SM90) for t in names}


def test_closure_skips_type_checking_imports():
    """Imports under `if TYPE_CHECKING:` never run: the module they name is not in the closure
    (the build code was in every template's key through one such import), an `else` branch is."""
    fake = {
        "deepinfer.fake2": I.ModuleText("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n"
                                        "    from .hint import X\nif typing.TYPE_CHECKING:\n    from .hint2 import Y\n"
                                        "else:\n    from .real import Z\n", True),
        "deepinfer.fake2.hint": I.ModuleText("X = 1\n", False),
        "deepinfer.fake2.hint2": I.ModuleText("Y = 1\n", False),
        "deepinfer.fake2.real": I.ModuleText("Z = 1\n", False),
    }
    assert set(I.import_closure("deepinfer.fake2", fake.get)) == {"deepinfer.fake2", "deepinfer.fake2.real"}
    assert "deepinfer.codegen.build" not in I.import_closure("deepinfer.codegen.library.tilelang_gemm")


def test_closure_follows_transitive_relative_and_function_level_imports():
    fake = {
        "deepinfer.fake": I.ModuleText("from . import sub\n", True),
        "deepinfer.fake.sub": I.ModuleText("from . import leaf\n", True),  # relative to the package itself
        "deepinfer.fake.sub.leaf": I.ModuleText("LEAF = 1\n", False),
        "deepinfer.fake.helper": I.ModuleText("PASS_CONFIGS = {}\n", False),
        "deepinfer.fake.mid": I.ModuleText("import os\nfrom .helper import PASS_CONFIGS\n", False),
        "deepinfer.fake.a": I.ModuleText("from .mid import PASS_CONFIGS\n", False),
        "deepinfer.fake.b": I.ModuleText("def render():\n    from deepinfer.fake import helper\n", False),
        "deepinfer.fake.c": I.ModuleText("from ..fake.sub.leaf import LEAF\n", False),
        "deepinfer.fake.d": I.ModuleText("from deepinfer.fake import helper, VALUE\n", False),
    }
    assert set(I.import_closure("deepinfer.fake.a", fake.get)) == {
        "deepinfer.fake.a", "deepinfer.fake.mid", "deepinfer.fake.helper"}
    # a submodule taken from a package: the package's __init__ is not part of it
    assert set(I.import_closure("deepinfer.fake.b", fake.get)) == {"deepinfer.fake.b", "deepinfer.fake.helper"}
    # an attribute taken from a package: its __init__ (and what that imports) is
    assert set(I.import_closure("deepinfer.fake.d", fake.get)) == {
        "deepinfer.fake", "deepinfer.fake.sub", "deepinfer.fake.sub.leaf", "deepinfer.fake.d", "deepinfer.fake.helper"}
    assert set(I.import_closure("deepinfer.fake.c", fake.get)) == {"deepinfer.fake.c", "deepinfer.fake.sub.leaf"}
    before = {m: I.closure_hash(m, fake.get) for m in ("deepinfer.fake.a", "deepinfer.fake.b", "deepinfer.fake.c")}
    edited = dict(fake, **{"deepinfer.fake.helper": I.ModuleText("PASS_CONFIGS = {'x': 1}\n", False)})
    after = {m: I.closure_hash(m, edited.get) for m in before}
    assert after["deepinfer.fake.a"] != before["deepinfer.fake.a"]
    assert after["deepinfer.fake.b"] != before["deepinfer.fake.b"]
    assert after["deepinfer.fake.c"] == before["deepinfer.fake.c"]  # c does not import the helper
    with pytest.raises(LookupError, match="not a module of the deepinfer package"):
        I.import_closure("deepinfer.fake.absent", fake.get)


def test_a_target_table_edit_rekeys_only_that_targets_renders(reader):
    """codegen/targets/<name>.py is data: render keys carry it as Target.key(). Editing sm90's
    defaults re-keys sm90's renders (through the Target) and no template's code, so no tuning row
    of any target goes stale; a template's own module still re-keys it."""
    import dataclasses

    for name in ("sm90", "sm100", "ascend950", "cpu"):
        assert f"deepinfer.codegen.targets.{name}" in I._target_tables()
    code = {t: I._template_code(t) for t in ("triton_grouped_gemm_fp4", "tilelang_gemm_fp8", "ascend_lookup")}
    assert not any(m in I._target_tables() for t in code for m in I.import_closure(templates()[t].render.__module__))
    sm90 = I.read_module_source("deepinfer.codegen.targets.sm90").text
    assert '"gemv_rows": 8' in sm90
    reader("deepinfer.codegen.targets.sm90", sm90.replace('"gemv_rows": 8', '"gemv_rows": 16'))
    assert {t: I._template_code(t) for t in code} == code
    edited = dataclasses.replace(SM90, defaults=dict(SM90.defaults, triton_grouped_gemm_fp4={"gemv_rows": 16}))
    assert I.render_key("triton_grouped_gemm_fp4", ANY, {}, edited) != I.render_key("triton_grouped_gemm_fp4", ANY, {},
                                                                                    SM90)


def test_the_build_key_reads_the_machine_not_the_defaults_table():
    """A defaults edit reaches a build only through the source it renders: the same text builds
    from the cache under an edited table (a variant plan rebuilds only what it changed), while the
    machine's own fields (arch, capacity: the build's check reads them) still re-key it."""
    src = templates()["triton_rms_norm"].render(SM90, NORM, {})
    edited = dataclasses.replace(SM90, defaults=dict(SM90.defaults, triton_grouped_gemm_fp4={"gemv_rows": 16}))
    assert B.cache_key(src, edited) == B.cache_key(src, SM90)
    assert B.cache_key(src, dataclasses.replace(SM90, smem_bytes=SM90.smem_bytes - 1024)) != B.cache_key(src, SM90)
    assert B.cache_key(src, dataclasses.replace(SM90, arch="sm_90")) != B.cache_key(src, SM90)


def test_shared_tilelang_helper_edit_rekeys_every_template_using_it(reader):
    users = ["tilelang_gemm_fp8", "tilelang_sparse_attn", "tilelang_indexer_scores", "tilelang_grouped_gemm_fp4"]
    assert f"{LIB}.tilelang_gemm" in I.import_closure(templates()["tilelang_sparse_attn"].render.__module__)
    before = keys(users)
    assert before == keys(users)  # stable while nothing changes
    gemm = I.read_module_source(f"{LIB}.tilelang_gemm").text
    assert "PASS_CONFIGS" in gemm
    reader(f"{LIB}.tilelang_gemm", gemm.replace("PASS_CONFIGS", "PASS_CONFIGS_EDITED"))
    after = keys(users)
    assert all(after[t] != before[t] for t in users), [t for t in users if after[t] == before[t]]


def test_launcher_edit_rekeys_no_triton_render_or_build(reader):
    assert TRITON and not triton_ops.__dict__.get("triton_launchers")  # not imported at module level
    assert f"{LIB}.triton_launchers" not in I.import_closure(triton_ops.__name__)
    before = keys(TRITON)
    launchers = I.read_module_source(f"{LIB}.triton_launchers").text
    reader(f"{LIB}.triton_launchers", launchers + "\n# a comment in a launcher\ndef launch_new(x, *, cfg):\n    return x\n")
    assert keys(TRITON) == before
    # the build key reads only the rendered source, and what an instance ships is the kernels'
    # text alone: no launcher is defined in it
    src = templates()["triton_rms_norm"].render(SM90, NORM, {})
    assert src.text == I.read_module_source(f"{LIB}.triton_kernels").text
    shipped = {n.name for n in ast.parse(src.text).body if isinstance(n, ast.FunctionDef)}
    launcher_defs = {n.name for n in ast.parse(launchers).body if isinstance(n, ast.FunctionDef)}
    assert src.meta["launcher"] in launcher_defs and not shipped & launcher_defs
    assert B.cache_key(src, SM90) == B.cache_key(templates()["triton_rms_norm"].render(SM90, NORM, {}), SM90)


def test_triton_kernels_edit_rekeys_every_triton_render_and_build(reader, monkeypatch):
    before = keys(TRITON)
    kernels = I.read_module_source(f"{LIB}.triton_kernels").text
    edited = kernels + "\n# a changed kernel\n"
    reader(f"{LIB}.triton_kernels", edited)
    after = keys(TRITON)
    assert all(after[t] != before[t] for t in TRITON)
    src = templates()["triton_rms_norm"].render(SM90, NORM, {})
    monkeypatch.setattr(triton_ops, "kernels_source", lambda: edited)
    src_edited = templates()["triton_rms_norm"].render(SM90, NORM, {})
    assert src_edited.text == edited and src_edited.meta == src.meta
    assert B.cache_key(src_edited, SM90) != B.cache_key(src, SM90)
    # and the launch description and target enter it too
    k2 = dataclasses.replace(src, meta=dict(src.meta, kernels=[dict(src.meta["kernels"][0], num_warps=8)]))
    assert B.cache_key(k2, SM90) != B.cache_key(src, SM90) != B.cache_key(src, TARGETS["sm100"])


def test_an_edit_of_one_template_module_rekeys_no_other_templates_render(reader):
    """Registration imports every template module, but that is not part of any template's code:
    an edit of the Triton kernels leaves every TileLang render key as it was, and an edit of
    the TileLang attention module leaves the GEMM's."""
    tilelang = sorted(t for t in templates() if t.startswith("tilelang_"))
    before = keys(tilelang)
    reader(f"{LIB}.triton_kernels", I.read_module_source(f"{LIB}.triton_kernels").text + "\n# edited\n")
    assert keys(tilelang) == before
    reader(f"{LIB}.tilelang_attention", I.read_module_source(f"{LIB}.tilelang_attention").text + "\n# edited\n")
    after = keys(tilelang)
    assert after["tilelang_gemm_fp8"] == before["tilelang_gemm_fp8"]
    assert after["tilelang_sparse_attn"] != before["tilelang_sparse_attn"]


def _prelude_program(prelude: str):
    from deepinfer.codegen.library.tilelang_gemm import _tl

    _, T = _tl()

    @T.prim_func
    def add_one(A: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128, prelude=prelude) as _:
            for i in T.Parallel(128):
                A[i] = A[i] + T.float32(1)

    return add_one


def test_a_tilelang_lowering_is_kept_by_the_program_not_by_the_code_that_built_it(tmp_path, monkeypatch):
    """A second lowering of the same program (printed with its metadata) comes from the cache; a
    program that differs only in its prelude's text, or the same program under other pass
    configs, is lowered again."""
    pytest.importorskip("tilelang")
    from deepinfer.codegen.library import tilelang_gemm as tlg

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    calls = []
    real = tlg._lower
    monkeypatch.setattr(tlg, "_lower", lambda *a: calls.append(a[1:]) or real(*a))
    a = tlg.lower(_prelude_program("// prelude a"), "sm_90a")
    b = tlg.lower(_prelude_program("// prelude b"), "sm_90a")
    assert len(calls) == 2 and "// prelude a" in a["src"] and "// prelude b" in b["src"]
    again = tlg.lower(_prelude_program("// prelude a"), "sm_90a")
    assert len(calls) == 2 and again == a and isinstance(again["grid"], tuple)
    tlg.lower(_prelude_program("// prelude a"), "sm_90a", {"tl.disable_vectorize_256": True})
    tlg.lower(_prelude_program("// prelude a"), "sm_100a")
    assert len(calls) == 4
    assert len(list((tmp_path / "lowered").iterdir())) == 4
