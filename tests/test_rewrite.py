"""Fusion by rewriting: each rule fires where it should, and the fused graph computes the same
outputs and gradients as the unfused one."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import rel_l2

import vkml
from vkml.compiler.stages import lower


def mlp_classifier(g: vkml.Graph, activation: str = "relu"):
    x = g.input("x", (6, 10))
    labels = g.input("labels", (6,), "i32")
    h = getattr(vkml.nn.Linear(g, "fc1", 10, 12)(x), activation)()
    logits = g.output("logits", vkml.nn.Linear(g, "fc2", 12, 4)(h))
    return g.cross_entropy(logits, labels), {"x": (6, 10), "labels": (6,)}


def regression(g: vkml.Graph, activation: str = "gelu"):
    x = g.input("x", (5, 7))
    target = g.input("target", (5, 3))
    h = vkml.nn.Linear(g, "fc1", 7, 9)(x)
    h = getattr(h * 0.5 + 0.25, activation)()
    y = g.output("y", vkml.nn.Linear(g, "fc2", 9, 3)(h).tanh())
    return g.mse(y, target), {"x": (5, 7), "target": (5, 3)}


def softmax_head(g: vkml.Graph, activation: str = "silu"):
    x = g.input("x", (4, 8))
    w = g.param("w", (8, 5), "normal", 0.5)
    p = g.output("p", getattr(x @ w, activation)().softmax())
    return (p * p).sum(-1).mean(), {"x": (4, 8)}


# (graph builder, activation, fused ops that must appear)
CASES = [
    (mlp_classifier, "relu", {"fused_matmul", "fused_sum", "fused_pointwise"}),
    (mlp_classifier, "sigmoid", {"fused_matmul", "fused_sum"}),
    (regression, "gelu", {"fused_matmul", "fused_sum", "fused_pointwise"}),
    (regression, "silu", {"fused_matmul", "fused_sum"}),
    (softmax_head, "silu", {"fused_sum"}),
]


def inputs_for(shapes, rng):
    return {n: (rng.integers(0, 4, s).astype(np.int32) if n == "labels"
                else rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()}


def compiled(builder, activation, rewrite, device, optimizer=None):
    g = vkml.Graph(seed=3)
    loss, shapes = builder(g, activation)
    return vkml.compile(g, loss=loss, optimizer=optimizer, device=device, rewrite=rewrite), shapes


@pytest.mark.parametrize("builder,activation,expected", CASES,
                         ids=[f"{b.__name__}-{a}" for b, a, _ in CASES])
def test_fused_graph_computes_the_same_outputs_and_gradients(builder, activation, expected,
                                                             device, rng):
    plain, shapes = compiled(builder, activation, "none", device)
    fused, _ = compiled(builder, activation, "greedy", device)
    ops = Counter(d.kernel.name.split("_")[0] + "_" + d.kernel.name.split("_")[1]
                  for d in fused.plan.dispatches)
    assert expected <= set(ops), ops
    assert len(fused.plan.dispatches) < len(plain.plan.dispatches)
    for name, value in inputs_for(shapes, rng).items():
        plain.set_input(name, value)
        fused.set_input(name, value)
    plain.step()
    fused.step()
    for name in plain.plan.outputs:
        assert rel_l2(fused.read(name), plain.read(name)) < 1e-6, name
    for name in plain.plan.params:
        assert rel_l2(fused.grad(name), plain.grad(name)) < 1e-6, name


def test_inference_folds_bias_and_activation_into_the_matmul(device):
    g = vkml.Graph()
    x = g.input("x", (4, 6))
    g.output("y", vkml.nn.Linear(g, "fc", 6, 3)(x).relu())
    session = vkml.compile(g, device=device)
    assert [d.op for d in session.plan.dispatches] == ["fused_matmul"]
    assert session.plan.dispatches[0].kernel.name.startswith("fused_matmul_nt_4x3x6_")
    xv = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    session.set_input("x", xv)
    session.step()
    expected = np.maximum(xv @ session.read("fc.weight").T + session.read("fc.bias"), 0)
    np.testing.assert_allclose(session.read("y"), expected, rtol=1e-5, atol=1e-6)


def test_training_with_fusion_matches_training_without(device, rng):
    plain, shapes = compiled(mlp_classifier, "relu", "none", device, vkml.Adam(lr=1e-2))
    fused, _ = compiled(mlp_classifier, "relu", "greedy", device, vkml.Adam(lr=1e-2))
    for _ in range(5):
        for name, value in inputs_for(shapes, rng).items():
            plain.set_input(name, value)
            fused.set_input(name, value)
        plain.step()
        fused.step()
    for name, value in plain.params().items():
        assert rel_l2(fused.read(name), value) < 1e-5, name


@pytest.mark.parametrize("host", ["matmul", "sum", "conv2d"])
def test_a_cast_to_i32_stays_out_of_an_f32_epilogue(device, host):
    """A product's, a sum's or a convolution's kernel stores f32: a cast of its result to i32
    (ONNX's MatMulInteger and ConvInteger) absorbed into its epilogue was WGSL naga refused."""
    rng = np.random.default_rng(0)
    x = rng.integers(-5, 5, (4, 6)).astype(np.float32)
    w = rng.integers(-5, 5, (6, 3)).astype(np.float32)
    kernel = np.ones((2, 1, 3, 3), np.float32)
    g = vkml.Graph()
    a = g.input("a", (4, 6))
    result = {"matmul": lambda: g.matmul(a, g.constant(w)), "sum": lambda: g.sum(a, 1),
              "conv2d": lambda: g.conv2d(g.reshape(a, (1, 1, 4, 6)), g.constant(kernel))}[host]()
    g.output("y", g.cast(result, "i32"))
    session = vkml.compile(g, device=device)
    session.set_input("a", x)
    session.step()
    t = torch.tensor(x, dtype=torch.float64)
    expected = {"matmul": lambda: t @ torch.tensor(w, dtype=torch.float64),
                "sum": lambda: t.sum(1),
                "conv2d": lambda: torch.nn.functional.conv2d(
                    t.reshape(1, 1, 4, 6), torch.tensor(kernel, dtype=torch.float64))}[host]()
    np.testing.assert_array_equal(session.read("y"), expected.numpy().astype(np.int32))


def test_outputs_are_never_fused_away(device):
    g = vkml.Graph()
    x = g.input("x", (3, 4))
    h = g.output("h", x.exp())  # read by the user, so it must stay in memory
    g.output("y", (h * 2.0).sum())
    session = vkml.compile(g, device=device)
    xv = np.ones((3, 4), np.float32)
    session.set_input("x", xv)
    session.step()
    np.testing.assert_allclose(session.read("h"), np.exp(xv), rtol=1e-6)
    np.testing.assert_allclose(session.read("y"), 24 * np.e, rtol=1e-6)


def test_axes_of_size_one_do_not_stop_fusion(device, rng):
    # at batch size 1 every activation has an axis of size 1, which broadcasting reads with
    # stride 0: the chain x * r * w + 1 must still become one kernel (it was three), and that
    # kernel the prologue of the last sum, which reads r broadcast over the reduced axis; the
    # mean and rsqrt move into the sum of squares' epilogue, through keepdims' reshape
    g = vkml.Graph()
    x = g.input("x", (1, 4, 8))
    w = g.param("w", (8,), "normal")
    r = g.rsqrt((x * x).mean(axis=-1, keepdims=True))
    g.output("y", ((x * r) * w + 1.0).sum(axis=-1))
    session = vkml.compile(g, device=device)
    assert [d.op for d in session.plan.dispatches] == [
        "fused_sum", "fused_sum"], [
        d.label for d in session.plan.dispatches]
    xv = rng.standard_normal((1, 4, 8)).astype(np.float32)
    session.set_input("x", xv)
    session.step()
    rv = 1 / np.sqrt((xv.astype(np.float64) ** 2).mean(-1, keepdims=True))
    expected = ((xv * rv) * session.read("w") + 1.0).sum(-1)
    assert rel_l2(session.read("y"), expected) < 1e-5


def test_an_elementwise_op_read_by_several_fusing_consumers_is_computed_in_each(device, rng):
    g = vkml.Graph()
    x = g.input("x", (4, 8))
    h = x * x.exp()  # one elementwise op (the exp fuses into it), read by three consumers
    g.output("a", h + 1.0)
    g.output("b", h.sum(axis=-1))
    g.output("c", (h * 3.0).relu())
    session = vkml.compile(g, device=device)
    ops = Counter(d.op for d in session.plan.dispatches)
    assert "mul" not in ops and sum(ops.values()) == 3, ops
    kept = vkml.Graph()  # a matmul cannot absorb it: then it stays in memory for all of them
    x2 = kept.input("x", (4, 8))
    h2 = x2 * x2.exp()
    kept.output("a", h2 + 1.0)
    kept.output("m", h2 @ kept.param("w", (8, 3), "normal"))
    assert any(node.op == "fused_pointwise" and node.shape == (4, 8) and len(node.inputs) == 1
               for node in lower(kept, device.caps).nodes)
    xv = rng.standard_normal((4, 8)).astype(np.float32)
    session.set_input("x", xv)
    session.step()
    hv = xv.astype(np.float64) * np.exp(xv)
    assert rel_l2(session.read("a"), hv + 1) < 1e-6
    assert rel_l2(session.read("b"), hv.sum(-1)) < 1e-6
    assert rel_l2(session.read("c"), np.maximum(3 * hv, 0)) < 1e-6


def test_an_add_that_took_in_a_product_is_not_copied_into_its_readers(device, rng):
    # a residual add after a linear layer (its bias already in the product's epilogue) takes
    # the product into its own epilogue in the pass that also copies the add, as a duplicable
    # elementwise op, into a norm's two sums and its scale: the copies then computed the
    # product three more times (seven kernels, four of them the second product)
    g = vkml.Graph()
    x = g.input("x", (6, 8))
    h = vkml.nn.Linear(g, "fc1", 8, 12)(x).gelu()
    y = x + vkml.nn.Linear(g, "fc2", 12, 8)(h)
    mean = y.mean(axis=-1, keepdims=True)
    scale = g.rsqrt(((y - mean) * (y - mean)).mean(axis=-1, keepdims=True) + 1e-5)
    g.output("out", (y - mean) * scale)
    session = vkml.compile(g, device=device)
    ops = [d.op for d in session.plan.dispatches]
    assert ops == ["fused_matmul", "fused_matmul", "fused_sum", "fused_sum",
                   "fused_pointwise"], ops
    xv = rng.standard_normal((6, 8)).astype(np.float64)
    session.set_input("x", xv.astype(np.float32))
    session.step()
    w1, b1, w2, b2 = (session.read(n).astype(np.float64)
                      for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    pre = xv @ w1.T + b1
    yv = xv + (0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))) @ w2.T + b2
    centered = yv - yv.mean(-1, keepdims=True)
    want = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-5)
    assert rel_l2(session.read("out"), want) < 1e-5


