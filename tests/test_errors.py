"""Mistakes that used to give silently wrong numbers now raise a VkmlError subclass naming the
input and the fix, and leave the session usable."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import subprocess_env

import vkml


def classifier(device, optimizer=None):
    g = vkml.Graph(seed=1)
    x = g.input("x", (4, 3))
    labels = g.input("labels", (4,), "i32")
    logits = g.output("logits", vkml.nn.Linear(g, "fc", 3, 4)(x))
    loss = g.cross_entropy(logits, labels)
    session = vkml.compile(g, loss=loss, optimizer=optimizer, device=device)
    session.set_input("x", np.ones((4, 3), np.float32))
    return g, session


@pytest.mark.parametrize("bad", [[0, 1, 2, 4], [0, -1, 2, 3], [1000, 0, 0, 0]])
def test_class_labels_out_of_range_are_refused(device, bad):
    _, session = classifier(device)
    with pytest.raises(vkml.InputError, match=r"input 'labels' holds .* outside \[0, 4\)"):
        session.set_input("labels", np.array(bad))
    session.set_input("labels", np.array([0, 1, 2, 3]))  # still usable
    session.step()
    assert np.isfinite(session.read("loss")) and session.read("loss") > 0


def test_token_ids_out_of_range_are_refused(device):
    g = vkml.Graph()
    ids = g.input("ids", (2, 3), "i32")
    table = g.param("table", (5, 2), "normal")
    g.output("e", g.embedding(g.reshape(ids, (6,)), table))
    session = vkml.compile(g, device=device)
    with pytest.raises(vkml.InputError, match=r"'ids' holds 5 .* embedding row"):
        session.set_input("ids", np.array([[0, 1, 2], [3, 4, 5]]))


def test_one_hot_ids_out_of_range_are_refused(device):
    g = vkml.Graph()
    ids = g.input("ids", (3,), "i32")
    g.output("h", g.one_hot(ids, 4))
    session = vkml.compile(g, device=device)
    with pytest.raises(vkml.InputError, match=r"'ids' holds -1 .* outside \[0, 4\)"):
        session.set_input("ids", np.array([0, -1, 3]))
    session.set_input("ids", np.array([0, 2, 3]))  # still usable
    session.step()
    np.testing.assert_array_equal(session.read("h"), np.eye(4, dtype=np.float32)[[0, 2, 3]])


# Index operands computed on the GPU (here from an i32 input through a slice, a concat, a
# transpose or a gather) are checked there: the first read or wait after the step raises, and
# the step changed no parameter. torch raises on each of these, checked alongside.
def _ids_through(producer: str, g: vkml.Graph, ids: vkml.Tensor) -> vkml.Tensor:
    """Four of the six ids (1, 2, 3, 4), through `producer`."""
    if producer == "slice":
        return g.slice(ids, 0, 1, 5)
    if producer == "concat":
        return g.concat([g.slice(ids, 0, 1, 3), g.slice(ids, 0, 3, 5)])
    if producer == "transpose":
        return g.reshape(g.transpose(g.reshape(g.slice(ids, 0, 1, 5), (2, 2))), (4,))
    return g.gather(ids, g.constant(np.array([1, 2, 3, 4]), "i32"), 0)


def _torch_ids_through(producer: str, ids: np.ndarray):
    t = torch.tensor(ids)
    if producer == "transpose":
        return t[1:5].reshape(2, 2).T.reshape(4)
    return t[1:5]


@pytest.mark.parametrize("producer", ["slice", "concat", "transpose", "gather"])
def test_embedding_ids_computed_on_the_gpu_are_checked(device, producer):
    g = vkml.Graph(seed=3)
    ids = g.input("ids", (6,), "i32")
    table = g.param("table", (5, 3), "normal")
    rows = g.embedding(_ids_through(producer, g, ids), table)
    loss = g.sum(g.mul(rows, rows))
    session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device)
    before = session.read("table")
    for bad in (7, -3, 10**6):
        values = np.array([9, 0, 1, bad, 4, 9])  # positions 0 and 5 are not used
        with pytest.raises((IndexError, RuntimeError)):
            F.embedding(_torch_ids_through(producer, values), torch.tensor(before))
        session.set_input("ids", values)
        session.step()
        with pytest.raises(vkml.InputError, match=rf"embedding .* read {bad} at flat position "
                           rf"\d of its embedding row operand .* outside \[0, 5\)"):
            session.read("loss")
        np.testing.assert_array_equal(session.read("table"), before)  # no update
    good = np.array([9, 0, 1, 2, 4, 9])  # 9 is never read: fine, as in torch
    session.set_input("ids", good)
    session.step()
    expected = (before[_torch_ids_through(producer, good).numpy()] ** 2).sum()
    np.testing.assert_allclose(session.read("loss"), expected, rtol=1e-5)
    assert not np.array_equal(session.read("table"), before)  # this one updates


@pytest.mark.parametrize("bad", [5, -2])
def test_class_labels_through_a_slice_are_checked(device, bad):
    g = vkml.Graph(seed=1)
    x, labels = g.input("x", (3, 4)), g.input("labels", (4,), "i32")
    logits = vkml.nn.Linear(g, "fc", 4, 5)(x)
    loss = g.cross_entropy(logits, g.slice(labels, 0, 1, 4))
    session = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.1), device=device)
    values = np.array([7, 0, bad, 4])
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(torch.zeros(3, 5), torch.tensor(values[1:]))
    session.set_input("x", np.ones((3, 4), np.float32))
    session.set_input("labels", values)
    before = session.params()
    session.step()
    with pytest.raises(vkml.InputError, match=rf"read {bad} .* class index .* outside \[0, 5\)"):
        session.wait()
    session.wait()  # reported once
    after = session.params()
    assert all(np.array_equal(before[n], after[n]) for n in before)


def test_one_hot_and_gather_indices_computed_on_the_gpu_are_checked(device):
    g = vkml.Graph()
    ids = g.input("ids", (4,), "i32")
    x = g.input("x", (3, 5))
    pair = g.concat([g.slice(ids, 0, 0, 2), g.slice(ids, 0, 2, 4)])
    g.output("h", g.one_hot(pair, 6))
    g.output("y", g.gather(x, g.slice(ids, 0, 1, 3), 1))  # valid in [-5, 5)
    session = vkml.compile(g, device=device)
    session.set_input("x", np.zeros((3, 5), np.float32))
    session.set_input("ids", np.array([0, -5, 4, 5]))
    session.forward()
    with pytest.raises(vkml.InputError, match=r"one_hot .* read -5 at flat position 1 .* "
                       r"outside \[0, 6\)"):
        session.read("y")
    session.set_input("ids", np.array([0, -6, 4, 5]))
    session.forward()
    with pytest.raises(vkml.InputError, match=r"read -6 .* outside \[0, 6\)"):
        session.read("h")  # the first operand in order: one_hot's
    session.set_input("ids", np.array([0, 5, 1, 3]))
    session.forward()
    with pytest.raises(vkml.InputError, match=r"gather .* read 5 .*outside \[-5, 5\)"):
        session.wait()
    session.set_input("ids", np.array([0, -4, 1, 3]))
    session.forward()
    with pytest.raises(vkml.InputError, match=r"one_hot .* read -4"):
        session.wait()
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    session.set_input("x", x)
    session.set_input("ids", np.array([0, 4, 1, 3]))
    session.forward()
    np.testing.assert_array_equal(session.read("h"), np.eye(6, dtype=np.float32)[[0, 4, 1, 3]])
    np.testing.assert_array_equal(session.read("y"), x[:, [4, 1]])


def test_constant_indices_out_of_range_are_refused_at_compile(device):
    g = vkml.Graph()
    table = g.param("table", (5, 3), "normal")
    g.output("e", g.embedding(g.reshape(g.constant(np.array([[0, 5]]), "i32"), (2,)), table))
    with pytest.raises(vkml.GraphError, match=r"read 5 at flat position 1 .* outside \[0, 5\): "
                       "a constant index out of range"):
        vkml.compile(g, device=device)


def test_reading_before_anything_was_computed_is_refused(device):
    _, session = classifier(device, vkml.SGD(lr=0.1))
    with pytest.raises(vkml.NotComputedError, match="run step"):
        session.read("loss")
    g, grads = classifier(device)
    grads.set_input("labels", np.zeros(4, np.int32))
    with pytest.raises(vkml.NotComputedError, match=r"gradient of 'fc.weight'.*step\(\)"):
        grads.grad("fc.weight")
    grads.forward()
    assert np.isfinite(grads.read("loss"))  # forward computes outputs, not gradients
    with pytest.raises(vkml.NotComputedError):
        grads.grad("fc.weight")
    grads.step()
    assert grads.grad("fc.weight").shape == (4, 3)
    assert session.read("fc.weight").shape == (4, 3)  # parameters are always defined


def test_half_submitted_chunked_step_cannot_be_read(device):
    if device.backend_name != "vulkan":
        pytest.skip("chunked steps are tested on Vulkan")
    g = vkml.Graph()
    x = g.input("x", (8,))
    g.output("y", (x * 2.0).exp().sum())
    session = vkml.compile(g, device=device, rewrite="none")
    session.set_input("x", np.zeros(8, np.float32))
    assert session.plan.barrier_count >= 2  # mul, exp, sum: three levels, so three pieces
    assert session.step_chunk(chunks=3) == 2
    with pytest.raises(vkml.NotComputedError, match="chunked step is in progress"):
        session.read("y")
    while session.step_chunk():
        pass
    assert float(session.read("y")) == 8.0


def test_compile_refuses_tensors_of_another_graph_and_bad_arguments(device):
    other = vkml.Graph()
    stray = other.input("x", (2,)).sum()
    g = vkml.Graph()
    y = g.input("y", (2,)).sum()
    with pytest.raises(vkml.GraphError, match=r"belongs to another Graph \(created at "
                                              r"test_errors.py:\d+\) than the one compiled"):
        vkml.compile(g, loss=stray, device=device)
    with pytest.raises(vkml.GraphError, match="output 'z'.*another Graph"):
        vkml.compile(g, outputs={"z": stray}, device=device)
    with pytest.raises(vkml.GraphError, match="must be a Tensor of this graph, got str"):
        vkml.compile(g, outputs={"z": str}, device=device)
    with pytest.raises(vkml.GraphError, match="keep_grads takes True or False .* got 'no'"):
        vkml.compile(g, loss=y, keep_grads="no", device=device)  # was true
    with pytest.raises(vkml.GraphError, match="check_finite takes True or False, got 0.5"):
        vkml.compile(g, loss=y, check_finite=0.5, device=device)
    with pytest.raises(vkml.GraphError, match="is the class: pass an instance"):
        vkml.compile(g, loss=y, optimizer=vkml.Adam, device=device)
    with pytest.raises(vkml.GraphError, match="loss must be f32"):
        vkml.compile(g, loss=g.reshape(g.input("i", (1,), "i32"), ()), device=device)
    with pytest.raises(vkml.GraphError, match="belongs to another Graph"):
        g.add(y, stray)
    vkml.compile(g, loss=y, device=device)  # the graph itself is fine


def test_compiled_names_that_read_would_resolve_to_another_tensor_are_refused(device):
    # read() looks parameters up first: such an output could never be read, and an output
    # named as an input is refused by graph.output too
    g = vkml.Graph()
    x = g.input("x", (3,))
    w = g.param("w", (3,), init=2.0)
    product = x * w
    for name in ("x", "w", "optimizer/y"):
        with pytest.raises(vkml.GraphError, match=f"the output name '{name}' is already used "
                                                  "by .*: give the output another name"):
            vkml.compile(g, outputs={name: product}, device=device)
    g.param("loss", (3,))
    with pytest.raises(vkml.GraphError, match="the loss is read as 'loss', a name already used "
                                              "by %.* param 'loss'.*: rename that one"):
        vkml.compile(g, loss=product.sum(), device=device)
    # a tensor under its own name is itself
    session = vkml.compile(g, outputs={"x": x, "w": w, "y": product}, device=device)
    session.set_input("x", np.arange(3, dtype=np.float32))
    session.step()
    np.testing.assert_array_equal(session.read("w"), np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(session.read("y"), np.arange(3) * 2.0)


@pytest.mark.parametrize("make", [
    lambda: vkml.Adam(lr=-1.0), lambda: vkml.Adam(lr=float("nan")),
    lambda: vkml.Adam(lr=float("inf")), lambda: vkml.SGD(lr=None),
    lambda: vkml.Adam(beta1=1.5), lambda: vkml.AdamW(eps=-1.0),
    lambda: vkml.SGD(lr=0.1, nesterov=True)])
def test_optimizers_refuse_what_torch_optim_refuses(make):
    with pytest.raises(vkml.InputError):
        make()


def test_set_hyperparams_is_checked_and_refuses_what_the_update_cannot_change(device):
    _, session = classifier(device, vkml.SGD(lr=0.1))
    session.set_input("labels", np.zeros(4, np.int32))
    with pytest.raises(vkml.InputError, match="momentum was 0.0 when compiled"):
        session.set_hyperparams(momentum=0.9)
    for bad in ({"lr": -1.0}, {"lr": float("nan")}, {"weight_decay": None}):
        with pytest.raises(vkml.InputError):
            session.set_hyperparams(**bad)
    before = session.read("fc.weight")
    session.set_hyperparams(weight_decay=0.5, lr=0.0)  # decay is honoured even if compiled 0
    session.step()
    np.testing.assert_array_equal(session.read("fc.weight"), before)  # lr 0: no change
    session.set_hyperparams(lr=0.1)
    session.step()
    assert not np.array_equal(session.read("fc.weight"), before)


def test_check_finite_skips_the_update_and_raises(device):
    g = vkml.Graph()
    x = g.input("x", (4, 3))
    w = g.param("w", (3, 2), 0.5)
    y = g.input("y", (4, 2))
    session = vkml.compile(g, loss=g.mse(x @ w, y), optimizer=vkml.Adam(lr=0.1),
                           device=device, check_finite=True)
    session.set_input("y", np.zeros((4, 2), np.float32))
    session.set_input("x", np.ones((4, 3), np.float32))
    session.step()
    state = session.state_dict()
    session.set_input("x", np.full((4, 3), np.nan, np.float32))
    with pytest.raises(vkml.NonFiniteError, match="update was skipped"):
        session.step()
    after = session.state_dict()
    assert all(np.array_equal(after[k], v) for k, v in state.items())  # step count too
    session.set_input("x", np.ones((4, 3), np.float32))
    session.step()
    assert np.isfinite(session.read("loss"))


def test_an_explicit_device_no_backend_has_is_refused_with_the_lists():
    import subprocess
    import sys

    code = ("import vkml\ntry:\n    vkml.Device()\nexcept vkml.DeviceError as e:\n"
            "    print('DeviceError:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(VKML_DEVICE="99"), timeout=120)
    assert "DeviceError: no usable device" in done.stdout, done.stdout + done.stderr
    assert "no Vulkan device matches '99'" in done.stdout
    assert "Devices available" in done.stdout


def test_batch_norm_training_refuses_one_value_per_channel():
    # as F.batch_norm does: with one value per channel x - mean is 0 and the output is the
    # bias, whatever x holds
    g = vkml.Graph()
    with pytest.raises(vkml.GraphError, match="more than one value per channel.*'x'"):
        g.batch_norm(g.input("x", (1, 3, 1, 1)), training=True)
    g.batch_norm(g.input("y", (2, 3, 1, 1)), training=True)  # two values: computed


def test_an_int_is_a_one_dimensional_shape_for_every_builder_that_takes_a_shape():
    g = vkml.Graph()
    z, p = g.input("z", 5), g.param("p", np.int64(5), "normal")
    assert (z.shape, p.shape) == ((5,), (5,))
    assert g.reshape(g.input("m", (2, 3)), 6).shape == (6,)
    assert g.inputs["m"].reshape(6).shape == (6,)
    assert g.broadcast_to(g.param("s", 1), 4).shape == (4,)
    assert g.expand(g.params["s"], 3).shape == g.tile(g.params["s"], 3).shape == (3,)
    assert g.input("from_numpy", np.array([2, 3])).shape == (2, 3)


@pytest.mark.parametrize("shape,problem", [
    ((3, -2), r"shape \(3, -2\): every dimension must be >= 1"),
    ((3, 0), r"shape \(3, 0\): every dimension must be >= 1"),
    (2.0, "shape 2.0 is not a shape"), ((2, 3.0), r"shape \(2, 3.0\) is not a shape"),
    ("5", "shape '5' is not a shape"), ((2, True), r"shape \(2, True\) is not a shape"),
    (None, "shape None is not a shape")])
def test_bad_shapes_are_refused_naming_the_call(shape, problem):
    g = vkml.Graph()
    x = g.input("x", (6,))
    at = r" at test_errors\.py:\d+: "
    for build, call in [(lambda: g.input("z", shape), "input 'z'"),
                        (lambda: g.param("p", shape), "parameter 'p'"),
                        (lambda: g.reshape(x, shape), r"reshape of %0 input 'x' f32\[6\]"),
                        (lambda: g.broadcast_to(x, shape), r"broadcast_to of %0 input 'x'"),
                        (lambda: g.expand(x, shape), r"expand of %0 input 'x'")]:
        with pytest.raises(vkml.GraphError, match=call + r".*" + at + problem):
            build()
    with pytest.raises(vkml.GraphError, match=r"tile of %0 .*: repeats \(2, 0\): every "):
        g.tile(x, (2, 0))
    with pytest.raises(vkml.GraphError, match=r"every dimension must be >= 1 \(or -1, once\)"):
        g.reshape(x, (-1, -1))
    assert "z" not in g.inputs and "p" not in g.params


def _builder_misuse(g: vkml.Graph) -> list[tuple[Callable[[], object], str]]:
    """Plausible mistakes with the graph builder, each with the GraphError it must raise:
    before, each failed deep inside with an IndexError, ZeroDivisionError, ValueError or
    AttributeError that named neither the call nor the argument, or was accepted (a constant
    of None, NaN; a 3-tuple padding, its third value dropped; max pooling's negative padding)."""
    img, x2, x1 = g.input("img", (2, 3, 8, 8)), g.input("x2", (4, 6)), g.input("x1", (6,))
    w, s, ids = g.param("w", (4, 3, 3, 3)), g.param("s", ()), g.input("ids", (4,), "i32")
    return [
        (lambda: g.mse(x1, np.zeros(6, np.float32)), r"mse\(\) at test_errors.py:\d+: `target` "
         r"takes a Tensor of this graph, got ndarray: make it one with g.constant"),
        (lambda: g.cross_entropy(np.zeros((4, 6)), ids), "`logits` takes a Tensor"),
        (lambda: g.exp(2.0), "`x` takes a Tensor of this graph, got float"),
        (lambda: g.conv2d(img, w, padding=(1, 1, 1)), r"conv2d padding takes an int or an "
         r"\(h, w\) pair of ints, each >= 0, got \(1, 1, 1\)"),
        (lambda: g.conv2d(img, w, stride=0), "conv2d stride .* each >= 1, got 0"),
        (lambda: g.conv2d(img, w, dilation=0), "conv2d dilation .* each >= 1, got 0"),
        (lambda: g.conv2d(img, w, groups=0), "conv2d: groups must be an int >= 1, got 0"),
        (lambda: g.conv1d(x2, g.param("w1", (4, 3, 3))), r"conv1d takes an \(N, C, L\) input"),
        (lambda: g.max_pool2d(img, 0), "max_pool2d kernel_size .* got 0"),
        (lambda: g.max_pool2d(img, 2, padding=-1), "max_pool2d padding .* >= 0, got -1"),
        (lambda: g.avg_pool2d(img, 2, stride=0), "avg_pool2d stride .* got 0"),
        (lambda: g.avg_pool2d(x2, 2), r"avg_pool2d takes an \(N, C, H, W\) tensor"),
        (lambda: g.upsample_nearest(x2), r"upsample_nearest takes an \(N, C, H, W\)"),
        (lambda: g.adaptive_avg_pool(img, 0), "adaptive_avg_pool takes .* positive size"),
        (lambda: g.group_norm(img, 0), "num_groups must be an int >= 1, got 0"),
        (lambda: g.group_norm(x1, 1), r"group_norm takes an \(N, C, ...\) tensor"),
        (lambda: g.instance_norm(x1), r"instance_norm takes an \(N, C, ...\) tensor"),
        (lambda: g.batch_norm(s, training=True), r"batch_norm takes an \(N, C, ...\) tensor"),
        (lambda: g.group_norm(img, 3, bias=0.5), "`bias` takes a Tensor of this graph, got float"),
        (lambda: g.layer_norm(x2, 6, weight=np.ones(6)), "`weight` takes a Tensor .* ndarray"),
        (lambda: g.bias_add(s, x1), "bias_add: bias .* must have shape"),
        (lambda: g.rope(x1), r"rope takes a \(..., S, D\) tensor"),
        (lambda: g.split(x2, 2, axis=5), "axis 5 is out of range"),
        (lambda: g.split(x2, 0), "split: a chunk size must be >= 1, got 0"),
        (lambda: g.concat([]), "concat takes a non-empty list"),
        (lambda: g.one_hot(ids, 0), "one_hot: num_classes must be an int >= 1, got 0"),
        (lambda: g.sum(x2, 1.0), "axes are ints"),
        (lambda: g.argmax(x2, axis=None), "argmax takes one axis, an int, got None"),
        (lambda: g.cumsum(x2, axis=(0, 1)), r"cumsum takes one axis, an int, got \(0, 1\)"),
        (lambda: g.constant(None), "a constant takes numbers .* got NoneType"),
        (lambda: g.constant("1.5"), "a constant takes numbers .* got str"),
        (lambda: g.param("p", (2,), init=np.array(["a", "b"])), "init array holds <U1"),
        (lambda: g.extra("e", None), "checkpoint extra 'e' must hold booleans, integers or "
         r"floats .* got NoneType \(object\)"),  # save() failed in safetensors
        (lambda: g.extra("e", 2**70), "got int"),
        (lambda: vkml.nn.Linear(g, "fc", 0, 3), r"Linear 'fc' at .*: \(out, in\) features \(3, "
         r"0\): every dimension must be >= 1"),
    ]


def test_builder_misuse_raises_a_graph_error_naming_the_call():
    for seed in (-1, 1.5, "0"):  # numpy's ValueError / TypeError
        with pytest.raises(vkml.GraphError, match=r"Graph\(seed=...\) takes an int >= 0"):
            vkml.Graph(seed=seed)
    g = vkml.Graph()
    for build, message in _builder_misuse(g):
        with pytest.raises(vkml.GraphError, match=message):
            build()
    # what torch accepts stays accepted: one value for both axes, numpy's integers
    assert g.conv2d(g.inputs["img"], g.params["w"], padding=(1,)).shape == (2, 4, 8, 8)
    assert g.max_pool2d(g.inputs["img"], np.int64(2), [2, 2]).shape == (2, 3, 4, 4)


def test_a_parameter_larger_than_the_host_is_refused_before_anything_is_allocated(monkeypatch):
    g = vkml.Graph()
    shape = (1 << 34, 1024)  # 64 TiB of f32: no host has it, and nothing is allocated
    gib = 4 * shape[0] * shape[1] / 2**30
    with pytest.raises(vkml.GraphError, match=rf"parameter 'huge' of shape \(17179869184, 1024\) "
                       rf"takes {gib:.1f} GiB \(f32\), which exceeds this machine's"):
        g.param("huge", shape, "normal")
    assert not g.params and g.initial_bytes == 0
    # What the graph holds already counts: on a host of 1 MiB, a second 0.6 MiB is refused.
    monkeypatch.setattr(vkml.graph, "_host_memory", lambda: 1 << 20)
    g.param("first", (160, 1024), "uniform")
    with pytest.raises(vkml.GraphError, match=r"'second' .* takes 0.6 MiB \(f32\), which with "
                       r"the graph's other parameters \(0.6 MiB\) exceeds this machine's 1.0 MiB"):
        g.param("second", (160, 1024))


RESERVED = "names starting with 'optimizer/' are reserved for the optimizer state"


def test_names_a_checkpoint_would_save_optimizer_state_under_are_reserved():
    g = vkml.Graph()
    g.param("w", (2,))
    for build in (lambda: g.param("optimizer/w/exp_avg", (2,)),
                  lambda: g.input("optimizer/hyperparams", (2,)),
                  lambda: g.extra("optimizer/w/momentum_buffer", 0)):
        with pytest.raises(vkml.GraphError, match=RESERVED):
            build()
    g.extra("count", np.int64(3))
    with pytest.raises(vkml.GraphError, match="'w' is already used by"):
        g.extra("w", 1.0)
    with pytest.raises(vkml.GraphError, match="'count' is already a checkpoint entry"):
        g.param("count", (1,))


def test_a_save_that_would_write_two_tensors_under_one_name_writes_nothing(device, tmp_path):
    """Graph's checks keep names unique; were one bypassed, save refuses rather than keep
    one of the two values."""
    g = vkml.Graph()
    y = g.output("y", g.input("x", (2,)) * g.param("w", (2,), 1.0))
    session = vkml.compile(g, outputs={"y": y}, device=device)
    session._entries.extras["w"] = np.zeros(2, np.int64)
    path = tmp_path / "clash.safetensors"
    with pytest.raises(vkml.CheckpointError, match=r"two tensors would be saved as \['w'\]"):
        session.save(path)
    assert not path.exists()


def test_malformed_environment_variables_are_named():
    # float() of them at import made `import vkml` fail with a bare ValueError, and
    # VKML_WAIT_TIMEOUT=inf with an OverflowError
    code = "import vkml.vk.context as c; print(c.WAIT_TIMEOUT_NS)"
    for env, expected in [({"VKML_WAIT_POLL": "abc"}, "VKML_WAIT_POLL='abc': give a number of "
                                                      "seconds >= 0 (unset: 0.02)"),
                          ({"VKML_WAIT_TIMEOUT": "0"}, "VKML_WAIT_TIMEOUT='0': give a number"),
                          ({"VKML_WAIT_TIMEOUT": "inf"}, str(2**64 - 1))]:
        out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(**env),
                             capture_output=True, text=True, timeout=60)
        assert expected in out.stdout + out.stderr, out.stderr
        assert "ValueError" not in out.stderr and "OverflowError" not in out.stderr


