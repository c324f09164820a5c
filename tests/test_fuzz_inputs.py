"""Fuzzing the readers of user files (issue #17, Build 4): the IR text parser, the config reader
and the plan loader take mutated inputs and end in the project's own one-line errors (ParseError,
ConfigError, PlanError), never another exception. Counts: 300 inputs per reader in CI, 10,000 with
DEEPINFER_FUZZ_FULL=1 (scripts/fuzz.sh)."""
import json
import tempfile
import warnings
from pathlib import Path

from fuzzing import check_clean, fuzz_settings
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.ir.text import ParseError, parse_graph, print_graph
from deepinfer.models.config import PRESETS_DIR, ConfigError, ConfigWarning, config_from_dict, load_config
from deepinfer.runtime.plan_file import PlanError, canonical, load_plan, sha256, versions

CI, FULL = 300, 10_000

GRAPH = """\
graph fuzzed
  input %x : bf16[num_tokens,256]
  param %w : fp8e4m3[512,256]{e8m0[16,8],32x32}
  param %g : f32[256]
  state %ring : bf16[num_slots,16,128]
  # a comment
  %t0 = rms_norm(%x, %g) {eps=1e-20, name="n", flags=[1,2.5,true,null], lim=inf, low=-inf} : bf16[num_tokens,256]
  %a, %b = split(%t0) {sizes=[128,128]} : bf16[num_tokens,128], bf16[num_tokens,128]
  %c = matmul(%a, %w) : bf16[(num_tokens+1)//2,512]
  output %t0, %c
end
"""
# pieces the grammar gives meaning to, so that mutations reach past the first character
TOKENS = ["%", "=", ",", ":", "(", ")", "[", "]", "{", "}", "x", "\n", " ", "\"", "-", ".", "e", "0", "1", "9",
          "graph", "end", "input", "param", "state", "output", "bf16", "fp8e4m3", "e8m0", "nan", "inf", "//",
          "32x32", "1x1x32", "num_tokens", "\\u0000", "\x00", "é", "99999999999999999999"]


@st.composite
def mutated_text(draw, base: str):
    text = base
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        kind = draw(st.sampled_from(["delete", "insert", "replace", "duplicate"]))
        piece = draw(st.one_of(st.sampled_from(TOKENS), st.text(max_size=4)))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "insert":
            text = text[:i] + piece + text[i:]
        elif kind == "replace":
            text = text[:i] + piece + text[j:]
        else:
            text = text[:j] + text[i:j] + text[j:]
    return text


def test_regressions_found_by_fuzzing():
    with pytest.raises(ParseError) as e:  # was: sympy's tokenizer error over two lines
        parse_graph(GRAPH.replace("fp8e4m3[512,", "fp8e4m3[w : fp8e4m3[512,"))
    assert str(e.value) == "line 3, column 22: bad dim expression 'w : fp8e4m3[512'"
    with pytest.raises(ParseError, match=r"^line 2, column 19: bad dim expression 'n.um_tokens'$"):
        parse_graph(GRAPH.replace("bf16[num_tokens,256]", "bf16[n.um_tokens,256]", 1))  # was: AttributeError
    g = parse_graph(GRAPH.replace("(num_tokens+1)//2", "num_tokens%3"))  # was: printed as Mod(...), not parsed
    assert parse_graph(print_graph(g)) == g


def test_the_base_graph_parses():
    assert print_graph(parse_graph(GRAPH)) == print_graph(parse_graph(print_graph(parse_graph(GRAPH))))


@fuzz_settings(CI, FULL)
@given(mutated_text(GRAPH))
def test_ir_parser_takes_mutated_text(text):
    g = check_clean(lambda: parse_graph(text), ParseError)
    if g is not None:  # what parses prints to text that parses back (it did not: `%` printed as Mod(a,b))
        assert parse_graph(print_graph(g)) == g


# ---- config.json ---------------------------------------------------------------------------------

TINY = json.loads((PRESETS_DIR / "v4.1-flash-tiny" / "config.json").read_text())
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 40)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def key_paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from key_paths(v, prefix + (k,))


def parent_dict(data: dict, path: tuple):
    """The dict holding `path`'s last key (None where an earlier mutation left no dict there)."""
    parent = data
    for k in path[:-1]:
        parent = parent.get(k) if isinstance(parent, dict) else None
    return parent if isinstance(parent, dict) else None


