"""The session as a user meets it: checkpoints, recording once, and clear errors on bad input
that leave the session usable."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import subprocess_env
from safetensors.numpy import load_file, save_file

import vkml
from vkml.expr import Arg, call
from vkml.graph import OPS
from vkml.runtime import device as device_module


def mlp_session(device, optimizer=None, seed=0):
    g = vkml.Graph(seed=seed)
    x = g.input("x", (4, 6))
    labels = g.input("labels", (4,), "i32")
    logits = vkml.nn.Linear(g, "fc2", 8, 3)(vkml.nn.Linear(g, "fc1", 6, 8)(x).relu())
    g.output("logits", logits)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                           optimizer=optimizer or vkml.Adam(lr=1e-2), device=device)
    session.set_input("x", MLP_X)
    session.set_input("labels", MLP_LABELS)
    return session


MLP_X = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
MLP_LABELS = np.array([0, 1, 2, 1], np.int32)


def mlp_loss(params: dict[str, np.ndarray]) -> float:
    """mlp_session's loss on its inputs at `params`, by torch in float64."""
    p = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    hidden = F.linear(torch.tensor(MLP_X, dtype=torch.float64), p["fc1.weight"], p["fc1.bias"])
    logits = F.linear(hidden.relu(), p["fc2.weight"], p["fc2.bias"])
    return float(F.cross_entropy(logits, torch.tensor(MLP_LABELS).long()))


def test_save_load_round_trip_restores_parameters_and_optimizer_state(device, tmp_path):
    trained = mlp_session(device)
    for _ in range(3):
        trained.step()
    path = tmp_path / "ckpt.safetensors"
    trained.save(path)
    saved = trained.state_dict()
    assert "optimizer/fc1.weight/exp_avg" in saved and "optimizer/hyperparams" in saved

    fresh = mlp_session(device, seed=99)  # different initial weights
    fresh.load(path)
    restored = fresh.state_dict()
    assert restored.keys() == saved.keys()
    for k in saved:
        np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)

    # Resuming from the checkpoint continues exactly where the original run goes.
    trained.step()
    fresh.step()
    for k, v in trained.params().items():
        np.testing.assert_array_equal(fresh.read(k), v, err_msg=k)


def test_load_checks_everything_before_changing_anything(device, tmp_path):
    session = mlp_session(device)
    before = session.state_dict()
    bad = {k: v for k, v in session.params().items()}
    bad["fc1.weight"] = np.zeros((2, 2), np.float32)  # wrong shape
    bad["fc2.bias"] = np.ones(3, np.float32) * 5  # would change, but must not
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    with pytest.raises(vkml.InputError, match=r"'fc1.weight' has shape \(2, 2\), expected"):
        session.load(path)
    for k, v in session.state_dict().items():
        np.testing.assert_array_equal(v, before[k])

    partial = tmp_path / "partial.safetensors"
    save_file({"fc1.bias": np.ones(8, np.float32), "other": np.ones(1, np.float32)}, str(partial))
    with pytest.raises(vkml.InputError, match="missing parameters.*unknown tensors"):
        session.load(partial)
    save_file({"fc1.bias": np.ones(8, np.float32)}, str(partial))
    session.load(partial, strict=False)
    np.testing.assert_array_equal(session.read("fc1.bias"), np.ones(8, np.float32))


