"""Reductions: sums and maxima over any axes, the row-wise softmax / log-softmax over the last
axis (vkml/kernels/reduce.py generates them), and the cumulative sum along an axis."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.errors import GraphError
from vkml.expr import contiguous_strides
from vkml.graph import Graph, OpDef, Tensor, builder, normalize_axes, register
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gather
from vkml.kernels import reduce as kernels
from vkml.kernels.common import check_loop
from vkml.ops.pointwise import same_f32


def _reduced(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32":
        raise GraphError(f"expects f32, got {x.dtype}")
    return tuple(d for i, d in enumerate(x.shape) if i not in attrs["axes"]), "f32"


def _kept(x: Tensor, axes: tuple[int, ...]) -> list[int]:
    """x's shape with the reduced axes as 1 (keepdims)."""
    return [1 if i in axes else n for i, n in enumerate(x.shape)]


def _sum_grad(g, node, d):
    (x,) = node.inputs
    return [g.broadcast_to(g.reshape(d, _kept(x, node.attrs["axes"])), x.shape)]


register(OpDef("sum", _reduced, "kernel", grad=_sum_grad, lower=kernels.generate_sum))


@builder(tensor=True)
def sum(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,  # noqa: A001
        keepdims: bool = False) -> Tensor:
    """Sum over `axis` (all axes by default)."""
    return _reduce(g, "sum", x, normalize_axes(x, axis), keepdims)


def _reduce(g: Graph, op: str, x: Tensor, axes: tuple[int, ...], keepdims: bool) -> Tensor:
    """`op` over `axes`, leaving out the axes of size 1: reducing over one element is a
    reshape (no kernel, no memory: a batch-of-1 weight gradient summed over its batch axis
    cost 80 ms as a kernel on lavapipe), and the kernel sees the simpler shape."""
    real = tuple(a for a in axes if x.shape[a] != 1)
    out = g.apply(op, [x], axes=real) if real else x
    if keepdims:
        shape = _kept(x, axes)
    else:
        shape = [n for i, n in enumerate(x.shape) if i not in axes]
    return out if out.shape == tuple(shape) else g.reshape(out, shape)


def _amax_grad(g, node, d):
    # torch.amax's rule: the gradient is shared evenly among the elements equal to the maximum.
    (x,) = node.inputs
    kept = _kept(x, node.attrs["axes"])
    hit = g.apply("equal", [x, g.reshape(node, kept)])
    share = g.div(g.reshape(d, kept), g.reshape(g.sum(hit, node.attrs["axes"]), kept))
    return [g.mul(hit, share)]


register(OpDef("amax", _reduced, "kernel", grad=_amax_grad, lower=kernels.generate_amax))
# The largest magnitude, which the backward pass's f16 products scale by (compiler/scale.py);
# made after differentiation, so it has no gradient.
register(OpDef("abs_max", _reduced, "kernel",
               lower=lambda node, caps: kernels.generate_amax(node, caps, magnitude=True)))


@builder
def amax(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
         keepdims: bool = False) -> Tensor:
    """torch.amax: the maximum over `axis` (all axes by default)."""
    return _reduce(g, "amax", x, normalize_axes(x, axis), keepdims)


def _rowwise(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32" or not x.shape:
        raise GraphError(f"expects an f32 tensor of rank >= 1, got {x.type}")
    return x.shape, "f32"


def _softmax_grad(g, node, d):
    # d softmax: y * (d - sum(d * y)) over the row
    return [g.mul(node, g.sub(d, g.sum(g.mul(d, node), -1, keepdims=True)))]


def _log_softmax_grad(g, node, d):
    # d log_softmax: d - softmax(x) * sum(d) over the row, softmax(x) = exp(y)
    return [g.sub(d, g.mul(g.exp(node), g.sum(d, -1, keepdims=True)))]


register(OpDef("softmax", _rowwise, "kernel", grad=_softmax_grad,
               lower=kernels.generate_softmax))
register(OpDef("log_softmax", _rowwise, "kernel", grad=_log_softmax_grad,
               lower=kernels.generate_log_softmax))


@builder(tensor=True)
def softmax(g: Graph, x: Tensor) -> Tensor:
    """Softmax over the last axis."""
    return g.apply("softmax", [x])


@builder(tensor=True)
def log_softmax(g: Graph, x: Tensor) -> Tensor:
    """Log-softmax over the last axis."""
    return g.apply("log_softmax", [x])


def _cumsum_kernel(node: Tensor, caps: Capabilities) -> Kernel:
    """One thread per output element summing its prefix (or suffix) in order, as torch's
    sequential cumsum adds: O(n^2) work over an axis of n, meant for short axes."""
    axis, reverse = node.attrs["axis"], node.attrs["reverse"]
    n, stride = node.shape[axis], contiguous_strides(node.shape)[axis]
    check_loop(node, caps, n, "cumsum over a shorter axis (e.g. in parts, adding each part's "
               "total to the next)")
    span = f"j = i{axis}; j < {n}u" if reverse else f"j = 0u; j <= i{axis}"
    return gather.generate(node, caps, [
        f"  let base = idx - i{axis} * {stride}u;", "  var acc = 0.0;",
        f"  for (var {span}; j++) {{ acc += in0[base + j * {stride}u]; }}",
        "  out[idx] = acc;"], flops=node.size * n)


register(OpDef("cumsum", same_f32, "kernel", lower=_cumsum_kernel,
               grad=lambda g, node, d: [g.apply("cumsum", [d], axis=node.attrs["axis"],
                                                reverse=not node.attrs["reverse"])]))


@builder
def cumsum(g: Graph, x: Tensor, axis: int = -1, reverse: bool = False) -> Tensor:
    """torch.cumsum along `axis`; `reverse`: sums from the end (the gradient of cumsum)."""
    (a,) = normalize_axes(x, axis)
    return g.apply("cumsum", [x], axis=a, reverse=bool(reverse))