@st.composite
def mutated_config(draw):
    data = json.loads(json.dumps(TINY))
    paths = list(key_paths(data))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(paths))
        parent = parent_dict(data, path)
        if parent is None:
            continue
        kind = draw(st.sampled_from(["delete", "set", "nudge"]))
        if kind == "delete":
            parent.pop(path[-1], None)
        elif kind == "nudge" and isinstance(parent.get(path[-1]), (int, list)):  # near-valid values
            v = parent[path[-1]]
            parent[path[-1]] = (v + draw(st.integers(-3, 3)) if isinstance(v, int) and not isinstance(v, bool)
                                else draw(st.lists(st.integers(-1, 12), max_size=len(v) + 2)) if isinstance(v, list) else v)
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return data


def read_config(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return config_from_dict(data)


@fuzz_settings(CI, FULL)
@given(mutated_config())
def test_config_reader_takes_mutated_configs(data):
    check_clean(lambda: read_config(data), ConfigError)


@fuzz_settings(CI // 3, FULL)
@given(mutated_text(json.dumps(TINY, indent=1)))
def test_config_reader_takes_mutated_files(text):
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            check_clean(lambda: load_config(d), ConfigError)


# ---- plan directories ----------------------------------------------------------------------------

def small_plan(root: Path) -> dict:
    """A plan directory as write_plan makes it (the loader reads the format, not the graphs)."""
    from deepinfer.codegen.plan import write_plan

    write_plan({"model": {"id": "m"}, "target": {"name": "cpu", "kind": "cpu"}, "versions": versions(),
                "options": {"max_num_seqs": 2}}, {"kernels/k0.py": b"# k0", "ir/step.ir": b"graph g\nend\n"}, root)
    return json.loads((root / "plan.json").read_text())


@st.composite
def mutated_plan_body(draw, body: dict):
    """A changed body whose own hash is made right again, so the checks past the hash are reached."""
    body = json.loads(json.dumps(body))
    body.pop("self_sha256")
    paths = list(key_paths(body))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        parent = parent_dict(body, path)
        if parent is not None:
            if draw(st.booleans()):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = draw(JSON_VALUES)
    if not isinstance(body, dict):
        return body
    body["self_sha256"] = sha256(canonical(body))
    return body


PLAN_ERRORS = (PlanError,)


@pytest.mark.parametrize("change,error", [  # each was a TypeError, AttributeError or KeyError
    (lambda b: b.update(files=None), "plan.json field 'files' is missing or malformed"),
    (lambda b: b.update(versions=[]), "plan.json field 'versions' is missing or malformed"),
    (lambda b: b.pop("target"), "plan.json field 'target' is missing or malformed"),
    (lambda b: b["target"].pop("name"), "plan.json names no target"),
    (lambda b: b["files"].update({"../x": "0"}), "../x is outside the plan directory"),
])
def test_plan_regressions_found_by_fuzzing(tmp_path, change, error):
    body = small_plan(tmp_path / "plan")
    body.pop("self_sha256")
    change(body)
    body["self_sha256"] = sha256(canonical(body))
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(body))
    with pytest.raises(PlanError) as e:
        load_plan(tmp_path / "plan", target="cpu")
    assert str(e.value) == f"plan {tmp_path / 'plan'}: {error}"


def test_plan_loader_takes_mutated_plans():
    with tempfile.TemporaryDirectory() as d:
        root = Path(d, "plan")
        body = small_plan(root)
        text = (root / "plan.json").read_text()

        @fuzz_settings(CI, FULL)
        @given(mutated_plan_body(body))
        def consistent(changed):
            (root / "plan.json").write_text(json.dumps(changed))
            check_clean(lambda: load_plan(root, target="cpu"), PLAN_ERRORS)

        @fuzz_settings(CI // 3, FULL)
        @given(mutated_text(text), st.binary(max_size=8))
        def damaged(changed, kernel):
            (root / "plan.json").write_text(changed, errors="surrogatepass")
            (root / "kernels/k0.py").write_bytes(kernel)
            check_clean(lambda: load_plan(root, target="cpu"), PLAN_ERRORS)

        consistent()
        damaged()