def test_weights_saved_by_torch_load_by_name(device, tmp_path):
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(6, 8))
    net.add_module("act", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(8, 3))
    path = tmp_path / "torch.safetensors"
    save_file({k: v.detach().numpy() for k, v in net.state_dict().items()}, str(path))
    session = mlp_session(device)
    session.load(path)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    session.set_input("x", x)
    session.forward()
    expected = net(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(session.read("logits"), expected, rtol=1e-5, atol=1e-6)
    assert load_file(str(path)).keys() == session.params().keys()


def test_steps_reuse_the_recorded_command_buffer(device, monkeypatch):
    session = mlp_session(device)

    record = device.backend.record

    def record_again(commands, label, *args, **kwargs):
        # Reading a result on a GPU whose memory the host cannot map records a copy-out program
        # once; the step itself must never be recorded again.
        if label not in ("run_now", "read-back"):
            raise AssertionError(f"step() recorded the command buffer {label!r} again")
        return record(commands, label, *args, **kwargs)

    monkeypatch.setattr(device.backend, "record", record_again)
    losses = []
    for _ in range(5):
        session.step()
        losses.append(float(session.read("loss")))
    assert losses[-1] < losses[0]


def test_inference_session_computes_outputs_only(device):
    g = vkml.Graph()
    x = g.input("x", (2, 3))
    w = g.param("w", (3, 4), init=np.arange(12, dtype=np.float32).reshape(3, 4))
    g.output("y", (x @ w).sigmoid())
    session = vkml.compile(g, device=device)
    xv = np.ones((2, 3), np.float32)
    session.set_input("x", xv)
    session.step()
    expected = 1 / (1 + np.exp(-(xv @ session.read("w"))))
    np.testing.assert_allclose(session.read("y"), expected, rtol=1e-6)
    with pytest.raises(vkml.InputError, match="no gradient"):
        session.grad("w")


BAD_INPUTS = [
    ("x", np.zeros((4, 5), np.float32), r"input 'x' expects shape \(4, 6\), got \(4, 5\)"),
    ("x", np.zeros((4, 6), np.int64), r"input 'x' expects floating-point.*astype\(np.float32\)"),
    ("labels", np.zeros(4, np.float32), r"input 'labels' expects integers.*astype\(np.int32\)"),
    ("nope", np.zeros(1), r"unknown input 'nope'; this session's inputs are: 'x', 'labels'"),
    ("x", [[0.0] * 6] * 3 + [[0.0] * 5], r"input 'x' takes a numpy array .* converting this "
     r"list failed: .*inhomogeneous"),
    ("x", torch.zeros((4, 6), requires_grad=True), r"input 'x' takes a numpy array .* "
     r"converting this Tensor failed: .*detach"),
    # float64 past f32's range would become inf in silence (an infinity itself is kept)
    ("x", np.full((4, 6), 1e39), r"input 'x': 24 finite value\(s\) lie beyond float32's "
     r"range .* largest magnitude is 1e\+39.*np.clip"),
]


@pytest.mark.parametrize("name,value,message", BAD_INPUTS, ids=[m[:20] for *_, m in BAD_INPUTS])
def test_bad_input_is_refused_clearly_and_session_stays_usable(device, name, value, message):
    session = mlp_session(device)
    session.step()
    with pytest.raises(vkml.InputError, match=message):
        session.set_input(name, value)
    session.forward()  # the inputs set before are still in place
    assert abs(float(session.read("loss")) - mlp_loss(session.params())) < 1e-6


def test_float64_infinities_and_values_within_float32_are_set_as_they_are(device):
    g = vkml.Graph()
    x = g.input("x", (3,))
    g.output("y", g.mul(x, 1.0))
    session = vkml.compile(g, device=device)
    value = np.array([np.inf, -3e38, np.nan])
    session.set_input("x", value)
    session.step()
    np.testing.assert_array_equal(session.read("y"), value.astype(np.float32))


def test_reading_unknown_names_and_unset_inputs(device):
    session = mlp_session(device)
    with pytest.raises(vkml.InputError, match="nothing named 'fc3.weight'.*parameters"):
        session.read("fc3.weight")
    g = vkml.Graph()
    x = g.input("x", (2,))
    g.output("y", x.exp())
    fresh = vkml.compile(g, device=device)
    with pytest.raises(vkml.InputError, match="input 'x' was never set"):
        fresh.step()


def test_graph_shape_mismatch_names_both_operands():
    g = vkml.Graph()
    a = g.input("a", (4, 6))
    w = g.param("w", (5, 3))
    with pytest.raises(vkml.GraphError) as err:
        a @ w
    text = str(err.value)
    assert "input 'a' f32[4,6]" in text and "param 'w' f32[5,3]" in text
    assert "6 != 5" in text and "test_session.py" in text
    with pytest.raises(vkml.GraphError, match=r"do not broadcast: axis -1 is 6 vs 3"):
        g.add(a, g.param("b", (3,)))
    with pytest.raises(vkml.GraphError, match="already used"):
        g.input("a", (1,))
    with pytest.raises(vkml.GraphError, match="loss must be a scalar"):
        vkml.compile(g, loss=a.exp() * w.sum())


def test_kernel_rejected_by_naga_reports_it_and_leaves_device_usable(device, monkeypatch):
    broken = dataclasses.replace(OPS["exp"], expr=lambda node: call("exp({0}, 2.0)", Arg(0)))
    monkeypatch.setitem(OPS, "exp", broken)
    g = vkml.Graph()
    x = g.input("x", (3,))
    g.output("y", x.exp())
    with pytest.raises(vkml.NagaError) as err:
        vkml.compile(g, device=device)
    text = str(err.value)
    assert "naga rejected kernel 'exp_3'" in text
    assert "exp(x0, 2.0)" in text  # the numbered WGSL is shown
    monkeypatch.undo()
    session = vkml.compile(g, device=device)
    session.set_input("x", np.zeros(3, np.float32))
    session.step()
    np.testing.assert_array_equal(session.read("y"), np.ones(3, np.float32))


def test_no_vulkan_device_gives_an_actionable_error():
    # Pinned to Vulkan: "auto" would fall back to wgpu (see test_wgpu_backend.py).
    env = subprocess_env(VK_DRIVER_FILES="/nonexistent/icd.json",
                         VK_ICD_FILENAMES="/nonexistent/icd.json", VKML_BACKEND="vulkan")
    code = ("import vkml\n"
            "g = vkml.Graph(); x = g.input('x', (2,)); g.output('y', x.exp())\n"
            "try:\n    vkml.compile(g)\n"
            "except vkml.DeviceError as e:\n    print('DeviceError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert "DeviceError:" in out.stdout, out.stdout + out.stderr
    assert "mesa-vulkan-drivers" in out.stdout


@pytest.mark.parametrize("backend", ["vulkan", "wgpu"])
def test_a_session_of_a_closed_device_raises_instead_of_touching_freed_memory(backend):
    if backend == "wgpu":
        pytest.importorskip("wgpu", reason="the wgpu backend needs `pip install vkml[wgpu]`")
    device = vkml.Device(backend=backend)  # its own: the fixture's stays open for the others
    session = mlp_session(device)
    session.step()
    device.close()
    # Each of these reached the freed device: a segfault on Vulkan, wgpu's "device is lost".
    for use in (session.step, lambda: session.read("loss"), session.params,
                lambda: session.set_input("x", MLP_X)):
        with pytest.raises(vkml.DeviceError, match="device was closed.*make a new vkml.Device"):
            use()
    session.close()  # nothing left to free
    session.close()
    with pytest.raises(vkml.DeviceError, match="this session is closed"):
        session.step()
    with pytest.raises(vkml.DeviceError, match="device was closed"):
        vkml.compile(_echo_graph(), device=device)
    with pytest.raises(vkml.InputError, match="device takes a vkml.Device.*got str"):
        vkml.compile(_echo_graph(), device=backend)


def _echo_graph() -> vkml.Graph:
    g = vkml.Graph()
    g.output("y", g.input("x", (2,)).exp())
    return g


def test_arguments_of_the_wrong_kind_are_refused_at_the_call(device):
    session = mlp_session(device)
    session.step()
    before = session.params()
    for use, message in [
            (lambda: session.profile(steps=1.5), r"profile\(steps\) takes a whole number of "
                                                 "steps >= 1, got 1.5"),  # ran 2 steps
            (lambda: session.profile(steps="2"), "got '2'"),  # a TypeError
            (lambda: session.step_chunk(max_ms="1"), "max_ms must be a number >= 0, got '1'"),
            (lambda: vkml.Device(backend=3), "unknown backend 3")]:  # an AttributeError
        with pytest.raises(vkml.VkmlError, match=message):
            use()
    if device.backend.timeline is not None:
        # refused by the step it applied to, after that step had begun: its training step
        # counted and its inputs staged
        with pytest.raises(vkml.InputError, match="wait_for_host: expected a VkSemaphore"):
            session.wait_for_host("semaphore", 1)
    assert all(np.array_equal(v, before[k]) for k, v in session.params().items())
    session.forward()
    assert abs(float(session.read("loss")) - mlp_loss(session.params())) < 1e-6


def test_inputs_of_the_graph_the_session_does_not_read_are_checked_and_change_nothing(device):
    # An inference session of a training graph: its labels fed only the loss. set_input said
    # "unknown input 'labels'" of an input the graph has, breaking a loop shared with training.
    g = vkml.Graph(seed=0)
    x = g.input("x", (4, 6))
    labels = g.input("labels", (4,), "i32")
    logits = g.output("logits", vkml.nn.Linear(g, "fc", 6, 3)(x))
    g.cross_entropy(logits, labels)
    session = vkml.compile(g, device=device)
    assert list(session.inputs) == ["x"]
    session.set_input("x", MLP_X)
    session.set_input("labels", MLP_LABELS)
    with pytest.raises(vkml.InputError, match=r"input 'labels' expects integers"):
        session.set_input("labels", MLP_LABELS.astype(np.float32))
    with pytest.raises(vkml.InputError, match="unknown input 'nope'"):
        session.set_input("nope", MLP_LABELS)
    session.step()
    params = session.params()
    expected = MLP_X.astype(np.float64) @ params["fc.weight"].T + params["fc.bias"]
    np.testing.assert_allclose(session.read("logits"), expected, rtol=1e-5, atol=1e-6)


def test_the_default_device_is_made_again_once_closed(monkeypatch):
    # compile() without device= kept handing out the closed default device
    monkeypatch.setattr(device_module, "_default", None)  # this test's own, not the run's
    first = vkml.compile(_echo_graph())
    first.device.close()
    second = vkml.compile(_echo_graph())
    assert second.device is not first.device and not second.device.closed
    second.set_input("x", np.zeros(2, np.float32))
    second.step()
    np.testing.assert_array_equal(second.read("y"), np.ones(2, np.float32))
    second.device.close()
