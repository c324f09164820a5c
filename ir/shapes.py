"""Shapes whose dims are ints or sympy expressions over positive-integer symbols.

A plan serves buckets of sizes; the graph keeps those sizes symbolic (`num_tokens`, `num_seqs`,
`ctx_len`, ...) until a pass specialises them. Every symbol is declared a positive integer so that
sympy can simplify `(num_tokens*4)/4` and decide `Max(1, num_tokens)`.
"""
from __future__ import annotations

from functools import lru_cache, reduce
from typing import Iterable, Mapping, Union

import sympy

Dim = Union[int, sympy.Expr]

_SYMBOLS: dict[str, sympy.Symbol] = {}


def sym(name: str) -> sympy.Symbol:
    """The one positive-integer symbol called `name` (same object every call)."""
    if not name.isidentifier():
        raise ValueError(f"symbol name {name!r} is not an identifier")
    s = _SYMBOLS.get(name)
    if s is None:
        s = _SYMBOLS[name] = sympy.Symbol(name, integer=True, positive=True)
    return s


# The sizes a step graph is written over.
num_tokens = sym("num_tokens")  # tokens processed in one step, all sequences together
num_seqs = sym("num_seqs")  # sequences in one step
ctx_len = sym("ctx_len")  # longest context a step addresses
num_slots = sym("num_slots")  # per-sequence state slots of the cache manager


def dim(d) -> Dim:
    """Normalise a dim: ints stay ints, expressions are simplified and collapse to ints if constant."""
    if isinstance(d, sympy.Basic):
        return _simplified(d)
    if isinstance(d, bool):
        raise TypeError("a dim cannot be a bool")
    if isinstance(d, int):
        if d < 0:
            raise ValueError(f"negative dim {d}")
        return d
    if isinstance(d, str):
        return parse_dim(d)
    if isinstance(d, float):
        raise TypeError(f"a dim cannot be a float ({d})")
    return _simplified(sympy.sympify(d))


@lru_cache(maxsize=65536)
def _simplified(e: sympy.Basic) -> Dim:
    # graphs repeat the same few dims thousands of times; simplify is the slow part
    if e.is_Symbol:
        return e
    e = sympy.simplify(e)
    if e.is_Integer:
        return int(e)
    return e


def shape(dims: Iterable) -> tuple[Dim, ...]:
    return tuple(dim(d) for d in dims)


_DIM_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-*/%(), ")


@lru_cache(maxsize=65536)
def parse_dim(text: str) -> Dim:
    """Parse `4*num_tokens` etc.; unknown names become positive-integer symbols."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    # sympify evaluates its text: only the characters of integer arithmetic on names reach it (no
    # '.', so no attribute access: `n.um_tokens` raised AttributeError from inside the evaluation)
    if not _DIM_CHARS.issuperset(text):
        raise ValueError(f"bad dim expression {text!r}")
    try:
        expr = sympy.sympify(text, locals=_symbol_table(text), rational=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, AttributeError):
        # not sympy's message: it spans lines (the tokenizer's error after a preamble), and the
        # parser's errors are one line naming the place
        raise ValueError(f"bad dim expression {text!r}") from None
    if expr.free_symbols - set(_SYMBOLS.values()):
        raise ValueError(f"bad dim expression {text!r}")
    return dim(expr)


def _symbol_table(text: str) -> dict:
    import re

    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
    # Mod too: sympy prints `a % b` as Mod(a, b), and printed shapes must parse back
    allowed_funcs = {"Max": sympy.Max, "Min": sympy.Min, "floor": sympy.floor, "ceiling": sympy.ceiling,
                     "Mod": sympy.Mod}
    table = {n: sym(n) for n in names if n not in allowed_funcs}
    table.update({n: f for n, f in allowed_funcs.items() if n in names})
    return table


def dim_str(d: Dim) -> str:
    return str(d) if isinstance(d, int) else sympy.sstr(d).replace(" ", "")


def subs(dims: tuple[Dim, ...], env: Mapping) -> tuple[Dim, ...]:
    """Substitute symbols (by name or Symbol) with ints or expressions."""
    table = {(sym(k) if isinstance(k, str) else k): v for k, v in env.items()}
    return tuple(d if isinstance(d, int) else dim(d.xreplace(table)) for d in dims)


def numel(dims: tuple[Dim, ...]) -> Dim:
    return dim(reduce(lambda a, b: a * b, dims, 1))


def is_static(dims: tuple[Dim, ...]) -> bool:
    return all(isinstance(d, int) for d in dims)


def free_symbols(dims: tuple[Dim, ...]) -> set[sympy.Symbol]:
    out: set = set()
    for d in dims:
        if not isinstance(d, int):
            out |= d.free_symbols
    return out


def equal(a: Dim, b: Dim) -> bool:
    """Provably equal for every positive-integer value of the symbols."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def bind(dims: tuple[Dim, ...], concrete: tuple[int, ...], env: dict, what: str) -> None:
    """Unify a symbolic shape with a concrete one, extending `env` (name -> int); raise on conflict."""
    if len(dims) != len(concrete):
        raise ValueError(f"{what}: expected rank {len(dims)}, got shape {tuple(concrete)}")
    for d, c in zip(dims, concrete):
        if isinstance(d, int):
            if d != c:
                raise ValueError(f"{what}: expected {shape_str(dims)}, got {list(concrete)}")
        elif isinstance(d, sympy.Symbol):
            if env.setdefault(d.name, c) != c:
                raise ValueError(f"{what}: {d.name} is {env[d.name]} elsewhere but {c} here")
    # compound dims are checked once every plain symbol is bound
    for d, c in zip(dims, concrete):
        if not isinstance(d, (int, sympy.Symbol)):
            v = d.xreplace({sym(k): n for k, n in env.items()})
            if v.is_Integer and int(v) != c:
                raise ValueError(f"{what}: expected {shape_str(dims)} = {int(v)}, got {c}")


def evaluate(dims: tuple[Dim, ...], env: Mapping[str, int]) -> tuple[int, ...]:
    """Every dim as an int under `env` (name -> int); raises naming the unbound symbols."""
    table = {sym(k): v for k, v in env.items()}
    fast = []
    for d in dims:
        if isinstance(d, int):
            fast.append(d)
            continue
        v = d.xreplace(table)
        if not (isinstance(v, int) or v.is_Integer):
            break
        fast.append(int(v))
    else:
        return tuple(fast)
    out = subs(dims, env)
    if not is_static(out):
        missing = sorted(s.name for s in free_symbols(out))
        raise ValueError(f"unbound size symbol(s): {', '.join(missing)}")
    return out  # type: ignore[return-value]


def shape_str(dims: tuple[Dim, ...]) -> str:
    return "[" + ",".join(dim_str(d) for d in dims) + "]"
