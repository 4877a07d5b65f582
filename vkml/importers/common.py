"""What both front ends share: the imported model they return and the collection of refusals.

An import either returns an `ImportedModel` whose graph computes what the model computes, or
raises one `ModelImportError` naming everything it cannot do; never a graph that computes
something else in silence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkml.errors import CheckpointError, GraphError, InputError, ModelImportError
from vkml.graph import Graph, Tensor

# How many node names a refusal lists per op type or reason.
FIRST_NODES = 3


class Refuse(Exception):
    """Raised by an op's conversion: this node cannot be imported, for the reason given."""


class Refusals:
    """Everything an import cannot do, collected over the whole model and raised together."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ops: dict[str, list[str]] = {}  # op type -> its nodes
        self.reasons: dict[str, str] = {}  # op type -> why it is refused ("" when no op exists)
        self.nodes: list[tuple[str, str, str]] = []  # (node, op type, why) for single nodes

    def unsupported(self, op_type: str, node: str, why: str = "") -> None:
        self.ops.setdefault(op_type, []).append(node)
        if why:
            self.reasons[op_type] = why

    def refuse(self, node: str, op_type: str, why: str) -> None:
        self.nodes.append((node, op_type, why))

    def __bool__(self) -> bool:
        return bool(self.ops or self.nodes)

    def check(self) -> None:
        """Raise one ModelImportError listing everything collected (nothing when empty)."""
        if not self:
            return
        lines = [f"cannot import {self.source}; nothing was built:"]
        if self.ops:
            lines.append("unsupported op types (count, first nodes):")
            for op, nodes in sorted(self.ops.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                shown = ", ".join(nodes[:FIRST_NODES]) + (", ..." if len(nodes) > FIRST_NODES
                                                          else "")
                why = f" -- {self.reasons[op]}" if op in self.reasons else ""
                lines.append(f"  {op} x{len(nodes)}: {shown}{why}")
        if self.nodes:
            lines.append("nodes that cannot be converted:")
            lines += [f"  {node} ({op}): {why}" for node, op, why in self.nodes]
        error = ModelImportError("\n".join(lines))
        error.unsupported = {op: len(nodes) for op, nodes in self.ops.items()}
        error.refused_nodes = [node for node, _, _ in self.nodes]
        raise error


def convert_guarded(refusals: Refusals, node: str, op_type: str,
                    convert: Callable[[], Any]) -> Any:
    """Run one node's conversion; a refusal or a graph the node's values do not fit is recorded
    against the node (None is returned) so the import goes on and reports everything at once."""
    try:
        return convert()
    except Refuse as e:
        refusals.refuse(node, op_type, str(e))
    except GraphError as e:
        refusals.refuse(node, op_type, f"vkml cannot build it: {e}")
    except Exception as e:  # a bug of the importer: named, and the import still refused whole
        refusals.refuse(node, op_type, f"the importer failed on it ({type(e).__name__}: {e}); "
                        "please report it")
    return None


@dataclass
class ImportedModel:
    """An imported model: its graph, inputs and outputs by the model's own names, and how to
    write trained values back into the model's format.

    `graph` is a plain vkml.Graph: add a loss, more inputs or outputs, then `vkml.compile` it.
    `params` maps each graph parameter to the model's name for it (the same string today) and
    `frozen` names the model's buffers (batch-norm running statistics), which are parameters
    built with trainable=False."""

    graph: Graph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    source: str
    params: dict[str, str] = field(default_factory=dict)
    frozen: tuple[str, ...] = ()
    # Written by the front end: values for names the graph does not hold (integer buffers,
    # constants), and the functions that write a model file / a state dict.
    _save_onnx: Callable[[dict[str, np.ndarray], str], None] | None = None
    _state_dict: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None

    def trained_values(self, session: Any) -> dict[str, np.ndarray]:
        """The session's value of every imported parameter (frozen ones included), by the
        model's names. A session compiled from this graph holds all of them (params() has
        every parameter of its graph); one that lacks any, or holds it in another shape, is
        refused: the file would get imported values in silence (another model's session, or
        one sharing its parameters with an owner that holds the missing ones)."""
        held = session.params()
        unfit = [param if param not in held else
                 f"{param} {held[param].shape} for {self.graph.params[param].shape}"
                 for param in self.params
                 if param not in held or held[param].shape != self.graph.params[param].shape]
        if unfit:
            shown = ", ".join(unfit[:5]) + (f" and {len(unfit) - 5} more" if len(unfit) > 5
                                            else "")
            raise InputError(f"this session does not hold the parameters of {self.source} "
                             f"({shown}): pass the session compiled from this import's graph "
                             "(where parameters are shared, the owner)")
        return {name: held[param] for param, name in self.params.items()}

    def save_onnx(self, session: Any, path: str) -> None:
        """Write the imported ONNX model again, with the session's parameter values as its
        initializers (in their original dtypes); onnxruntime runs it as it ran the original."""
        if self._save_onnx is None:
            raise ModelImportError(f"{self.source} was not imported from ONNX; use "
                                   "state_dict(session) and torch.onnx.export the module")
        values = self.trained_values(session)
        try:
            self._save_onnx(values, path)
        except OSError as exc:
            raise CheckpointError(f"cannot write {path}: {exc.strerror or exc} (check that the "
                                  "directory exists and is writable, and that the path is not "
                                  "a directory)") from exc

    def state_dict(self, session: Any) -> dict[str, Any]:
        """The session's values under the model's names: for a PyTorch import, torch tensors
        for `module.load_state_dict(..., strict=True)`; for an ONNX import, numpy arrays by
        initializer name."""
        values = self.trained_values(session)
        return self._state_dict(values) if self._state_dict is not None else values


# ---- graph-building helpers both front ends use -------------------------------------------------
def power(g: Graph, x: Tensor, exponent: float) -> Tensor:
    """x ** exponent for a number known at import, as the ops a hand-written model uses."""
    if exponent == 1.0:
        return x
    if exponent == 2.0:
        return g.square(x)
    if exponent == 0.5:
        return g.sqrt(x)
    if exponent == -0.5:
        return g.rsqrt(x)
    if exponent == -1.0:
        return g.div(1.0, x)
    if exponent == 3.0:
        return g.mul(g.square(x), x)
    if hasattr(g, "pow"):
        return g.pow(x, exponent)
    raise Refuse(f"x ** {exponent} needs vkml's pow op")


def matmul(g: Graph, a: Tensor, w: Tensor, transpose_b: bool = False) -> Tensor:
    """numpy's matmul; a batch times one matrix as nn.Linear computes it (the leading axes
    flattened into one product), vectors as matrices of one row or column."""
    if len(a.shape) == 1:
        y = matmul(g, g.reshape(a, (1, a.shape[0])), w, transpose_b)
        return g.reshape(y, y.shape[:-2] + y.shape[-1:])
    if len(w.shape) == 1:
        y = matmul(g, a, g.reshape(w, (w.shape[0], 1)))
        return g.reshape(y, y.shape[:-1])
    if len(w.shape) == 2 and len(a.shape) > 2:
        flat = g.matmul(g.reshape(a, (-1, a.shape[-1])), w, transpose_b=transpose_b)
        return g.reshape(flat, (*a.shape[:-1], flat.shape[-1]))
    return g.matmul(a, w, transpose_b=transpose_b)


def last_axis(g: Graph, x: Tensor, axis: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """`fn` (a last-axis op) applied along `axis`, moving it last and back."""
    axis %= len(x.shape)
    if axis == len(x.shape) - 1:
        return fn(x)
    order = [*[a for a in range(len(x.shape)) if a != axis], axis]
    back = list(np.argsort(order))
    return g.transpose(fn(g.transpose(x, order)), back)


def take(g: Graph, x: Tensor, indices: np.ndarray, axis: int) -> Tensor:
    """np.take(x, indices, axis) for indices known at import: slices (one for a scalar or a
    run of consecutive indices), concatenated, reshaped to the indices' shape."""
    axis %= len(x.shape)
    n = x.shape[axis]
    flat = [int(i) % n for i in np.asarray(indices).reshape(-1)]
    runs: list[list[int]] = []
    for i in flat:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    parts = [x if (lo, hi) == (0, n) else g.slice(x, axis, lo, hi) for lo, hi in runs]
    y = g.concat(parts, axis)
    shape = (*x.shape[:axis], *np.shape(indices), *x.shape[axis + 1:])
    return y if y.shape == shape else g.reshape(y, shape)


