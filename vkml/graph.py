"""The typed static graph, the IR every later stage consumes, and the registry of ops.

A `Graph` is an append-only list of `Tensor` nodes. Each node records its op (a key into `OPS`),
its inputs, its static shape and dtype, and the op's attributes. Shapes and dtypes are checked
when a node is built, so a mistake is reported at the line that made it, naming both operands,
and never surfaces later as a wrong kernel.

This module knows no particular op. Each op is defined once, in a family module of vkml/ops/:
`register(OpDef(...))` gives its shape rule, gradient, lowering and the facts the passes read,
and `@builder` attaches the method that builds it (`g.relu(x)`, and `x.relu()` where the op has
a tensor form). Editors and type checkers see those methods in vkml/graph.pyi, which
tools/graph_stub.py generates (tests/test_graph_stub.py says when it is out of date).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol

import numpy as np

from vkml.errors import GraphError
from vkml.expr import Body, Expr, broadcast_strides

if TYPE_CHECKING:
    from vkml.hal import Capabilities, Kernel

DType = Literal["f32", "i32"]
Shape = tuple[int, ...]
# How later stages treat an op: "source" (inputs, parameters, constants: no kernel), "view"
# (shares its input's storage: no kernel), "pointwise" (an expression per element: fusable and
# lowered by the pointwise generator), "kernel" (lowered by the op's own `lower`).
Kind = Literal["source", "view", "pointwise", "kernel"]

InferRule = Callable[[list["Tensor"], dict[str, Any]], tuple[Shape, DType]]
GradRule = Callable[["Graph", "Tensor", "Tensor"], Sequence[Optional["Tensor"]]]
Lowering = Callable[["Tensor", "Capabilities"], "Kernel"]


@dataclass(frozen=True)
class OpDef:
    """Everything later stages need to know about an op (like a JAX primitive's rules)."""

    name: str
    infer: InferRule  # shape and dtype of the result; raises GraphError naming the problem
    kind: Kind
    grad: GradRule | None = None  # input gradients from other ops; None: not differentiable
    lower: Lowering | None = None  # "kernel" ops: the dispatch's kernel (bindings: inputs, out)
    # "pointwise" ops: the result as an expression of the inputs' elements (vkml/expr.py) and,
    # when not numpy broadcasting, per input the element stride of each output axis.
    expr: Callable[[Tensor], Expr] | None = None
    strides: Callable[[Tensor], list[Shape]] | None = None
    # "kernel" ops that are products summing over a long axis: into how many partial sums the
    # split stage (compiler/split.py) cuts a node on a device (Capabilities); above 1 the node
    # gets attribute "splits", its result a leading axis of that length, and a sum follows.
    splits: Callable[[Tensor, Capabilities], int] | None = None
    # The facts the other passes read (none of them keeps a list of op names):
    # `indexes`: an op that selects with an i32 input: (which input, its valid [first, end) for
    # the node, what it indexes). Values outside it, which PyTorch raises on, are refused
    # wherever they come from: by set_input, at compile for constants, else by a check on the
    # GPU read after the step (vkml/ops/indexing.py, "index checks": all a new op needs).
    indexes: Callable[[Tensor], tuple[int, int, int, str]] | None = None
    # `index_range`: an op whose i32 result lies in [low, end) by construction (argmax, argsort:
    # positions along an axis); an index operand it computes (through views) within the
    # operand's valid range needs no check.
    index_range: Callable[[Tensor], tuple[int, int]] | None = None
    # `fusion`: how the rewrite (compiler/rewrite.py) fuses pointwise ops into this op's
    # kernel. "product": its stores take a pointwise epilogue (inputs a, b, then the
    # epilogue's); "sum": its summand (a prologue) and its result (an epilogue) may be
    # pointwise computations. `fused` names the op it becomes with them (itself once fused);
    # `unfused`, a fused op's plain one (compiler/split.py cuts a split product back to it,
    # its sum taking over the epilogue).
    fusion: Literal["product", "sum"] | None = None
    fused: str | None = None
    unfused: str | None = None
    # `scaled`: a product whose f16 kernel may scale its operands into f16's range
    # (compiler/scale.py): whether it does for the node on the (backward pass's) target.
    scaled: Callable[[Tensor, Capabilities], bool] | None = None
    # `composes`: a composition of other ops that this op computes in one kernel: at a node,
    # the composition it ends (or None), given the graph's constants and the target
    # (compiler/compose.py puts this op in its place).
    composes: Callable[[Tensor, dict[int, np.ndarray], Capabilities], Composition | None] | None \
        = None
    # `training_only`: an op that acts in training steps alone (dropout): compiled without a
    # loss, a node of it is its first input (compiler/stages.py), so that inference plans are
    # those of the graph without it.
    training_only: bool = False
    # `layouts`: in an inference (a graph compiled without a loss), the layout ops a node's
    # kernel reads its inputs through on the target: per input None (as it is) or (op,
    # attributes) of a one-input op that copies it so, and the node's attributes then; None
    # where it reads them as they are (compiler/layouts.py inserts the copies).
    layouts: Callable[[Tensor, Capabilities],
                      tuple[tuple[tuple[str, dict[str, Any]] | None, ...], dict[str, Any]] | None
                      ] | None = None
    # `stores`: whether a node's kernel can write its result in the layout that the layout op
    # named makes, in place of such a copy of it as its only reader (node attribute "store";
    # compiler/layouts.py `store_layouts`).
    stores: Callable[[Tensor, str], bool] | None = None


class Composition(Protocol):
    """What an op's `composes` rule found at a node: a composition of other ops that the op
    computes in one kernel."""

    # The nodes inside the composition: replaced only where nothing else reads them.
    interior: tuple[Tensor, ...]

    def takes_reader(self, reader: Tensor) -> bool:
        """Whether the one kernel also computes `reader`, the composition's only reader (a
        layout change it can write directly)."""
        ...

    def replacement(self, node: Tensor, with_reader: bool
                    ) -> tuple[str, list[Tensor], Shape, dict[str, Any]]:
        """The op, inputs (nodes of the graph matched), shape and attributes of the node that
        replaces `node` (and its reader, `with_reader`)."""
        ...


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op '{op.name}' is defined twice")
    if (op.kind == "pointwise") != (op.expr is not None) or (op.kind == "kernel") != (
            op.lower is not None):
        raise ValueError(f"op '{op.name}': a pointwise op needs `expr`, a kernel op `lower`")
    if (op.fusion is not None) != (op.fused is not None):
        raise ValueError(f"op '{op.name}': an op that fuses (`fusion`) names the op it becomes "
                         "(`fused`)")
    OPS[op.name] = op
    return op


F = Callable[..., "Tensor"]


def builder(fn: F | None = None, *, tensor: bool | Callable[..., Tensor] = False) -> Any:
    """Decorator: `fn(g, ...)` becomes the Graph method of its name. `tensor=True` adds the
    Tensor method `x.name(...)` = `g.name(x, ...)`; a function there is the Tensor method.
    Arguments of parameters annotated `Tensor` (or `Tensor | None`) are checked to be
    Tensors first (see _tensors_checked)."""
    def attach(f: F) -> F:
        f = _tensors_checked(f)
        setattr(Graph, f.__name__, f)
        if tensor is True:
            def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
                return f(self.graph, self, *args, **kwargs)
            method.__name__, method.__doc__ = f.__name__, f.__doc__
            setattr(Tensor, f.__name__, method)
        elif tensor:
            setattr(Tensor, f.__name__, tensor)
        return f
    return attach(fn) if fn is not None else attach


_MISSING = object()


def _tensors_checked(f: F) -> F:
    """`f` refusing, with a GraphError naming the call and the parameter, a non-Tensor where
    it takes a Tensor: a numpy array or a number there (g.mse(y, target_array)) otherwise
    fails deep inside a shape rule, with an AttributeError or IndexError that names neither."""
    params = list(inspect.signature(f).parameters.values())[1:]  # after the graph
    checked = [(i, p.name, p.annotation == "Tensor | None") for i, p in enumerate(params)
               if p.annotation in ("Tensor", "Tensor | None")
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not checked:
        return f

    @functools.wraps(f)
    def method(g: Graph, *args: Any, **kwargs: Any) -> Tensor:
        for i, name, optional in checked:
            value = args[i] if i < len(args) else kwargs.get(name, _MISSING)
            if isinstance(value, Tensor) or value is _MISSING or (optional and value is None):
                continue
            hint = (": make it one with g.constant(value), or g.input(name, shape) "
                    "to set it every step" if isinstance(value, np.ndarray | numbers.Number)
                    else "")
            raise GraphError(f"{f.__name__}() at {user_frame()}: `{name}` takes a Tensor of "
                             f"this graph, got {type(value).__name__}{hint}")
        return f(g, *args, **kwargs)
    return method  # type: ignore[return-value]


def body_of(node: Tensor) -> Body:
    """The pointwise body of a pointwise node: stored on fused nodes, built from the OpDef else."""
    if "body" in node.attrs:
        return node.attrs["body"]
    opdef = OPS[node.op]
    assert opdef.expr is not None, f"{node.label} is not pointwise"
    strides = (opdef.strides(node) if opdef.strides is not None
               else [broadcast_strides(x.shape, node.shape) for x in node.inputs])
    return Body(opdef.expr(node), tuple(strides))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_IN_PACKAGE: dict[str, bool] = {}  # code file name -> whether it lies in vkml (abspath is slow)


def _in_package(filename: str) -> bool:
    inside = _IN_PACKAGE.get(filename)
    if inside is None:
        inside = _IN_PACKAGE[filename] = os.path.abspath(filename).startswith(_PACKAGE_DIR)
    return inside


_BUILDER_FILES = tuple(os.path.join(_PACKAGE_DIR, f) for f in ("graph.py", "nn.py", "ops"))


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning issued by the caller point at the user's code."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def user_frame() -> str:
    """`file:line` of the first caller outside vkml, so errors point at the user's code. In
    vkml's own programs (`python -m vkml demo`: every caller is vkml's, then the interpreter's
    runpy), the first caller outside the graph builder (graph.py, nn.py, ops/) instead."""
    frame = sys._getframe(1)
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith("<frozen "):
        frame = sys._getframe(1)
        while (frame.f_back is not None
               and os.path.abspath(frame.f_code.co_filename).startswith(_BUILDER_FILES)):
            frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class Tensor:
    """A node of a `Graph`: a value of static shape and dtype, produced by one op. Its methods
    (x.relu(), x.sum(...), ...) are attached by the ops that define them."""

    __slots__ = ("graph", "id", "op", "inputs", "shape", "dtype", "attrs", "name", "where")

    def __init__(self, graph: Graph, id: int, op: str, inputs: tuple[Tensor, ...], shape: Shape,
                 dtype: DType, attrs: dict[str, Any], name: str | None, where: str) -> None:
        self.graph, self.id, self.op, self.inputs = graph, id, op, inputs
        self.shape, self.dtype, self.attrs, self.name, self.where = shape, dtype, attrs, name, where

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # Python ints: as np.prod, without its per-call overhead

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    @property
    def label(self) -> str:
        """How errors and dumps refer to this node."""
        return f"%{self.id} {self.op}" + (f" '{self.name}'" if self.name else "") + f" {self.type}"

    @property
    def type(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def __repr__(self) -> str:
        return f"<Tensor {self.label} at {self.where}>"

    # Python's operators, as the graph methods the ops define.
    def __add__(self, other: Operand) -> Tensor: return self.graph.add(self, other)
    def __radd__(self, other: Operand) -> Tensor: return self.graph.add(other, self)
    def __sub__(self, other: Operand) -> Tensor: return self.graph.sub(self, other)
    def __rsub__(self, other: Operand) -> Tensor: return self.graph.sub(other, self)
    def __mul__(self, other: Operand) -> Tensor: return self.graph.mul(self, other)
    def __rmul__(self, other: Operand) -> Tensor: return self.graph.mul(other, self)
    def __truediv__(self, other: Operand) -> Tensor: return self.graph.div(self, other)
    def __rtruediv__(self, other: Operand) -> Tensor: return self.graph.div(other, self)
    def __matmul__(self, other: Tensor) -> Tensor: return self.graph.matmul(self, other)
    def __neg__(self) -> Tensor: return self.graph.neg(self)
    def __pow__(self, other: Operand) -> Tensor: return self.graph.pow(self, other)
    def __floordiv__(self, other: Operand) -> Tensor: return self.graph.floor_divide(self, other)
    def __mod__(self, other: Operand) -> Tensor: return self.graph.remainder(self, other)
    def __rpow__(self, other: Operand) -> Tensor: return self.graph.pow(other, self)
    # Comparisons give f32 masks; == and != stay Python's identity tests (tensors are dict keys).
    def __lt__(self, other: Operand) -> Tensor: return self.graph.less(self, other)
    def __le__(self, other: Operand) -> Tensor: return self.graph.less_equal(self, other)
    def __gt__(self, other: Operand) -> Tensor: return self.graph.greater(self, other)
    def __ge__(self, other: Operand) -> Tensor: return self.graph.greater_equal(self, other)

    @property
    def T(self) -> Tensor:
        return self.graph.transpose(self)


Operand = Tensor | float | int

# Checkpoints keep optimizer state under this prefix ("optimizer/<param>/<state>"): a name of
# the graph starting with it could be overwritten by that state on save, so none may.
STATE_PREFIX = "optimizer/"
# The input (i32, a scalar) by which ops that act only in training (dropout) know the step: the
# session sets it itself before each submission, to the number of the training step (1, 2, ...
# counted per session) in step(), chunked or not, and record(); to 0 in forward() and in every
# step of a session compiled without a loss. A write like any input's: nothing is recorded again.
TRAINING_STEP = "vkml/training_step"
# Random initial values are drawn this many elements at a time into the f32 result, so a
# parameter needs its own bytes on the host and not twice as many again in float64; numpy
# draws the same values whatever the cut.
_INIT_CHUNK = 1 << 20


def as_shape(shape: object, call: str, minus_ones: int = 0, what: str = "shape") -> Shape:
    """`shape` as a tuple of dimensions, each an integer (Python's or numpy's) >= 1; an int
    alone is a 1-D shape, as numpy takes it. Up to `minus_ones` dimensions may be -1 (reshape
    infers one, expand keeps x's sizes). Anything else raises a GraphError that names `call`
    and calls the value `what` (repeats are checked alike)."""
    alone = isinstance(shape, (numbers.Integral, str, bytes)) or (
        isinstance(shape, np.ndarray) and shape.ndim == 0)
    try:
        dims = (shape,) if alone else tuple(shape)  # type: ignore[arg-type]
        if any(isinstance(d, (bool, np.bool_)) for d in dims):  # an int to Python, not here
            raise TypeError
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise GraphError(f"{call} at {user_frame()}: {what} {shape!r} is not a {what}; give "
                         "an int or a tuple of ints, e.g. (32, 784)") from None
    if any(d < 1 and d != -1 for d in dims) or dims.count(-1) > minus_ones:
        allowed = "every dimension must be >= 1" + (
            "" if not minus_ones else " (or -1, once)" if minus_ones == 1 else " (or -1)")
        raise GraphError(f"{call} at {user_frame()}: {what} {dims}: {allowed}")
    return dims


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**29 else f"{nbytes / 2**20:.1f} MiB"


def _host_memory() -> int | None:
    """This machine's physical memory in bytes, where the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class Graph:
    """Builder and container of the static graph.

    Inputs, parameters and outputs have unique names; they are how a session is addressed
    (and checkpoints: no name may start with STATE_PREFIX, where optimizer state is saved).
    `seed` makes parameter initialisation reproducible. The op methods (g.matmul, g.relu, ...)
    are defined beside their ops in vkml/ops/.
    """

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self.params: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.initial_values: dict[int, np.ndarray] = {}  # parameter and constant id -> value
        # What checkpoints carry beside the parameters (see extra() and unsupported())
        self.extras: dict[str, np.ndarray] = {}
        self.unsupported_tensors: dict[str, str] = {}
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise GraphError(f"Graph(seed=...) takes an int >= 0 (numpy's seeds), got {seed!r}")
        self.rng = np.random.default_rng(seed)
        self.initial_bytes = 0  # of the parameters' initial values, all held on the host
        self.created_at = user_frame()  # where it was made: errors about mixed graphs say which

    # ---- building -------------------------------------------------------------------------
    def apply(self, op: str, inputs: Sequence[Tensor], name: str | None = None,
              **attrs: Any) -> Tensor:
        """Add one node; the op's shape rule checks the inputs and gives the result type."""
        opdef = OPS[op]
        for t in inputs:
            if not isinstance(t, Tensor):
                raise GraphError(f"{op}: expected a Tensor, got {type(t).__name__}")
            if t.graph is not self and not self.owns(t):
                raise GraphError(f"{op}: input {t.label} belongs to another Graph (created at "
                                 f"{t.graph.created_at}) than this one (created at "
                                 f"{self.created_at})")
        where = user_frame()
        try:
            shape, dtype = opdef.infer([*inputs], attrs)
        except GraphError as e:
            operands = ", ".join(t.label for t in inputs)
            raise GraphError(f"{op}({operands}) at {where}: {e}") from None
        node = Tensor(self, len(self.nodes), op, tuple(inputs), tuple(int(d) for d in shape),
                      dtype, attrs, name, where)
        self.nodes.append(node)
        return node

    def owns(self, t: Tensor) -> bool:
        """Whether `t` is a node of this graph (a copy's nodes are its original's too)."""
        return t.id < len(self.nodes) and self.nodes[t.id] is t

    def _claim(self, name: str, kind: str) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{kind} name must be a non-empty string, got {name!r}")
        if name.startswith(STATE_PREFIX):
            raise GraphError(f"{kind} name '{name}': names starting with '{STATE_PREFIX}' are "
                             "reserved for the optimizer state checkpoints hold, which would "
                             "be saved over it; give this one another name")
        for table in (self.inputs, self.params, self.outputs):
            if name in table:
                raise GraphError(f"the name '{name}' is already used by {table[name].label}; "
                                 f"give this {kind} another name")
        if name in self.extras or name in self.unsupported_tensors:
            raise GraphError(f"the name '{name}' is already a checkpoint entry of this graph; "
                             f"give this {kind} another name")

    def input(self, name: str, shape: int | Sequence[int], dtype: DType = "f32") -> Tensor:
        """A value the user sets before each step (`session.set_input(name, array)`).
        `shape`: a tuple of ints, or an int for one axis (as numpy takes shapes)."""
        if name == TRAINING_STEP:
            raise GraphError(f"the input name '{name}' is the one the session sets itself "
                             "(graph.training_step()); give this input another name")
        self._claim(name, "input")
        t = self.apply("input", [], name=name, shape=as_shape(shape, f"input '{name}'"),
                       dtype=dtype)
        self.inputs[name] = t
        return t

    def training_step(self) -> Tensor:
        """The i32 scalar input that numbers the training steps, 0 outside training (see
        TRAINING_STEP): made on first use, set by the session, never by the user."""
        if TRAINING_STEP not in self.inputs:
            self._claim(TRAINING_STEP, "input")
            self.inputs[TRAINING_STEP] = self.apply("input", [], name=TRAINING_STEP, shape=(),
                                                    dtype="i32")
        return self.inputs[TRAINING_STEP]

    def param(self, name: str, shape: int | Sequence[int],
              init: str | float | np.ndarray | np.number = "zeros",
              scale: float = 1.0, trainable: bool = True) -> Tensor:
        """An f32 parameter of `shape` (as for `input`). `init`: an array, a number (numpy's
        too), "zeros", "normal" (std `scale`) or "uniform" (in [-scale, scale]); its value is
        made now and held on the host, so a parameter that would not fit in this machine's
        memory beside the graph's others is refused here. `trainable=False` freezes it: no
        gradient and no optimizer state, but it is read, saved and loaded like any other
        parameter (`vkml.compile(..., trainable=...)` can override the choice per
        compilation)."""
        self._claim(name, "parameter")
        shape = as_shape(shape, f"parameter '{name}'")
        value = self._initial_value(name, shape, init, scale)
        t = self.apply("param", [], name=name, shape=shape, dtype="f32",
                       trainable=bool(trainable))
        self.initial_values[t.id] = value
        self.initial_bytes += value.nbytes
        self.params[name] = t
        return t

    def extra(self, name: str, value: np.ndarray | int | float | bool) -> None:
        """A tensor this graph's checkpoints carry by name that nothing computes with, such as
        the `num_batches_tracked` counters of torchvision's ResNet files: a session keeps it
        on the host in its own dtype (`value`'s), loads it from a file (same shape, the same
        kind of number), and saves it back unchanged, so such files load with strict=True and
        round-trip. A file without it loads too (the value stays)."""
        self._claim(name, "checkpoint extra")
        array = np.array(value)
        if array.dtype.kind not in "biuf":  # what safetensors stores, and _as_extra loads
            raise GraphError(f"checkpoint extra '{name}' must hold booleans, integers or "
                             f"floats (of 64 bits at most), got {type(value).__name__} "
                             f"({array.dtype}): the checkpoint could not be saved")
        self.extras[name] = array

    def unsupported(self, name: str, reason: str) -> None:
        """A checkpoint tensor whose presence means that the file's model uses an option this
        graph does not implement (e.g. `layer_weights`, which Hugging Face's Whisper
        classifier has only with use_weighted_layer_sum=True): `session.load` refuses such a
        file, naming the tensor and `reason`, with strict=False too, rather than drop the
        tensor and compute something else in silence."""
        self._claim(name, "unsupported checkpoint tensor")
        self.unsupported_tensors[name] = reason

    def _initial_value(self, name: str, shape: Shape,
                       init: str | float | np.ndarray | np.number, scale: float) -> np.ndarray:
        if isinstance(init, np.ndarray) and init.shape != ():
            if init.shape != shape:
                raise GraphError(f"parameter '{name}': init array has shape {init.shape}, "
                                 f"expected {shape}")
        nbytes, memory = 4 * math.prod(shape), _host_memory()
        if memory is not None and self.initial_bytes + nbytes > memory:
            others = (f" with the graph's other parameters ({_size(self.initial_bytes)})"
                      if self.initial_bytes else "")
            raise GraphError(
                f"parameter '{name}' of shape {shape} takes {_size(nbytes)} (f32), "
                f"which{others} exceeds this machine's {_size(memory)} of memory: every "
                "parameter's value is held on the host until a session uploads it. Check the "
                "shape")
        try:
            return self._fill(name, shape, init, scale)
        except MemoryError:
            raise GraphError(f"parameter '{name}' of shape {shape}: the host has not "
                             f"{_size(nbytes)} free for its initial value (f32); check the "
                             "shape, or free memory") from None

    def _fill(self, name: str, shape: Shape, init: str | float | np.ndarray | np.number,
              scale: float) -> np.ndarray:
        if isinstance(init, np.ndarray) and init.shape != ():
            if init.dtype.kind not in "biuf":
                raise GraphError(f"parameter '{name}': init array holds {init.dtype}, not "
                                 "numbers")
            return init.astype(np.float32)
        # Any real number fills: Python's, numpy's scalars (np.float32(x) is no `float`) and
        # 0-d arrays alike.
        if isinstance(init, numbers.Real) or (isinstance(init, np.ndarray)
                                               and init.dtype.kind in "iuf"):
            return np.full(shape, float(init), np.float32)
        if init == "zeros":
            return np.zeros(shape, np.float32)
        if init in ("normal", "uniform"):
            value = np.empty(shape, np.float32)
            flat = value.reshape(-1)
            for start in range(0, flat.size, _INIT_CHUNK):
                n = min(_INIT_CHUNK, flat.size - start)
                if init == "normal":
                    flat[start:start + n] = self.rng.standard_normal(n) * scale
                else:
                    flat[start:start + n] = self.rng.uniform(-scale, scale, n)
            return value
        raise GraphError(f"parameter '{name}': unknown init {init!r}; use an array, a number, "
                         "'zeros', 'normal' or 'uniform'")

    def constant(self, value: float | np.ndarray, dtype: DType = "f32") -> Tensor:
        """A value fixed at build time; `dtype="i32"` for integers such as gather indices."""
        if dtype == "i32":
            wide = np.asarray(value)
            if wide.dtype.kind not in "iub" or (wide.size and (
                    wide.min() < -2**31 or wide.max() >= 2**31)):
                raise GraphError(f"an i32 constant needs integers within 32 bits, got "
                                 f"{wide.dtype} values")
            arr = wide.astype(np.int32)
        elif dtype == "f32":
            wide = np.asarray(value)
            if wide.dtype.kind not in "biuf":  # None and strings would become NaN or raise
                raise GraphError(f"a constant takes numbers (a number, an array, nested lists "
                                 f"of numbers), got {type(value).__name__} ({wide.dtype})")
            arr = wide.astype(np.float32)
        else:
            raise GraphError(f"unsupported dtype {dtype!r}; use 'f32' or 'i32'")
        t = self.apply("constant", [], shape=arr.shape, dtype=dtype)
        self.initial_values[t.id] = arr
        return t

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Make `tensor` readable after a step as `session.read(name)`."""
        self._claim(name, "output")
        self.outputs[name] = tensor
        return tensor

    def lift(self, x: Operand, dtype: DType = "f32") -> Tensor:
        """A tensor as it is; a number as a scalar constant of `dtype`."""
        if isinstance(x, Tensor):
            return x
        if not isinstance(x, (int, float, np.floating, np.integer)):
            raise GraphError(f"expected a Tensor or a number, got {type(x).__name__}")
        if dtype == "i32":
            if not float(x).is_integer():
                raise GraphError(f"{x!r} is no integer, and the other operand is i32: "
                                 "cast that one to f32 first (cast(t, 'f32'))")
            return self.constant(int(x), "i32")
        return self.constant(float(x))

    # ---- inspection -----------------------------------------------------------------------
    def copy(self) -> Graph:
        """A graph sharing these (immutable) nodes, that later stages may extend freely."""
        g = Graph.__new__(Graph)
        g.nodes, g.inputs, g.params = list(self.nodes), dict(self.inputs), dict(self.params)
        g.outputs, g.initial_values, g.rng = dict(self.outputs), dict(self.initial_values), self.rng
        g.created_at, g.initial_bytes = self.created_at, self.initial_bytes
        g.extras, g.unsupported_tensors = dict(self.extras), dict(self.unsupported_tensors)
        return g

    def reachable(self, roots: Iterable[Tensor]) -> list[Tensor]:
        """Nodes that `roots` depend on, in topological (id) order."""
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            t = stack.pop()
            if t.id not in seen:
                seen.add(t.id)
                stack.extend(t.inputs)
        return [self.nodes[i] for i in sorted(seen)]

    def dump(self, roots: Iterable[Tensor] | None = None) -> str:
        """The graph as text, one node a line, in the spirit of a jaxpr."""
        nodes = self.reachable(roots) if roots is not None else self.nodes
        names = {t.id: n for n, t in self.outputs.items()}
        lines = []
        for t in nodes:
            args = ", ".join(f"%{i.id}" for i in t.inputs)
            attrs = " ".join(f"{k}={v}" for k, v in t.attrs.items()
                             if (k not in ("shape", "dtype") or t.op in ("reshape", "broadcast_to"))
                             and (k, v) != ("trainable", True))
            tag = f"  # {t.name}" if t.name else f"  # {t.where}"
            if t.id in names:
                tag += f"  -> output '{names[t.id]}'"
            lines.append(f"%{t.id}: {t.type} = {t.op}({args}){' ' + attrs if attrs else ''}{tag}")
        return "\n".join(lines)

    __str__ = dump


def normalize_axis(x: Tensor, axis: int, call: str) -> int:
    """One non-negative axis of `x`, for the ops that take exactly one (argmax, sort, cumsum,
    split); None or a tuple there is a GraphError naming `call`, not an unpacking error."""
    if not isinstance(axis, numbers.Integral):
        raise GraphError(f"{call} takes one axis, an int, got {axis!r} for {x.label}")
    (a,) = normalize_axes(x, axis)
    return a


def normalize_axes(x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    """Sorted, non-negative axes of `x` (all of them for None), checked against its rank."""
    rank = len(x.shape)
    if axis is None:
        return tuple(range(rank))
    axes = (axis,) if isinstance(axis, numbers.Integral) else (
        tuple(axis) if isinstance(axis, Iterable) else (axis,))
    out = []
    for a in axes:
        if not isinstance(a, numbers.Integral):
            raise GraphError(f"axes are ints (or a sequence of them), got {axis!r} for "
                             f"{x.label}")
        if not -rank <= a < rank:
            raise GraphError(f"axis {a} is out of range for {x.label} (rank {rank})")
        out.append(a % rank)
    return tuple(sorted(set(out)))
