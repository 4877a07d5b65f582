"""NaN and infinities through the ops, against PyTorch computed here on the same values: every
public unary op and clamp at +-inf and NaN, maxima (amax, max pooling) over NaN and -inf,
softmax and log-softmax of rows holding -inf, +inf or NaN, and attention with a fully masked
row (torch's softmax gives NaN there, its scaled_dot_product_attention 0; vkml does the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vkml
from vkml.ops.pointwise import PARAMETRIC, UNARY

INF, NAN = np.inf, np.nan
SPECIAL = np.array([INF, -INF, NAN, 0.0, -0.0, 1.0, -1.0, 100.0, -100.0], np.float32)

# torch's function for each public unary op, the parametric ones at torch's defaults (a new op
# must add its own here)
TORCH_UNARY = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
               "silu": F.silu, "exp": torch.exp, "log": torch.log, "neg": torch.neg,
               "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "square": torch.square,
               "abs": torch.abs, "sign": torch.sign, "erf": torch.erf,
               "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "floor": torch.floor,
               "ceil": torch.ceil, "round": torch.round, "reciprocal": torch.reciprocal,
               "sin": torch.sin, "cos": torch.cos, "log1p": torch.log1p, "expm1": torch.expm1,
               "leaky_relu": F.leaky_relu, "elu": F.elu, "softplus": F.softplus}
PUBLIC_UNARY = sorted([*(name for name, rule in UNARY.items() if rule[3] != "internal"),
                       *PARAMETRIC])
CASES = {**{name: (lambda g, x, name=name: getattr(g, name)(x), TORCH_UNARY.get(name))
            for name in PUBLIC_UNARY},
         "gelu": (lambda g, x: g.gelu(x), F.gelu),
         "gelu_tanh": (lambda g, x: g.gelu(x, approximate="tanh"),
                       lambda x: F.gelu(x, approximate="tanh"))}


def forward(device, build, x: np.ndarray) -> np.ndarray:
    g = vkml.Graph()
    g.output("y", build(g, g.input("x", x.shape)))
    with vkml.compile(g, device=device) as session:
        session.set_input("x", x)
        session.forward()
        return session.read("y")


def same(actual, expected) -> None:
    """Equal where torch is finite (to f32 rounding of the largest), and NaN, +inf, -inf
    exactly where torch's are."""
    expected = np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(actual), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-5, atol=1e-6 * scale)


def test_every_public_unary_op_has_a_reference():
    assert sorted(TORCH_UNARY) == PUBLIC_UNARY


@pytest.mark.parametrize("name", sorted(CASES))
def test_unary_at_infinities_and_nan(device, name):
    build, reference = CASES[name]
    same(forward(device, build, SPECIAL), reference(torch.from_numpy(SPECIAL)))


def test_clamp_keeps_nan_and_infinities(device):
    same(forward(device, lambda g, x: g.clamp(x, -2.0, 3.0), SPECIAL),
         torch.clamp(torch.from_numpy(SPECIAL), -2.0, 3.0))


# Rows that decide a maximum: all -inf, a NaN first, last or between, +inf, ordinary.
ROWS = np.array([[-INF, -INF, -INF, -INF], [NAN, 1.0, 2.0, -INF], [1.0, 2.0, 3.0, NAN],
                 [1.0, NAN, 2.0, 0.0], [INF, 0.0, -INF, 1.0], [-INF, 0.0, -INF, -INF],
                 [0.5, -1.0, 2.0, 1.5]], np.float32)


@pytest.mark.parametrize("rows", [1, 70], ids=["workgroup_per_output", "thread_per_output"])
@pytest.mark.parametrize("op", ["amax", "amin"])
def test_extremes_propagate_nan_and_start_at_infinity(device, op, rows):
    x = np.tile(ROWS, (rows, 1))  # 70 x 7 rows of 4: the short kernel, a thread an output
    for sign in (1, -1):  # rows of +inf for amin
        same(forward(device, lambda g, t: getattr(g, op)(t, -1), sign * x),
             getattr(torch.from_numpy(sign * x), op)(-1))
    same(forward(device, lambda g, t: getattr(g, op)(t), ROWS),
         getattr(torch.from_numpy(ROWS), op)())


@pytest.mark.parametrize("op", ["amax", "amin"])
def test_extreme_of_infinities_is_infinite(device, op):
    x = np.full((3,), -INF if op == "amax" else INF, np.float32)
    same(forward(device, lambda g, t: getattr(g, op)(t), x), getattr(torch.from_numpy(x), op)())


def test_max_pool_propagates_nan(device):
    x = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    x[0, 0, 0, 1] = NAN
    x[1, 2, 3, 3] = -INF
    x[1, 1, :2, :2] = -INF
    same(forward(device, lambda g, t: g.max_pool2d(t, 2), x),
         F.max_pool2d(torch.from_numpy(x), 2))


@pytest.mark.parametrize("length", [4, 3000], ids=["held_in_registers", "three_passes"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_of_rows_with_infinities_and_nan(device, op, length):
    x = np.tile(ROWS, (1, length // 4))
    same(forward(device, lambda g, t: getattr(g, op)(t), x),
         getattr(torch, op)(torch.from_numpy(x), -1))


def test_attention_row_with_every_key_masked_is_zero_as_in_torch(device, rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.zeros((3, 3), np.float32)
    mask[1, :] = -INF  # query 1 sees no key
    mask[2, 0] = -INF
    g = vkml.Graph()
    tq, tk, tv = (g.param(n, a.shape, a) for n, a in zip("qkv", (q, k, v)))
    out = g.output("out", g.scaled_dot_product_attention(tq, tk, tv, g.constant(mask)))
    loss = g.sum(g.mul(out, g.constant(np.arange(out.size, dtype=np.float32).reshape(
        out.shape))))
    with vkml.compile(g, loss=loss, outputs={"out": out}, device=device) as session:
        session.step()
        got = session.read("out")
        grads = {n: session.grad(n) for n in "qkv"}
    tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(mask).double())
    (ref * torch.arange(ref.numel(), dtype=torch.float64).reshape(ref.shape)).sum().backward()
    assert not torch.isnan(ref).any() and (ref[:, :, 1] == 0).all()  # what torch does
    same(got, ref.detach().numpy())
    for name, t in zip("qkv", (tq, tk, tv)):
        same(grads[name], t.grad.numpy())
