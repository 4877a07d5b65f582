"""Seeded differential fuzzer: small random graphs built through vkml's public Graph API and the
same computation in PyTorch (float64, CPU), compared whole, forward and backward.

    python tools/fuzz.py --seed 0 --cases 200            # VKML_BACKEND=wgpu for the wgpu backend
    python tools/fuzz.py --seed 0 --case 17              # one case again, shrunk if it fails

A case is an input shape and a chain of 2-6 steps, each an op name and a seed of its own; a
step draws its attributes and extra operands from its seed and the shape it receives, so a
shrunk case (steps dropped, the input smaller) replays every remaining step the same way. Every
float operand is a parameter, so each gets a gradient from the scalar loss sum(out * W) (W a
random constant). A step PyTorch refuses ends the chain there, and vkml must then refuse it
too with a GraphError or InputError ("refused, invalid"); a refusal of something PyTorch
accepts is reported apart ("refused, valid"): an API limit, not a wrong number.

A mismatch is max |y - ref| > TOL * (1 + max |ref|) or a relative L2 error over TOL (the
reference's norm floored at an rms of 1e-2), on the output or on any gradient, or NaN/inf where
the reference has none (or the reverse). It counts as f32 rounding (cancellation, overflow),
apart from the bugs, where PyTorch's float32 fails the same bound on the same tensor and vkml's
error is at most ten times PyTorch's."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vkml
import vkml  # noqa: E402

TOL = 1e-4
MAX_ELEMENTS = 20000  # a step whose result is larger is not taken: lavapipe is slow
DIMS = (1, 1, 2, 3, 3, 4, 5, 7, 8, 17)


@dataclass
class Applied:
    """One step made concrete for a shape: its description, extra operands (f32 arrays become
    parameters, int arrays i32 constants), and the same op on both sides."""
    desc: str
    extras: list[np.ndarray]
    vk: Callable  # (graph, x, *extras as vkml tensors) -> Tensor
    th: Callable  # (x, *extras as torch tensors) -> torch.Tensor
    # torch leaves the choice among equal values open (topk): not drawn for data with ties
    tie_sensitive: bool = False


Gen = Callable[[np.random.Generator, tuple], "Applied | None"]
OPS: dict[str, Gen] = {}


def op(fn: Gen) -> Gen:
    OPS[fn.__name__.removeprefix("gen_")] = fn
    return fn


def normal(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def axis_of(rng, shape) -> int:
    """A random axis, as a negative index half the time."""
    a = int(rng.integers(len(shape)))
    return a - len(shape) if rng.random() < 0.5 else a


# ---- pointwise ---------------------------------------------------------------------------

def positive(g_or_t, x):
    """|x| + 0.5: the domain of log, sqrt, reciprocal, a power's base."""
    return (x.abs() if hasattr(x, "abs") else g_or_t.abs(x)) + 0.5


UNARY: dict[str, tuple[Callable, Callable]] = {
    "relu": (lambda g, x: g.relu(x), torch.relu),
    "sigmoid": (lambda g, x: g.sigmoid(x), torch.sigmoid),
    "tanh": (lambda g, x: g.tanh(x), torch.tanh),
    "silu": (lambda g, x: g.silu(x), F.silu),
    "exp": (lambda g, x: g.exp(x), torch.exp),
    "neg": (lambda g, x: -x, torch.neg),
    "square": (lambda g, x: g.square(x), torch.square),
    "abs": (lambda g, x: g.abs(x), torch.abs),
    "erf": (lambda g, x: g.erf(x), torch.erf),
    "sin": (lambda g, x: g.sin(x), torch.sin),
    "cos": (lambda g, x: g.cos(x), torch.cos),
    "gelu": (lambda g, x: g.gelu(x), F.gelu),
    "gelu_tanh": (lambda g, x: g.gelu(x, approximate="tanh"),
                  lambda x: F.gelu(x, approximate="tanh")),
    "elu": (lambda g, x: g.elu(x, 0.7), lambda x: F.elu(x, 0.7)),
    "leaky_relu": (lambda g, x: g.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
    "softplus": (lambda g, x: g.softplus(x, 2.0, 3.0), lambda x: F.softplus(x, 2.0, 3.0)),
    "hardswish": (lambda g, x: g.hardswish(x), F.hardswish),
    "hardsigmoid": (lambda g, x: g.hardsigmoid(x), F.hardsigmoid),
    "mish": (lambda g, x: g.mish(x), F.mish),
    "selu": (lambda g, x: g.selu(x), F.selu),
    "hardtanh": (lambda g, x: g.hardtanh(x, -0.5, 0.8), lambda x: F.hardtanh(x, -0.5, 0.8)),
    "relu6": (lambda g, x: g.relu6(x * 4.0), lambda x: F.relu6(x * 4.0)),
    "expm1": (lambda g, x: g.expm1(x), torch.expm1),
    "log1p": (lambda g, x: g.log1p(g.abs(x)), lambda x: torch.log1p(x.abs())),
    "log": (lambda g, x: g.log(positive(g, x)), lambda x: torch.log(positive(None, x))),
    "sqrt": (lambda g, x: g.sqrt(positive(g, x)), lambda x: torch.sqrt(positive(None, x))),
    "rsqrt": (lambda g, x: g.rsqrt(positive(g, x)), lambda x: torch.rsqrt(positive(None, x))),
    "reciprocal": (lambda g, x: g.reciprocal(positive(g, x)),
                   lambda x: torch.reciprocal(positive(None, x))),
    "floor": (lambda g, x: g.floor(x * 3.0) + x, lambda x: torch.floor(x * 3.0) + x),
    "round": (lambda g, x: g.round(x * 3.0) + x, lambda x: torch.round(x * 3.0) + x),
    "sign": (lambda g, x: g.sign(x) * x, lambda x: torch.sign(x) * x),
    "clamp": (lambda g, x: g.clamp(x, -0.3, 0.6), lambda x: x.clamp(-0.3, 0.6)),
    "pow_int": (lambda g, x: x ** 3, lambda x: x ** 3),
}


@op
def gen_unary(rng, shape):
    name = pick(rng, sorted(UNARY))
    vk, th = UNARY[name]
    return Applied(name, [], lambda g, x: vk(g, x), th)


def broadcast_partner(rng, shape) -> tuple:
    """A shape that broadcasts with `shape`: some axes 1, some leading ones dropped or added,
    and where `shape` has a 1, sometimes a longer axis."""
    out = []
    for d in shape:
        r = rng.random()
        out.append(1 if r < 0.3 else (pick(rng, (2, 3)) if d == 1 and r < 0.5 else d))
    r = rng.random()
    if r < 0.3 and out:
        out = out[int(rng.integers(1, len(out) + 1)):]
    elif r < 0.5:
        out = [pick(rng, (1, 2, 3)) for _ in range(int(rng.integers(1, 3)))] + out
    return tuple(out)


BINARY: dict[str, tuple[Callable, Callable]] = {
    "add": (lambda g, a, b: a + b, torch.add),
    "sub": (lambda g, a, b: g.sub(a, b), torch.sub),
    "mul": (lambda g, a, b: a * b, torch.mul),
    "div": (lambda g, a, b: a / positive(g, b), lambda a, b: a / positive(None, b)),
    "maximum": (lambda g, a, b: g.maximum(a, b), torch.maximum),
    "minimum": (lambda g, a, b: g.minimum(a, b), torch.minimum),
    "pow": (lambda g, a, b: g.pow(positive(g, a), b), lambda a, b: positive(None, a) ** b),
    "where_less": (lambda g, a, b: g.where(g.less(a, b), a, b * 2.0),
                   lambda a, b: torch.where(a < b, a, b * 2.0)),
    "where_ge": (lambda g, a, b: g.where(a >= b, b, 0.5), lambda a, b: torch.where(a >= b, b, 0.5)),
    "mask_mul": (lambda g, a, b: a * g.greater(b, 0.0) + b * g.less_equal(a, b),
                 lambda a, b: a * (b > 0) + b * (a <= b)),
    "clamp_tensor": (lambda g, a, b: g.clamp(a, b - 0.5, b + 0.5),
                     lambda a, b: torch.clamp(a, b - 0.5, b + 0.5)),
}


@op
def gen_binary(rng, shape):
    name = pick(rng, sorted(BINARY))
    vk, th = BINARY[name]
    other = broadcast_partner(rng, shape)
    if rng.random() < 0.5:
        return Applied(f"{name}(x, p{other})", [normal(rng, other)], vk, th)
    return Applied(f"{name}(p{other}, x)", [normal(rng, other)],
                   lambda g, x, b: vk(g, b, x), lambda x, b: th(b, x))


@op
def gen_scalar(rng, shape):
    c = float(pick(rng, (-2.5, -1.0, 0.5, 3.0)))
    kind = pick(rng, ("radd", "rsub", "rmul", "rdiv", "rpow"))
    table = {
        "radd": (lambda g, x: c + x, lambda x: c + x),
        "rsub": (lambda g, x: c - x, lambda x: c - x),
        "rmul": (lambda g, x: x * c, lambda x: x * c),
        "rdiv": (lambda g, x: c / positive(g, x), lambda x: c / positive(None, x)),
        "rpow": (lambda g, x: abs(c) ** x, lambda x: abs(c) ** x),
    }
    vk, th = table[kind]
    return Applied(f"{kind} {c}", [], vk, th)


# ---- reductions --------------------------------------------------------------------------

def axes_of(rng, shape):
    if not shape or rng.random() < 0.15:
        return None
    n = int(rng.integers(1, len(shape) + 1))
    axes = sorted(int(a) for a in rng.choice(len(shape), n, replace=False))
    axes = [a - len(shape) if rng.random() < 0.3 else a for a in axes]
    return axes[0] if len(axes) == 1 and rng.random() < 0.5 else tuple(axes)


def torch_dims(shape, axes):
    if not shape:
        return (0,)  # torch reduces a 0-d tensor over its dim 0
    if axes is None:
        return tuple(range(len(shape)))
    return axes if isinstance(axes, tuple) else (axes,)


REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "logsumexp": lambda x, d, k: torch.logsumexp(x, d, keepdim=k),
    "reduce_l2": lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k),
}


