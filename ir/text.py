"""The text form of a graph: `print_graph` and `parse_graph` round-trip to an equal graph.

    graph tiny
      input %x : bf16[num_tokens,256]
      param %w : fp8e4m3[512,256]{e8m0[16,8],32x32}
      state %ring : bf16[num_slots,16,128]
      %t0 = rms_norm(%x, %g) {eps=1e-20} : bf16[num_tokens,256]
      %a, %b = split(%t0) {sizes=[128,128]} : bf16[num_tokens,128], bf16[num_tokens,128]
      output %t0
    end

Attribute values are ints, floats, "strings", true/false/null and [lists]. A parse error names the
line and column. Lines starting with '#' are comments.
"""
from __future__ import annotations

import json
import math
import re

from . import dtypes as dt
from . import shapes as sh
from .graph import Graph, Node
from .types import QuantType, TensorType, Type


class ParseError(ValueError):
    pass


# ---- printing ---------------------------------------------------------------------------------

def _attr_str(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ",".join(_attr_str(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


# a type's text is sympy's printing of its dims, the bulk of a print; graphs share few types
_TYPE_TEXT: dict[Type, str] = {}


def _type_str(t: Type) -> str:
    s = _TYPE_TEXT.get(t)
    if s is None:
        s = str(t)
        if len(_TYPE_TEXT) < 100_000:
            _TYPE_TEXT[t] = s
    return s


def print_graph(g: Graph) -> str:
    lines = [f"graph {g.name}"]
    for kind, names in (("input", g.inputs), ("param", g.params), ("state", g.state)):
        lines += [f"  {kind} %{n} : {_type_str(g.types[n])}" for n in names]
    for n in g.nodes:
        outs = ", ".join(f"%{o}" for o in n.outputs)
        args = ", ".join(f"%{i}" for i in n.inputs)
        attrs = (" {" + ", ".join(f"{k}={_attr_str(v)}" for k, v in n.attrs) + "}") if n.attrs else ""
        types = ", ".join(_type_str(g.types[o]) for o in n.outputs)
        lines.append(f"  {outs} = {n.op}({args}){attrs} : {types}")
    if g.outputs:
        lines.append("  output " + ", ".join(f"%{o}" for o in g.outputs))
    lines.append("end")
    return "\n".join(lines) + "\n"


# ---- parsing ----------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_.@]*")
_WS = re.compile(r"[ \t]*")
# a graph repeats few type lists many times (the suite's round trips parse hundreds of graphs):
# the text after a line's ':' maps to its parsed types, which are frozen and safe to share
_TYPES_SEEN: dict[str, tuple[Type, ...]] = {}


class _Cursor:
    def __init__(self, text: str, line: int):
        self.s, self.i, self.line = text, 0, line

    def error(self, msg: str, at: int | None = None) -> ParseError:
        col = (self.i if at is None else at) + 1
        return ParseError(f"line {self.line}, column {col}: {msg}")

    def ws(self):
        self.i = _WS.match(self.s, self.i).end()

    def peek(self, tok: str) -> bool:
        self.ws()
        return self.s.startswith(tok, self.i)

    def accept(self, tok: str) -> bool:
        if self.peek(tok):
            self.i += len(tok)
            return True
        return False

    def expect(self, tok: str):
        if not self.accept(tok):
            got = self.s[self.i:self.i + 12] or "end of line"
            raise self.error(f"expected {tok!r}, found {got!r}")

    def name(self, what: str) -> str:
        self.ws()
        j = _NAME.match(self.s, self.i).end()
        if j == self.i:
            raise self.error(f"expected {what}")
        out, self.i = self.s[self.i:j], j
        return out

    def value_ref(self) -> str:
        self.expect("%")
        return self.name("a value name after '%'")

    def types_to_end(self) -> tuple[Type, ...]:
        """The comma-separated types that end the line."""
        self.ws()
        text = self.s[self.i:]
        hit = _TYPES_SEEN.get(text)
        if hit is not None:
            self.i = len(self.s)
            return hit
        types = [self.type_()]
        while self.accept(","):
            types.append(self.type_())
        self.done()
        if len(_TYPES_SEEN) < 100_000:
            _TYPES_SEEN[text] = tuple(types)
        return tuple(types)

    def done(self):
        self.ws()
        if self.i != len(self.s):
            raise self.error(f"unexpected text {self.s[self.i:self.i + 12]!r}")

    # types
    def tensor_type(self) -> TensorType:
        self.ws()
        start = self.i
        name = self.name("a dtype")
        try:
            dtype = dt.dtype(name)
        except ValueError as e:
            raise self.error(str(e), start) from None
        self.expect("[")
        dims = []
        if not self.accept("]"):
            while True:
                self.ws()
                j, depth = self.i, 0
                while j < len(self.s) and not (depth == 0 and self.s[j] in ",]"):
                    depth += {"(": 1, ")": -1}.get(self.s[j], 0)
                    j += 1
                if j == len(self.s):
                    raise self.error("unclosed '[' in a shape", start)
                try:
                    dims.append(sh.parse_dim(self.s[self.i:j]))
                except ValueError as e:
                    raise self.error(str(e)) from None
                self.i = j
                if self.accept("]"):
                    break
                self.expect(",")
        return TensorType(dtype, tuple(dims))

    def type_(self) -> Type:
        start = self.i
        data = self.tensor_type()
        if not self.accept("{"):
            return data
        scale = self.tensor_type()
        self.expect(",")
        self.ws()
        j = self.i
        while j < len(self.s) and (self.s[j].isdigit() or self.s[j] == "x"):
            j += 1
        try:
            block = tuple(int(b) for b in self.s[self.i:j].split("x"))
        except ValueError:
            raise self.error("expected a block shape such as 32x32") from None
        self.i = j
        self.expect("}")
        try:
            return QuantType(data, scale, block)
        except ValueError as e:
            raise self.error(str(e), start) from None

    # attributes
    def attr_value(self):
        self.ws()
        s, i = self.s, self.i
        if self.accept("["):
            items = []
            if not self.accept("]"):
                while True:
                    items.append(self.attr_value())
                    if self.accept("]"):
                        break
                    self.expect(",")
            return tuple(items)
        if s.startswith('"', i):
            dec = json.JSONDecoder()
            try:
                v, end = dec.raw_decode(s, i)
            except json.JSONDecodeError:
                raise self.error("bad string literal") from None
            self.i = end
            return v
        for word, v in (("true", True), ("false", False), ("null", None), ("nan", math.nan),
                        ("inf", math.inf), ("-inf", -math.inf)):
            if s.startswith(word, i) and not (i + len(word) < len(s) and s[i + len(word)].isalnum()):
                self.i = i + len(word)
                return v
        j = i
        while j < len(s) and s[j] in "0123456789+-.eE":
            j += 1
        tok = s[i:j]
        if not tok:
            raise self.error("expected an attribute value")
        self.i = j
        try:
            return int(tok)
        except ValueError:
            pass
        try:
            return float(tok)
        except ValueError:
            raise self.error(f"bad number {tok!r}", i) from None


def parse_type(text: str) -> Type:
    """A type in the text form, e.g. `fp8e4m3[num_slots,22,128]{e8m0[num_slots,22,4],1x1x32}`."""
    c = _Cursor(text, 1)
    t = c.type_()
    c.done()
    return t


def parse_graph(text: str) -> Graph:
    g: Graph | None = None
    ended = False
    lineno = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        c = _Cursor(line, lineno)
        if ended:
            raise c.error("text after 'end'")
        if g is None:
            c.expect("graph")
            g = Graph(c.name("a graph name"))
            c.done()
            continue
        c.ws()
        if c.accept("end"):
            c.done()
            ended = True
            continue
        if c.peek("output"):
            c.expect("output")
            g.outputs = [c.value_ref()]
            while c.accept(","):
                g.outputs.append(c.value_ref())
            c.done()
            continue
        for kind, add in (("input", g.add_input), ("param", g.add_param), ("state", g.add_state)):
            if c.peek(kind + " "):
                c.expect(kind)
                at = c.i
                name = c.value_ref()
                c.expect(":")
                types = c.types_to_end()
                if len(types) != 1:
                    raise c.error(f"one type expected after %{name}, found {len(types)}", at)
                t = types[0]
                if name in g.types:
                    raise c.error(f"%{name} is defined twice", at)
                add(name, t)
                break
        else:
            _parse_node(c, g)
    if g is None:
        raise ParseError(f"line {max(lineno, 1)}, column 1: expected 'graph NAME'")
    if not ended:
        raise ParseError(f"line {lineno + 1}, column 1: missing 'end'")
    return g


def _parse_node(c: _Cursor, g: Graph) -> None:
    c.ws()
    at = c.i
    outs = [c.value_ref()]
    while c.accept(","):
        outs.append(c.value_ref())
    c.expect("=")
    op = c.name("an op name")
    c.expect("(")
    ins = []
    if not c.accept(")"):
        ins.append(c.value_ref())
        while c.accept(","):
            ins.append(c.value_ref())
        c.expect(")")
    attrs = {}
    if c.accept("{"):
        if not c.accept("}"):
            while True:
                k = c.name("an attribute name")
                c.expect("=")
                attrs[k] = c.attr_value()
                if c.accept("}"):
                    break
                c.expect(",")
    c.expect(":")
    types = c.types_to_end()
    if len(types) != len(outs):
        raise c.error(f"{len(outs)} outputs but {len(types)} types", at)
    for o, t in zip(outs, types):
        if o in g.types:
            raise c.error(f"%{o} is defined twice", at)
        g.types[o] = t
    g.nodes.append(Node.make(op, ins, outs, attrs))
