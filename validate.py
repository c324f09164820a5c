"""Argument checks shared by the engine, the compiler and the sampling parameters: one rule, one
message. An error's `param` names the argument it is about and its message starts with that name,
so the CLI can name its flag instead (`--max-num-seqs must be ...`, cli.py)."""
from __future__ import annotations


def param_error(error: type[Exception], param: str, message: str) -> Exception:
    """`error(f"{param} {message}")`, knowing its parameter."""
    e = error(f"{param} {message}")
    e.param = param
    return e


def check_positive_ints(error: type[Exception], **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise param_error(error, name, f"must be an integer >= 1, got {v!r}")
