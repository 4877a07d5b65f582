"""Reductions: sums, maxima and minima over any axes (log-sum-exp and the L2 norm composed of
them), the row-wise softmax / log-softmax over the last axis (vkml/kernels/reduce.py generates
them), and per thread the cumulative sum, the index of the maximum or minimum, and the rank
of each element (argsort, from which sort and topk gather) along an axis."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.errors import GraphError
from vkml.expr import Arg, call, contiguous_strides
from vkml.graph import Graph, OpDef, Tensor, builder, normalize_axes, normalize_axis, register
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gather
from vkml.kernels import reduce as kernels
from vkml.kernels.common import check_loop, is_nan, offset
from vkml.ops.pointwise import binary_f32, same_f32


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


register(OpDef("sum", _reduced, "kernel", grad=_sum_grad, lower=kernels.generate_sum,
               fusion="sum", fused="fused_sum"))


@builder(tensor=True)
def sum(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,  # noqa: A001
        keepdims: bool = False) -> Tensor:
    """Sum over `axis` (all axes by default)."""
    return _reduce(g, "sum", x, normalize_axes(x, axis), keepdims)


def _reduce(g: Graph, op: str, x: Tensor, axes: tuple[int, ...], keepdims: bool) -> Tensor:
    """`op` over `axes`, leaving out the axes of size 1: reducing over one element is a
    reshape (no kernel, no memory: a batch-of-1 weight gradient summed over its batch axis
    would be a whole pass), and the kernel sees the simpler shape."""
    real = tuple(a for a in axes if x.shape[a] != 1)
    out = g.apply(op, [x], axes=real) if real else x
    if keepdims:
        shape = _kept(x, axes)
    else:
        shape = [n for i, n in enumerate(x.shape) if i not in axes]
    return out if out.shape == tuple(shape) else g.reshape(out, shape)


def _extreme_grad(g, node, d):
    # torch.amax's and amin's rule: the gradient is shared evenly among the elements equal to
    # the extreme.
    (x,) = node.inputs
    kept = _kept(x, node.attrs["axes"])
    hit = g.apply("equal", [x, g.reshape(node, kept)])
    share = g.div(g.reshape(d, kept), g.reshape(g.sum(hit, node.attrs["axes"]), kept))
    return [g.mul(hit, share)]


register(OpDef("amax", _reduced, "kernel", grad=_extreme_grad, lower=kernels.generate_amax))
register(OpDef("amin", _reduced, "kernel", grad=_extreme_grad, lower=kernels.generate_amin))
# The largest finite magnitude, which the backward pass's f16 products scale by
# (compiler/scale.py); made after differentiation, so it has no gradient.
register(OpDef("abs_max", _reduced, "kernel",
               lower=lambda node, caps: kernels.generate_amax(node, caps, magnitude=True)))


@builder
def amax(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
         keepdims: bool = False) -> Tensor:
    """torch.amax: the maximum over `axis` (all axes by default)."""
    return _reduce(g, "amax", x, normalize_axes(x, axis), keepdims)


@builder
def amin(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
         keepdims: bool = False) -> Tensor:
    """torch.amin: the minimum over `axis` (all axes by default)."""
    return _reduce(g, "amin", x, normalize_axes(x, axis), keepdims)


@builder
def logsumexp(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
              keepdims: bool = False) -> Tensor:
    """torch.logsumexp / ONNX ReduceLogSumExp over `axis`: log(sum(exp(x - m))) + m with m the
    maximum, so no exponential overflows; as torch, m = 0 where the maximum is infinite, so
    a +inf gives +inf and all -inf gives -inf (not inf - inf = NaN). The result does not
    depend on m, so no gradient flows through it: the gradient is d softmax(x) as torch's
    (through m it would add d and take it away, inf - inf = NaN for an infinite d)."""
    axes = normalize_axes(x, axis)
    top = g.amax(x, axes, keepdims=True)
    top = g.stop_gradient(g.where(g.isinf(top), 0.0, top))
    out = g.add(g.log(g.sum(g.exp(g.sub(x, top)), axes, keepdims=True)), top)
    return out if keepdims else g.reshape(out, [n for i, n in enumerate(x.shape) if i not in axes])


# The L2 norm is 2^e sqrt(sum((x 2^-e)^2)) with 2^(e - 1) <= s < 2^e for s the largest finite
# magnitude (e = 0 where none is above 0), as BLAS's nrm2 scales, so that no square overflows
# (past 1.8e19) or underflows; infinities and NaN pass through the sum as torch's. A power of
# two applied by ldexp is exact, where x / s is not on GPUs: Vulkan bounds a division's error
# only for divisors up to 2^126, and the H200's took x / 1.4e38 to 0 (x times a reciprocal
# flushed to zero). The gradient x / norm: e, a constant, passes none, and the scalings down
# and up pass the gradient unscaled: every step between them is linear in the gradient, so the
# two factors cancel, and d 2^e (past f32's range for a large upstream d) is never formed.
register(OpDef("norm_scale", same_f32, "pointwise",
               expr=lambda n: call("select(f32(frexp({0}).exp), 0.0, {0} == 0.0)", Arg(0))))
for _name, _sign in (("norm_scale_down", "-"), ("norm_scale_up", "")):
    register(OpDef(_name, binary_f32, "pointwise", grad=lambda g, node, d: [d, None],
                   expr=lambda n, sign=_sign: call(f"ldexp({{0}}, {sign}i32({{1}}))",
                                                   Arg(0), Arg(1))))


@builder
def reduce_l2(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
              keepdims: bool = False) -> Tensor:
    """ONNX ReduceL2 (torch.linalg.vector_norm of order 2) over `axis`: sqrt(sum(x^2)),
    scaled by the largest magnitude (finite for any finite result)."""
    axes = normalize_axes(x, axis)
    largest = g.apply("abs_max", [x], axes=axes)
    scale = g.apply("norm_scale", [g.reshape(largest, _kept(x, axes))])
    unit = g.apply("norm_scale_down", [x, scale])
    root = g.apply("norm_sqrt", [g.sum(g.square(unit), axes, keepdims=True)])
    out = g.apply("norm_scale_up", [root, scale])
    return out if keepdims else g.reshape(out, [n for i, n in enumerate(x.shape)
                                                if i not in axes])


def _arg_extreme(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32" or not x.shape:
        raise GraphError(f"expects an f32 tensor of rank >= 1, got {x.type}")
    return tuple(d for i, d in enumerate(x.shape) if i != attrs["axis"]), "i32"


def _arg_extreme_kernel(node: Tensor, caps: Capabilities) -> Kernel:
    """One thread per output element scanning the axis in order: the first index of the
    extreme, or of the first NaN, as torch's argmax and argmin."""
    (x,) = node.inputs
    axis, n = node.attrs["axis"], x.shape[node.attrs["axis"]]
    check_loop(node, caps, n, f"{node.op} over a shorter axis")
    indices = [f"i{a}" for a in range(len(node.shape))]
    strides = contiguous_strides(x.shape)
    at = offset([*indices[:axis], "j", *indices[axis:]], strides)
    better = ">" if node.op == "argmax" else "<"
    return gather.generate(node, caps, [
        f"  var j = 0u; var best = in0[{at}]; var found = 0u;",
        f"  for (j = 1u; j < {n}u; j++) {{",
        f"    let v = in0[{at}];",
        f"    if (!{is_nan('best')} && (v {better} best || {is_nan('v')})) {{ best = v; "
        "found = j; }",
        "  }",
        "  out[idx] = i32(found);"], flops=node.size * n)


