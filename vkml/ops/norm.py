"""Normalisations, as compositions of existing ops (mean, sub, square, rsqrt, mul, add), so
autodiff derives their gradients and the fusion pass merges the pointwise parts into the sums'
prologues and epilogues. No dedicated row-reduction kernel yet: each mean is one reduction
dispatch (two per norm). Graph methods of the same names call these; PyTorch's conventions
(biased variance, eps inside the square root, affine parameters per normalised element or per
channel)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkml.errors import GraphError

if TYPE_CHECKING:
    from vkml.graph import Graph, Tensor


def _normalize(g: Graph, x: Tensor, axes: tuple[int, ...], eps: float) -> Tensor:
    centred = g.sub(x, g.mean(x, axes, keepdims=True))
    var = g.mean(g.square(centred), axes, keepdims=True)
    return g.mul(centred, g.rsqrt(g.add(var, float(eps))))


def _affine(g: Graph, y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = g.mul(y, weight)
    if bias is not None:
        y = g.add(y, bias)
    return y


def layer_norm(g: Graph, x: Tensor, normalized_shape, weight=None, bias=None,
               eps: float = 1e-5) -> Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[len(x.shape) - len(shape):]) != shape:
        raise GraphError(f"layer_norm: {x.label} does not end in {shape}")
    axes = tuple(range(len(x.shape) - len(shape), len(x.shape)))
    return _affine(g, _normalize(g, x, axes, eps), weight, bias)


def rms_norm(g: Graph, x: Tensor, weight=None, eps: float = 1e-6) -> Tensor:
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


def group_norm(g: Graph, x: Tensor, num_groups: int, weight=None, bias=None,
               eps: float = 1e-5) -> Tensor:
    n, c = x.shape[:2]
    if c % num_groups:
        raise GraphError(f"group_norm: {c} channels do not split into {num_groups} groups")
    grouped = g.reshape(x, (n, num_groups, -1))
    y = g.reshape(_normalize(g, grouped, (2,), eps), x.shape)
    return _affine(g, y, _per_channel(g, weight, x), _per_channel(g, bias, x))


def batch_norm(g: Graph, x: Tensor, running_mean=None, running_var=None, weight=None, bias=None,
               training: bool = False, eps: float = 1e-5) -> Tensor:
    """Training form: statistics of this batch over (N, H, W) (biased variance, as F.batch_norm
    normalises with); the running statistics are not updated (the graph has no state writes).
    Inference form: the given running_mean / running_var (inputs or parameters, shape (C,))."""
    if training:
        axes = (0, *range(2, len(x.shape)))
        y = _normalize(g, x, axes, eps)
    else:
        if running_mean is None or running_var is None:
            raise GraphError("batch_norm in inference form needs running_mean and running_var")
        mean, var = _per_channel(g, running_mean, x), _per_channel(g, running_var, x)
        y = g.mul(g.sub(x, mean), g.rsqrt(g.add(var, float(eps))))
    return _affine(g, y, _per_channel(g, weight, x), _per_channel(g, bias, x))