def gather_points(g: Graph, x: Tensor, indices: Sequence[np.ndarray], first: int) -> Tensor:
    """x indexed by arrays known at import (numpy's advanced indexing), one for each axis from
    `first` on (broadcast together): those axes merged into one, and one gather along it at
    the flattened indices."""
    k = len(indices)
    dims = x.shape[first:first + k]
    arrays = [np.asarray(i, np.int64) % d for i, d in zip(np.broadcast_arrays(*indices), dims)]
    merged = g.reshape(x, (*x.shape[:first], math.prod(dims), *x.shape[first + k:]))
    flat = np.ravel_multi_index(tuple(arrays), dims) if arrays[0].size else arrays[0]
    return g.gather(merged, g.constant(flat, "i32"), first)


def slice_along(g: Graph, x: Tensor, axis: int, start: int | None, end: int | None,
                step: int = 1) -> Tensor:
    """x[start:end:step] along `axis` with Python's (and ONNX's) reading of the bounds: None
    for the whole axis, negative from the end, clamped to it."""
    n = x.shape[axis]
    if step < 1:
        raise Refuse(f"slices with step {step} are not supported (positive steps are)")
    lo = 0 if start is None else max(0, min(n, start + n if start < 0 else start))
    hi = n if end is None else max(0, min(n, end + n if end < 0 else end))
    if hi <= lo:
        raise Refuse(f"an empty slice [{start}:{end}] of axis {axis} ({n})")
    return x if (lo, hi, step) == (0, n, 1) else g.slice(x, axis, lo, hi, step)


