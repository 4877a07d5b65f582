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


def test_log1p_expm1_keep_tiny_arguments_digits(device):
    x = np.array([1e-7, -3e-6, 2e-4, -1e-3, 0.01, -0.2, 0.45, -0.45], np.float32)
    got = run_unary(device, x, ["log1p", "expm1"])
    for name in got:
        want = getattr(torch, name)(torch.tensor(x, dtype=torch.float64)).numpy()
        np.testing.assert_allclose(got[name], want, rtol=3e-7, err_msg=name)


def test_unknown_gelu_approximation_is_refused():
    g = vkml.Graph()
    with pytest.raises(vkml.GraphError, match="'none' or 'tanh'"):
        g.gelu(g.input("x", (2,)), approximate="fast")
