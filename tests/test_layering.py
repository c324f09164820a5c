"""Layering rules, read from the source: target knowledge lives in the manifests
(codegen/targets/), so passes and templates never compare a target's name; and passes and codegen
do not import each other at module level (the one that needs the other imports it where it runs)."""
import ast
from pathlib import Path

import pytest

import deepinfer
from deepinfer.codegen.targets import TARGETS

ROOT = Path(deepinfer.__file__).parent
NAMES = set(TARGETS)


def _sources(*globs):
    return sorted(p for g in globs for p in ROOT.glob(g))


def _name_literals(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_name_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def name_comparisons(tree: ast.AST) -> list[str]:
    """`x == "sm90"`, `x in ("sm90", "sm100")`, `case "cpu":`: a comparison against a target's name."""
    hits = set()
    for node in ast.walk(tree):
        sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else (
            (node.value,) if isinstance(node, ast.MatchValue) else ())
        for side in sides:
            hits.update(f"line {node.lineno}: compares with {name!r}" for name in _name_literals(side))
    return sorted(hits)


def test_the_check_finds_a_name_comparison():
    tree = ast.parse('if target.name == "sm100" and k:\n    pass\nok = kind == "cuda"\nx = t in ("sm90", "sm100")\n'
                     'match t:\n    case "cpu":\n        pass')
    assert name_comparisons(tree) == ["line 1: compares with 'sm100'", "line 4: compares with 'sm100'",
                                      "line 4: compares with 'sm90'", "line 6: compares with 'cpu'"]


@pytest.mark.parametrize("path", _sources("codegen/library/*.py", "passes/*.py"), ids=lambda p: p.name)
def test_no_target_name_comparisons(path):
    assert name_comparisons(ast.parse(path.read_text())) == [], f"{path.relative_to(ROOT)}: read the manifest"


def module_level_imports(path: Path, package: str) -> list[str]:
    """Absolute names of the modules `path` imports when it is imported (function and class
    bodies and `if TYPE_CHECKING:` blocks excluded)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["deepinfer", *rel.parts]
    here = parts[:-1]  # the package a relative import starts from
    found = []

    def visit(stmts):
        for s in stmts:
            if isinstance(s, ast.Import):
                found.extend(a.name for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                base = here[:len(here) - s.level + 1] if s.level else []
                mod = ".".join([*base, *(s.module.split(".") if s.module else [])])
                found.extend([mod] + [f"{mod}.{a.name}" for a in s.names])
            elif isinstance(s, ast.If):
                if not (isinstance(s.test, ast.Name) and s.test.id == "TYPE_CHECKING"):
                    visit(s.body)
                visit(s.orelse)
            elif isinstance(s, (ast.Try, ast.With)):
                visit(s.body)
                for h in getattr(s, "handlers", []):
                    visit(h.body)
                visit(getattr(s, "orelse", []))
                visit(getattr(s, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return sorted({m for m in found if m == package or m.startswith(package + ".")})


def test_import_resolution():
    assert module_level_imports(ROOT / "passes" / "pipelines.py", "deepinfer.passes") == [
        "deepinfer.passes.attention", "deepinfer.passes.attention.lower_sparse_attention",
        "deepinfer.passes.fuse", "deepinfer.passes.fuse.fuse", "deepinfer.passes.fuse.fuse_attention_rope",
        "deepinfer.passes.fuse.fuse_collapse_norm_quant",
        "deepinfer.passes.fuse.fuse_combine_expand",
        "deepinfer.passes.fuse.fuse_decode",
        "deepinfer.passes.fuse.fuse_decode_linear_quant",
        "deepinfer.passes.fuse.fuse_decode_norm",
        "deepinfer.passes.fuse.fuse_decode_router_linear",
        "deepinfer.passes.fuse.fuse_gate_up_gemms", "deepinfer.passes.fuse.fuse_moe_shared",
        "deepinfer.passes.fuse.split_hc_pre",
        "deepinfer.passes.kernels", "deepinfer.passes.kernels.select_kernels",
        "deepinfer.passes.moe", "deepinfer.passes.moe.lower_moe_dispatch", "deepinfer.passes.moe.shard_tables",
        "deepinfer.passes.quant", "deepinfer.passes.quant.legalize_quant", "deepinfer.passes.quant.row_weight_scales",
        "deepinfer.passes.shapes", "deepinfer.passes.shapes.infer_shapes"]


@pytest.mark.parametrize("path", _sources("passes/*.py"), ids=lambda p: p.name)
def test_passes_do_not_import_codegen_at_module_level(path):
    assert module_level_imports(path, "deepinfer.codegen") == []


@pytest.mark.parametrize("path", _sources("codegen/*.py", "codegen/*/*.py"), ids=lambda p: str(p.relative_to(ROOT)))
def test_codegen_does_not_import_passes_at_module_level(path):
    assert module_level_imports(path, "deepinfer.passes") == []


def test_importing_the_passes_loads_no_codegen():
    import subprocess
    import sys

    code = ("import sys, deepinfer.passes.pipelines, deepinfer.passes.driver; "
            "print(sorted(m for m in sys.modules if m.startswith('deepinfer.codegen')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
