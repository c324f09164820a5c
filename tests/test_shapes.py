import pytest
import sympy

from deepinfer.ir import shapes as sh
from deepinfer.ir import tensor
from deepinfer.ir.registry import ShapeError, get_op
from deepinfer.ir.types import quantized


def test_symbols_are_positive_integers_and_unique():
    n = sh.sym("num_tokens")
    assert n is sh.num_tokens and n.is_integer and n.is_positive
    assert sympy.Max(n, 0) == n  # positivity lets sympy decide this


def test_simplification_collapses_to_ints():
    n = sh.num_tokens
    assert sh.dim(n * 4 / 4) == n
    assert sh.dim(n - n + 3) == 3 and isinstance(sh.dim(n - n + 3), int)
    assert sh.equal(2 * (n + 1), 2 * n + 2)
    assert not sh.equal(n, sh.num_seqs)


def test_substitution_and_evaluation():
    s = sh.shape([sh.num_tokens, 4 * sh.num_seqs, 7])
    assert sh.subs(s, {"num_tokens": 5}) == (5, 4 * sh.num_seqs, 7)
    assert sh.evaluate(s, {"num_tokens": 5, "num_seqs": 2}) == (5, 8, 7)
    with pytest.raises(ValueError, match="unbound size symbol"):
        sh.evaluate(s, {"num_tokens": 5})


def test_parse_and_print_dims():
    d = sh.parse_dim("4*num_tokens + 2")
    assert sh.dim_str(d) == "4*num_tokens+2"
    assert sh.parse_dim(sh.dim_str(d)) == d
    with pytest.raises(ValueError):
        sh.parse_dim("num_tokens +")


def test_bind_unifies_and_detects_conflicts():
    env = {}
    sh.bind(sh.shape([sh.num_tokens, 4]), (6, 4), env, "x")
    assert env == {"num_tokens": 6}
    with pytest.raises(ValueError, match="num_tokens is 6 elsewhere"):
        sh.bind(sh.shape([sh.num_tokens]), (7,), env, "y")
    with pytest.raises(ValueError, match="expected"):
        sh.bind(sh.shape([2 * sh.num_tokens]), (13,), env, "z")


def test_symbolic_shape_rules_of_ops():
    n = sh.num_tokens
    x, w = tensor("bf16", n, 256), tensor("bf16", 512, 256)
    (y,) = get_op("linear").infer_types([x, w], {})
    assert y.shape == (n, 512) and y.dtype.name == "bf16"
    (y32,) = get_op("linear").infer_types([x, w], {"out_dtype": "f32"})
    assert y32.dtype.name == "f32"
    with pytest.raises(ShapeError, match="input features"):
        get_op("linear").infer_types([tensor("bf16", n, 128), w], {})
    (c,) = get_op("concat").infer_types([tensor("bf16", n, 3), tensor("bf16", n, 5)], {"axis": -1})
    assert c.shape == (n, 8)
    (r,) = get_op("reshape").infer_types([tensor("bf16", n, 8)], {"shape": ["num_tokens", 2, 4]})
    assert r.shape == (n, 2, 4)
    with pytest.raises(ShapeError, match="cannot reshape"):
        get_op("reshape").infer_types([tensor("bf16", n, 8)], {"shape": ["num_tokens", 3]})
    (b,) = get_op("add").infer_types([tensor("f32", n, 1, 4), tensor("f32", 5, 4)], {})
    assert b.shape == (n, 5, 4)
    with pytest.raises(ShapeError, match="broadcast"):
        get_op("add").infer_types([tensor("f32", n, 3), tensor("f32", n, 4)], {})


def test_costs_are_sympy_expressions_over_sizes():
    n = sh.num_tokens
    x, w = tensor("bf16", n, 256), tensor("bf16", 512, 256)
    opdef = get_op("linear")
    c = opdef.cost([x, w], opdef.infer_types([x, w], {}), {})
    assert sympy.simplify(c.flops - 2 * n * 512 * 256) == 0
    assert sympy.simplify(c.bytes_read - (2 * 256 * n + 2 * 512 * 256)) == 0
    assert sympy.simplify(c.bytes_written - 2 * 512 * n) == 0
    assert c.subs({"num_tokens": 2}).flops == 2 * 2 * 512 * 256


def test_quantized_type_scale_shape_and_bytes():
    q = quantized("fp8e4m3", (70, 100), "e8m0", (32, 32))
    assert q.scale.shape == (3, 4)
    assert q.nbytes == 70 * 100 + 12
    f4 = quantized("fp4e2m1", (sh.num_tokens, 128), "e8m0", (1, 32))
    assert f4.data.storage_shape() == (sh.num_tokens, 64)
    assert sympy.simplify(f4.nbytes - (64 * sh.num_tokens + 4 * sh.num_tokens)) == 0
    with pytest.raises(ValueError):
        from deepinfer.ir.types import QuantType
        QuantType(tensor("fp8e4m3", 64, 64), tensor("e8m0", 1, 1), (32, 32))
