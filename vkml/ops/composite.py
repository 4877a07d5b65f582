"""Ops built from other ops: losses, normalisations, attention, rotary embedding, SwiGLU, 1-D
convolution, pooling, upsampling and resizing, split, mean. Autodiff differentiates them through
their parts and the rewrite stage fuses their pointwise parts into the reductions and matmuls
around them, so none needs a kernel of its own, and only batch norm's training form a gradient
rule (`normalized`: two sums where its parts' rules make four). PyTorch's conventions throughout
(biased variance, eps inside the square root, affine parameters per normalised element or per
channel)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from vkml.errors import GraphError
from vkml.expr import Arg, call
from vkml.graph import Graph, OpDef, Tensor, builder, normalize_axes, normalize_axis, register
from vkml.ops.conv import pair, pool_extent
from vkml.ops.pointwise import broadcast_shapes, sum_to


@builder(tensor=True)
def mean(g: Graph, x: Tensor, axis: int | Sequence[int] | None = None,
         keepdims: bool = False) -> Tensor:
    """Mean over `axis` (all axes by default)."""
    axes = normalize_axes(x, axis)
    count = int(np.prod([x.shape[i] for i in axes], dtype=np.int64))
    return g.mul(g.sum(x, axes, keepdims), 1.0 / count)


# ---- losses -------------------------------------------------------------------------------------
@builder
def cross_entropy(g: Graph, logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the rows of 2-D `logits`. `labels`: class indices (i32, shape
    (rows,)) or target probabilities / one-hot rows (f32, same shape as logits). As torch's:
    with class indices a -inf logit of another class changes nothing (its log-probability is
    picked out, not multiplied by 0: 0 * -inf is NaN); with probabilities it is NaN."""
    if len(logits.shape) != 2:
        raise GraphError(f"cross_entropy: logits {logits.label} must be 2-D (rows, classes)")
    rows, classes = logits.shape
    if labels.dtype == "i32":
        if labels.shape != (rows,):
            raise GraphError(f"cross_entropy: class-index labels {labels.label} must have "
                             f"shape ({rows},) to match logits {logits.label}")
        return g.mul(g.sum(picked_log_probabilities(g, logits, labels)), -1.0 / rows)
    if labels.shape != logits.shape:
        raise GraphError(f"cross_entropy: labels {labels.label} must have shape "
                         f"{logits.shape} like logits {logits.label}, or be i32 indices of "
                         f"shape ({rows},)")
    return g.mul(g.sum(g.mul(labels, g.log_softmax(logits))), -1.0 / rows)


def picked_log_probabilities(g: Graph, logits: Tensor, labels: Tensor) -> Tensor:
    """(rows, classes): each row's log-softmax at its i32 label, 0 elsewhere."""
    return g.where(g.one_hot(labels, logits.shape[-1]), g.log_softmax(logits), 0.0)