def scatter_along(g: Graph, data: Tensor, updates: Tensor, targets: np.ndarray, axis: int,
                  reduction: str = "none") -> Tensor:
    """data with its slice targets[q] along `axis` replaced by updates' slice q (reduction
    none: the last one where targets repeat) or increased by every such slice (add: the
    updates summed per written slice by a constant 0/1 matrix, `resample`): a gather where a
    slice is written, the data elsewhere, for targets known at import (ONNX's scatters, torch's
    slice_scatter). The gradient goes to both."""
    if reduction not in ("none", "add"):
        raise Refuse(f"reduction '{reduction}' is not supported (none and add are)")
    targets = np.asarray(targets).reshape(-1)
    written_rows, row_of = np.unique(targets, return_inverse=True)
    if reduction == "add":
        sums = np.zeros((len(written_rows), len(targets)), np.float32)
        sums[row_of.reshape(-1), np.arange(len(targets))] = 1.0
        updates = g.resample(updates, axis, sums)
        source_of = np.arange(len(written_rows), dtype=np.int32)
    else:
        source_of = np.zeros(len(written_rows), np.int32)
        source_of[row_of.reshape(-1)] = np.arange(len(targets), dtype=np.int32)  # the last wins
    rows = data.shape[axis]
    source = np.zeros(rows, np.int32)
    source[written_rows] = source_of
    written = np.zeros((rows,) + (1,) * (len(data.shape) - axis - 1), np.float32)
    written[written_rows] = 1.0
    picked = g.gather(updates, g.constant(source, "i32"), axis)
    if reduction == "add":
        picked = g.add(data, picked)
    return g.where(g.constant(written), picked, data)


