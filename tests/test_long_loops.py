"""Reductions longer than a driver lets one shader invocation loop: lavapipe silently stops an
invocation's loops after 65535 iterations in all, which made a 6.3M-element sum (SmolLM2's
full-vocabulary loss) 34% low. Long reductions get more threads per workgroup; kernels that
cannot split their loops are refused at compile time, never run short."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import vkml
from vkml.compiler.stages import lower
from vkml.kernels.reduce import WORKGROUP

LAVAPIPE_LOOP_LIMIT = 65535  # what llvmpipe allows; GPUs have no limit


def test_sum_longer_than_one_loop_may_run(device):
    limit = device.caps.max_loop_iterations or LAVAPIPE_LOOP_LIMIT
    n = WORKGROUP * limit + 12345  # each thread of a 64-thread workgroup would loop past it
    g = vkml.Graph()
    x = g.input("x", (n,))
    g.output("total", x.sum())
    g.output("softmax", g.reshape(x, (1, n)).softmax())
    session = vkml.compile(g, device=device)
    session.set_input("x", np.ones(n, np.float32))
    session.step()
    assert float(session.read("total")) == n  # integers below 2**24 are exact in f32
    np.testing.assert_allclose(session.read("softmax"), 1.0 / n, rtol=1e-3)
    assert not any(f"@workgroup_size({WORKGROUP})" in d.kernel.wgsl
                   for d in session.plan.dispatches)


LONG = 70000  # past lavapipe's 65535 loop iterations per invocation


def test_amax_longer_than_one_loop_may_run(device):
    x = np.zeros(LONG, np.float32)
    x[-1] = 3.0  # the maximum last: a loop stopped early would miss it
    g = vkml.Graph()
    xi = g.input("x", (LONG,))
    g.output("m", g.amax(xi))
    session = vkml.compile(g, device=device)
    session.set_input("x", x)
    session.step()
    assert float(session.read("m")) == 3.0


@pytest.mark.parametrize("k", [65536, LONG])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_inner_dimension_longer_than_one_loop_may_run(device, k, ta, tb):
    g = vkml.Graph()
    a = g.input("a", (k, 1) if ta else (1, k))
    b = g.input("b", (1, k) if tb else (k, 1))
    g.output("c", g.matmul(a, b, transpose_a=ta, transpose_b=tb))
    session = vkml.compile(g, device=device)
    session.set_input("a", np.ones(a.shape, np.float32))
    session.set_input("b", np.ones(b.shape, np.float32))
    session.step()
    assert float(session.read("c")[0, 0]) == k  # integers below 2**24 are exact in f32


def test_linear_weight_gradient_over_many_rows(device):
    g = vkml.Graph()
    x = g.input("x", (LONG, 2))
    layer = vkml.nn.Linear(g, "fc", 2, 3)
    session = vkml.compile(g, loss=g.sum(layer(x)), keep_grads=True, device=device)
    session.set_input("x", np.ones((LONG, 2), np.float32))
    session.step()
    np.testing.assert_array_equal(session.grad("fc.weight"), np.full((3, 2), LONG, np.float32))
    np.testing.assert_array_equal(session.grad("fc.bias"), np.full(3, LONG, np.float32))


def test_embedding_gradient_over_many_positions(device):
    ids = np.arange(LONG, dtype=np.int32) % 5
    ids[-1] = 4  # the last position counts too
    g = vkml.Graph()
    idx = g.input("ids", (LONG,), "i32")
    table = g.param("table", (5, 2), "normal")
    session = vkml.compile(g, loss=g.sum(g.embedding(idx, table)), keep_grads=True,
                           device=device)
    session.set_input("ids", ids)
    session.step()
    counts = np.bincount(ids, minlength=5).astype(np.float32)
    np.testing.assert_array_equal(session.grad("table"), np.repeat(counts[:, None], 2, 1))


def limited(device):
    if device.caps.max_loop_iterations is None:
        pytest.skip(f"{device.caps.device_name} has no loop limit: nothing to refuse")


def test_fused_attention_past_the_loop_limit_is_refused_and_unfused_computes(device):
    limited(device)
    v = np.zeros((1, 1, LONG, 1), np.float32)
    v[..., -10000:, :] = 1.0  # the last keys: a loop stopped early would miss them
    g = vkml.Graph()
    q = g.input("q", (1, 1, 1, 4))
    k = g.input("k", (1, 1, LONG, 4))
    vi = g.input("v", (1, 1, LONG, 1))
    g.output("o", g.scaled_dot_product_attention(q, k, vi, fused=False))
    session = vkml.compile(g, device=device)
    for name, value in (("q", np.zeros((1, 1, 1, 4))), ("k", np.zeros((1, 1, LONG, 4))),
                        ("v", v)):
        session.set_input(name, value.astype(np.float32))
    session.step()
    np.testing.assert_allclose(session.read("o"), 10000 / LONG, rtol=1e-4)
    fused = vkml.Graph()
    q, k, vi = (fused.input(n, t.shape) for n, t in (("q", q), ("k", k), ("v", vi)))
    fused.output("o", fused.scaled_dot_product_attention(q, k, vi, fused=True))
    with pytest.raises(vkml.GraphError, match=r"70000 trips.*fused=False"):
        vkml.compile(fused, device=device)


def test_cumsum_past_the_loop_limit_is_refused(device):
    limited(device)
    g = vkml.Graph()
    g.output("c", g.cumsum(g.input("x", (LONG,)), 0))
    with pytest.raises(vkml.GraphError, match=r"cumsum .*70000 trips.*shorter axis"):
        vkml.compile(g, device=device)


def test_a_reduction_too_long_for_the_widest_workgroup_is_refused(device):
    # a device whose workgroups hold 64 threads: 64 x 65535 terms per output is its most
    caps = dataclasses.replace(device.caps, max_loop_iterations=LAVAPIPE_LOOP_LIMIT,
                               max_workgroup_invocations=WORKGROUP)
    g = vkml.Graph()
    g.output("s", g.input("x", (WORKGROUP * LAVAPIPE_LOOP_LIMIT + 1,)).sum())
    with pytest.raises(vkml.GraphError, match=r"sum .*made at .*reduce in two steps"):
        lower(g, caps)
