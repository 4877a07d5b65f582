"""argsort, sort and topk (ops/reduce.py: one kernel, argsort, ranks every element along an axis)
against PyTorch: indices exactly as torch's stable sort orders them (ties, NaN, signed zeros),
values, and the values' gradient in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vkml

# ties, NaN, signed zeros and infinities along the last axis; random values elsewhere
SPECIAL = np.array([[3, 1, np.nan, 1, -0.0, 0.0, -np.inf, np.nan],
                    [np.inf, 2, 2, -1, 2, np.nan, 0.5, -3]], np.float32)


def values_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b, equal_nan=True)
                and np.array_equal(np.signbit(a), np.signbit(b)))


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_sort_orders_as_torch_stable_sort(device, axis, descending):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    x[1, 2:] = SPECIAL  # along axes 0 and 1 they meet random values
    x[2, :, :3] = 0.5  # ties across axes 0 and 1 too
    g = vkml.Graph()
    xt = g.input("x", x.shape)
    values, indices = g.sort(xt, axis, descending)
    g.output("values", values)
    g.output("indices", indices)
    g.output("argsort", g.argsort(xt, axis, descending))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.step()
    ref = torch.sort(torch.tensor(x, dtype=torch.float64), dim=axis, descending=descending,
                     stable=True)
    assert np.array_equal(session.read("indices"), ref.indices.numpy())
    assert np.array_equal(session.read("argsort"), ref.indices.numpy())
    assert values_equal(session.read("values"), ref.values.numpy().astype(np.float32))
    assert session.read("indices").dtype == np.int32
    # the ranks in a kernel of their own, the values gathered at them
    assert {d.op for d in session.plan.dispatches} == {"argsort", "gather_elements"}


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_topk_and_its_gradient_match_torch(device, k, largest):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7)).astype(np.float32)  # distinct: torch's order is defined
    w = rng.standard_normal((5, k)).astype(np.float32)
    g = vkml.Graph()
    xp = g.param("x", x.shape, init=x)
    values, indices = g.topk(xp, k, axis=1, largest=largest)
    g.output("values", values)
    g.output("indices", indices)
    loss = g.sum(g.mul(values, g.constant(w)))
    session = vkml.compile(g, loss=loss, device=device)
    session.step()
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref = torch.topk(xt, k, dim=1, largest=largest)
    (ref.values * torch.tensor(w, dtype=torch.float64)).sum().backward()
    assert np.array_equal(session.read("indices"), ref.indices.numpy())
    assert np.array_equal(session.read("values"), ref.values.detach().numpy().astype(np.float32))
    assert np.allclose(session.grad("x"), xt.grad.numpy(), rtol=0, atol=1e-6)


def test_topk_refuses_a_k_the_axis_cannot_give():
    g = vkml.Graph()
    x = g.input("x", (2, 5))
    for k in (0, 6, 2.0):
        with pytest.raises(vkml.GraphError, match="topk: k must be an int in"):
            g.topk(x, k)
    with pytest.raises(vkml.GraphError, match="expects an f32 tensor"):
        g.argsort(g.input("ids", (3,), "i32"))