def test_a_fused_kernel_never_binds_more_buffers_than_the_device_allows(device, rng):
    n = device.caps.max_bindings_per_stage + 8
    g = vkml.Graph()
    xs = [g.input(f"x{k}", (4,)) for k in range(n)]
    total = xs[0]
    for x in xs[1:]:
        total = total + x * 0.5
    g.output("y", total)
    session = vkml.compile(g, device=device)
    assert all(len(d.slots) <= device.caps.max_bindings_per_stage
               for d in session.plan.dispatches)
    values = [rng.standard_normal(4).astype(np.float32) for _ in range(n)]
    for k, v in enumerate(values):
        session.set_input(f"x{k}", v)
    session.step()
    expected = values[0].astype(np.float64) + 0.5 * np.sum(values[1:], axis=0, dtype=np.float64)
    assert rel_l2(session.read("y"), expected) < 1e-6


def test_a_small_op_broadcast_into_a_larger_one_is_computed_again_inside_it(device, rng):
    # w * 2 + 1 per column, read broadcast by every row: no kernel and no memory of its own
    g = vkml.Graph()
    x = g.input("x", (4, 8))
    w = g.param("w", (8,), "normal")
    g.output("y", (x * (w * 2.0 + 1.0)).exp())
    session = vkml.compile(g, device=device)
    assert [d.op for d in session.plan.dispatches] == ["fused_pointwise"]
    # one that reads its own input broadcast (u along the rows of t) is not: inside the larger
    # op it would need strides of strides, so it keeps its kernel
    kept = vkml.Graph()
    x2 = kept.input("x", (5, 2, 3))
    u = kept.param("u", (3,), "normal")
    t = kept.input("t", (2, 3)) + u
    kept.output("y", x2 * t)
    kept_session = vkml.compile(kept, device=device)
    assert [d.op for d in kept_session.plan.dispatches] == ["add", "mul"]
    xv = rng.standard_normal((4, 8)).astype(np.float32)
    session.set_input("x", xv)
    session.step()
    want = np.exp(xv * (session.read("w").astype(np.float64) * 2 + 1))
    assert rel_l2(session.read("y"), want) < 1e-6
    x2v = rng.standard_normal((5, 2, 3)).astype(np.float32)
    tv = rng.standard_normal((2, 3)).astype(np.float32)
    kept_session.set_input("x", x2v)
    kept_session.set_input("t", tv)
    kept_session.step()
    assert rel_l2(kept_session.read("y"), x2v * (tv + kept_session.read("u"))) < 1e-6
