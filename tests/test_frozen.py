"""Frozen parameters: `graph.param(..., trainable=False)` and `vkml.compile(..., trainable=...)`.
A frozen parameter gets no gradient, no optimizer state and no update, yet is read, saved and
loaded like any other; the trainable ones train exactly as if the frozen ones were constants."""

from __future__ import annotations

import numpy as np
import pytest

import vkml


def two_layer(frozen_first: bool, seed: int = 3):
    g = vkml.Graph(seed=seed)
    x = g.input("x", (8, 5))
    w1 = g.param("enc.weight", (5, 6), "normal", 0.5, trainable=not frozen_first)
    w2 = g.param("dec.weight", (6, 3), "normal", 0.5)
    target = g.input("y", (8, 3))
    pred = g.output("pred", g.tanh(x @ w1) @ w2)
    return g, g.mse(pred, target)


def feed(session, rng):
    session.set_input("x", rng.standard_normal((8, 5)).astype(np.float32))
    session.set_input("y", rng.standard_normal((8, 3)).astype(np.float32))


def test_frozen_parameter_is_not_updated_and_has_no_state(device, rng, tmp_path):
    g, loss = two_layer(frozen_first=True)
    session = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.05), device=device)
    before = session.params()
    feed(session, rng)
    for _ in range(3):
        session.step()
    after = session.params()
    assert np.array_equal(after["enc.weight"], before["enc.weight"])
    assert not np.array_equal(after["dec.weight"], before["dec.weight"])
    state = session.state_dict()
    assert "enc.weight" in state and "optimizer/dec.weight/exp_avg" in state
    assert not any(k.startswith("optimizer/enc.weight") for k in state)
    path = tmp_path / "frozen.safetensors"
    session.save(path)
    session.set_param("enc.weight", np.zeros((5, 6), np.float32))
    session.load(path)
    assert np.array_equal(session.read("enc.weight"), before["enc.weight"])


def test_frozen_parameter_has_no_gradient(device, rng):
    g, loss = two_layer(frozen_first=True)
    session = vkml.compile(g, loss=loss, device=device)
    feed(session, rng)
    session.step()
    assert session.grad("dec.weight").shape == (6, 3)
    with pytest.raises(vkml.InputError, match="frozen"):
        session.grad("enc.weight")


def test_trainable_argument_overrides_the_flag_and_matches_a_constant(device, rng):
    """Training only `dec.weight` (chosen at compile time) equals training a graph in which the
    first layer is a constant with the same values."""
    g, loss = two_layer(frozen_first=False)
    chosen = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device,
                          trainable=lambda name: name.startswith("dec."))
    by_name = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device,
                           trainable=["dec.weight"])
    w1 = chosen.read("enc.weight")
    c = vkml.Graph(seed=3)
    x = c.input("x", (8, 5))
    c.rng.standard_normal((5, 6))  # the same draw as enc.weight, so dec.weight matches too
    w2 = c.param("dec.weight", (6, 3), "normal", 0.5)
    target = c.input("y", (8, 3))
    pred = c.output("pred", c.tanh(x @ c.constant(w1)) @ w2)
    constant = vkml.compile(c, loss=c.mse(pred, target), optimizer=vkml.SGD(lr=0.1),
                            device=device)
    data = np.random.default_rng(5)
    xs = data.standard_normal((8, 5)).astype(np.float32)
    ys = data.standard_normal((8, 3)).astype(np.float32)
    for s in (chosen, by_name, constant):
        s.set_input("x", xs)
        s.set_input("y", ys)
        for _ in range(4):
            s.step()
    assert np.array_equal(chosen.read("enc.weight"), w1)
    np.testing.assert_array_equal(chosen.read("dec.weight"), constant.read("dec.weight"))
    np.testing.assert_array_equal(by_name.read("dec.weight"), constant.read("dec.weight"))


def test_trainable_argument_rejects_unknown_names(device):
    g, loss = two_layer(frozen_first=False)
    with pytest.raises(vkml.GraphError, match="unknown parameters"):
        vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device,
                     trainable=["decoder.weight"])