@op
def gen_reduce(rng, shape):
    name = pick(rng, sorted(REDUCTIONS))
    axes = axes_of(rng, shape)
    keep = bool(rng.random() < 0.5)
    dims = torch_dims(shape, axes)
    return Applied(f"{name}(axis={axes}, keepdims={keep})", [],
                   lambda g, x: getattr(g, name)(x, axes, keepdims=keep),
                   lambda x: REDUCTIONS[name](x, dims, keep))


@op
def gen_arg_extreme(rng, shape):
    """argmax/argmin as an f32 mask-like value times x's reduction (no gradient through it)."""
    if not shape:
        return None
    name = pick(rng, ("argmax", "argmin"))
    axis = axis_of(rng, shape)
    keep = bool(rng.random() < 0.5)
    return Applied(f"{name}(axis={axis}, keepdims={keep}) + amax", [],
                   lambda g, x: g.cast(getattr(g, name)(x, axis, keepdims=keep), "f32")
                   + g.amax(x, axis, keepdims=keep),
                   lambda x: getattr(torch, name)(x, axis, keepdim=keep).to(x.dtype)
                   + x.amax(axis, keepdim=keep))


@op
def gen_softmax(rng, shape):
    if not shape:
        return None
    name = pick(rng, ("softmax", "log_softmax"))
    return Applied(name, [], lambda g, x: getattr(g, name)(x),
                   lambda x: getattr(torch, name)(x, -1))


@op
def gen_norm(rng, shape):
    if not shape:
        return None
    kind = pick(rng, ("layer_norm", "layer_norm", "rms_norm", "group_norm"))
    if kind == "group_norm":
        if len(shape) < 3:
            return None
        c = shape[1]
        groups = pick(rng, [k for k in range(1, c + 1) if c % k == 0])
        w, b = normal(rng, (c,)), normal(rng, (c,))
        return Applied(f"group_norm({groups})", [w, b],
                       lambda g, x, w, b: g.group_norm(x, groups, w, b),
                       lambda x, w, b: by_hand_norm(
                           x.reshape(x.shape[0], groups, -1), (2,), 1.0, 0.0
                       ).reshape(x.shape) * w.reshape(per_channel(x)) + b.reshape(per_channel(x)))
    n = 1 if len(shape) == 1 or rng.random() < 0.6 else 2
    norm = tuple(shape[-n:])
    w, b = normal(rng, norm), normal(rng, norm)
    if kind == "rms_norm":
        w = normal(rng, shape[-1:])
        return Applied("rms_norm", [w], lambda g, x, w: g.rms_norm(x, w, eps=1e-6),
                       lambda x, w: F.rms_norm(x, shape[-1:], w, eps=1e-6))
    if rng.random() < 0.3:
        return Applied(f"layer_norm({norm}) no affine", [],
                       lambda g, x: g.layer_norm(x, norm),
                       lambda x: F.layer_norm(x, norm))
    return Applied(f"layer_norm({norm})", [w, b],
                   lambda g, x, w, b: g.layer_norm(x, norm, w, b),
                   lambda x, w, b: F.layer_norm(x, norm, w, b))


