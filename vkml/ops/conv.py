"""2-D convolution and max pooling over NCHW tensors, with PyTorch's conventions (weight
(out, in/groups, kh, kw); stride, padding, dilation, groups). All lower to the "conv" archetype
(`vkml/kernels/conv.py`), reading the input through the im2col index map without materialising
it: the forward and the input gradient as register-tiled implicit GEMMs, the weight gradient one
workgroup per weight element reducing over batch x output pixels. 1-D convolution,
average and global-average pooling are compositions (graph.py)."""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.ops import OpDef, register


def out_extent(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _geometry(x_shape, w_shape, a) -> tuple[int, ...]:
    n, c, h, w = x_shape
    o, cpg, kh, kw = w_shape
    groups = a["groups"]
    if c % groups or o % groups or cpg != c // groups:
        raise GraphError(f"conv2d: input channels {c}, weight {w_shape}, groups {groups} "
                         "do not agree (weight must be (out, in/groups, kh, kw))")
    oh = out_extent(h, kh, a["stride"][0], a["padding"][0], a["dilation"][0])
    ow = out_extent(w, kw, a["stride"][1], a["padding"][1], a["dilation"][1])
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


register(OpDef("conv2d", _conv2d, "conv", grad=_conv2d_grad))


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


register(OpDef("conv2d_input_grad", _input_grad, "conv", grad=_input_grad_grad))
register(OpDef("conv2d_weight_grad", _weight_grad, "conv", grad=_weight_grad_grad))


def _max_pool2d(inputs, attrs):
    (x,) = inputs
    if len(x.shape) != 4 or x.dtype != "f32":
        raise GraphError(f"max_pool2d takes an f32 NCHW tensor, got {x.type}")
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    if ph > kh // 2 or pw > kw // 2:
        raise GraphError("max_pool2d: padding must be at most half the kernel (PyTorch's rule)")
    n, c, h, w = x.shape
    return (n, c, out_extent(h, kh, sh, ph, 1), out_extent(w, kw, sw, pw, 1)), "f32"


def _max_pool2d_grad(g, node, d):
    # Each input element receives the gradient of every window whose (first) maximum it is.
    (x,) = node.inputs
    return [g.apply("max_pool2d_backward", [x, d], **node.attrs)]


register(OpDef("max_pool2d", _max_pool2d, "conv", grad=_max_pool2d_grad))
register(OpDef("max_pool2d_backward", lambda inputs, attrs: (inputs[0].shape, "f32"), "conv"))