def _positions(node: Tensor) -> tuple[int, int]:
    """argmax's, argmin's and argsort's values: positions along their input's axis."""
    return 0, node.inputs[0].shape[node.attrs["axis"]]


for _name in ("argmax", "argmin"):
    register(OpDef(_name, _arg_extreme, "kernel", lower=_arg_extreme_kernel,
                   index_range=_positions))


def _arg(g: Graph, op: str, x: Tensor, axis: int, keepdims: bool) -> Tensor:
    a = normalize_axis(x, axis, op)
    out = g.apply(op, [x], axis=a)
    return g.reshape(out, [1 if i == a else n for i, n in enumerate(x.shape)]) if keepdims else out


@builder
def argmax(g: Graph, x: Tensor, axis: int = -1, keepdims: bool = False) -> Tensor:
    """torch.argmax along `axis` as i32 (the first index of the maximum; of the first NaN where
    there is one); no gradient."""
    return _arg(g, "argmax", x, axis, keepdims)


@builder
def argmin(g: Graph, x: Tensor, axis: int = -1, keepdims: bool = False) -> Tensor:
    """torch.argmin along `axis` as i32 (the first index of the minimum; of the first NaN where
    there is one); no gradient."""
    return _arg(g, "argmin", x, axis, keepdims)


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
    exclusive = node.attrs.get("exclusive", False)
    span = (f"j = i{axis}{' + 1u' if exclusive else ''}; j < {n}u" if reverse
            else f"j = 0u; j {'<' if exclusive else '<='} i{axis}")
    return gather.generate(node, caps, [
        f"  let base = idx - i{axis} * {stride}u;",
        f"  var acc = {'0.0' if node.dtype == 'f32' else '0i'};",
        f"  for (var {span}; j++) {{ acc += in0[base + j * {stride}u]; }}",
        "  out[idx] = acc;"], flops=node.size * n)


