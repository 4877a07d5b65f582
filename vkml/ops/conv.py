"""2-D convolution and max pooling over NCHW tensors, with PyTorch's conventions (weight
(out, in/groups, kh, kw); stride, padding, dilation, groups). vkml/kernels/conv.py generates them
as implicit GEMMs on the GEMM core, reading the input through the im2col index map without
materialising it; CPU drivers get kernels of their own (vkml/kernels/conv_cpu.py). The
transposed convolution is the input gradient's kernel; 1-D convolution, average and
global-average pooling are compositions (ops/composite.py)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from vkml.errors import GraphError
from vkml.graph import Graph, OpDef, Tensor, builder, register
from vkml.kernels import conv as kernels
from vkml.kernels import conv_cpu, gemm


def _geometry(x_shape, w_shape, a) -> tuple[int, ...]:
    n, c, h, w = x_shape
    o, cpg, kh, kw = w_shape
    groups = a["groups"]
    if c % groups or o % groups or cpg != c // groups:
        raise GraphError(f"conv2d: input channels {c}, weight {w_shape}, groups {groups} "
                         "do not agree (weight must be (out, in/groups, kh, kw))")
    oh = kernels.out_extent(h, kh, a["stride"][0], a["padding"][0], a["dilation"][0])
    ow = kernels.out_extent(w, kw, a["stride"][1], a["padding"][1], a["dilation"][1])
    if oh <= 0 or ow <= 0:
        raise GraphError(f"conv2d: the kernel {kh}x{kw} does not fit the padded input {h}x{w}")
    return n, o, oh, ow


def _conv2d(inputs, attrs):
    x, w = inputs
    if len(x.shape) != 4 or len(w.shape) != 4 or x.dtype != "f32" or w.dtype != "f32":
        raise GraphError(f"conv2d takes f32 NCHW input and OIHW weight, got {x.type}, {w.type}")
    return _geometry(x.shape, w.shape, attrs), "f32"


def _conv_attrs(a) -> dict:
    return {k: a[k] for k in ("stride", "padding", "dilation", "groups")}


def _conv2d_grad(g, node, d):
    x, w = node.inputs
    a = _conv_attrs(node.attrs)
    return [g.apply("conv2d_input_grad", [d, w], in_shape=x.shape, **a),
            g.apply("conv2d_weight_grad", [x, d], w_shape=w.shape, **a)]


def by_device(on_gemm, on_cpu, dims, partials=None) -> dict:
    """A convolution's lowering and split rule: on CPU drivers their own kernel where its loops
    fit (kernels/conv_cpu.py), elsewhere the GEMM core's, split as the core decides for
    `dims(node, caps)`, the shape of one of its grid layers, times the `partials(node, caps)`
    that its kernel sums in any case (phased input gradients: one a tap)."""
    def cpu_kernel(node: Tensor, caps) -> bool:
        return gemm.on_cpu(caps) and conv_cpu.handles(node, caps)

    def lower(node: Tensor, caps):
        return (on_cpu if cpu_kernel(node, caps) else on_gemm)(node, caps)

    def splits(node: Tensor, caps) -> int:
        if cpu_kernel(node, caps):
            return 1
        pieces = gemm.splits(*dims(node, caps), caps, plain=kernels.plain(node),
                             coop_min=kernels.coop_min(node))
        return pieces * (partials(node, caps) if partials is not None else 1)

    return {"lower": lower, "splits": splits}


def channels_last(node: Tensor, caps) -> tuple[tuple[tuple[str, dict] | None, ...], dict] | None:
    """OpDef.layouts of a forward convolution (and its fused form): its operands copied
    channels-last in f16 where its kernels read them so on the target (kernels/conv.py
    `channels_last`; a pointwise one's weight is read as it is, `weight_copied`); the node
    keeps its NCHW shapes as attributes."""
    if not kernels.channels_last(node, caps):
        return None
    x, w = node.inputs[:2]
    copy = (kernels.CHANNELS_LAST, {})
    return (copy, copy if kernels.weight_copied(node) else None), {
        **node.attrs, "operands": kernels.CHANNELS_LAST, "x_shape": x.shape, "w_shape": w.shape}


def stores_channels_last(node: Tensor, layout: str) -> bool:
    """OpDef.stores of a forward convolution (and of a sum, the split ones' last step): its
    kernel writes a channels-last copy's layout itself where the copy would pad nothing."""
    return (layout == kernels.CHANNELS_LAST and len(node.shape) == 4 and node.dtype == "f32"
            and node.shape[1] % kernels.CHANNEL_QUAD == 0 and "splits" not in node.attrs
            and "store" not in node.attrs)


register(OpDef("conv2d", _conv2d, "kernel", grad=_conv2d_grad, fusion="product",
               fused="fused_conv2d", layouts=channels_last, stores=stores_channels_last,
               **by_device(kernels.generate_conv2d, conv_cpu.generate_conv2d,
                           kernels.dims_conv2d)))


def _channels_last_copy(inputs, attrs):
    """(A, C, H, W) f32 -> (A, H, W, C padded to a multiple of 4) f16, two halves an element."""
    (x,) = inputs
    if len(x.shape) != 4 or x.dtype != "f32":
        raise GraphError(f"{kernels.CHANNELS_LAST} takes an f32 4-D tensor, got {x.type}")
    a, c, h, w = x.shape
    return (a, h, w, kernels.padded_channels(c) // 2), "i32"


# Made only by the layout rewrite (compiler/layouts.py) for inference, so without a gradient.
register(OpDef(kernels.CHANNELS_LAST, _channels_last_copy, "kernel",
               lower=kernels.generate_channels_last))


@builder
def conv2d(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1,
           padding=0, dilation=1, groups: int = 1) -> Tensor:
    """F.conv2d: weight (out, in/groups, kh, kw); int or (h, w) stride/padding/dilation."""
    y = g.apply("conv2d", [x, weight], stride=pair(stride, "conv2d stride", 1),
                padding=pair(padding, "conv2d padding", 0),
                dilation=pair(dilation, "conv2d dilation", 1),
                groups=groups_of(groups, "conv2d"))
    if bias is not None:
        y = g.add(y, g.reshape(bias, (bias.size, 1, 1)))
    return y


@builder
def conv_transpose2d(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1,
                     padding=0, output_padding=0, dilation=1, groups: int = 1) -> Tensor:
    """F.conv_transpose2d: weight (in, out/groups, kh, kw). It is the input gradient of the
    conv2d that maps its output back to x, so it runs on that kernel, and its gradients are
    that conv2d and conv2d's weight gradient."""
    if len(x.shape) != 4 or len(weight.shape) != 4 or weight.shape[0] != x.shape[1]:
        raise GraphError(f"conv_transpose2d takes NCHW input and (in, out/groups, kh, kw) "
                         f"weight with in = the input's channels, got {x.type}, {weight.type}")
    what = "conv_transpose2d"
    stride, padding = pair(stride, f"{what} stride", 1), pair(padding, f"{what} padding", 0)
    dilation, extra = pair(dilation, f"{what} dilation", 1), pair(output_padding,
                                                                  f"{what} output_padding", 0)
    groups = groups_of(groups, what)
    if any(e >= s for e, s in zip(extra, stride)):
        raise GraphError(f"conv_transpose2d: output_padding {extra} must be smaller than the "
                         f"stride {stride}")
    n, _, h, w = x.shape
    size = [(i - 1) * s - 2 * p + d * (k - 1) + e + 1 for i, s, p, d, k, e in
            zip((h, w), stride, padding, dilation, weight.shape[2:], extra)]
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    shape = (n, weight.shape[1] * groups, *size)
    if min(size) <= 0 or _geometry(shape, weight.shape, attrs) != x.shape:
        raise GraphError(f"conv_transpose2d: no output size fits {x.type} with weight "
                         f"{weight.type} and {attrs} (the output would be {shape})")
    y = g.apply("conv2d_input_grad", [x, weight], in_shape=shape, **attrs)
    if bias is not None:
        y = g.add(y, g.reshape(bias, (bias.size, 1, 1)))
    return y


def _input_grad(inputs, attrs):  # (d output, weight) -> d input: a transposed convolution
    return attrs["in_shape"], "f32"


def _input_grad_grad(g, node, d):
    dy, w = node.inputs
    a = _conv_attrs(node.attrs)
    return [g.apply("conv2d", [d, w], **a),
            g.apply("conv2d_weight_grad", [d, dy], w_shape=w.shape, **a)]


def _weight_grad(inputs, attrs):  # (input, d output) -> d weight
    return attrs["w_shape"], "f32"


def _weight_grad_grad(g, node, d):
    x, dy = node.inputs
    a = _conv_attrs(node.attrs)
    return [g.apply("conv2d_input_grad", [dy, d], in_shape=x.shape, **a),
            g.apply("conv2d", [x, d], **a)]


register(OpDef("conv2d_input_grad", _input_grad, "kernel", grad=_input_grad_grad,
               fusion="product", fused="fused_conv2d_input_grad",
               **by_device(kernels.generate_conv2d_input_grad,
                           conv_cpu.generate_conv2d_input_grad, kernels.dims_conv2d_input_grad,
                           kernels.phase_taps)))
register(OpDef("conv2d_weight_grad", _weight_grad, "kernel", grad=_weight_grad_grad,
               **by_device(kernels.generate_conv2d_weight_grad,
                           conv_cpu.generate_conv2d_weight_grad,
                           kernels.dims_conv2d_weight_grad)))


def _max_pool2d(inputs, attrs):
    (x,) = inputs
    if len(x.shape) != 4 or x.dtype != "f32":
        raise GraphError(f"max_pool2d takes an f32 NCHW tensor, got {x.type}")
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    if ph > kh // 2 or pw > kw // 2:
        raise GraphError("max_pool2d: padding must be at most half the kernel (PyTorch's rule)")
    n, c, h, w = x.shape
    ceil = attrs.get("ceil_mode", False)
    return (n, c, pool_extent(h, kh, sh, ph, ceil), pool_extent(w, kw, sw, pw, ceil)), "f32"


def pool_extent(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool) -> int:
    """Pooling windows along an axis; with ceil_mode a last partial window too, if it starts
    inside the input or its left padding (PyTorch's rule; its taps outside are skipped)."""
    if not ceil_mode:
        out = kernels.out_extent(size, kernel, stride, pad, 1)
    else:
        out = -(-(size + 2 * pad - kernel) // stride) + 1
        out = out - 1 if (out - 1) * stride >= size + pad else out
    if out < 1:  # PyTorch refuses too ("Output size is too small")
        raise GraphError(f"pooling: a window of {kernel} (stride {stride}, padding {pad}"
                         f"{', ceil_mode' if ceil_mode else ''}) does not fit an input axis of "
                         f"{size}: no output position; use a smaller kernel or more padding")
    return out


def _max_pool2d_grad(g, node, d):
    # Each input element receives the gradient of every window whose (first) maximum it is.
    (x,) = node.inputs
    return [g.apply("max_pool2d_backward", [x, d], **node.attrs)]


register(OpDef("max_pool2d", _max_pool2d, "kernel", grad=_max_pool2d_grad,
               lower=kernels.generate_max_pool2d))
register(OpDef("max_pool2d_backward", lambda inputs, attrs: (inputs[0].shape, "f32"), "kernel",
               lower=kernels.generate_max_pool2d_backward))


@builder
def max_pool2d(g: Graph, x: Tensor, kernel_size, stride=None, padding=0,
               ceil_mode: bool = False) -> Tensor:
    """F.max_pool2d (the first maximum of a window takes its gradient, as PyTorch's);
    `ceil_mode`: a last window that runs past the input where it starts inside it."""
    kernel = pair(kernel_size, "max_pool2d kernel_size", 1)
    return g.apply("max_pool2d", [x], kernel=kernel,
                   stride=kernel if stride is None else pair(stride, "max_pool2d stride", 1),
                   padding=pair(padding, "max_pool2d padding", 0),
                   **({"ceil_mode": True} if ceil_mode else {}))


def pair(v, what: str, least: int) -> tuple[int, int]:
    """An int, or an (h, w) pair of ints (one alone applies to both, as torch takes them), as
    (h, w), each at least `least`; else a GraphError naming `what` ("conv2d stride")."""
    values = (v, v) if isinstance(v, numbers.Integral) else (
        tuple(v) * (2 if len(v) == 1 else 1) if isinstance(v, Sequence | np.ndarray) else ())
    if (len(values) != 2 or not all(isinstance(n, numbers.Integral) for n in values)
            or min(values) < least):
        raise GraphError(f"{what} takes an int or an (h, w) pair of ints, each >= {least}, "
                         f"got {v!r}")
    return int(values[0]), int(values[1])


def groups_of(groups, what: str) -> int:
    if not isinstance(groups, numbers.Integral) or groups < 1:
        raise GraphError(f"{what}: groups must be an int >= 1, got {groups!r}")
    return int(groups)
