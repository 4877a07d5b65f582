"""Dropout: a fresh mask each training step from a counter-based hash, the identity in forward()
and in sessions without a loss, the gradient through the same mask, the same numbers whole or in
chunks and from one session to the next."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2

import vkml

U32 = (1 << 32) - 1


def pcg(v: np.ndarray) -> np.ndarray:
    """The kernel's hash (ops/pointwise.py DROPOUT_HELPER) in numpy, in 64-bit lanes."""
    state = (v * 747796405 + 2891336453) & U32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & U32
    return (word >> 22) ^ word


def kept(seed: int, step: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """Which elements the op keeps at this training step, recomputed independently."""
    index = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = pcg(pcg(pcg(np.uint64(seed)) ^ np.uint64(step)) ^ index)
    return (h >= min(round(p * 2**32), U32)).reshape(shape)


def mlp(p: float = 0.25, seed_a: int = 11, seed_b: int = 12) -> tuple[vkml.Graph, vkml.Tensor]:
    """x @ w1 + b -> gelu -> dropout -> @ w2 -> dropout: one dropout in a product's epilogue,
    one after the last product."""
    rng = np.random.default_rng(5)
    g = vkml.Graph()
    x = g.input("x", (8, 12))
    w1 = g.param("w1", (12, 16), init=rng.standard_normal((12, 16)).astype(np.float32))
    b = g.param("b", (16,), init=rng.standard_normal(16).astype(np.float32))
    w2 = g.param("w2", (16, 6), init=rng.standard_normal((16, 6)).astype(np.float32))
    h = g.dropout(g.gelu(x @ w1 + b), p, seed=seed_a)
    out = g.dropout(h @ w2, p, seed=seed_b)
    g.output("out", out)
    return g, out


def loss_of(g: vkml.Graph, out: vkml.Tensor) -> vkml.Tensor:
    return g.mean(g.square(out))


X = np.random.default_rng(6).standard_normal((8, 12)).astype(np.float32)


def session_of(device, optimizer=None, **compile_options):
    g, out = mlp()
    s = vkml.compile(g, loss=loss_of(g, out), optimizer=optimizer, device=device,
                     keep_grads=True, **compile_options)
    s.set_input("x", X)
    return s


def test_forward_and_gradients_match_torch_with_the_same_masks(device):
    """Step 1 and step 2 against torch in float64 given the masks the hash draws: values and
    every parameter's gradient (the backward pass applies the forward's masks)."""
    s = session_of(device)
    params = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True)
              for n, v in s.params().items()}
    p = 0.25
    for step in (1, 2):
        s.step()
        for t in params.values():
            t.grad = None
        x = torch.tensor(X, dtype=torch.float64)
        m1 = torch.tensor(kept(11, step, (8, 16), p))
        m2 = torch.tensor(kept(12, step, (8, 6), p))
        h = F.gelu(x @ params["w1"] + params["b"]) * m1 / (1 - p)
        out = (h @ params["w2"]) * m2 / (1 - p)
        out.square().mean().backward()
        assert rel_l2(s.read("out"), out.detach().numpy()) < 1e-5
        for name, t in params.items():
            assert rel_l2(s.grad(name), t.grad.numpy()) < 1e-5, name


def test_mask_statistics_scale_and_fresh_masks(device):
    p, shape = 0.3, (64, 128)
    g = vkml.Graph()
    x = g.param("x", shape, init=1.0)
    y = g.dropout(x, p)
    s = vkml.compile(g, loss=g.sum(y), outputs={"y": y}, device=device)
    masks = []
    for _ in range(3):
        s.step()
        y_value = s.read("y")
        scale = np.float32(1 / (1 - p))
        assert set(np.unique(y_value)) == {np.float32(0), scale}
        np.testing.assert_array_equal(s.grad("x"), y_value)  # d(sum y)/dx: the mask, scaled
        keep = y_value != 0
        # kept fraction within 6 standard deviations of 1 - p, overall and per block of rows
        sd = np.sqrt(p * (1 - p) / keep.size)
        assert abs(keep.mean() - (1 - p)) < 6 * sd
        blocks = keep.reshape(8, -1).mean(1)
        assert np.all(np.abs(blocks - (1 - p)) < 6 * sd * np.sqrt(8))
        masks.append(keep)
    for a, b in ((0, 1), (1, 2), (0, 2)):  # independent masks differ in ~2p(1-p) of elements
        assert abs((masks[a] != masks[b]).mean() - 2 * p * (1 - p)) < 0.05


def test_forward_and_inference_are_the_identity(device):
    s = session_of(device)
    s.forward()
    g, out = mlp()
    plain = vkml.compile(g, device=device)  # no loss: inference, every step
    # compiled without a loss, the plan is that of the graph without dropout
    assert vkml.graph.TRAINING_STEP not in plain.plan.inputs
    without = vkml.Graph()
    x = without.input("x", (8, 12))
    w1, b, w2 = (without.param(n, v.shape, init=v) for n, v in plain.params().items())
    without.output("out", without.gelu(x @ w1 + b) @ w2)
    assert ([d.name for d in vkml.compile(without, device=device).plan.dispatches]
            == [d.name for d in plain.plan.dispatches])
    plain.set_input("x", X)
    plain.step()
    reference = s.read("out")
    np.testing.assert_array_equal(plain.read("out"), reference)
    x = torch.tensor(X, dtype=torch.float64)
    w = {n: torch.tensor(v, dtype=torch.float64) for n, v in s.params().items()}
    assert rel_l2(reference, (F.gelu(x @ w["w1"] + w["b"]) @ w["w2"]).numpy()) < 1e-5