def _same_number(inputs, attrs):
    """f32 in, f32 out; i32 in, i32 out (a running count: RoBERTa's position ids), wrapping as
    torch's int32 sums do."""
    (x,) = inputs
    return x.shape, x.dtype


register(OpDef("cumsum", _same_number, "kernel", lower=_cumsum_kernel,
               grad=lambda g, node, d: [g.apply("cumsum", [d], **(node.attrs | {
                   "reverse": not node.attrs["reverse"]}))]))


@builder
def cumsum(g: Graph, x: Tensor, axis: int = -1, reverse: bool = False,
           exclusive: bool = False) -> Tensor:
    """torch.cumsum along `axis`; `reverse`: sums from the end (the gradient of cumsum);
    `exclusive`: each sum leaves its own element out (ONNX CumSum's exclusive=1)."""
    a = normalize_axis(x, axis, "cumsum")
    return g.apply("cumsum", [x], axis=a, reverse=bool(reverse),
                   **({"exclusive": True} if exclusive else {}))


def _argsort_kernel(node: Tensor, caps: Capabilities) -> Kernel:
    """One thread per element: its rank along the axis is how many elements come before it
    (greater when descending, smaller when ascending, NaN greater than every number; equal ones
    by index: a stable sort), and it writes its index at that rank. Every rank of a row is
    taken by exactly one element, so each output is written once. O(n^2) work over an axis of
    n, meant for short axes."""
    axis, descending = node.attrs["axis"], node.attrs["descending"]
    n, stride = node.shape[axis], contiguous_strides(node.shape)[axis]
    check_loop(node, caps, n, "argsort over a shorter axis")
    # NaN tests around each comparison: a driver may not assume how a NaN compares
    before = (f"!{is_nan('b')} && (a > b || {is_nan('a')})" if descending
              else f"!{is_nan('a')} && (a < b || {is_nan('b')})")
    return gather.generate(node, caps, [
        f"  let base = idx - i{axis} * {stride}u;", "  let v = in0[idx];", "  var rank = 0u;",
        f"  for (var j = 0u; j < {n}u; j++) {{",
        f"    let w = in0[base + j * {stride}u];",
        f"    if (precedes(w, v) || (j < i{axis} && !precedes(v, w))) {{ rank++; }}",
        "  }",
        f"  out[base + rank * {stride}u] = i32(i{axis});"], flops=node.size * n,
        prelude=["fn precedes(a: f32, b: f32) -> bool {", f"  return {before};", "}"])


def _argsorted(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32" or not x.shape:
        raise GraphError(f"expects an f32 tensor of rank >= 1, got {x.type}")
    return x.shape, "i32"


register(OpDef("argsort", _argsorted, "kernel", lower=_argsort_kernel, index_range=_positions))


@builder
def argsort(g: Graph, x: Tensor, axis: int = -1, descending: bool = False) -> Tensor:
    """torch.argsort(stable=True) along `axis` as i32: the indices that sort `x` (NaN last
    ascending, first descending; equal values in their order); no gradient."""
    a = normalize_axis(x, axis, "argsort")
    return g.apply("argsort", [x], axis=a, descending=bool(descending))


@builder
def sort(g: Graph, x: Tensor, axis: int = -1, descending: bool = False
         ) -> tuple[Tensor, Tensor]:
    """torch.sort(stable=True): (the values sorted along `axis`, their i32 indices in `x`);
    the values' gradient goes back to the elements they came from."""
    indices = g.argsort(x, axis, descending)
    return g.gather_elements(x, indices, axis), indices


@builder
def topk(g: Graph, x: Tensor, k: int, axis: int = -1, largest: bool = True
         ) -> tuple[Tensor, Tensor]:
    """torch.topk / ONNX TopK: (the `k` largest, or smallest, values along `axis` in order,
    their i32 indices); equal values by index, as ONNX orders them."""
    a = normalize_axis(x, axis, "topk")
    if not isinstance(k, int) or not 1 <= k <= x.shape[a]:
        raise GraphError(f"topk: k must be an int in [1, {x.shape[a]}] for axis {a} of "
                         f"{x.label}, got {k!r}")
    indices = g.argsort(x, a, largest)
    if k < x.shape[a]:
        indices = g.slice(indices, a, 0, k)
    return g.gather_elements(x, indices, a), indices
