"""The graph IR: dtypes, symbolic shapes, types, nodes and graphs, the op registry, the verifier,
the text form and the interpreter."""
from . import dtypes, quant, shapes
from .graph import Graph, Node
from .interp import InterpretError, interpret
from .registry import Cost, OpDef, ShapeError, all_ops, get_op, op
from .text import ParseError, parse_graph, parse_type, print_graph
from .types import QuantType, TensorType, Type, quantized, tensor
from .verify import VerifyError, verify

__all__ = [
    "dtypes", "quant", "shapes", "Graph", "Node", "InterpretError", "interpret", "Cost", "OpDef",
    "ShapeError", "all_ops", "get_op", "op", "ParseError", "parse_graph", "parse_type", "print_graph", "QuantType",
    "TensorType", "Type", "quantized", "tensor", "VerifyError", "verify",
]
