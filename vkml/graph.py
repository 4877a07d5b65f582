"""The typed static graph: the IR every later stage consumes.

A `Graph` is an append-only list of `Tensor` nodes. Each node records its op (a key into
`vkml.ops.OPS`), its inputs, its static shape and dtype, and the op's attributes. Shapes and dtypes
are checked when a node is built, so a mistake is reported at the line that made it, naming both
operands, and never surfaces later as a wrong kernel.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from vkml.errors import GraphError
from vkml.ops import OPS, DType, Shape
from vkml.ops import attention as _attention
from vkml.ops import norm as _norm

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_frame() -> str:
    """`file:line` of the first caller outside vkml, so errors point at the user's code."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class Tensor:
    """A node of a `Graph`: a value of static shape and dtype, produced by one op."""

    __slots__ = ("graph", "id", "op", "inputs", "shape", "dtype", "attrs", "name", "where")

    def __init__(self, graph: Graph, id: int, op: str, inputs: tuple[Tensor, ...], shape: Shape,
                 dtype: DType, attrs: dict[str, Any], name: str | None, where: str) -> None:
        self.graph, self.id, self.op, self.inputs = graph, id, op, inputs
        self.shape, self.dtype, self.attrs, self.name, self.where = shape, dtype, attrs, name, where

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

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

    # Operators and method forms delegate to the graph so there is one definition of each op.
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

    def relu(self) -> Tensor: return self.graph.relu(self)
    def sigmoid(self) -> Tensor: return self.graph.sigmoid(self)
    def tanh(self) -> Tensor: return self.graph.tanh(self)
    def gelu(self) -> Tensor: return self.graph.gelu(self)
    def silu(self) -> Tensor: return self.graph.silu(self)
    def exp(self) -> Tensor: return self.graph.exp(self)
    def log(self) -> Tensor: return self.graph.log(self)

    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self.graph.sum(self, axis, keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self.graph.mean(self, axis, keepdims)

    def softmax(self) -> Tensor: return self.graph.softmax(self)
    def log_softmax(self) -> Tensor: return self.graph.log_softmax(self)
    def reshape(self, *shape: int) -> Tensor: return self.graph.reshape(self, shape)

    def transpose(self, *axes: int) -> Tensor: return self.graph.transpose(self, axes or None)

    @property
    def T(self) -> Tensor:
        return self.graph.transpose(self)


Operand = Tensor | float | int


class Graph:
    """Builder and container of the static graph.

    Inputs, parameters and outputs have unique names; they are how a session is addressed.
    `seed` makes parameter initialisation reproducible.
    """

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self.params: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.initial_values: dict[int, np.ndarray] = {}  # parameter and constant id -> value
        self.rng = np.random.default_rng(seed)

    # ---- building -------------------------------------------------------------------------
    def apply(self, op: str, inputs: Sequence[Tensor], name: str | None = None,
              **attrs: Any) -> Tensor:
        """Add one node; the op's shape rule checks the inputs and gives the result type."""
        opdef = OPS[op]
        for t in inputs:
            if t.graph is not self and not self._owns(t):
                raise GraphError(f"{op}: input {t.label} belongs to another Graph")
        where = _user_frame()
        try:
            shape, dtype = opdef.infer([*inputs], attrs)
        except GraphError as e:
            operands = ", ".join(t.label for t in inputs)
            raise GraphError(f"{op}({operands}) at {where}: {e}") from None
        node = Tensor(self, len(self.nodes), op, tuple(inputs), tuple(int(d) for d in shape),
                      dtype, attrs, name, where)
        self.nodes.append(node)
        return node

    def _owns(self, t: Tensor) -> bool:
        return t.id < len(self.nodes) and self.nodes[t.id] is t

    def _claim(self, name: str, kind: str) -> None:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{kind} name must be a non-empty string, got {name!r}")
        for table in (self.inputs, self.params, self.outputs):
            if name in table:
                raise GraphError(f"the name '{name}' is already used by {table[name].label}; "
                                 f"give this {kind} another name")

    def input(self, name: str, shape: Sequence[int], dtype: DType = "f32") -> Tensor:
        """A value the user sets before each step (`session.set_input(name, array)`)."""
        self._claim(name, "input")
        t = self.apply("input", [], name=name, shape=tuple(shape), dtype=dtype)
        self.inputs[name] = t
        return t

    def param(self, name: str, shape: Sequence[int], init: str | float | np.ndarray = "zeros",
              scale: float = 1.0, trainable: bool = True) -> Tensor:
        """An f32 parameter. `init`: an array, a number, "zeros", "normal" (std `scale`) or
        "uniform" (in [-scale, scale]). `trainable=False` freezes it: no gradient and no
        optimizer state, but it is read, saved and loaded like any other parameter
        (`vkml.compile(..., trainable=...)` can override the choice per compilation)."""
        self._claim(name, "parameter")
        t = self.apply("param", [], name=name, shape=tuple(shape), dtype="f32",
                       trainable=bool(trainable))
        self.initial_values[t.id] = self._initial_value(name, t.shape, init, scale)
        self.params[name] = t
        return t

    def _initial_value(self, name: str, shape: Shape, init: str | float | np.ndarray,
                       scale: float) -> np.ndarray:
        if isinstance(init, np.ndarray):
            if init.shape != shape:
                raise GraphError(f"parameter '{name}': init array has shape {init.shape}, "
                                 f"expected {shape}")
            return init.astype(np.float32)
        if isinstance(init, (int, float)):
            return np.full(shape, init, np.float32)
        if init == "zeros":
            return np.zeros(shape, np.float32)
        if init == "normal":
            return (self.rng.standard_normal(shape) * scale).astype(np.float32)
        if init == "uniform":
            return self.rng.uniform(-scale, scale, shape).astype(np.float32)
        raise GraphError(f"parameter '{name}': unknown init {init!r}; use an array, a number, "
                         "'zeros', 'normal' or 'uniform'")

    def constant(self, value: float | np.ndarray) -> Tensor:
        arr = np.asarray(value, dtype=np.float32)
        t = self.apply("constant", [], shape=arr.shape, dtype="f32")
        self.initial_values[t.id] = arr
        return t

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Make `tensor` readable after a step as `session.read(name)`."""
        self._claim(name, "output")
        self.outputs[name] = tensor
        return tensor

    def _lift(self, x: Operand) -> Tensor:
        if isinstance(x, Tensor):
            return x
        if isinstance(x, (int, float, np.floating, np.integer)):
            return self.constant(float(x))
        raise GraphError(f"expected a Tensor or a number, got {type(x).__name__}")

    # ---- pointwise ------------------------------------------------------------------------
    def add(self, a: Operand, b: Operand) -> Tensor:
        return self.apply("add", [self._lift(a), self._lift(b)])

    def sub(self, a: Operand, b: Operand) -> Tensor:
        return self.apply("sub", [self._lift(a), self._lift(b)])

    def mul(self, a: Operand, b: Operand) -> Tensor:
        return self.apply("mul", [self._lift(a), self._lift(b)])

    def div(self, a: Operand, b: Operand) -> Tensor:
        return self.apply("div", [self._lift(a), self._lift(b)])

    def bias_add(self, x: Tensor, bias: Tensor) -> Tensor:
        """x + bias over the last axis; bias must have shape (x.shape[-1],)."""
        if bias.shape != x.shape[-1:]:
            raise GraphError(f"bias_add: bias {bias.label} must have shape ({x.shape[-1]},) "
                             f"to match the last axis of {x.label}")
        return self.add(x, bias)

    def relu(self, x: Tensor) -> Tensor: return self.apply("relu", [x])
    def sigmoid(self, x: Tensor) -> Tensor: return self.apply("sigmoid", [x])
    def tanh(self, x: Tensor) -> Tensor: return self.apply("tanh", [x])
    def gelu(self, x: Tensor) -> Tensor: return self.apply("gelu", [x])
    def silu(self, x: Tensor) -> Tensor: return self.apply("silu", [x])
    def exp(self, x: Tensor) -> Tensor: return self.apply("exp", [x])
    def log(self, x: Tensor) -> Tensor: return self.apply("log", [x])
    def neg(self, x: Tensor) -> Tensor: return self.apply("neg", [x])
    def sqrt(self, x: Tensor) -> Tensor: return self.apply("sqrt", [x])
    def rsqrt(self, x: Tensor) -> Tensor: return self.apply("rsqrt", [x])
    def square(self, x: Tensor) -> Tensor: return self.apply("square", [x])

    def broadcast_to(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        return self.apply("broadcast_to", [x], shape=tuple(shape))

    def one_hot(self, labels: Tensor, num_classes: int) -> Tensor:
        return self.apply("one_hot", [labels], num_classes=int(num_classes))

    # ---- reductions -----------------------------------------------------------------------
    def sum(self, x: Tensor, axis: int | Sequence[int] | None = None,
            keepdims: bool = False) -> Tensor:
        axes = _normalize_axes(x, axis)
        reduced = self.apply("sum", [x], axes=axes)
        if keepdims:
            return self.reshape(reduced, [1 if i in axes else d for i, d in enumerate(x.shape)])
        return reduced

    def mean(self, x: Tensor, axis: int | Sequence[int] | None = None,
             keepdims: bool = False) -> Tensor:
        axes = _normalize_axes(x, axis)
        count = int(np.prod([x.shape[i] for i in axes], dtype=np.int64))
        return self.mul(self.sum(x, axes, keepdims), 1.0 / count)

    def amax(self, x: Tensor, axis: int | Sequence[int] | None = None,
             keepdims: bool = False) -> Tensor:
        """torch.amax: the maximum over `axis` (all axes by default)."""
        axes = _normalize_axes(x, axis)
        reduced = self.apply("amax", [x], axes=axes)
        if keepdims:
            return self.reshape(reduced, [1 if i in axes else d for i, d in enumerate(x.shape)])
        return reduced

    def softmax(self, x: Tensor) -> Tensor: return self.apply("softmax", [x])
    def log_softmax(self, x: Tensor) -> Tensor: return self.apply("log_softmax", [x])

    # ---- linear algebra and layout --------------------------------------------------------
    def matmul(self, a: Tensor, b: Tensor, transpose_a: bool = False,
               transpose_b: bool = False) -> Tensor:
        """op(a) @ op(b), op transposing the last two axes when asked (no copy is made);
        operands of rank > 2 are batches of matrices, their leading axes broadcast as numpy's."""
        return self.apply("matmul", [a, b], transpose_a=bool(transpose_a),
                          transpose_b=bool(transpose_b))

    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        shape = tuple(int(d) for d in shape)
        if shape.count(-1) == 1:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            shape = tuple(x.size // known if d == -1 and known else d for d in shape)
        return self.apply("reshape", [x], shape=shape)

    def transpose(self, x: Tensor, axes: Sequence[int] | None = None) -> Tensor:
        """Permute axes; with no `axes`, swap the last two (the matrix transpose)."""
        if axes is None:
            if len(x.shape) < 2:
                raise GraphError(f"transpose: {x.label} has fewer than 2 axes")
            axes = (*range(len(x.shape) - 2), len(x.shape) - 1, len(x.shape) - 2)
        return self.apply("transpose", [x], axes=tuple(int(a) for a in axes))

    def permute(self, x: Tensor, axes: Sequence[int]) -> Tensor:
        """torch.permute: the same op as transpose with explicit axes."""
        return self.transpose(x, axes)

    # ---- indexing and shape (issue 4; vkml/ops/indexing.py) ------------------------------------
    def slice(self, x: Tensor, axis: int, start: int, stop: int) -> Tensor:
        """x[..., start:stop, ...] along `axis` (step 1, non-negative bounds)."""
        return self.apply("slice", [x], axis=int(axis), start=int(start), stop=int(stop))

    def pad(self, x: Tensor, axis: int, before: int, after: int) -> Tensor:
        """Zero padding along one axis."""
        return self.apply("pad", [x], axis=int(axis), before=int(before), after=int(after))

    def concat(self, xs: Sequence[Tensor], axis: int = 0) -> Tensor:
        if len(xs) == 1:
            return xs[0]
        return self.apply("concat", list(xs), axis=int(axis))

    def split(self, x: Tensor, sizes: int | Sequence[int], axis: int = 0) -> list[Tensor]:
        """torch.split: chunks of `sizes` (an int: equal chunks, the last may be shorter)."""
        extent = x.shape[axis]
        if isinstance(sizes, int):
            sizes = [min(sizes, extent - s) for s in range(0, extent, sizes)]
        if sum(sizes) != extent:
            raise GraphError(f"split: sizes {list(sizes)} do not add up to {extent}")
        out, start = [], 0
        for size in sizes:
            out.append(x if size == extent else self.slice(x, axis, start, start + size))
            start += size
        return out

    def upsample_nearest(self, x: Tensor, scale: int = 2) -> Tensor:
        """Nearest upsampling of an (N, C, H, W) tensor by an integer factor: a broadcast (one
        pointwise kernel); its gradient is a sum over each scale x scale block."""
        n, c, h, w = x.shape
        wide = self.broadcast_to(self.reshape(x, (n, c, h, 1, w, 1)), (n, c, h, scale, w, scale))
        return self.reshape(wide, (n, c, h * scale, w * scale))

    def embedding(self, ids: Tensor, weight: Tensor) -> Tensor:
        """F.embedding(ids, weight): rows of `weight` (rows, dim) at i32 `ids` -> (*ids, dim)."""
        return self.apply("embedding", [weight, ids])

    # ---- normalisation, attention, activations (compositions: vkml/ops/norm.py, attention.py)
    def layer_norm(self, x: Tensor, normalized_shape, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
        return _norm.layer_norm(self, x, normalized_shape, weight, bias, eps)

    def rms_norm(self, x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        return _norm.rms_norm(self, x, weight, eps)

    def group_norm(self, x: Tensor, num_groups: int, weight: Tensor | None = None,
                   bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
        return _norm.group_norm(self, x, num_groups, weight, bias, eps)

    def batch_norm(self, x: Tensor, running_mean: Tensor | None = None,
                   running_var: Tensor | None = None, weight: Tensor | None = None,
                   bias: Tensor | None = None, training: bool = False,
                   eps: float = 1e-5) -> Tensor:
        return _norm.batch_norm(self, x, running_mean, running_var, weight, bias, training, eps)

    def scaled_dot_product_attention(self, q: Tensor, k: Tensor, v: Tensor,
                                     mask: Tensor | None = None, causal: bool = False,
                                     scale: float | None = None, fused: bool = False) -> Tensor:
        return _attention.scaled_dot_product_attention(self, q, k, v, mask, causal, scale, fused)

    def rope(self, x: Tensor, theta: float = 10000.0, offset: int = 0) -> Tensor:
        return _attention.rope(self, x, theta, offset)

    def swiglu(self, a: Tensor, b: Tensor) -> Tensor:
        return _attention.swiglu(self, a, b)

    # ---- convolution and pooling (NCHW; vkml/ops/conv.py) -----------------------------------
    def conv2d(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
               dilation=1, groups: int = 1) -> Tensor:
        """F.conv2d: weight (out, in/groups, kh, kw); int or (h, w) stride/padding/dilation."""
        y = self.apply("conv2d", [x, weight], stride=_pair(stride), padding=_pair(padding),
                       dilation=_pair(dilation), groups=int(groups))
        if bias is not None:
            y = self.add(y, self.reshape(bias, (bias.size, 1, 1)))
        return y

    def conv1d(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int = 1,
               padding: int = 0, dilation: int = 1, groups: int = 1) -> Tensor:
        """F.conv1d as conv2d over a height of 1: x (N, C, L), weight (out, in/groups, k)."""
        n, c, length = x.shape
        o, cpg, k = weight.shape
        y = self.conv2d(self.reshape(x, (n, c, 1, length)), self.reshape(weight, (o, cpg, 1, k)),
                        None, (1, stride), (0, padding), (1, dilation), groups)
        y = self.reshape(y, (n, o, y.shape[-1]))
        return y if bias is None else self.add(y, self.reshape(bias, (o, 1)))

    def max_pool2d(self, x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
        kernel = _pair(kernel_size)
        return self.apply("max_pool2d", [x], kernel=kernel,
                          stride=kernel if stride is None else _pair(stride),
                          padding=_pair(padding))

    def avg_pool2d(self, x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
        """F.avg_pool2d (count_include_pad=True): a depthwise conv2d with constant weights."""
        kh, kw = _pair(kernel_size)
        c = x.shape[1]
        weight = self.constant(np.full((c, 1, kh, kw), 1.0 / (kh * kw), np.float32))
        return self.conv2d(x, weight, None, (kh, kw) if stride is None else stride, padding,
                           1, c)

    def global_avg_pool2d(self, x: Tensor) -> Tensor:
        """(N, C, H, W) -> (N, C, 1, 1), as F.adaptive_avg_pool2d(x, 1)."""
        return self.mean(x, (2, 3), keepdims=True)

    # ---- losses (compositions of the ops above, so they differentiate for free) -----------
    def cross_entropy(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy over the rows of 2-D `logits`. `labels`: class indices (i32,
        shape (rows,)) or target probabilities / one-hot rows (f32, same shape as logits)."""
        if len(logits.shape) != 2:
            raise GraphError(f"cross_entropy: logits {logits.label} must be 2-D (rows, classes)")
        rows, classes = logits.shape
        if labels.dtype == "i32":
            if labels.shape != (rows,):
                raise GraphError(f"cross_entropy: class-index labels {labels.label} must have "
                                 f"shape ({rows},) to match logits {logits.label}")
            labels = self.one_hot(labels, classes)
        elif labels.shape != logits.shape:
            raise GraphError(f"cross_entropy: labels {labels.label} must have shape "
                             f"{logits.shape} like logits {logits.label}, or be i32 indices of "
                             f"shape ({rows},)")
        return self.mul(self.sum(self.mul(labels, self.log_softmax(logits))), -1.0 / rows)

    def mse(self, prediction: Tensor, target: Tensor) -> Tensor:
        """Mean squared error over all elements."""
        if prediction.shape != target.shape:
            raise GraphError(f"mse: prediction {prediction.label} and target {target.label} "
                             "must have the same shape")
        diff = self.sub(prediction, target)
        return self.mean(self.mul(diff, diff))

    # ---- inspection -----------------------------------------------------------------------
    def copy(self) -> Graph:
        """A graph sharing these (immutable) nodes, that later stages may extend freely."""
        g = Graph.__new__(Graph)
        g.nodes, g.inputs, g.params = list(self.nodes), dict(self.inputs), dict(self.params)
        g.outputs, g.initial_values, g.rng = dict(self.outputs), dict(self.initial_values), self.rng
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


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else (int(v[0]), int(v[1]))


def _normalize_axes(x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    rank = len(x.shape)
    if axis is None:
        return tuple(range(rank))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise GraphError(f"axis {a} is out of range for {x.label} (rank {rank})")
        out.append(a % rank)
    return tuple(sorted(set(out)))