@op
def gen_cumsum(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    reverse, exclusive = bool(rng.random() < 0.4), bool(rng.random() < 0.3)

    def th(x):
        y = x.flip(axis) if reverse else x
        if exclusive:  # shifted by one (not cumsum - x, which makes inf - inf = NaN)
            y = torch.cat([torch.zeros_like(y.narrow(axis, 0, 1)),
                           y.narrow(axis, 0, y.shape[axis] - 1)], axis)
        y = y.cumsum(axis)
        return y.flip(axis) if reverse else y
    return Applied(f"cumsum(axis={axis}, reverse={reverse}, exclusive={exclusive})", [],
                   lambda g, x: g.cumsum(x, axis, reverse=reverse, exclusive=exclusive), th)


@op
def gen_sort(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    if rng.random() < 0.5:
        desc = bool(rng.random() < 0.5)
        return Applied(f"sort(axis={axis}, descending={desc}) values", [],
                       lambda g, x: g.sort(x, axis, descending=desc)[0],
                       lambda x: torch.sort(x, dim=axis, descending=desc, stable=True)[0])
    k = int(rng.integers(1, shape[axis] + 1))
    largest = bool(rng.random() < 0.5)
    return Applied(f"topk(k={k}, axis={axis}, largest={largest}) values", [],
                   lambda g, x: g.topk(x, k, axis, largest=largest)[0],
                   lambda x: torch.topk(x, k, axis, largest=largest)[0], tie_sensitive=True)


# ---- layout and indexing -----------------------------------------------------------------

def factorize(rng, n: int) -> tuple:
    dims = []
    while n > 1 and len(dims) < 4:
        divisors = [d for d in range(2, n + 1) if n % d == 0]
        d = pick(rng, divisors)
        dims.append(d)
        n //= d
    if n > 1:
        dims.append(n)
    for _ in range(int(rng.integers(0, 2))):
        dims.insert(int(rng.integers(len(dims) + 1)), 1)
    return tuple(dims) or (1,)


@op
def gen_reshape(rng, shape):
    new = factorize(rng, math.prod(shape))
    spec = list(new)
    if rng.random() < 0.4:
        spec[int(rng.integers(len(spec)))] = -1
    spec = tuple(spec)
    return Applied(f"reshape{spec}", [], lambda g, x: g.reshape(x, spec),
                   lambda x: x.reshape(spec))


@op
def gen_permute(rng, shape):
    if len(shape) < 2:
        return None
    if rng.random() < 0.3:
        return Applied(".T (last two)", [], lambda g, x: x.T, lambda x: x.transpose(-1, -2))
    perm = tuple(int(a) for a in rng.permutation(len(shape)))
    return Applied(f"permute{perm}", [], lambda g, x: g.permute(x, perm),
                   lambda x: x.permute(perm))


@op
def gen_slice(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    n = shape[axis]
    start = int(rng.integers(0, n))
    stop = int(rng.integers(start + 1, n + 1))
    step = int(pick(rng, (1, 1, 2, 3)))
    if rng.random() < 0.2:  # negative bounds, counted from the end as Python's
        start, stop = start - n, (stop - n if stop < n else stop)
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(start, stop, step)
    return Applied(f"slice(axis={axis}, {start}:{stop}:{step})", [],
                   lambda g, x: g.slice(x, axis, start, stop, step),
                   lambda x: x[tuple(idx)])


@op
def gen_concat(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    other = list(shape)
    other[axis] = int(pick(rng, (1, 2, 3, 5)))
    other = tuple(other)
    first = rng.random() < 0.5
    return Applied(f"concat(axis={axis}, p{other} {'after' if first else 'before'})",
                   [normal(rng, other)],
                   lambda g, x, p: g.concat([x, p] if first else [p, x], axis),
                   lambda x, p: torch.cat([x, p] if first else [p, x], axis))


@op
def gen_split(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    n = shape[axis]
    size = int(rng.integers(1, n + 1))
    pieces = -(-n // size)
    k = int(rng.integers(pieces))
    return Applied(f"split({size}, axis={axis})[{k}]", [],
                   lambda g, x: g.split(x, size, axis)[k],
                   lambda x: torch.split(x, size, axis)[k])


@op
def gen_gather(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    n = shape[axis]
    kind = pick(rng, ("gather", "index_select", "gather_elements", "flip", "roll"))
    if kind == "gather":
        ishape = tuple(int(pick(rng, (1, 2, 3))) for _ in range(int(rng.integers(0, 3))))
        idx = rng.integers(-n, n, ishape)
        return Applied(f"gather(axis={axis}, indices{idx.tolist()})", [idx],
                       lambda g, x, i: g.gather(x, i, axis),
                       lambda x, i: gather_ref(x, i, axis))
    if kind == "index_select":
        idx = rng.integers(0, n, int(rng.integers(1, 5)))
        return Applied(f"index_select(axis={axis}, {idx.tolist()})", [idx],
                       lambda g, x, i: g.index_select(x, axis, i),
                       lambda x, i: torch.index_select(x, axis, i))
    if kind == "gather_elements":
        ishape = list(shape)
        ishape[axis] = int(pick(rng, (1, 2, 3)))
        ishape = [min(d, int(rng.integers(1, d + 1))) if i != axis % len(shape) else d
                  for i, d in enumerate(ishape)]
        idx = rng.integers(-n, n, tuple(ishape))
        return Applied(f"gather_elements(axis={axis}, idx{tuple(ishape)})", [idx],
                       lambda g, x, i: g.gather_elements(x, i, axis),
                       lambda x, i: torch.gather(x, axis, i % n))
    if kind == "flip":
        axes = tuple(sorted({axis_of(rng, shape) % len(shape)
                             for _ in range(int(rng.integers(1, 3)))}))
        axes = tuple(a - len(shape) if rng.random() < 0.5 else a for a in axes)
        return Applied(f"flip{axes}", [], lambda g, x: g.flip(x, axes),
                       lambda x: torch.flip(x, axes))
    shift = int(rng.integers(-2 * n, 2 * n + 1))
    return Applied(f"roll({shift}, axis={axis})", [], lambda g, x: g.roll(x, shift, axis),
                   lambda x: torch.roll(x, shift, axis))


def gather_ref(x, i, axis):
    n = x.shape[axis]
    return torch.index_select(x, axis, (i % n).reshape(-1)).reshape(
        x.shape[:axis % x.dim()] + tuple(i.shape) + x.shape[axis % x.dim() + 1:])


INT_OPS = {
    "floor_divide": (lambda g, a, b: a // b, lambda a, b: torch.div(a, b, rounding_mode="floor")),
    "trunc_divide": (lambda g, a, b: g.trunc_divide(a, b),
                     lambda a, b: torch.div(a, b, rounding_mode="trunc")),
    "remainder": (lambda g, a, b: a % b, torch.remainder),
    "fmod": (lambda g, a, b: g.fmod(a, b), torch.fmod),
}


@op
def gen_int_index(rng, shape):
    """Gather at indices computed in i32 (a division or remainder of constants, its result
    wrapped into the axis with remainder), or at argsort's indices (a sort by gather)."""
    if not shape:
        return None
    axis = axis_of(rng, shape)
    n = shape[axis]
    if rng.random() < 0.3:
        desc = bool(rng.random() < 0.5)
        return Applied(f"gather_elements(x, argsort(x, axis={axis}, descending={desc}))", [],
                       lambda g, x: g.gather_elements(x, g.argsort(x, axis, desc), axis),
                       lambda x: torch.gather(x, axis, torch.argsort(
                           x, dim=axis, descending=desc, stable=True)),
                       tie_sensitive=False)
    name = pick(rng, sorted(INT_OPS))
    vk, th = INT_OPS[name]
    count = int(rng.integers(1, 6))
    a = rng.integers(-40, 40, count)
    b = rng.integers(1, 9, count) * rng.choice([-1, 1], count)
    return Applied(f"index_select(axis={axis}, remainder({name}({a.tolist()}, {b.tolist()}), "
                   f"{n}))", [a, b],
                   lambda g, x, a, b: g.index_select(x, axis, vk(g, a, b) % n),
                   lambda x, a, b: torch.index_select(x, axis, torch.remainder(th(a, b), n)))


@op
def gen_expand(rng, shape):
    new = [int(pick(rng, (2, 3))) if d == 1 and rng.random() < 0.7 else d for d in shape]
    lead = [int(pick(rng, (1, 2, 3))) for _ in range(int(rng.integers(0, 2)))]
    kind = pick(rng, ("expand", "broadcast_to", "tile"))
    if kind == "tile":
        reps = tuple(int(pick(rng, (1, 2, 3))) for _ in range(len(shape) + int(rng.integers(0, 2))))
        return Applied(f"tile{reps}", [], lambda g, x: g.tile(x, reps), lambda x: x.repeat(reps))
    target = tuple(lead + new)
    if kind == "expand":
        spec = tuple(-1 if (i >= len(lead) and rng.random() < 0.3) else d
                     for i, d in enumerate(target))
        return Applied(f"expand{spec}", [], lambda g, x: g.expand(x, spec),
                       lambda x: x.expand(spec))
    return Applied(f"broadcast_to{target}", [], lambda g, x: g.broadcast_to(x, target),
                   lambda x: x.broadcast_to(target))


@op
def gen_pad(rng, shape):
    if not shape:
        return None
    axis = axis_of(rng, shape)
    n = shape[axis]
    if n < 1:
        return None
    mode = pick(rng, ("constant", "constant", "reflect", "replicate", "circular"))
    hi = n - 1 if mode == "reflect" else (n if mode == "circular" else 3)
    before, after = int(rng.integers(0, hi + 1)), int(rng.integers(0, hi + 1))
    if mode == "constant" and rng.random() < 0.2 and n > 2:
        before = -int(rng.integers(1, n // 2 + 1))  # crops, as ONNX's
    value = float(pick(rng, (0.0, 1.5)))
    ax = axis % len(shape)

    def th(x):
        if mode == "constant":
            widths = [0, 0] * (len(shape) - 1 - ax) + [before, after]
            return F.pad(x, widths, value=value)
        # torch pads the last axis of a (batch, channels, length) tensor in these modes
        y = x.movedim(ax, -1).reshape(1, -1, n)
        y = F.pad(y, [before, after], mode=mode)
        return y.reshape(x.movedim(ax, -1).shape[:-1] + (y.shape[-1],)).movedim(-1, ax)
    return Applied(f"pad(axis={axis}, {before}, {after}, {mode}, {value})", [],
                   lambda g, x: g.pad(x, axis, before, after, mode=mode, value=value), th)


# ---- linear algebra ----------------------------------------------------------------------

@op
def gen_matmul(rng, shape):
    if not shape:
        return None
    if len(shape) == 1:
        if rng.random() < 0.7:  # vkml's matmul takes rank >= 2: rarely, to see it refused
            return None
        k = shape[0]
        n = int(pick(rng, (1, 3, 5)))
        return Applied(f"matmul(x, p({k},{n}))", [normal(rng, (k, n))],
                       lambda g, x, w: x @ w, lambda x, w: x @ w)
    k = shape[-1]
    n = int(pick(rng, (1, 2, 5, 7, 17, 65)))
    batch = list(broadcast_partner(rng, shape[:-2])) if len(shape) > 2 else []
    if rng.random() < 0.3:
        batch = [int(pick(rng, (1, 2)))] + batch
    ta, tb = bool(rng.random() < 0.3), bool(rng.random() < 0.3)
    wshape = tuple(batch) + ((n, k) if tb else (k, n))
    if ta:  # x holds the transposed operand: (.., m, k) read as (.., k, m)^T
        return Applied(f"matmul(x^T as a, p{wshape}, transpose_b={tb})",
                       [normal(rng, wshape)],
                       lambda g, x, w: g.matmul(g.transpose(x), w, transpose_a=True,
                                                transpose_b=tb),
                       lambda x, w: x @ (w.transpose(-1, -2) if tb else w))
    if rng.random() < 0.3:  # x on the right: p (.., m2, rows) @ x (.., rows, k)
        rows = shape[-2]
        pshape = tuple(batch) + (int(pick(rng, (1, 3, 4))), rows)
        return Applied(f"matmul(p{pshape}, x)", [normal(rng, pshape)],
                       lambda g, x, p: p @ x, lambda x, p: p @ x)
    return Applied(f"matmul(x, p{wshape}, transpose_b={tb})", [normal(rng, wshape)],
                   lambda g, x, w: g.matmul(x, w, transpose_b=tb),
                   lambda x, w: x @ (w.transpose(-1, -2) if tb else w))


@op
def gen_einsum(rng, shape):
    if len(shape) == 2:
        m, k = shape
        n = int(pick(rng, (1, 3, 5)))
        choices = [("ij,jk->ik", (k, n)), ("ij,kj->ki", (n, k)), ("ij->ji", None),
                   ("ij->j", None), ("ij,ij->i", (m, k))]
        if m == k:
            choices += [("ii->i", None), ("ii", None)]
    elif len(shape) == 3:
        b, m, k = shape
        choices = [("bij,bjk->bik", (b, k, 2)), ("bij,bkj->bik", (b, 3, k)),
                   ("...ij,jk", (k, 4)), ("bij->jb", None)]
    else:
        return None
    eq, other = pick(rng, choices)
    if other is None:
        return Applied(f"einsum({eq!r})", [], lambda g, x: g.einsum(eq, x),
                       lambda x: torch.einsum(eq, x))
    return Applied(f"einsum({eq!r}, x, p{other})", [normal(rng, other)],
                   lambda g, x, p: g.einsum(eq, x, p), lambda x, p: torch.einsum(eq, x, p))


@op
def gen_attention(rng, shape):
    if len(shape) != 4 or shape[-1] > 17:
        return None
    b, h, length, d = shape
    hkv = pick(rng, [k for k in range(1, h + 1) if h % k == 0])
    s = int(pick(rng, (1, 3, length, 7)))
    dv = int(pick(rng, (d, 2, 5)))
    causal = bool(rng.random() < 0.4)
    fused = bool(rng.random() < 0.4)
    masked = not fused and rng.random() < 0.3
    scale = float(pick(rng, (0.3, 1.0))) if rng.random() < 0.3 else None
    extras = [normal(rng, (b, hkv, s, d)), normal(rng, (b, hkv, s, dv))]
    if masked:
        extras.append(normal(rng, (1, 1, length, s)))

    def th(q, k, v, *mask):  # by hand: vkml takes a mask and causal=True together
        rep = h // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
        if mask:
            scores = scores + mask[0]
        if causal:  # an additive -inf, as torch's math kernel (masked_fill would cut a NaN
            # gradient off at the masked scores; softmax's backward gives 0 * NaN there)
            keep = torch.ones(length, s, dtype=torch.bool).tril()
            scores = scores + torch.zeros(length, s, dtype=q.dtype).masked_fill(~keep, -math.inf)
        # torch's math kernel's softmax: 0 for a query whose scores are all -inf (it sees no
        # key), where a plain softmax gives NaN
        return torch._safe_softmax(scores, -1) @ v
    return Applied(f"sdpa(q=x, k{extras[0].shape}, v{extras[1].shape}, mask={masked}, "
                   f"causal={causal}, fused={fused}, scale={scale})", extras,
                   lambda g, x, k, v, *m: g.scaled_dot_product_attention(
                       x, k, v, m[0] if m else None, causal=causal, scale=scale, fused=fused),
                   th)


@op
def gen_interpolate(rng, shape):
    if len(shape) not in (3, 4):
        return None
    spatial = len(shape) - 2
    mode = pick(rng, ("nearest", "nearest-exact", "linear" if spatial == 1 else "bilinear")
                + (("bicubic",) if spatial == 2 else ()))
    align = bool(rng.random() < 0.5) if mode in ("linear", "bilinear", "bicubic") else None
    if rng.random() < 0.5:
        size = tuple(int(rng.integers(1, 2 * n + 3)) for n in shape[2:])
        kw = {"size": size}
    else:
        kw = {"scale_factor": tuple(float(pick(rng, (0.5, 1.5, 2.0, 3.0))) for _ in shape[2:])}
    return Applied(f"interpolate({kw}, {mode}, align_corners={align})", [],
                   lambda g, x: g.interpolate(x, mode=mode, align_corners=align, **kw),
                   lambda x: F.interpolate(x, mode=mode, align_corners=align, **kw))


@op
def gen_index(rng, shape):
    if not shape:
        return None
    kind = pick(rng, ("index", "embedding"))
    if kind == "embedding":
        if len(shape) != 2:
            return None
        ids = rng.integers(0, shape[0], tuple(int(pick(rng, (1, 2, 3)))
                                              for _ in range(int(rng.integers(1, 3)))))
        return Applied(f"embedding(ids{ids.tolist()}, x)", [ids],
                       lambda g, x, i: g.embedding(i, x), lambda x, i: F.embedding(i, x))
    lead = int(rng.integers(1, min(len(shape), 3) + 1))
    bshape = tuple(int(pick(rng, (1, 2, 3))) for _ in range(int(rng.integers(1, 3))))
    which = [rng.random() < 0.7 for _ in range(lead)]
    if not any(which):
        which[0] = True
    arrays = []
    for a in range(lead):
        if which[a]:
            sub = tuple(d if rng.random() < 0.7 else 1 for d in bshape)
            arrays.append(rng.integers(-shape[a], shape[a], sub))
    it = iter(range(len(arrays)))
    slots = [next(it) if w else None for w in which]

    def vk(g, x, *ts):
        return g.index(x, [None if s is None else ts[s] for s in slots])

    def th(x, *ts):
        return x[tuple(slice(None) if s is None else ts[s] for s in slots)]
    return Applied(f"index(x, {[None if s is None else arrays[s].tolist() for s in slots]})",
                   arrays, vk, th)


def by_hand_norm(x, axes, w, b, eps=1e-5):
    """Batch statistics over `axes`, per channel (axis 1): torch's batch and instance norm
    refuse a single value per channel (or group) in training, where vkml gives the bias."""
    mean = x.mean(axes, keepdim=True)
    var = ((x - mean) ** 2).mean(axes, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if isinstance(w, float):
        return y
    return y * w.reshape(per_channel(x)) + b.reshape(per_channel(x))


def per_channel(x) -> tuple:
    return (1, -1) + (1,) * (x.dim() - 2)


@op
def gen_special(rng, shape):
    """Ops with a fixed contract on the last axes: rope, swiglu, batch/instance norm, losses."""
    kind = pick(rng, ("rope", "swiglu", "batch_norm", "instance_norm", "cross_entropy", "mse"))
    if kind == "rope":
        if len(shape) < 2 or shape[-1] % 2:
            return None
        theta = float(pick(rng, (10000.0, 100.0)))
        offset = int(pick(rng, (0, 3)))

        def th(x):
            length, dim = x.shape[-2:]
            inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            ang = torch.outer(torch.arange(offset, offset + length, dtype=torch.float64), inv)
            cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
            half = dim // 2
            rot = torch.cat([-x[..., half:], x[..., :half]], -1)
            return x * cos.to(x.dtype) + rot * sin.to(x.dtype)
        return Applied(f"rope(theta={theta}, offset={offset})", [],
                       lambda g, x: g.rope(x, theta, offset), th)
    if kind == "swiglu":
        other = broadcast_partner(rng, shape)
        return Applied(f"swiglu(x, p{other})", [normal(rng, other)],
                       lambda g, x, b: g.swiglu(x, b), lambda x, b: F.silu(x) * b)
    if kind == "batch_norm":
        if len(shape) < 2:
            return None
        c = shape[1]
        w, b = normal(rng, (c,)), normal(rng, (c,))
        return Applied("batch_norm(training)", [w, b],
                       lambda g, x, w, b: g.batch_norm(x, None, None, w, b, training=True),
                       lambda x, w, b: by_hand_norm(x, (0, *range(2, len(shape))), w, b))
    if kind == "instance_norm":
        if len(shape) not in (3, 4):
            return None
        c = shape[1]
        w, b = normal(rng, (c,)), normal(rng, (c,))
        return Applied("instance_norm", [w, b],
                       lambda g, x, w, b: g.instance_norm(x, w, b),
                       lambda x, w, b: by_hand_norm(x, tuple(range(2, len(shape))), w, b))
    if kind == "cross_entropy":
        if len(shape) != 2:
            return None
        if rng.random() < 0.5:
            labels = rng.integers(0, shape[1], shape[0])
            return Applied(f"cross_entropy(x, labels{labels.tolist()})", [labels],
                           lambda g, x, t: g.cross_entropy(x, t),
                           lambda x, t: F.cross_entropy(x, t))
        target = rng.random(shape).astype(np.float32)
        target /= target.sum(-1, keepdims=True)
        return Applied("cross_entropy(x, probabilities)", [target],
                       lambda g, x, t: g.cross_entropy(x, t),
                       lambda x, t: F.cross_entropy(x, t))
    target = normal(rng, shape)
    return Applied("mse(x, p)", [target], lambda g, x, t: g.mse(x, t), F.mse_loss)


# ---- convolution and pooling -------------------------------------------------------------

def as_nchw(shape):
    return len(shape) == 4


@op
def gen_conv(rng, shape):
    if len(shape) == 3 and rng.random() < 0.5:
        n, c, length = shape
        groups = pick(rng, [k for k in range(1, c + 1) if c % k == 0])
        out = groups * int(pick(rng, (1, 2, 3)))
        k = int(pick(rng, (1, 2, 3)))
        s, p, d = int(pick(rng, (1, 2))), int(rng.integers(0, 3)), int(pick(rng, (1, 2)))
        w, b = normal(rng, (out, c // groups, k)), normal(rng, (out,))
        return Applied(f"conv1d(w{w.shape}, stride={s}, pad={p}, dil={d}, groups={groups})",
                       [w, b], lambda g, x, w, b: g.conv1d(x, w, b, s, p, d, groups),
                       lambda x, w, b: F.conv1d(x, w, b, s, p, d, groups))
    if not as_nchw(shape):
        return None
    c = shape[1]
    groups = pick(rng, [k for k in range(1, c + 1) if c % k == 0])
    out = groups * int(pick(rng, (1, 2, 3)))
    kh, kw = int(pick(rng, (1, 2, 3))), int(pick(rng, (1, 3)))
    stride = (int(pick(rng, (1, 2, 3))), int(pick(rng, (1, 2))))
    padding = (int(rng.integers(0, 3)), int(rng.integers(0, 2)))
    dilation = (int(pick(rng, (1, 2))), int(pick(rng, (1, 2))))
    bias = rng.random() < 0.6
    if rng.random() < 0.25:  # transposed
        wshape = (c, out // groups, kh, kw)
        op_pad = tuple(int(rng.integers(0, max(1, min(s, d)))) for s, d in zip(stride, dilation))
        w, b = normal(rng, wshape), normal(rng, (out,))
        return Applied(f"conv_transpose2d(w{wshape}, stride={stride}, pad={padding}, "
                       f"out_pad={op_pad}, dil={dilation}, groups={groups})", [w, b],
                       lambda g, x, w, b: g.conv_transpose2d(x, w, b, stride, padding, op_pad,
                                                             dilation, groups),
                       lambda x, w, b: F.conv_transpose2d(x, w, b, stride, padding, op_pad,
                                                          groups, dilation))
    w = normal(rng, (out, c // groups, kh, kw))
    extras = [w, normal(rng, (out,))] if bias else [w]
    return Applied(f"conv2d(w{w.shape}, bias={bias}, stride={stride}, pad={padding}, "
                   f"dil={dilation}, groups={groups})", extras,
                   lambda g, x, w, *b: g.conv2d(x, w, b[0] if b else None, stride, padding,
                                                dilation, groups),
                   lambda x, w, *b: F.conv2d(x, w, b[0] if b else None, stride, padding,
                                             dilation, groups))


@op
def gen_pool(rng, shape):
    if not as_nchw(shape):
        return None
    kind = pick(rng, ("max", "avg", "avg", "adaptive", "upsample"))
    if kind == "adaptive":
        size = (int(rng.integers(1, shape[2] + 2)), int(rng.integers(1, shape[3] + 2)))
        return Applied(f"adaptive_avg_pool2d{size}", [],
                       lambda g, x: g.adaptive_avg_pool2d(x, size),
                       lambda x: F.adaptive_avg_pool2d(x, size))
    if kind == "upsample":
        scale = (int(pick(rng, (1, 2, 3))), int(pick(rng, (1, 2))))
        return Applied(f"upsample_nearest{scale}", [],
                       lambda g, x: g.upsample_nearest(x, scale),
                       lambda x: F.interpolate(x, scale_factor=scale, mode="nearest"))
    k = (int(pick(rng, (1, 2, 3))), int(pick(rng, (2, 3))))
    s = (int(pick(rng, (1, 2, 3))), int(pick(rng, (1, 2))))
    p = (int(rng.integers(0, k[0] // 2 + 1)), int(rng.integers(0, k[1] // 2 + 1)))
    ceil = bool(rng.random() < 0.4)
    if kind == "max":
        return Applied(f"max_pool2d(k={k}, s={s}, p={p}, ceil={ceil})", [],
                       lambda g, x: g.max_pool2d(x, k, s, p, ceil_mode=ceil),
                       lambda x: F.max_pool2d(x, k, s, p, ceil_mode=ceil))
    cip = bool(rng.random() < 0.5)
    div = int(pick(rng, (2, 5))) if rng.random() < 0.2 else None
    return Applied(f"avg_pool2d(k={k}, s={s}, p={p}, ceil={ceil}, count_include_pad={cip}, "
                   f"divisor={div})", [],
                   lambda g, x: g.avg_pool2d(x, k, s, p, ceil_mode=ceil, count_include_pad=cip,
                                             divisor_override=div),
                   lambda x: F.avg_pool2d(x, k, s, p, ceil_mode=ceil, count_include_pad=cip,
                                          divisor_override=div))


# ---- cases -------------------------------------------------------------------------------

# how often each family is drawn
WEIGHTS = {"unary": 3, "binary": 4, "scalar": 1, "reduce": 3, "arg_extreme": 1, "softmax": 2,
           "norm": 2, "cumsum": 1, "sort": 1, "reshape": 2, "permute": 2, "slice": 2,
           "concat": 1, "split": 1, "gather": 3, "expand": 2, "pad": 2, "matmul": 3,
           "conv": 3, "pool": 2, "einsum": 1, "attention": 2, "interpolate": 1, "index": 2,
           "special": 2, "int_index": 1}


@dataclass
class Case:
    seed: int
    shape: tuple
    steps: list[tuple[str, int]]  # (op family, step seed)

    @property
    def ties(self) -> bool:
        """A quarter of the cases draw their data on a grid of halves: ties for the maxima,
        sorts and comparisons, exact zeros at the kinks of relu, abs, clamp."""
        return bool(np.random.default_rng(self.seed + 7).random() < 0.25)

    @property
    def special(self) -> bool:
        """One case in ten has a few NaN, infinite or huge values in its input."""
        return bool(np.random.default_rng(self.seed + 11).random() < 0.1)

    @property
    def execution(self) -> dict:
        """How the gradient session runs: whole, in chunks, or (a second step, the first having
        timed every dispatch) cut into pieces of a tiny budget, whose long levels are split into
        ranges of workgroups; and with fusion (rewrite="greedy") or without."""
        rng = np.random.default_rng(self.seed + 13)
        r = rng.random()
        step = {} if r < 0.6 else ({"chunks": int(pick(rng, (2, 3)))} if r < 0.8
                                   else {"budget_ms": 0.05})
        return {"step": step, "rewrite": "none" if rng.random() < 0.2 else "greedy"}

    def describe(self) -> str:
        return (f"seed={self.seed} shape={self.shape} steps={self.steps}"
                + (" ties" if self.ties else "") + (" special" if self.special else "")
                + f" execution={self.execution}")


@dataclass
class Realized:
    """A case made concrete: the applied steps (those that fit), the arrays, torch's answer."""
    case: Case
    x0: np.ndarray
    applied: list[Applied] = field(default_factory=list)
    torch_error: str | None = None  # torch refused the last applied step


def input_shape(rng) -> tuple:
    rank = pick(rng, (1, 2, 2, 3, 3, 4, 4, 4))
    shape = [int(pick(rng, DIMS)) for _ in range(rank)]
    if rng.random() < 0.12:  # past a workgroup's width, a tile, a register row
        shape[int(rng.integers(rank))] = int(pick(rng, (33, 65, 130, 257)))
    if rng.random() < 0.03:
        shape[int(rng.integers(rank))] = 0
    while math.prod(shape) > 6000:
        shape[int(np.argmax(shape))] //= 2
    return tuple(shape)


def reference(applied: list[Applied], x0: np.ndarray, dtype) -> tuple:
    """torch's output and parameters (x0 first, then every float extra), in `dtype`."""
    x = torch.tensor(x0, dtype=dtype, requires_grad=True)
    params = [x]
    y = x
    for a in applied:
        ts = []
        for e in a.extras:
            if e.dtype.kind == "f":
                ts.append(torch.tensor(e, dtype=dtype, requires_grad=True))
                params.append(ts[-1])
            else:
                ts.append(torch.tensor(e, dtype=torch.long))
        y = a.th(y, *ts)
    return y, params


def on_grid(a: np.ndarray, ties: bool) -> np.ndarray:
    if not ties or a.dtype.kind != "f":
        return a
    return (np.round(a * 2) / 2).astype(np.float32)


def realize(case: Case) -> Realized:
    rng = np.random.default_rng(case.seed)
    real = Realized(case, on_grid(normal(rng, case.shape), case.ties))
    if case.special and real.x0.size:
        flat = real.x0.reshape(-1)
        for i in rng.integers(0, flat.size, int(rng.integers(1, 4))):
            flat[i] = pick(rng, (np.nan, np.inf, -np.inf, 1e30, -1e30, -0.0))
    shape = case.shape
    for family, seed in case.steps:
        try:
            a = OPS[family](np.random.default_rng(seed), shape)
        except ValueError:  # an empty axis leaves a generator nothing to draw from
            if 0 not in shape:
                raise
            a = None
        if a is None or (a.tie_sensitive and case.ties):
            continue
        a.extras = [on_grid(e, case.ties) for e in a.extras]
        try:
            with torch.no_grad():
                y, _ = reference([*real.applied, a], real.x0, torch.float64)
        except Exception as e:  # torch refuses: the chain ends with this step
            real.applied.append(a)
            real.torch_error = f"{type(e).__name__}: {e}".splitlines()[0]
            return real
        if y.numel() > MAX_ELEMENTS or y.dtype != torch.float64:
            continue
        real.applied.append(a)
        shape = tuple(y.shape)
    return real


def generate(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    shape = input_shape(rng)
    families = sorted(WEIGHTS)
    p = np.array([WEIGHTS[f] for f in families], float)
    p /= p.sum()
    n = int(rng.integers(2, 7))
    steps = []
    tries = 0
    # draw until n steps fit the shapes they meet (a step that does not fit is redrawn)
    while len(steps) < n and tries < 40:
        tries += 1
        candidate = (str(rng.choice(families, p=p)), int(rng.integers(2**31)))
        real = realize(Case(seed, shape, steps + [candidate]))
        if len(real.applied) == len(steps) + 1:
            steps.append(candidate)
            if real.torch_error:
                break
    return Case(seed, shape, steps)


@dataclass
class Result:
    kind: str  # ok, mismatch, f32_rounding, crash, refused_invalid, refused_valid,
    #            accepted_invalid, validation
    detail: str = ""
    errors: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "crash", "accepted_invalid", "validation")


def errors_of(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max |got - want| / (1 + max |want|), relative L2); inf where the shapes, or where
    NaN / inf stand, differ."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf, math.inf
    finite = np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)) or not np.array_equal(
            got[np.isinf(want)], want[np.isinf(want)]) or not np.all(np.isfinite(got[finite])):
        return math.inf, math.inf
    g, w = got[finite], want[finite]
    if g.size == 0:
        return 0.0, 0.0
    scale = 1.0 + float(np.max(np.abs(w)))
    # a reference that is zero but for rounding (a gradient or a mean that cancels exactly) has
    # no relative error to speak of: below an rms of 1e-2 the elementwise bound alone decides
    norm = max(float(np.linalg.norm(w)), 1e-2 * math.sqrt(w.size))
    return float(np.max(np.abs(g - w))) / scale, float(np.linalg.norm(g - w)) / norm


def run(real: Realized, device) -> Result:
    applied = real.applied
    rng = np.random.default_rng(real.case.seed + 1)
    g = vkml.Graph()
    names = ["x0"]
    try:
        x = g.param("x0", real.x0.shape, init=real.x0)
        y = x
        for si, a in enumerate(applied):
            ts = []
            for ei, e in enumerate(a.extras):
                if e.dtype.kind == "f":
                    names.append(f"p{si}_{ei}")
                    ts.append(g.param(names[-1], e.shape, init=e))
                else:
                    ts.append(g.constant(e, "i32"))
            y = a.vk(g, y, *ts)
    except (vkml.GraphError, vkml.InputError) as e:
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        return Result("refused_invalid" if real.torch_error else "refused_valid", msg)
    except Exception:
        return Result("crash", "building: " + traceback.format_exc(limit=-3))
    if real.torch_error:
        return Result("accepted_invalid", f"torch refused the last step ({real.torch_error}); "
                      f"vkml built {y.shape}")
    ref, params = reference(applied, real.x0, torch.float64)
    weights = normal(rng, tuple(ref.shape))
    try:
        loss = g.sum(g.mul(y, g.constant(weights)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session = vkml.compile(g, loss=loss, outputs={"out": y}, device=device,
                                   rewrite=real.case.execution["rewrite"])
        try:
            step = real.case.execution["step"]
            if "budget_ms" in step:  # the first step times the dispatches the second cuts
                session.step(**step)
            session.step(**step)
            out = session.read("out")
            grads = {}
            for name in names:
                try:
                    grads[name] = session.grad(name)
                except vkml.VkmlError:  # no gradient: the loss does not reach it
                    grads[name] = None
        finally:
            session.close()
        # the inference plan (no loss) is another plan: other fusions, hoisted work
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session = vkml.compile(g, outputs={"out": y}, device=device)
        try:
            session.forward()
            inference = session.read("out")
        finally:
            session.close()
    except (vkml.GraphError, vkml.InputError) as e:
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        return Result("refused_valid", "compiling: " + msg)
    except Exception:
        return Result("crash", "compiling or running: " + traceback.format_exc(limit=-3))
    messages = list(device.backend.validation_messages)
    device.backend.validation_messages.clear()
    if messages:
        return Result("validation", "\n".join(messages[:3]))

    (ref * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    want = {"out": ref.detach().numpy(), "inference out": ref.detach().numpy()}
    got = {"out": out, "inference out": inference}
    for name, p in zip(names, params):
        want[name] = p.grad.numpy() if p.grad is not None else np.zeros(p.shape)
        got[name] = grads[name] if grads[name] is not None else np.zeros(p.shape)
    errors = {k: errors_of(got[k], want[k]) for k in want}
    bad = {k: e for k, e in errors.items() if e[0] > TOL or e[1] > TOL}
    if not bad:
        return Result("ok", errors=errors)
    # the same in torch float32: does PyTorch's own f32 show it too?
    ref32, params32 = reference(applied, real.x0, torch.float32)
    (ref32 * torch.tensor(weights)).sum().backward()
    got32 = {"out": ref32.detach().numpy(), "inference out": ref32.detach().numpy()}
    for name, p in zip(names, params32):
        got32[name] = p.grad.numpy() if p.grad is not None else np.zeros(p.shape)
    e32 = {k: errors_of(got32[k], want[k]) for k in bad}
    # rounding: PyTorch's float32 fails the same bound on the same tensor, and vkml's error is
    # at most ten times PyTorch's
    rounding = all((e32[k][0] > TOL or e32[k][1] > TOL)
                   and e[0] <= 10 * e32[k][0] and e[1] <= 10 * e32[k][1] for k, e in bad.items())
    detail = "; ".join(f"{k}: max {e[0]:.3g} rel_l2 {e[1]:.3g} (torch f32: max "
                       f"{e32[k][0]:.3g} rel_l2 {e32[k][1]:.3g})" for k, e in bad.items())
    return Result("f32_rounding" if rounding else "mismatch", detail, errors)


def shrink(case: Case, result: Result, device, budget: int = 25) -> tuple[Case, Result]:
    """Drop steps and shrink the input while the case still fails the same way."""
    def fails(c: Case) -> Result | None:
        r = run(realize(c), device)
        return r if r.kind == result.kind else None

    changed = True
    while changed and budget > 0:
        changed = False
        candidates = [Case(case.seed, case.shape, case.steps[:i] + case.steps[i + 1:])
                      for i in range(len(case.steps))]
        for i, d in enumerate(case.shape):
            for smaller in sorted({1, d // 2, d - 1} - {d, 0}, reverse=True):
                if smaller >= 1 and smaller < d:
                    shape = case.shape[:i] + (smaller,) + case.shape[i + 1:]
                    candidates.append(Case(case.seed, shape, case.steps))
        for c in candidates:
            if budget <= 0:
                break
            budget -= 1
            r = fails(c)
            if r is not None:
                case, result, changed = c, r, True
                break
    return case, result


def report(case: Case, result: Result) -> str:
    real = realize(case)
    lines = [f"[{result.kind}] {case.describe()}", f"  input x0 {case.shape}"]
    lines += [f"  {i}. {a.desc}" for i, a in enumerate(real.applied)]
    if real.torch_error:
        lines.append(f"  torch: {real.torch_error}")
    lines += ["  " + line for line in result.detail.strip().splitlines()[-6:]]
    return "\n".join(lines)


def fuzz(seeds, device, shrinking: bool = True, minutes: float | None = None,
         log=print) -> list[tuple[Case, Result]]:
    """Every case of `seeds` on `device`: (the case, shrunk where it failed, and its result)."""
    start = time.time()
    results = []
    for seed in seeds:
        if minutes and time.time() - start > minutes * 60:
            break
        case = generate(seed)
        result = run(realize(case), device)
        if result.failed and shrinking:
            case, result = shrink(case, result, device)
        if result.kind != "ok" and log:
            log(report(case, result))
        results.append((case, result))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed")
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--case", type=int, help="run this one case seed only")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--backend", default=None, help="vulkan or wgpu (default VKML_BACKEND)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--json", help="write every result here, one JSON object a line")
    args = ap.parse_args(argv)
    device = vkml.Device(backend=args.backend)
    seeds = [args.case] if args.case is not None else range(args.seed, args.seed + args.cases)
    start = time.time()
    results = fuzz(seeds, device, not args.no_shrink, args.minutes,
                   log=lambda text: print(text, flush=True))
    counts: dict[str, int] = {}
    for _, result in results:
        counts[result.kind] = counts.get(result.kind, 0) + 1
    if args.json:
        with open(args.json, "w") as out:
            for case, result in results:
                out.write(json.dumps({"seed": case.seed, "kind": result.kind,
                                      "case": case.describe(), "detail": result.detail}) + "\n")
    print(f"{len(results)} cases in {time.time() - start:.0f} s on {device}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    device.close()
    return 1 if any(r.failed for _, r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
