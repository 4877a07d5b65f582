"""The prologue (compiler/schedule.py `hoisted`, runtime/bound.py): what a step reads that
depends on parameters and constants alone is computed before a step only when a parameter it
reads changed, and every result is bit for bit what the session computes with hoist=False,
which runs the same kernels every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_render_loop import host, vk, vulkan_only  # noqa: F401 (host: the fixture)

import vkml
from vkml.compiler.stages import lower
from vkml.kernels import conv
from vkml.session import Session


def _pair(graph, device, **options):
    """The graph compiled with hoisting and without."""
    return (vkml.compile(graph, device=device, **options),
            vkml.compile(graph, device=device, hoist=False, **options))


def _same_outputs(hoisted: Session, plain: Session, inputs: dict[str, np.ndarray],
                  names) -> None:
    for session in (hoisted, plain):
        for name, value in inputs.items():
            session.set_input(name, value)
        session.step()
    for name in names:
        a, b = hoisted.read(name), plain.read(name)
        assert np.array_equal(a, b), (name, np.abs(a - b).max())


def _onnx_model():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((6, 4)), "b1": rng.standard_normal(6),
               "w2": rng.standard_normal((5, 6)), "shape": np.array([1, 6])}
    inits = [numpy_helper.from_array(v.astype(np.int64 if k == "shape" else np.float32), k)
             for k, v in weights.items()]
    nodes = [helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w1t"], ["h"]),
             helper.make_node("Reshape", ["b1", "shape"], ["b1r"]),
             helper.make_node("Add", ["h", "b1r"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "transposed",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 4))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (3, 5))],
                              inits)
    return onnx, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_imported_models_transposed_weights_are_hoisted(device):
    _, model = _onnx_model()
    imported = vkml.import_onnx(model)
    hoisted, plain = _pair(imported.graph, device, outputs=imported.outputs)
    assert hoisted.plan.prologue and not plain.plan.prologue
    assert len(hoisted.plan.dispatches) < len(plain.plan.dispatches)
    assert all(r.role != "input" for d in hoisted.plan.prologue for r in
               (hoisted.plan.slots[s] for s in d.slots))
    rng = np.random.default_rng(1)
    for _ in range(2):
        _same_outputs(hoisted, plain, {"x": rng.standard_normal((3, 4)).astype(np.float32)},
                      imported.outputs)
    hoisted.close()
    plain.close()


def test_dinov2_position_table_is_resized_once(device):
    from vkml.models import dinov2
    cfg = dinov2.tiny()
    g = vkml.Graph(seed=3)
    pixels = g.input("pixel_values", (1, 3, 28, 28))  # not the table's own 56 x 56: resized
    hidden = dinov2.dinov2(g, pixels, cfg, trainable=False)
    g.output("last", dinov2.final_norm(g, cfg, trainable=False)(hidden[-1]))
    hoisted, plain = _pair(g, device)
    assert any(d.op == "resample" for d in hoisted.plan.prologue)  # bicubic
    assert not any(d.op == "resample" for d in hoisted.plan.dispatches)
    x = np.random.default_rng(0).standard_normal((1, 3, 28, 28)).astype(np.float32)
    _same_outputs(hoisted, plain, {"pixel_values": x}, ["last"])
    hoisted.close()
    plain.close()


def test_channels_last_weight_copies_are_hoisted(device, rng, monkeypatch):
    from vkml.models import resnet
    caps = dataclasses.replace(device.caps, precision="f16")
    if device.backend_name != "vulkan" or caps.f16_products is None:
        pytest.skip(f"{caps.device_name} ({device.backend_name}): no f16 arithmetic on the "
                    "Vulkan backend here, so channels-last copies are not made")
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 0))
    cfg = dataclasses.replace(resnet.tiny("bottleneck"), bn="eval")
    built = resnet.build(cfg)
    plans = [lower(built.graph, caps, outputs=built.outputs, precision="f16", hoist=h).plan
             for h in (True, False)]
    copies = [d for d in plans[0].prologue if d.op == conv.CHANNELS_LAST]
    assert copies and not any(d.op == conv.CHANNELS_LAST and d.label in
                              {c.label for c in copies} for d in plans[0].dispatches)
    assert len(plans[1].dispatches) - len(plans[0].dispatches) == len(plans[0].prologue)
    hoisted, plain = (Session(p, device) for p in plans)
    x = rng.standard_normal(built.inputs["x"].shape).astype(np.float32)
    _same_outputs(hoisted, plain, {"x": x}, ["logits"])
    hoisted.close()
    plain.close()


def _mlp(g: vkml.Graph, x, frozen: bool = False):
    """x @ w1^T (w1 stored transposed, as imported models keep it), relu, @ w2^T + b."""
    w1 = g.param("w1", (8, 4), "normal", trainable=not frozen)
    w2 = g.param("w2", (3, 8), "normal", 0.5)
    b = g.param("b", (3,), "normal")
    h = g.matmul(x, g.transpose(w1 * 0.5, (1, 0))).relu()
    return g.matmul(h, g.transpose(w2, (1, 0))) + b


def test_set_param_and_load_between_steps_rerun_the_prologue(device, tmp_path):
    g = vkml.Graph(seed=0)
    g.output("y", _mlp(g, g.input("x", (2, 4))))
    hoisted, plain = _pair(g, device)
    assert len(hoisted.plan.prologue) == 2  # both transposed weights
    rng = np.random.default_rng(0)
    x = {"x": rng.standard_normal((2, 4)).astype(np.float32)}
    _same_outputs(hoisted, plain, x, ["y"])
    before = hoisted.read("y")
    for s in (hoisted, plain):
        s.set_param("w2", np.full((3, 8), 0.25, np.float32))
    _same_outputs(hoisted, plain, x, ["y"])
    assert not np.array_equal(before, hoisted.read("y"))
    _same_outputs(hoisted, plain, x, ["y"])  # the prologue's results kept between steps
    other = vkml.compile(g, device=device)
    other.set_param("w1", rng.standard_normal((8, 4)).astype(np.float32))
    other.save(tmp_path / "w.safetensors")
    for s in (hoisted, plain):
        s.load(tmp_path / "w.safetensors")
    _same_outputs(hoisted, plain, x, ["y"])
    for s in (hoisted, plain, other):
        s.close()


def _trainer_and_follower(device):
    """A training session of `_mlp` and an inference session sharing its parameters, with
    their inputs set; the follower's graph, and its input."""
    def graph(training: bool):
        g = vkml.Graph(seed=0)
        y = _mlp(g, g.input("x", (4, 4)))
        if not training:
            g.output("y", y)
            return g, None
        return g, g.mean((y - g.input("target", (4, 3))) ** 2)

    rng = np.random.default_rng(2)
    batch = {"x": rng.standard_normal((4, 4)).astype(np.float32),
             "target": rng.standard_normal((4, 3)).astype(np.float32)}
    g, loss = graph(True)
    trainer = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.05), device=device)
    for name, value in batch.items():
        trainer.set_input(name, value)
    inference_graph, _ = graph(False)
    follower = vkml.compile(inference_graph, device=device, share_params_with=trainer)
    assert follower.plan.prologue
    follower.set_input("x", batch["x"])
    return trainer, follower, inference_graph, batch["x"]


