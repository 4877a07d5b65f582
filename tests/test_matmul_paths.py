"""Both matmul kernels on the device at hand: codegen picks workgroup-memory tiles for GPUs and
direct reads for CPU drivers, so on lavapipe the GPU variant would otherwise go untested here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import rel_l2

import vkml
from vkml.compiler.stages import lower
from vkml.session import Session

CASES = {  # name: (a shape, b shape, transpose_a, transpose_b)
    "nn_edges": ((20, 24), (24, 18), False, False),
    "nt": ((20, 24), (18, 24), False, True),
    "tn": ((24, 20), (24, 18), True, False),
    "tt_register_tile_2x2": ((40, 40), (36, 40), True, True),
    "batched_broadcast": ((3, 20, 17), (17, 18), False, False),
}


@pytest.mark.parametrize("device_type", ["discrete", "cpu"])
@pytest.mark.parametrize("name", CASES)
def test_matmul_variant_matches_numpy(name, device_type, device, rng):
    if device.backend_name != "vulkan":
        pytest.skip("the variants are a codegen choice; one backend is enough to check them")
    a_shape, b_shape, ta, tb = CASES[name]
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a_shape, init=a), g.param("b", b_shape, init=b)
    g.output("c", g.matmul(pa, pb, transpose_a=ta, transpose_b=tb).relu())  # with an epilogue
    caps = dataclasses.replace(device.caps, device_type=device_type)
    session = Session(lower(g, caps).plan, device)
    session.step()
    a64 = np.swapaxes(a, -1, -2) if ta else a
    b64 = np.swapaxes(b, -1, -2) if tb else b
    expected = np.maximum(a64.astype(np.float64) @ b64.astype(np.float64), 0)
    staged = any("var<workgroup>" in d.kernel.wgsl for d in session.plan.dispatches)
    assert staged == (device_type != "cpu")
    assert rel_l2(session.read("c"), expected) < 1e-5
