"""vkml/graph.pyi, what editors and type checkers read for vkml/graph.py, is the stub
tools/graph_stub.py makes of the code as it is: graph.py's definitions and a method for every
op method the ops attach (g.relu(x), x.sum(...))."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from vkml.graph import Graph, Tensor

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("graph_stub", REPO / "tools" / "graph_stub.py")
graph_stub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(graph_stub)


def test_the_graph_stub_is_current():
    assert graph_stub.STUB.read_text() == graph_stub.render(), (
        "vkml/graph.pyi is out of date (an op's builder or vkml/graph.py changed): run "
        "python tools/graph_stub.py")


def test_the_stub_declares_every_op_method():
    stub = ast.parse(graph_stub.STUB.read_text())
    declared = {c.name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)}
                for c in stub.body if isinstance(c, ast.ClassDef)}
    for cls in (Graph, Tensor):
        methods = {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
        assert methods - declared[cls.__name__] == set(), cls.__name__
    assert {"relu", "matmul", "conv2d", "cross_entropy"} <= declared["Graph"]
    assert {"relu", "sum", "reshape", "transpose"} <= declared["Tensor"]