def _as_fresh(follower: Session, trainer: Session, graph, x, device) -> None:
    """The follower's output equals that of a session built from the trainer's weights."""
    fresh = vkml.compile(graph, device=device, hoist=False)
    for name, value in trainer.params().items():
        fresh.set_param(name, value)
    fresh.set_input("x", x)
    fresh.step()
    assert np.array_equal(follower.read("y"), fresh.read("y"))
    fresh.close()


def test_a_session_sharing_a_trainers_parameters_follows_its_updates(device):
    trainer, follower, graph, x = _trainer_and_follower(device)
    for chunks in (None, 2, None):
        trainer.step()
        follower.step(chunks=chunks)
        _as_fresh(follower, trainer, graph, x, device)
    follower.step()  # no update since: the prologue's results as they were
    _as_fresh(follower, trainer, graph, x, device)
    for update in (True, False):  # timed steps; update=False puts the parameters back after
        trainer.profile(steps=1, update=update)
        follower.step()
        _as_fresh(follower, trainer, graph, x, device)
    follower.close()
    trainer.close()


def test_a_session_cannot_share_the_parameters_of_a_sharing_session(device):
    # it compiled, and its prologue never saw the owner's updates: its outputs went stale
    trainer, follower, graph, _ = _trainer_and_follower(device)
    with pytest.raises(vkml.InputError, match="uses the parameters of another session .* "
                                              "pass that one, the owner"):
        vkml.compile(graph, device=device, share_params_with=follower)
    follower.close()
    trainer.close()


def test_steps_recorded_into_a_hosts_command_buffer_run_the_prologue_first(
        device, host):  # noqa: F811 (the fixture)
    vulkan_only(device)
    dev = host.adopt()
    trainer, follower, graph, x = _trainer_and_follower(dev)
    cb = host.command_buffer()
    for _ in range(2):
        host.begin(cb)
        trainer.record(cb)
        follower.record(cb)  # after the trainer's update: its prologue first
        vk.vkEndCommandBuffer(cb)
        host.submit_and_wait(cb)
        _as_fresh(follower, trainer, graph, x, dev)
    follower.close()
    trainer.close()
    dev.close()


def test_frozen_weights_are_hoisted_in_training_and_steps_do_not_rerun_them(device):
    def session(hoist: bool) -> Session:
        g = vkml.Graph(seed=0)
        y = _mlp(g, g.input("x", (4, 4)), frozen=True)
        return vkml.compile(g, loss=g.mean((y - g.input("target", (4, 3))) ** 2),
                            optimizer=vkml.SGD(lr=0.1), device=device, hoist=hoist)

    hoisted, plain = session(True), session(False)
    prologue = hoisted.plan.prologue
    assert any(hoisted.plan.params["w1"] in d.reads for d in prologue)
    assert not any(hoisted.plan.params["w2"] in d.reads for d in prologue)  # trained
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((4, 4)).astype(np.float32),
             "target": rng.standard_normal((4, 3)).astype(np.float32)}
    runs = []  # the parameter counters at which the prologue last ran, after each step
    for step in range(3):
        if step == 2:
            for s in (hoisted, plain):
                s.set_param("w1", np.full((8, 4), 0.5, np.float32))
        _same_outputs(hoisted, plain, batch, ["loss"])
        runs.append(hoisted._bound._prologue_ran)
    assert runs[0] == runs[1] != runs[2]  # the training step alone does not rerun it
    for name, value in plain.params().items():
        assert np.array_equal(hoisted.read(name), value), name
    hoisted.close()
    plain.close()
