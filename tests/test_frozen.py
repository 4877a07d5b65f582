"""Frozen parameters: `graph.param(..., trainable=False)` and `vkml.compile(..., trainable=...)`.
A frozen parameter gets no gradient, no optimizer state and no update, yet is read, saved and
loaded like any other; the trainable ones train exactly as if the frozen ones were constants.
A trainable parameter the loss does not reach is left alone as torch.optim leaves it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import rel_l2
from safetensors.numpy import load_file

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



def test_trainable_names_from_a_generator_train_those_parameters(device, rng):
    """A generator of names is read once: the compiler asks for the trained set more than
    once, and from the second time on it was empty (nothing trained, nothing said)."""
    g, loss = two_layer(frozen_first=False)
    session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device,
                           trainable=(name for name in g.params if name.startswith("dec.")))
    before = session.params()
    feed(session, rng)
    session.step()
    after = session.params()
    assert np.array_equal(after["enc.weight"], before["enc.weight"])
    assert not np.array_equal(after["dec.weight"], before["dec.weight"])


@pytest.mark.parametrize("trainable,message", [
    ([], "trainable names no parameter"),
    (lambda name: name.startswith("head."), "the trainable predicate accepts none"),
    (None, r"the graph's parameters are all frozen \(trainable=False\)"),
])
def test_an_optimizer_with_nothing_to_train_is_refused(device, trainable, message):
    """As torch.optim refuses an empty parameter list: a predicate or list that matches no
    name (a prefix spelled as another exporter names it) compiled a session whose steps
    trained nothing."""
    g = vkml.Graph()
    x = g.input("x", (4, 3))
    w = g.param("enc.weight", (3, 2), "normal", trainable=trainable is not None)
    loss = g.mse(x @ w, g.input("y", (4, 2)))
    with pytest.raises(vkml.GraphError, match=f"nothing to train: {message}.*'enc.weight'"):
        vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.1), device=device,
                     trainable=trainable)
    vkml.compile(g, loss=loss, device=device, trainable=trainable).close()  # gradients alone

# torch.optim skips a parameter whose .grad is None: not even its weight decay applies.
UNREACHED_OPTIMIZERS = {
    "sgd": (lambda: vkml.SGD(lr=0.1, momentum=0.9, weight_decay=0.1),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)),
    "adamw": (lambda: vkml.AdamW(lr=0.05, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", UNREACHED_OPTIMIZERS)
def test_parameters_the_loss_does_not_reach_are_left_alone_as_torch_optim_leaves_them(
        name, device, tmp_path):
    ours, theirs = UNREACHED_OPTIMIZERS[name]
    g = vkml.Graph(seed=4)
    x, y = g.input("x", (6, 4)), g.input("y", (6, 3))
    w = g.param("w", (4, 3), "normal", 0.5)
    g.param("head.weight", (2, 4), "normal", 0.5)  # a head this loss does not use
    g.param("emb.weight", (5, 4), "normal", 0.5)  # an unused embedding table
    loss = g.mse(x @ w, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = vkml.compile(g, loss=loss, optimizer=ours(), device=device)
    assert [str(m.message).count("['head.weight', 'emb.weight']") for m in caught] == [1]
    assert caught[0].filename == __file__  # it points at the compile call
    initial = session.params()
    assert set(initial) == {"w", "head.weight", "emb.weight"}

    reference = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                 for n, v in initial.items()}
    optimizer = theirs(list(reference.values()))
    data = np.random.default_rng(5)
    for _ in range(3):
        xb = data.standard_normal((6, 4)).astype(np.float32)
        yb = data.standard_normal((6, 3)).astype(np.float32)
        session.set_input("x", xb)
        session.set_input("y", yb)
        session.step()
        optimizer.zero_grad()
        ((torch.tensor(xb, dtype=torch.float64) @ reference["w"]
          - torch.tensor(yb, dtype=torch.float64)) ** 2).mean().backward()
        optimizer.step()
    after = session.params()
    for n, expected in reference.items():
        assert rel_l2(after[n], expected.detach().numpy()) < 1e-5, n
    assert rel_l2(after["w"], initial["w"]) > 1e-2  # it did train
    for n in ("head.weight", "emb.weight"):
        assert reference[n].grad is None
        np.testing.assert_array_equal(after[n], reference[n].detach().numpy().astype(np.float32))

    path = tmp_path / "unreached.safetensors"
    session.save(path)
    saved = load_file(path)
    assert not any(k.startswith(("optimizer/head.weight", "optimizer/emb.weight")) for k in saved)
    for n in after:
        np.testing.assert_array_equal(saved[n], after[n])
    session.set_param("emb.weight", np.zeros((5, 4), np.float32))
    session.load(path)
    np.testing.assert_array_equal(session.read("emb.weight"), after["emb.weight"])

    with pytest.warns(UserWarning, match="head.weight"):
        gradients = vkml.compile(g, loss=loss, device=device)
    with pytest.raises(vkml.InputError, match="the loss does not depend on it"):
        gradients.grad("head.weight")