def test_onnx_import_misuse_is_named_and_a_session_of_another_graph_is_refused(device,
                                                                               tmp_path,
                                                                               monkeypatch):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    weight = np.arange(8, dtype=np.float32).reshape(4, 2)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weight, "w")]), opset_imports=[helper.make_opsetid("", 17)])
    # each was a TypeError or ValueError from deep inside
    with pytest.raises(vkml.ModelImportError, match="takes a path, bytes or an onnx.ModelProto, "
                                                    "got NoneType"):
        vkml.import_onnx(None)
    for shape in ("3,4", 3):
        with pytest.raises(vkml.ModelImportError, match=r"shapes\['x'\] = .*: give an input's "
                                                        "whole shape as a tuple of ints"):
            vkml.import_onnx(model, shapes={"x": shape})
    imp = vkml.import_onnx(model, shapes={"batch": 3})
    session = vkml.compile(imp.graph, outputs=imp.outputs, device=device)
    with pytest.raises(vkml.CheckpointError, match="cannot write .*No such file or directory"):
        imp.save_onnx(session, str(tmp_path / "absent" / "tuned.onnx"))  # an OSError before
    # another graph's session: the file got the imported values, without a word
    g = vkml.Graph()
    g.output("y", g.input("x", (3, 4)) @ g.param("v", (4, 2)))
    other = vkml.compile(g, device=device)
    for write in (lambda: imp.save_onnx(other, str(tmp_path / "wrong.onnx")),
                  lambda: imp.state_dict(other)):
        with pytest.raises(vkml.InputError, match=r"does not hold the parameters of .*\(w\): "
                                                  "pass the session compiled from this"):
            write()
    assert not (tmp_path / "wrong.onnx").exists()
    session.set_param("w", weight * 2)
    imp.save_onnx(session, str(tmp_path / "tuned.onnx"))
    saved = onnx.load(str(tmp_path / "tuned.onnx")).graph.initializer[0]
    np.testing.assert_array_equal(numpy_helper.to_array(saved), weight * 2)
    # a write that fails part-way (a full disk) leaves the file as it was, and no temporary
    written = (tmp_path / "tuned.onnx").read_bytes()
    session.set_param("w", weight * 3)

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(vkml.CheckpointError, match="No space left on device"):
        imp.save_onnx(session, str(tmp_path / "tuned.onnx"))
    assert (tmp_path / "tuned.onnx").read_bytes() == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned.onnx"]


def test_the_command_line_refuses_what_would_fail_after_the_run():
    # 0 epochs or fewer images than a batch ended in a StatisticsError after training; a
    # missing script in a FileNotFoundError traceback
    for argv, message in [(["demo", "--epochs", "0"], "argument --epochs: 0 is below 1"),
                          (["demo", "--train", "10"], "argument --train: 10 is below 64"),
                          (["dump", "absent.py"], "no such script 'absent.py'")]:
        out = subprocess.run([sys.executable, "-m", "vkml", *argv], env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