def test_same_graph_same_masks_and_forward_does_not_advance(device):
    """Two sessions of one graph draw the same masks step by step; a forward() between steps
    takes no step number; another seed draws other masks."""
    a, b = session_of(device), session_of(device)
    a.step()
    first = a.read("out")
    a.forward()
    a.step()
    b.step()
    np.testing.assert_array_equal(b.read("out"), first)
    b.step()
    np.testing.assert_array_equal(b.read("out"), a.read("out"))
    assert not np.array_equal(first, a.read("out"))
    g, out = mlp(seed_a=21, seed_b=22)
    c = vkml.compile(g, loss=loss_of(g, out), device=device)
    c.set_input("x", X)
    c.step()
    assert not np.array_equal(c.read("out"), first)


def test_chunked_steps_are_bit_identical(device):
    whole, chunked = (session_of(device, vkml.SGD(lr=0.1)) for _ in range(2))
    for _ in range(3):
        whole.step()
        chunked.step(chunks=3)
        np.testing.assert_array_equal(chunked.read("out"), whole.read("out"))
    for name, value in whole.params().items():
        np.testing.assert_array_equal(chunked.params()[name], value)


def test_the_training_step_is_the_sessions_own(device):
    s = session_of(device)
    assert vkml.graph.TRAINING_STEP not in s.inputs
    with pytest.raises(vkml.InputError, match="sets it"):
        s.set_input(vkml.graph.TRAINING_STEP, np.int32(3))
    g = vkml.Graph()
    with pytest.raises(vkml.GraphError, match="another name"):
        g.input(vkml.graph.TRAINING_STEP, (1,))
    with pytest.raises(vkml.GraphError, match="between 0 and 1"):
        g.dropout(g.input("x", (2,)), 1.5)
    x = g.input("y", (2,))
    assert g.dropout(x, 0.5, training=False) is x and g.dropout(x, 0.0) is x


def test_a_resumed_run_draws_the_masks_it_would_have(device, tmp_path):
    run, resumed = (session_of(device, vkml.Adam(lr=0.01)) for _ in range(2))
    run.step()
    run.step()
    run.save(tmp_path / "ckpt.safetensors")
    resumed.load(tmp_path / "ckpt.safetensors")
    for _ in range(2):
        run.step()
        resumed.step()
        np.testing.assert_array_equal(resumed.read("out"), run.read("out"))


def test_dropout_fused_into_a_sum_reads_each_elements_own_mask(device):
    """A dropout that only a loss's sum reads becomes the sum's summand; its elements' indices
    there (three axes, a broadcast factor) are the tensor's own."""
    p, shape = 0.4, (4, 5, 6)
    rng = np.random.default_rng(8)
    x0, w = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(6)
    g = vkml.Graph()
    x = g.param("x", shape, init=x0)
    loss = g.sum(g.dropout(x, p, seed=3) * g.constant(w.astype(np.float32)))
    s = vkml.compile(g, loss=loss, device=device)
    assert any("sum" in d.name for d in s.plan.dispatches)
    assert not any(d.op == "dropout" for d in s.plan.dispatches)
    for step in (1, 2):
        s.step()
        factor = kept(3, step, shape, p) / (1 - p) * w
        assert abs(float(s.read("loss")) - np.sum(x0 * factor)) < 1e-5 * np.sum(np.abs(x0 * factor))
        assert rel_l2(s.grad("x"), factor) < 1e-6


def test_attention_dropout_matches_torch_given_the_mask(device):
    """scaled_dot_product_attention(dropout_p=...): the weights' dropout, torch's composition
    given the mask the hash draws, values and gradients."""
    p, shapes = 0.2, [(1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)]
    rng = np.random.default_rng(9)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    g = vkml.Graph()
    q, k, v = (g.param(n, x.shape, init=x) for n, x in zip("qkv", values))
    out = g.scaled_dot_product_attention(q, k, v, dropout_p=p)
    (node,) = [t for t in g.nodes if t.op == "dropout"]
    salt = int(g.initial_values[node.inputs[2].id])
    s = vkml.compile(g, loss=g.sum(g.square(out)), outputs={"out": out}, device=device)
    s.step()
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in values)
    weights = torch.softmax(tq @ tk.transpose(-1, -2) / np.sqrt(8), -1)
    ref = (weights * torch.tensor(kept(salt, 1, node.shape, p)) / (1 - p)) @ tv
    ref.square().sum().backward()
    assert rel_l2(s.read("out"), ref.detach().numpy()) < 1e-5
    for name, t in zip("qkv", (tq, tk, tv)):
        assert rel_l2(s.grad(name), t.grad.numpy()) < 1e-5, name