def fourier(g: Graph, x: Tensor, axis: int, length: int, inverse: bool,
             onesided: bool) -> Tensor:
    """ONNX's DFT of x (..., 1 or 2) along `axis` (a signal axis, before the last): products
    with constant cosine and sine matrices, the signal cut or zero-padded to `length`."""
    n = x.shape[axis]
    if n > length:
        x = g.slice(x, axis, 0, length)
    elif n < length:
        x = g.pad(x, axis, 0, length - n)
    bins = length // 2 + 1 if onesided else length
    angle = 2 * np.pi * np.outer(np.arange(length), np.arange(bins)) / length
    sign, scale = (1.0, 1.0 / length) if inverse else (-1.0, 1.0)
    cos, sin = (g.constant((f(angle) * scale).astype(np.float32)) for f in
                (np.cos, lambda a: sign * np.sin(a)))
    last = len(x.shape) - 1
    order = [a for a in range(last) if a != axis] + [axis]
    parts = [g.reshape(g.slice(x, last, k, k + 1), x.shape[:-1]) for k in range(x.shape[-1])]
    if order != list(range(last)):
        parts = [g.transpose(v, order) for v in parts]
    real, imaginary = matmul(g, parts[0], cos), matmul(g, parts[0], sin)
    if len(parts) == 2:  # (a + ib)(cos + i sin)
        real = g.sub(real, matmul(g, parts[1], sin))
        imaginary = g.add(imaginary, matmul(g, parts[1], cos))
    back = [int(i) for i in np.argsort(order)]
    pair = [g.transpose(v, back) if order != list(range(last)) else v
            for v in (real, imaginary)]
    return g.concat([g.reshape(v, (*v.shape, 1)) for v in pair], last)


def fold(g: Graph, x: Tensor, image: Sequence[int], block: Sequence[int],
         dilations: Sequence[int], pads: Sequence[int], strides: Sequence[int]) -> Tensor:
    """torch's F.fold (ONNX Col2Im) of x (N, C * kh * kw, L) to (N, C, H, W): each column's
    block of values added into the image where it sits (overlaps summed, what falls in the
    padding dropped), a scatter-add at positions known at import (pads: top, left, bottom,
    right)."""
    n, channels, length = x.shape
    (h, w), (kh, kw) = image, block
    blocks = [(size + lo + hi - d * (k - 1) - 1) // s + 1 for size, lo, hi, d, k, s in
              zip((h, w), pads[:2], pads[2:], dilations, (kh, kw), strides)]
    if channels % (kh * kw) or blocks[0] * blocks[1] != length:
        raise Refuse(f"fold of {x.label}: {length} columns for {blocks[0]} x {blocks[1]} "
                     f"blocks of {kh} x {kw} in a {h} x {w} image")
    ki, kj, bi, bj = np.meshgrid(np.arange(kh), np.arange(kw), np.arange(blocks[0]),
                                 np.arange(blocks[1]), indexing="ij")
    rows = bi * strides[0] - pads[0] + ki * dilations[0]
    cols = bj * strides[1] - pads[1] + kj * dilations[1]
    inside = ((rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)).reshape(-1)
    values = g.reshape(x, (n, channels // (kh * kw), kh * kw * length))
    if not inside.all():
        values = g.gather(values, g.constant(np.nonzero(inside)[0].astype(np.int32), "i32"), 2)
    targets = (rows * w + cols).reshape(-1)[inside]
    zeros = g.constant(np.zeros((1, 1, h * w), np.float32))
    image_sums = scatter_along(g, g.expand(zeros, (n, channels // (kh * kw), h * w)), values,
                               targets, 2, "add")
    return g.reshape(image_sums, (n, channels // (kh * kw), h, w))
