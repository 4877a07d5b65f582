"""The elementwise ops the model importers map onto (activations, rounding, trigonometry, powers,
minimum and maximum), forward and backward against PyTorch in float64 and against finite
differences, as tests/test_ops.py checks the rest; and their values at NaN, infinities, zeros and
tiny or large arguments against torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ops import Case, case_tests, unary

import vkml

CASES = [
    unary("erf", torch.erf),
    unary("expm1", torch.expm1),
    unary("reciprocal", torch.reciprocal, positive=True),
    Case("gelu_tanh", [(6, 9)], lambda g, a: g.gelu(a, approximate="tanh"),
         lambda a: F.gelu(a, approximate="tanh")),
    Case("gelu_erf_named", [(6, 9)], lambda g, a: a.gelu(approximate="none"), F.gelu),
    Case("hardswish", [(6, 9)], lambda g, a: g.hardswish(a * 3.0),
         lambda a: F.hardswish(a * 3.0)),
    Case("hardsigmoid", [(6, 9)], lambda g, a: (a * 3.0).hardsigmoid(),
         lambda a: F.hardsigmoid(a * 3.0)),
    Case("leaky_relu", [(6, 9)], lambda g, a: g.leaky_relu(a), F.leaky_relu),
    Case("leaky_relu_slope", [(6, 9)], lambda g, a: a.leaky_relu(0.2),
         lambda a: F.leaky_relu(a, 0.2)),
    Case("elu", [(6, 9)], lambda g, a: g.elu(a, alpha=0.7), lambda a: F.elu(a, 0.7)),
    Case("softplus", [(6, 9)], lambda g, a: g.softplus(a), F.softplus),
    Case("softplus_beta_threshold", [(6, 9)], lambda g, a: g.softplus(a, beta=2.0, threshold=3.0),
         lambda a: F.softplus(a, 2.0, 3.0)),
    Case("mish", [(6, 9)], lambda g, a: g.mish(a), F.mish),
    Case("selu", [(6, 9)], lambda g, a: a.selu(), F.selu),
    # zero gradients, as torch's: multiplied by x so that the loss still reaches x
    Case("floor_ceil_round_sign", [(6, 9)],
         lambda g, a: (a * g.floor(a * 2.0) + a.ceil() * a * a + g.round(a * 3.0) * a
                       + a.sign() * a),
         lambda a: (a * torch.floor(a * 2.0) + a.ceil() * a * a + torch.round(a * 3.0) * a
                    + a.sign() * a)),
    Case("sin_cos", [(6, 9)], lambda g, a: g.sin(a * 3.0) + (a * 5.0).cos(),
         lambda a: torch.sin(a * 3.0) + torch.cos(a * 5.0)),
    Case("log1p", [(6, 9)], lambda g, a: g.log1p(a * 0.3), lambda a: torch.log1p(a * 0.3)),
    Case("pow_tensors_broadcast", [(5, 7), (7,)], lambda g, a, b: a ** b, torch.pow,
         positive=True),
    Case("pow_number_exponents", [(5, 7)], lambda g, a: a ** 3 - g.pow(a, 2.0) + 2.0 ** a,
         lambda a: a ** 3 - a ** 2.0 + 2.0 ** a),
    Case("maximum_minimum_broadcast", [(5, 7), (7,)],
         lambda g, a, b: g.maximum(a, b) * 2.0 + g.minimum(b, a * 0.5) + g.maximum(a, 0.1),
         lambda a, b: torch.maximum(a, b) * 2.0 + torch.minimum(b, a * 0.5)
         + torch.clamp(a, min=0.1)),
    Case("clamp_tensor_bounds", [(5, 7), (7,), (5, 1)],
         lambda g, x, lo, hi: g.clamp(x, lo - 0.5, hi + 0.5),
         lambda x, lo, hi: torch.clamp(x, lo - 0.5, hi + 0.5)),
    Case("through_integers", [(5, 7)],
         lambda g, a: a * g.cast(g.cast(a * 3.0, "i32") * 2 - 1, "f32"),
         lambda a: a * ((a * 3.0).to(torch.int32) * 2 - 1).to(torch.float64)),
    Case("gather_computed_indices", [(6, 4)], lambda g, x, i: g.gather(x, i * 2 - 1, 0),
         lambda x, i: x[(i.long() * 2 - 1) % 6],
         extras={"i": lambda rng: rng.integers(0, 3, (2, 5)).astype(np.int32)}),
    Case("clamp_one_tensor_bound", [(5, 7), (7,), (5, 1)],
         lambda g, x, lo, hi: x.clamp(min=lo) + x.clamp(max=hi) + g.clamp(x, 0.2, hi),
         lambda x, lo, hi: x.clamp(min=lo) + x.clamp(max=hi)
         + torch.clamp(x, torch.tensor(0.2, dtype=torch.float64), hi)),
]


test_forward_and_gradient_match_torch, test_gradient_matches_finite_differences = case_tests(CASES)


SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-7, 3e-6, 0.3, -0.49, 0.5, 2.5, -2.5,
           3.0, -3.0, 7.3, -20.5, 88.0, -100.0, 1e4]
UNARY = {"erf": torch.erf, "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil,
         "round": torch.round, "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
         "log1p": torch.log1p, "expm1": torch.expm1, "hardswish": F.hardswish,
         "hardsigmoid": F.hardsigmoid, "leaky_relu": F.leaky_relu, "elu": F.elu,
         "softplus": F.softplus, "mish": F.mish, "selu": F.selu}


def run_unary(device, x: np.ndarray, names) -> dict[str, np.ndarray]:
    g = vkml.Graph()
    xi = g.input("x", x.shape)
    for name in names:
        g.output(name, getattr(g, name)(xi))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.forward()
    return {name: session.read(name) for name in names}


# mish(-20.5) = -20.5 tanh(1.3e-9): tanh's helper (ops/pointwise.py) is accurate to 3e-8
# absolute, not relative, near 0
ABSOLUTE = {"mish": 1e-6}


def test_special_values_match_torch(device):
    """NaN where torch gives NaN, the same infinities, and finite values within a few ulps
    (absolute 2e-7 near zero, where erf's approximation is absolute)."""
    x = np.array(SPECIAL, np.float32)
    got = run_unary(device, x, UNARY)
    for name, fn in UNARY.items():
        want = fn(torch.tensor(x)).numpy()
        np.testing.assert_allclose(got[name], want, rtol=2e-6, atol=ABSOLUTE.get(name, 2e-7),
                                   equal_nan=True, err_msg=name)


def test_log1p_expm1_erf_keep_tiny_arguments_digits(device):
    x = np.array([1e-7, -3e-6, 2e-4, -1e-3, 0.01, -0.2, 0.45, -0.45], np.float32)
    got = run_unary(device, x, ["log1p", "expm1", "erf"])
    for name in got:
        want = getattr(torch, name)(torch.tensor(x, dtype=torch.float64)).numpy()
        np.testing.assert_allclose(got[name], want, rtol=3e-7, err_msg=name)


def test_unknown_gelu_approximation_is_refused():
    g = vkml.Graph()
    with pytest.raises(vkml.GraphError, match="'none' or 'tanh'"):
        g.gelu(g.input("x", (2,)), approximate="fast")


BASES = [-np.inf, -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.01, 0.999, 2.0, 10.0, np.inf, np.nan]
EXPONENTS = [-np.inf, -3.0, -2.0, -1.0, -0.5, 0.0, 1 / 3, 0.5, 1.0, 2.0, 3.0, 100.0, np.inf,
             np.nan]


def test_pow_special_cases_match_torch(device):
    """0 ** 0, negative bases to integer and other powers, infinities, NaN, bases near 1."""
    x, y = (a.astype(np.float32) for a in np.meshgrid(BASES, EXPONENTS, indexing="ij"))
    g = vkml.Graph()
    g.output("pow", g.pow(g.input("x", x.shape), g.input("y", y.shape)))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.set_input("y", y)
    session.forward()
    want = torch.pow(torch.tensor(x), torch.tensor(y)).numpy()
    np.testing.assert_allclose(session.read("pow"), want, rtol=2e-6, equal_nan=True)


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_extremum_splits_ties_and_passes_nan_as_torch(name, device):
    """Ties share the gradient half and half; a NaN operand is the result, and both operands
    then get the whole gradient (torch's rule)."""
    a = np.array([1.0, 2.0, -1.0, np.nan, 3.0, 0.5], np.float32)
    b = np.array([1.0, -2.0, 4.0, 1.0, np.nan, 0.5], np.float32)
    weights = np.arange(1, 7, dtype=np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a.shape, init=a), g.param("b", b.shape, init=b)
    out = getattr(g, name)(pa, pb)
    session = vkml.compile(g, loss=g.sum(out * g.constant(weights)), outputs={"out": out},
                           device=device)
    session.step()
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    ref = getattr(torch, name)(ta, tb)
    (ref * torch.tensor(weights)).sum().backward()
    np.testing.assert_array_equal(session.read("out"), ref.detach().numpy())
    np.testing.assert_array_equal(session.grad("a"), ta.grad.numpy())
    np.testing.assert_array_equal(session.grad("b"), tb.grad.numpy())


def test_casts_and_integer_arithmetic_match_torch(device):
    """f32 -> i32 truncates toward zero; i32 add, sub, mul wrap as torch's int32 do."""
    x = np.array([-2.7, -0.5, -0.0, 0.4, 1.5, 2.5, 1e9, -1e9], np.float32)
    ids = np.array([0, 1, -7, 2**31 - 1, -2**31, 12345, 46341, -3], np.int32)
    g = vkml.Graph()
    xi, ii = g.input("x", x.shape), g.input("ids", ids.shape, "i32")
    outputs = {"trunc": g.cast(xi, "i32"), "to_f32": ii.cast("f32"), "add": ii + 1,
               "sub": 2 - ii, "mul": ii * ii, "mixed": g.add(g.mul(ii, 3), g.cast(xi, "i32")),
               "where_i32": g.where(ii, xi, -1.0), "max_i32": g.maximum(ii, 7)}
    for name, t in outputs.items():
        g.output(name, t)
    assert g.cast(xi, "f32") is xi
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.set_input("ids", ids)
    session.forward()
    tx, ti = torch.tensor(x), torch.tensor(ids)
    expected = {"trunc": tx.to(torch.int32), "to_f32": ti.to(torch.float32), "add": ti + 1,
                "sub": 2 - ti, "mul": ti * ti, "mixed": ti * 3 + tx.to(torch.int32),
                "where_i32": torch.where(ti != 0, tx, -1.0),
                "max_i32": torch.maximum(ti, torch.tensor(7, dtype=torch.int32))}
    for name, want in expected.items():
        got = session.read(name)
        assert got.dtype == want.numpy().dtype, name
        np.testing.assert_array_equal(got, want.numpy(), err_msg=name)


def test_integer_operands_refuse_fractions_and_division():
    g = vkml.Graph()
    ids = g.input("ids", (3,), "i32")
    with pytest.raises(vkml.GraphError, match="cast"):
        ids + 0.5
    with pytest.raises(vkml.GraphError, match="f32"):
        ids / 2
    with pytest.raises(vkml.GraphError, match="'f32' or 'i32'"):
        g.cast(ids, "f16")


def test_integer_division_matches_torch_for_every_sign(device):
    a, b = (v.astype(np.int32) for v in np.meshgrid(np.arange(-7, 8), [-3, -2, -1, 1, 2, 5],
                                                     indexing="ij"))
    g = vkml.Graph()
    ai, bi = g.input("a", a.shape, "i32"), g.input("b", b.shape, "i32")
    for name, t in {"floor": ai // bi, "trunc": g.trunc_divide(ai, bi), "remainder": ai % bi,
                    "fmod": g.fmod(ai, bi), "by_number": ai // 2 + ai % 3}.items():
        g.output(name, t)
    session = vkml.compile(g, device=device)
    session.set_input("a", a)
    session.set_input("b", b)
    session.forward()
    ta, tb = torch.tensor(a), torch.tensor(b)
    expected = {"floor": ta // tb, "trunc": torch.div(ta, tb, rounding_mode="trunc"),
                "remainder": ta % tb, "fmod": torch.fmod(ta, tb), "by_number": ta // 2 + ta % 3}
    for name, want in expected.items():
        np.testing.assert_array_equal(session.read(name), want.numpy(), err_msg=name)
    with pytest.raises(vkml.GraphError, match="i32"):
        g.floor_divide(g.input("x", (2,)), 2.0)
