"""Values that enter the graph from outside: inputs, parameters and constants (Graph.input,
Graph.param and Graph.constant build them, as they also record names and initial values)."""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.graph import OpDef, register


def _source(inputs, attrs):
    shape, dtype = attrs["shape"], attrs["dtype"]
    if any(not isinstance(d, int) or d <= 0 for d in shape):
        raise GraphError(f"every dimension must be a positive integer, got shape {shape}")
    if dtype not in ("f32", "i32"):
        raise GraphError(f"unsupported dtype {dtype!r}; use 'f32' or 'i32'")
    return shape, dtype


def _constant(inputs, attrs):
    return attrs["shape"], attrs["dtype"]


register(OpDef("input", _source, "source"))
register(OpDef("param", _source, "source"))
register(OpDef("constant", _constant, "source"))
