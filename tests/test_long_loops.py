"""Reductions longer than a driver lets one shader invocation loop: lavapipe silently stops an
invocation's loops after 65535 iterations in all, which made a 6.3M-element sum (SmolLM2's
full-vocabulary loss) 34% low. Long reductions get more threads per workgroup."""

from __future__ import annotations

import numpy as np

import vkml
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