@builder
def mse(g: Graph, prediction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over all elements."""
    if prediction.shape != target.shape:
        raise GraphError(f"mse: prediction {prediction.label} and target {target.label} "
                         "must have the same shape")
    diff = g.sub(prediction, target)
    return g.mean(g.mul(diff, diff))


# ---- normalisations -----------------------------------------------------------------------------
def _statistics(g: Graph, x: Tensor, axes: tuple[int, ...], eps: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The mean over `axes`, x minus it, and 1 / sqrt(biased variance + eps)."""
    mean = g.mean(x, axes, keepdims=True)
    centred = g.sub(x, mean)
    var = g.mean(g.square(centred), axes, keepdims=True)
    return mean, centred, g.rsqrt(g.add(var, float(eps)))


def _normalize(g: Graph, x: Tensor, axes: tuple[int, ...], eps: float) -> Tensor:
    _, centred, rstd = _statistics(g, x, axes, eps)
    return g.mul(centred, rstd)


def _affine(g: Graph, y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = g.mul(y, weight)
    if bias is not None:
        y = g.add(y, bias)
    return y


@builder
def layer_norm(g: Graph, x: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[len(x.shape) - len(shape):]) != shape:
        raise GraphError(f"layer_norm: {x.label} does not end in {shape}")
    axes = tuple(range(len(x.shape) - len(shape), len(x.shape)))
    return _affine(g, _normalize(g, x, axes, eps), weight, bias)


@builder
def rms_norm(g: Graph, x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x^2, last axis) + eps) * weight (LLaMA's RMSNorm, F.rms_norm)."""
    ms = g.mean(g.square(x), -1, keepdims=True)
    return _affine(g, g.mul(x, g.rsqrt(g.add(ms, float(eps)))), weight, None)


def _per_channel(g: Graph, p: Tensor | None, x: Tensor) -> Tensor | None:
    """A (C,) parameter shaped to broadcast over an (N, C, ...) tensor."""
    if p is None:
        return None
    if p.shape != (x.shape[1],):
        raise GraphError(f"{p.label} must have shape ({x.shape[1]},) (one per channel of "
                         f"{x.label})")
    return g.reshape(p, (x.shape[1],) + (1,) * (len(x.shape) - 2))


@builder
def group_norm(g: Graph, x: Tensor, num_groups: int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    _require_channels(x, "group_norm")
    if not isinstance(num_groups, numbers.Integral) or num_groups < 1:
        raise GraphError(f"group_norm: num_groups must be an int >= 1, got {num_groups!r}")
    n, c = x.shape[:2]
    if c % num_groups:
        raise GraphError(f"group_norm: {c} channels do not split into {num_groups} groups")
    grouped = g.reshape(x, (n, num_groups, -1))
    y = g.reshape(_normalize(g, grouped, (2,), eps), x.shape)
    return _affine(g, y, _per_channel(g, weight, x), _per_channel(g, bias, x))


@builder
def instance_norm(g: Graph, x: Tensor, weight: Tensor | None = None,
                  bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """F.instance_norm / ONNX InstanceNormalization (batch statistics of each sample's channel
    over its spatial axes): group_norm with a group per channel."""
    _require_channels(x, "instance_norm")
    return g.group_norm(x, x.shape[1], weight, bias, eps)


def _require_channels(x: Tensor, what: str) -> None:
    """Refuse a tensor without the (N, C, ...) axes a per-channel normalisation reads."""
    if len(x.shape) < 2:
        raise GraphError(f"{what} takes an (N, C, ...) tensor, got {x.label}")


def _normalized_type(inputs, attrs):
    x = inputs[0]
    if any(t.dtype != "f32" for t in inputs):
        raise GraphError("expects f32 operands")
    kept = tuple(1 if i in attrs["axes"] else d for i, d in enumerate(x.shape))
    for t in inputs[1:]:
        if broadcast_shapes(kept, t.shape) != kept:
            raise GraphError(f"{t.label} must broadcast to {kept}: one value for all "
                             f"of {x.label}'s normalised axes {attrs['axes']}")
    return x.shape, "f32"


def _normalized_grad(g: Graph, node: Tensor, dy: Tensor) -> list[Tensor | None]:
    """The gradient through the batch statistics too (PyTorch's batch-norm backward): with
    xhat = (x - mean) * rstd, t1 = sum(dy) and t2 = sum(dy * xhat) over the normalised axes,
    dx = weight * rstd / n * (n dy - t1 - xhat t2), and t1, t2 are also the bias's and the
    weight's gradients. So mean and rstd take no gradient of their own (None)."""
    x, mean, rstd, weight, bias = node.inputs
    axes, n = node.attrs["axes"], node.attrs["count"]
    xhat = g.mul(g.sub(x, mean), rstd)
    t1 = g.sum(dy, axes, keepdims=True)
    t2 = g.sum(g.mul(dy, xhat), axes, keepdims=True)
    dx = g.mul(g.mul(weight, g.mul(rstd, 1.0 / n)),
               g.sub(g.sub(g.mul(dy, float(n)), t1), g.mul(xhat, t2)))
    return [dx, None, None,
            None if weight.op == "constant" else sum_to(g, t2, weight.shape),
            None if bias.op == "constant" else sum_to(g, t1, bias.shape)]


# (x - mean) * rstd * weight + bias, where mean, rstd, weight and bias are constant along `axes`
register(OpDef("normalized", _normalized_type, "pointwise", grad=_normalized_grad,
               expr=lambda node: call("({0} - {1}) * {2} * {3} + {4}",
                                      *[Arg(i) for i in range(5)])))


@builder
def batch_norm(g: Graph, x: Tensor, running_mean: Tensor | None = None,
               running_var: Tensor | None = None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, eps: float = 1e-5) -> Tensor:
    """Training form: statistics of this batch over (N, H, W) (biased variance, as F.batch_norm
    normalises with); the running statistics are not updated (the graph has no state writes).
    Inference form: the given running_mean / running_var (inputs or parameters, shape (C,))."""
    _require_channels(x, "batch_norm")
    if training:
        axes = (0, *range(2, len(x.shape)))
        count = int(np.prod([x.shape[a] for a in axes]))
        if count == 1:  # PyTorch refuses it too: the output would be the bias whatever x is
            raise GraphError(f"batch_norm in training form needs more than one value per "
                             f"channel; {x.label} has one (batch 1, no spatial extent): use "
                             "the inference form with running statistics, or a larger batch")
        mean, _, rstd = _statistics(g, x, axes, eps)
        weight, bias = _per_channel(g, weight, x), _per_channel(g, bias, x)
        return g.apply("normalized", [x, mean, rstd,
                                      g.constant(1.0) if weight is None else weight,
                                      g.constant(0.0) if bias is None else bias],
                       axes=axes, count=count)
    if running_mean is None or running_var is None:
        raise GraphError("batch_norm in inference form needs running_mean and running_var")
    mean, var = _per_channel(g, running_mean, x), _per_channel(g, running_var, x)
    y = g.mul(g.sub(x, mean), g.rsqrt(g.add(var, float(eps))))
    return _affine(g, y, _per_channel(g, weight, x), _per_channel(g, bias, x))


# ---- attention ----------------------------------------------------------------------------------
MASKED = -1e30  # exp(MASKED - max) is exactly 0 in f32, with no infinities in the arithmetic


def grouped_heads(g: Graph, q: Tensor, k: Tensor, v: Tensor, scale: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """q (scaled) as (..., Hkv, H / Hkv, L, D), k as (..., Hkv, 1, S, D) and v as
    (..., Hkv, 1, S, Dv), so batched products pair each query head with its key/value head.
    The scale goes on q (L x D) rather than on the scores (L x S): a pass over the score
    matrix fewer each way."""
    *lead, h, length, dim = q.shape
    hkv = k.shape[-3]
    return (g.reshape(g.mul(q, scale), (*lead, hkv, h // hkv, length, dim)),
            g.reshape(k, (*k.shape[:-3], hkv, 1, *k.shape[-2:])),
            g.reshape(v, (*v.shape[:-3], hkv, 1, *v.shape[-2:])))


def causal_mask(length: int, keys: int) -> np.ndarray:
    """The additive mask by which query i sees keys j <= i (top-left aligned, as torch's)."""
    return np.triu(np.full((length, keys), MASKED, np.float32), k=1)


def attention_scores(g: Graph, q5: Tensor, k5: Tensor, causal: bool) -> Tensor:
    """The scores q K^T over grouped heads (`grouped_heads`), the causal mask added to the
    product itself, not after a reshape: then the rewrite fuses the add into the product's
    epilogue, a pass over the scores fewer a layer (SmolLM2's training step 2592 -> 2562
    dispatches)."""
    scores = g.matmul(q5, k5, transpose_b=True)
    if causal:
        scores = g.add(scores, g.constant(causal_mask(*scores.shape[-2:])))
    return scores


@builder
def scaled_dot_product_attention(g: Graph, q: Tensor, k: Tensor, v: Tensor, mask=None,
                                 causal: bool = False, scale: float | None = None,
                                 fused: bool = False, dropout_p: float = 0.0) -> Tensor:
    """q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, L, Dv); H a multiple
    of Hkv (query head h uses key/value head h // (H / Hkv), as torch's enable_gqa). `mask`: an
    additive f32 tensor broadcastable to (..., H, L, S); `causal`: query i sees keys j <= i.
    `fused`: one flash-style kernel (`flash_attention`) instead of the composition.
    `dropout_p`: dropout on the attention weights in training steps, as torch's."""
    if len(q.shape) < 3 or len(k.shape) != len(q.shape) or len(v.shape) != len(q.shape):
        raise GraphError(f"attention takes q, k, v of one rank >= 3 (..., heads, seq, dim), got "
                         f"{q.type}, {k.type}, {v.type}")
    *lead, h, length, dim = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    if h % hkv or v.shape[-3] != hkv or v.shape[-2] != s or k.shape[-1] != dim:
        raise GraphError(f"attention: q {q.type}, k {k.type}, v {v.type} do not agree")
    rep = h // hkv
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if fused:
        if mask is not None or dropout_p:
            raise GraphError("fused attention takes no additive mask (causal or full only) and "
                             "no dropout: use fused=False")
        return g.apply("flash_attention", [q, k, v], causal=bool(causal), scale=scale)
    q5, k5, v5 = grouped_heads(g, q, k, v, scale)
    scores = g.reshape(attention_scores(g, q5, k5, causal), (*lead, h, length, s))
    if mask is not None:
        scores = g.add(scores, mask)
    # A row whose keys are all masked (-inf) attends to nothing: 0, as torch's SDPA gives it,
    # where a softmax of it is NaN.
    probs = g.apply("softmax", [scores], masked_zero=True)
    if dropout_p:
        probs = g.dropout(probs, dropout_p)
    probs = g.reshape(probs, (*lead, hkv, rep, length, s))
    return g.reshape(g.matmul(probs, v5), (*lead, h, length, dv))


def rope_tables(length: int, dim: int, theta: float, offset: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    freqs = np.outer(np.arange(offset, offset + length, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


@builder
def rope(g: Graph, x: Tensor, theta: float = 10000.0, offset: int = 0) -> Tensor:
    """x (..., S, D), D even: x * cos + rotate_half(x) * sin, positions offset..offset+S-1."""
    if len(x.shape) < 2:
        raise GraphError(f"rope takes a (..., S, D) tensor (positions, features), got {x.label}")
    *_, length, dim = x.shape
    if dim % 2:
        raise GraphError(f"rope: the last axis of {x.label} must be even")
    cos, sin = rope_tables(length, dim, theta, offset)
    return g.add(g.mul(x, g.constant(cos)), g.mul(g.rotate_half(x), g.constant(sin)))


@builder
def swiglu(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b (the gate and the up projection of a LLaMA FFN)."""
    return g.mul(g.silu(a), b)


@builder(tensor=True)
def selu(g: Graph, x: Tensor) -> Tensor:
    """torch's F.selu: scale elu(x, alpha) with its fixed constants."""
    return g.mul(g.elu(x, 1.6732632423543772848170429916717), 1.0507009873554804934193349852946)




# ---- convolution and pooling --------------------------------------------------------------------
@builder
def conv1d(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int = 1,
           padding: int = 0, dilation: int = 1, groups: int = 1) -> Tensor:
    """F.conv1d as conv2d over a height of 1: x (N, C, L), weight (out, in/groups, k)."""
    if len(x.shape) != 3 or len(weight.shape) != 3:
        raise GraphError(f"conv1d takes an (N, C, L) input and an (out, in/groups, k) weight, "
                         f"got {x.label} and {weight.label}")
    n, c, length = x.shape
    o, cpg, k = weight.shape
    y = g.conv2d(g.reshape(x, (n, c, 1, length)), g.reshape(weight, (o, cpg, 1, k)), None,
                 (1, stride), (0, padding), (1, dilation), groups)
    y = g.reshape(y, (n, o, y.shape[-1]))
    return y if bias is None else g.add(y, g.reshape(bias, (o, 1)))


def _triple(v, what: str, least: int) -> tuple[int, int, int]:
    """An int or a (d, h, w) triple of ints as (d, h, w), each at least `least`; else a
    GraphError naming `what` ("conv3d stride")."""
    values = (v,) * 3 if isinstance(v, numbers.Integral) else (
        tuple(v) if isinstance(v, Sequence | np.ndarray) else ())
    if (len(values) != 3 or not all(isinstance(n, numbers.Integral) for n in values)
            or min(values) < least):
        raise GraphError(f"{what} takes an int or a (d, h, w) triple of ints, each >= {least}, "
                         f"got {v!r}")
    return int(values[0]), int(values[1]), int(values[2])


@builder
def conv3d(g: Graph, x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1,
           padding=0, dilation=1, groups: int = 1) -> Tensor:
    """F.conv3d as one conv2d: x (N, C, D, H, W), weight (out, in/groups, kd, kh, kw); int or
    (d, h, w) stride/padding/dilation. The kd frames each output frame reads are stacked as
    channels (group by group) and the frames go into the batch: (N D_out, groups kd C/groups,
    H, W), convolved with the weight's depth taps laid out the same way."""
    if len(x.shape) != 5 or len(weight.shape) != 5:
        raise GraphError(f"conv3d takes (N, C, D, H, W) input and (out, in/groups, kd, kh, kw) "
                         f"weight, got {x.label} and {weight.label}")
    stride, dilation = _triple(stride, "conv3d stride", 1), _triple(dilation, "conv3d dilation", 1)
    padding = _triple(padding, "conv3d padding", 0)
    n, c, depth, h, w = x.shape
    o, per_group, kd, kh, kw = weight.shape
    if padding[0]:
        x = g.pad(x, 2, padding[0], padding[0])
        depth += 2 * padding[0]
    out = (depth - dilation[0] * (kd - 1) - 1) // stride[0] + 1
    if out < 1:
        raise GraphError(f"conv3d: a depth of {x.shape[2]} is shorter than the kernel's "
                         f"{dilation[0] * (kd - 1) + 1}")
    taps = []
    for k in range(kd):  # each tap's frames, (N, D_out, groups, 1, C/groups, H, W)
        first = k * dilation[0]
        frames = g.slice(x, 2, first, first + (out - 1) * stride[0] + 1, stride[0]) \
            if (first, out, stride[0]) != (0, depth, 1) else x
        frames = g.transpose(frames, (0, 2, 1, 3, 4))
        taps.append(g.reshape(frames, (n, out, groups, 1, c // groups, h, w)))
    stacked = g.concat(taps, 3) if kd > 1 else taps[0]
    frames = g.reshape(stacked, (n * out, groups * kd * per_group, h, w))
    kernel = g.reshape(g.transpose(weight, (0, 2, 1, 3, 4)) if kd > 1 else weight,
                       (o, kd * per_group, kh, kw))
    y = g.conv2d(frames, kernel, None, stride[1:], padding[1:], dilation[1:], groups)
    y = g.transpose(g.reshape(y, (n, out, o, *y.shape[2:])), (0, 2, 1, 3, 4))
    return y if bias is None else g.add(y, g.reshape(bias, (o, 1, 1, 1)))


@builder
def avg_pool2d(g: Graph, x: Tensor, kernel_size, stride=None, padding=0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> Tensor:
    """F.avg_pool2d: a depthwise conv2d with constant weights. Where windows differ in what
    they divide by (count_include_pad=False, ceil_mode's partial windows, divisor_override),
    the conv sums (over zeros added past the input for ceil_mode's windows) and a constant
    (out_h, out_w) map of torch's divisors divides."""
    if len(x.shape) != 4:
        raise GraphError(f"avg_pool2d takes an (N, C, H, W) tensor, got {x.label}")
    kernel = pair(kernel_size, "avg_pool2d kernel_size", 1)
    pads = pair(padding, "avg_pool2d padding", 0)
    strides = kernel if stride is None else pair(stride, "avg_pool2d stride", 1)
    if divisor_override is not None and not (isinstance(divisor_override, numbers.Integral)
                                             and divisor_override >= 1):
        raise GraphError(f"avg_pool2d: divisor_override must be an int >= 1 or None, got "
                         f"{divisor_override!r}")
    c, spatial = x.shape[1], x.shape[2:]
    starts = [np.arange(pool_extent(n, k, s, p, ceil_mode)) * s - p
              for n, k, s, p in zip(spatial, kernel, strides, pads)]
    # torch's divisor per axis: the window within the padded input, or within the input alone
    padded = [np.minimum(a + k, n + p) - a for a, n, k, p in zip(starts, spatial, kernel, pads)]
    inside = [np.minimum(a + k, n) - np.maximum(a, 0) for a, n, k in zip(starts, spatial, kernel)]
    counts = np.outer(*(padded if count_include_pad else inside)).astype(np.float64)
    if divisor_override is None and np.all(counts == kernel[0] * kernel[1]) and all(
            len(a) == pool_extent(n, k, s, p, False)
            for a, n, k, s, p in zip(starts, spatial, kernel, strides, pads)):
        weight = g.constant(np.full((c, 1, *kernel), 1.0 / (kernel[0] * kernel[1]), np.float32))
        return g.conv2d(x, weight, None, strides, pads, 1, c)
    for axis, (a, n, k, p) in enumerate(zip(starts, spatial, kernel, pads), 2):
        beyond = int(a[-1]) + k - (n + p)  # how far ceil_mode's last window runs past the pad
        if beyond > 0:
            x = g.pad(x, axis, 0, beyond)
    sums = g.conv2d(x, g.constant(np.ones((c, 1, *kernel), np.float32)), None, strides, pads,
                    1, c)
    divisor = np.full_like(counts, divisor_override) if divisor_override else counts
    return g.mul(sums, g.constant((1.0 / divisor).astype(np.float32)))


def _pool3d(g: Graph, pool2d, x: Tensor, kernel_size, stride, padding, **flags) -> Tensor:
    """A 3-D pooling as two 2-D ones, which is exact for a maximum and for an average (each
    window's count is the product of its extents along the axes, with or without padding,
    ceil_mode or not): over (H, W) with the depth among the channels, then over the depth
    with the (H, W) positions in a row."""
    if len(x.shape) != 5:
        raise GraphError(f"3-D pooling takes an (N, C, D, H, W) tensor, got {x.label}")
    kernel = _triple(kernel_size, "3-D pooling kernel_size", 1)
    pads = _triple(padding, "3-D pooling padding", 0)
    strides = kernel if stride is None else _triple(stride, "3-D pooling stride", 1)
    n, c, depth = x.shape[:3]
    planes = pool2d(g.reshape(x, (n, c * depth, *x.shape[3:])), kernel[1:], strides[1:],
                    pads[1:], **flags)
    h, w = planes.shape[2:]
    y = pool2d(g.reshape(planes, (n, c, depth, h * w)), (kernel[0], 1), (strides[0], 1),
               (pads[0], 0), **flags)
    return g.reshape(y, (n, c, y.shape[2], h, w))


@builder
def max_pool3d(g: Graph, x: Tensor, kernel_size, stride=None, padding=0,
               ceil_mode: bool = False) -> Tensor:
    """F.max_pool3d of an (N, C, D, H, W) tensor: max_pool2d over (H, W), then over D."""
    return _pool3d(g, g.max_pool2d, x, kernel_size, stride, padding, ceil_mode=ceil_mode)


@builder
def avg_pool3d(g: Graph, x: Tensor, kernel_size, stride=None, padding=0,
               ceil_mode: bool = False, count_include_pad: bool = True) -> Tensor:
    """F.avg_pool3d of an (N, C, D, H, W) tensor: avg_pool2d over (H, W), then over D."""
    return _pool3d(g, g.avg_pool2d, x, kernel_size, stride, padding, ceil_mode=ceil_mode,
                   count_include_pad=count_include_pad)


@builder
def global_avg_pool2d(g: Graph, x: Tensor) -> Tensor:
    """(N, C, H, W) -> (N, C, 1, 1), as F.adaptive_avg_pool2d(x, 1)."""
    return g.mean(x, (2, 3), keepdims=True)


@builder
def adaptive_avg_pool2d(g: Graph, x: Tensor, output_size: int | Sequence[int]) -> Tensor:
    """F.adaptive_avg_pool2d of an (N, C, H, W) tensor (adaptive_avg_pool's 2-D case)."""
    if len(x.shape) != 4:
        raise GraphError(f"adaptive_avg_pool2d takes an (N, C, H, W) tensor, got {x.label}")
    return g.adaptive_avg_pool(x, pair(output_size, "adaptive_avg_pool2d output_size", 1))


@builder
def adaptive_avg_pool(g: Graph, x: Tensor, output_size: Sequence[int | None]) -> Tensor:
    """F.adaptive_avg_pool1d/2d/3d of an (N, C, *spatial) tensor, one output size per spatial
    axis (None keeps the axis): output cell i along an axis of n averages inputs
    floor(i n / out) to ceil((i + 1) n / out). Global pooling is a mean, whole 2-D windows an
    avg_pool2d, other sizes a `resample` of each axis by its averaging matrix."""
    spatial = x.shape[2:]
    if isinstance(output_size, numbers.Integral):  # one size for every axis, as torch takes it
        output_size = (output_size,) * len(spatial)
    sizes = tuple(n if out is None else int(out) for n, out in zip(spatial, output_size))
    if not spatial or len(output_size) != len(spatial) or min(sizes) < 1:
        raise GraphError(f"adaptive_avg_pool takes an (N, C, *spatial) tensor and a positive "
                         f"size per spatial axis, got {x.label} and {output_size}")
    if all(out == 1 for out in sizes):
        return g.mean(x, tuple(range(2, len(x.shape))), keepdims=True)
    if len(spatial) == 2 and all(n % out == 0 for n, out in zip(spatial, sizes)):
        return g.avg_pool2d(x, tuple(n // out for n, out in zip(spatial, sizes)))
    matrices = []
    for n, out in zip(spatial, sizes):
        matrix = np.zeros((out, n), np.float32)
        for i in range(out):
            start, stop = i * n // out, -(-(i + 1) * n // out)
            matrix[i, start:stop] = 1.0 / (stop - start)
        matrices.append(matrix)
    return _resample_axes(g, x, matrices)


@builder
def upsample_nearest(g: Graph, x: Tensor, scale: int | tuple[int, int] = 2) -> Tensor:
    """Nearest upsampling of an (N, C, H, W) tensor by an integer factor (or one per axis): a
    broadcast (one pointwise kernel); its gradient is a sum over each block."""
    if len(x.shape) != 4:
        raise GraphError(f"upsample_nearest takes an (N, C, H, W) tensor, got {x.label}")
    n, c, h, w = x.shape
    sh, sw = pair(scale, "upsample_nearest scale", 1)
    wide = g.broadcast_to(g.reshape(x, (n, c, h, 1, w, 1)), (n, c, h, sh, w, sw))
    return g.reshape(wide, (n, c, h * sh, w * sw))


# ---- resizing (ONNX Resize, F.interpolate) ------------------------------------------------------
# Each resized axis is a map from output to input positions, computed here in float32 as
# onnxruntime's and torch's CPU kernels compute them, and applied as its constant sparse
# interpolation taps (one, two or four a row: `resample`, whose gradient is the transposed
# map); nearest integer upsampling is a broadcast as upsample_nearest.
COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")
NEAREST_MODES = {"floor": np.floor, "ceil": np.ceil,
                 "round_prefer_floor": lambda v: np.ceil(v - np.float32(0.5)),
                 "round_prefer_ceil": lambda v: np.floor(v + np.float32(0.5))}


def _source_positions(size: int, out: int, scale: float | None, mode: str) -> np.ndarray:
    """The input coordinate of each output position along an axis (ONNX Resize's
    coordinate_transformation_mode; `scale` the output/input factor given, else out / size)."""
    f32 = np.float32
    dst = np.arange(out, dtype=f32)
    ratio = f32(1.0 / scale) if scale else f32(size) / f32(out)
    if mode == "align_corners":
        return dst * (f32(size - 1) / f32(out - 1)) if out > 1 else np.zeros(out, f32)
    if mode == "asymmetric":
        return dst * ratio
    if mode == "pytorch_half_pixel" and out == 1:
        return np.zeros(out, f32)
    return (dst + f32(0.5)) * ratio - f32(0.5)


Taps = tuple[np.ndarray, np.ndarray]  # (columns, weights), each (out, taps): resample's


def _linear_taps(size: int, out: int, source: np.ndarray, rule: str) -> Taps:
    """Each output position's two linear taps as `rule` computes them, every tap read (an
    infinity at a tap of weight 0 gives NaN): "onnxruntime" clamps the coordinate into the
    input and weighs an edge's one pixel 0.5 and 0.5; "torch" clamps it at 0, reads an edge's
    pixel twice by its two weights, and an axis it keeps the size of at (i, i) by (1, 0)."""
    f32 = np.float32
    if rule == "onnxruntime":
        src = np.clip(source, 0, size - 1)
        low = np.minimum(src.astype(np.int64), size - 1)
        high = np.minimum(low + 1, size - 1)
        frac = (src - low).astype(f32)
        edge = low == high
        weights = np.stack([np.where(edge, f32(0.5), 1 - frac), np.where(edge, f32(0.5), frac)])
    else:
        src = np.maximum(source, 0)
        low = np.minimum(np.floor(src).astype(np.int64), size - 1)
        high = low + ((low < size - 1) & (size != out))
        frac = np.clip(src - low, 0, 1).astype(f32)
        weights = np.stack([1 - frac, frac])
    return np.stack([low, high], 1), weights.T.astype(f32)


def _cubic_taps(size: int, out: int, source: np.ndarray, a: float) -> Taps:
    """Each output position's four cubic-convolution taps (coefficient `a`), every tap read,
    those past the input at its edge, as torch's bicubic and onnxruntime's cubic read."""
    f32 = np.float32
    low = np.minimum(np.floor(source), size - 1)
    t = np.clip(source - low, 0, 1).astype(f32)
    a = f32(a)

    def inner(d: np.ndarray) -> np.ndarray:  # the weight of a tap at distance d <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def outer(d: np.ndarray) -> np.ndarray:  # at distance 1 < d < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    columns = np.clip(low[:, None] + np.arange(-1, 3), 0, size - 1).astype(np.int64)
    weights = np.stack([outer(t + 1), inner(t), inner(1 - t), outer(2 - t)], 1)
    return columns, weights.astype(f32)


@builder
def resize(g: Graph, x: Tensor, size: Sequence[int] | None = None,
           scale: Sequence[float] | None = None, mode: str = "nearest",
           coordinate_mode: str = "half_pixel", nearest_mode: str = "round_prefer_floor",
           cubic_coeff_a: float = -0.75, taps_as: str = "onnxruntime") -> Tensor:
    """ONNX Resize of the axes after the first two of an (N, C, L) or (N, C, H, W) tensor, to
    `size` or by `scale` (output / input, the output floor(input * scale)). `mode`: "nearest",
    "linear" or "cubic" (taps outside read the edge: exclude_outside=0); `coordinate_mode`:
    half_pixel, pytorch_half_pixel, align_corners or asymmetric; `nearest_mode`: floor, ceil,
    round_prefer_floor or round_prefer_ceil. `taps_as`: whose interpolation taps, which decide
    where an infinity or NaN spreads ("onnxruntime", or "torch": F.interpolate's)."""
    spatial = x.shape[2:]
    if len(spatial) not in (1, 2) or (size is None) == (scale is None):
        raise GraphError(f"resize takes an (N, C, L) or (N, C, H, W) tensor and one of size "
                         f"and scale, got {x.label}, size={size}, scale={scale}")
    if mode not in ("nearest", "linear", "cubic") or coordinate_mode not in COORDINATE_MODES or (
            nearest_mode not in NEAREST_MODES):
        raise GraphError(f"resize: mode {mode!r}, coordinate_mode {coordinate_mode!r} or "
                         f"nearest_mode {nearest_mode!r} is not one of ('nearest', 'linear', "
                         f"'cubic'), {COORDINATE_MODES}, {tuple(NEAREST_MODES)}")
    scales = [None] * len(spatial) if scale is None else [float(f) for f in scale]
    sizes = ([int(math.floor(n * f)) for n, f in zip(spatial, scales)] if size is None
             else [int(n) for n in size])
    if len(sizes) != len(spatial) or len(scales) != len(spatial) or min(sizes) < 1:
        raise GraphError(f"resize: {len(spatial)} spatial axes of {x.label}, but size {size} "
                         f"and scale {scale}")
    sources = [_source_positions(n, out, f, coordinate_mode)
               for n, out, f in zip(spatial, sizes, scales)]
    if mode == "nearest":
        return _resize_nearest(g, x, sizes, sources, NEAREST_MODES[nearest_mode])
    if taps_as not in ("onnxruntime", "torch"):
        raise GraphError(f"resize: taps_as is 'onnxruntime' or 'torch', got {taps_as!r}")
    if taps_as == "onnxruntime" and all(n == out and np.array_equal(src, np.arange(n))
                                        for n, out, src in zip(spatial, sizes, sources)):
        return x  # onnxruntime copies; an axis that keeps its size beside others has its taps
    for axis, (n, out, src) in enumerate(zip(spatial, sizes, sources), 2):
        x = g.resample(x, axis, _linear_taps(n, out, src, taps_as) if mode == "linear"
                       else _cubic_taps(n, out, src, cubic_coeff_a))
    return x


def _resample_axes(g: Graph, x: Tensor, matrices: list[np.ndarray]) -> Tensor:
    """x through each spatial axis's matrix, the identities left out."""
    for axis, matrix in enumerate(matrices, 2):
        if not np.array_equal(matrix, np.eye(x.shape[axis], dtype=np.float32)):
            x = g.resample(x, axis, matrix)
    return x


def _resize_nearest(g: Graph, x: Tensor, sizes: list[int], sources: list[np.ndarray],
                    rounding) -> Tensor:
    spatial = x.shape[2:]
    picks = [np.clip(rounding(src), 0, n - 1).astype(np.int64)
             for n, src in zip(spatial, sources)]
    factors = [out // n for n, out in zip(spatial, sizes)]
    if len(spatial) == 2 and all(out % n == 0 and np.array_equal(pick, np.arange(out) // f)
                                 for n, out, f, pick in zip(spatial, sizes, factors, picks)):
        return g.upsample_nearest(x, tuple(factors))  # integer upsampling: a broadcast
    return _resample_axes(g, x, [np.eye(n, dtype=np.float32)[pick]
                                 for n, pick in zip(spatial, picks)])


@builder
def interpolate(g: Graph, x: Tensor, size: int | Sequence[int] | None = None,
                scale_factor: float | Sequence[float] | None = None, mode: str = "nearest",
                align_corners: bool | None = None) -> Tensor:
    """F.interpolate of an (N, C, L) or (N, C, H, W) tensor: modes "nearest" (torch's floor
    rule), "nearest-exact", "linear", "bilinear" and "bicubic" (align_corners False or True;
    no antialias)."""
    spatial = len(x.shape) - 2

    def per_axis(v):
        return None if v is None else [v] * spatial if isinstance(v, (int, float)) else list(v)
    if mode in ("nearest", "nearest-exact"):
        if align_corners:
            raise GraphError("interpolate: align_corners applies to linear modes only")
        exact = mode == "nearest-exact"
        return g.resize(x, per_axis(size), per_axis(scale_factor), "nearest",
                        "half_pixel" if exact else "asymmetric",
                        "round_prefer_ceil" if exact else "floor")
    if mode not in ("linear", "bilinear", "bicubic"):
        raise GraphError(f"interpolate: mode {mode!r} is not supported; use 'nearest', "
                         "'nearest-exact', 'linear', 'bilinear' or 'bicubic'")
    return g.resize(x, per_axis(size), per_axis(scale_factor),
                    "cubic" if mode == "bicubic" else "linear",
                    "align_corners" if align_corners else "half_pixel", taps_as="torch")


# ---- splitting ----------------------------------------------------------------------------------
@builder
def split(g: Graph, x: Tensor, sizes: int | Sequence[int], axis: int = 0) -> list[Tensor]:
    """torch.split: chunks of `sizes` (an int: equal chunks, the last may be shorter)."""
    axis = normalize_axis(x, axis, "split")
    extent = x.shape[axis]
    if isinstance(sizes, int):
        if sizes < 1:
            raise GraphError(f"split: a chunk size must be >= 1, got {sizes}")
        sizes = [min(sizes, extent - s) for s in range(0, extent, sizes)]
    if sum(sizes) != extent:
        raise GraphError(f"split: sizes {list(sizes)} do not add up to {extent}")
    out, start = [], 0
    for size in sizes:
        out.append(x if size == extent else g.slice(x, axis, start, start + size))
        start += size
    return out
