"""The engine API a render loop asked for (issue 12's demo): several pieces in one submission
priced by measured cost (step_chunk(max_ms=...), piece_costs()), completion per session,
parameters shared between a training and an inference session, set_input that does not wait
for the step in flight, profile(update=False), Device.from_vulkan with the host's whole
extension list, and reductions over axes of size 1 (no kernel).

Every test runs under the validation layer when `make test` enables it (conftest checks the
messages after each test); results are compared bit for bit with plain whole steps."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import live_objects
from test_render_loop import (  # noqa: F401  (host: the fixture)
    assert_same,
    host,
    mlp,
    reference,
    state,
    vk,
    vulkan_only,
)

import vkml
from vkml.compiler import schedule
from vkml.compiler.plan import ELSEWHERE
from vkml.kernels.reduce import canonical
from vkml.vk.context import Adopted, check_declared


def net(g, x):
    """mlp()'s network (same parameter names and initialisation for the same seed)."""
    h = vkml.nn.Linear(g, "fc1", 12, 16)(x).relu()
    h = vkml.nn.Linear(g, "fc2", 16, 16)(h).tanh()
    return vkml.nn.Linear(g, "fc3", 16, 5)(h)


def inference(device, owner=None, seed=0, batch=8):
    g = vkml.Graph(seed=seed)
    g.output("logits", net(g, g.input("x", (batch, 12))))
    return vkml.compile(g, device=device, share_params_with=owner)


def inputs(k):
    rng = np.random.default_rng(100 + k)
    return (rng.standard_normal((8, 12)).astype(np.float32),
            rng.integers(0, 5, 8).astype(np.int32))


def reference_with_inputs(device, steps):
    """Whole steps, step k on inputs(k): the state after them."""
    with mlp(device) as s:
        for k in range(steps):
            x, y = inputs(k)
            s.set_input("x", x)
            s.set_input("labels", y)
            s.step()
        return state(s)


# ---- step_chunk(max_ms=...) and piece_costs() -----------------------------------------------

def test_max_ms_packs_pieces_into_one_submission(device):
    expected = reference(device, 4)
    with mlp(device) as s:
        with pytest.raises(vkml.InputError, match="measured"):
            s.piece_costs()
        profile = s.profile(steps=1, update=False)  # measures, leaves the state as it was
        costs = s.piece_costs()  # by default one piece per level, what max_ms packs
        assert len(costs) == len({d.level for d in s.plan.dispatches})
        assert sum(costs) == pytest.approx(sum(profile.dispatch_ms))
        assert s.piece_costs(chunks=1) == [pytest.approx(sum(costs))]
        counted = []
        backend = s.device.backend
        submit_batch = backend.submit_batch
        backend.submit_batch = lambda programs: (counted.append(len(programs)),
                                                 submit_batch(programs))[1]
        try:
            budget = sum(costs[:3])
            left, cost = s.step_chunk(max_ms=budget)  # the first three levels, one submission
            assert (left, cost) == (len(costs) - 3, pytest.approx(budget))
            assert counted == [4]  # the inputs' copies and three pieces
            nothing = s.step_chunk(max_ms=0.0)  # the next piece does not fit: nothing goes
            assert nothing == (len(costs) - 3, 0.0)
            one = s.step_chunk(max_ms=0.0, at_least_one=True)
            assert one.pieces_left == len(costs) - 4 and one.cost_ms == pytest.approx(costs[3])
            assert s.step_chunk(max_ms=1e9) == (0, pytest.approx(sum(costs[4:])))
        finally:
            backend.submit_batch = submit_batch
        for _ in range(3):  # whole steps in as few submissions as the budget allows
            while s.step_chunk(max_ms=sum(costs) / 2, at_least_one=True).pieces_left:
                pass
        s.wait()
        assert_same(state(s), expected)
        assert s.record_pieces(chunks=2) == 2 and s._chunker.recorded_cuts == 2
        # an explicit chunking applies to max_ms too
        s.step_chunk(chunks=2, max_ms=0.0)
        assert s.pieces_left == 2 and s.piece_costs() == s.piece_costs(chunks=2)
        s.step_chunk(max_ms=1e9)
        assert s.pieces_left == 0


def test_max_ms_before_anything_was_measured_runs_one_timed_step(device):
    expected = reference(device, 2)
    with mlp(device) as s:
        left, cost = s.step_chunk(max_ms=5.0)  # nothing measured: one whole step, timed
        assert left == 0 and cost > 0
        while s.step_chunk(max_ms=cost / 3, at_least_one=True).pieces_left:
            pass
        s.wait()
        assert_same(state(s), expected)


# ---- completion per session ----------------------------------------------------------------

def test_waiting_for_a_session_does_not_wait_for_later_work_of_another(device):
    vulkan_only(device)
    backend = device.backend
    first, second = mlp(device), mlp(device, seed=1)
    try:
        semaphore, none_yet = first.done()
        assert none_yet == 0
        first.step()
        _, mine = first.done()
        second.step_chunk(chunks=3)
        second.step_chunk()
        _, theirs = second.done()
        assert theirs == mine + 2  # one submission per piece, the first with its inputs
        waited = []
        wait_value = backend._wait_value
        backend._wait_value = lambda value: (waited.append(value), wait_value(value))[1]
        try:
            first.read("loss")
            first.wait()
        finally:
            backend._wait_value = wait_value
        # only up to its own submission: never the other session's pieces queued after it
        assert waited and max(waited) <= mine
        assert first.done() == (semaphore, mine)
        second.step_chunk()
        second.wait()
        assert second.done()[1] > theirs
    finally:
        first.close()
        second.close()


# ---- inputs that do not wait for the step in flight ----------------------------------------

def test_set_input_during_a_step_in_flight_does_not_wait_and_keeps_its_inputs(device):
    expected = reference_with_inputs(device, 4)
    with mlp(device) as s:
        waits = []
        backend = s.device.backend
        wait_for, wait = backend.wait_for, backend.wait
        backend.wait_for = lambda p: (waits.append(p), wait_for(p))[1]
        backend.wait = lambda: (waits.append("all"), wait())[1]
        for k in range(4):
            x, y = inputs(k)
            waits.clear()
            s.set_input("x", x)  # the previous step's last pieces may still be running
            s.set_input("labels", y)
            assert waits == []
            s.step_chunk(chunks=3)
            x[:] = 0  # the caller's array is copied, never read later
            s.set_input("x", np.full((8, 12), 7.0, np.float32))  # for a step never run
            s.step_chunk()
            s.step_chunk()
            s.set_input("x", inputs(k)[0])
        backend.wait_for, backend.wait = wait_for, wait
        s.wait()
        assert_same(state(s), expected)


# ---- profile(update=False) -------------------------------------------------------------------

def test_profile_without_update_leaves_the_state_bit_for_bit(device):
    expected = reference(device, 3)
    with mlp(device) as s:
        s.step()
        before = s.state_dict()
        profile = s.profile(steps=2, update=False)
        after = s.state_dict()
        assert_same(before, after)  # parameters, Adam's moments and its step count
        assert profile.steps >= 2 and len(profile.dispatch_ms) == len(s.plan.dispatches)
        assert any(d.phase == "update" for d in s.plan.dispatches)  # the update was timed too
        s.step()
        s.step()
        assert_same(state(s), expected)
        s.profile(steps=1)  # update=True (the default): profiled steps are real steps
        assert_same({k: v for k, v in s.state_dict().items()},
                    {k: v for k, v in reference_state_dict(device, 4).items()})


def reference_state_dict(device, steps):
    with mlp(device) as s:
        for _ in range(steps):
            s.step()
        return s.state_dict()


# ---- shared parameters -----------------------------------------------------------------------

def test_an_inference_session_sees_the_training_sessions_parameters_in_place(device):
    train = mlp(device)
    infer = inference(device, owner=train)
    alone = inference(device)  # the same network with its own parameters, set by copy
    try:
        x = inputs(9)[0]
        shared = [s for s in infer.plan.params.values()]
        assert all(infer.plan.memory.placement[s][0] == ELSEWHERE for s in shared)
        assert sum(infer.plan.memory.arena_bytes) < sum(alone.plan.memory.arena_bytes)
        for _ in range(3):
            for s in (infer, alone):
                s.set_input("x", x)
            for name in alone.plan.params:
                alone.set_param(name, train.read(name))
            infer.step()
            alone.step()
            np.testing.assert_array_equal(infer.read("logits"), alone.read("logits"))
            train.step_chunk(chunks=4)  # inference may run before a step's updates begin
            infer.step()
            while train.step_chunk():
                pass
        train.wait()
        assert_same(state(train), reference(device, 3))  # sharing changed nothing in training
        np.testing.assert_array_equal(infer.read("fc1.weight"), train.read("fc1.weight"))
        with pytest.raises(vkml.InputError, match="belongs to the session"):
            infer.set_param("fc1.weight", np.zeros((16, 12), np.float32))
        with pytest.raises(vkml.InputError, match="load the checkpoint into that session"):
            infer.load("unused.safetensors")
    finally:
        alone.close()
        infer.close()
        train.close()


def test_no_step_sees_half_an_update(device, monkeypatch):
    monkeypatch.setenv("VKML_PLAN_CACHE", "0")  # the plan depends on PACK_BYTES
    monkeypatch.setattr(schedule, "PACK_BYTES", 1024)  # updates in several packs, so
    train = mlp(device)  # several levels
    infer = inference(device, owner=train)
    try:
        infer.set_input("x", inputs(1)[0])
        infer.profile(steps=1)  # measured costs, for step_chunk(max_ms=...) below
        train.profile(steps=1, update=False)
        writes = [any(d.phase == "update" and d.update and d.update.size
                      for d in train.plan.dispatches[a:b])
                  for a, b in train.chunk_boundaries(chunks=99)]
        first_update = writes.index(True)
        assert any(writes[first_update + 1:])  # the updates span several levels
        for _ in range(first_update + 1):
            assert not train.updating
            train.step_chunk(chunks=99)  # one piece per level
        assert train.updating  # some parameters updated, others not yet
        with pytest.raises(vkml.InputError, match="part-way through a parameter update"):
            infer.step()
        with pytest.raises(vkml.InputError, match="part-way through a parameter update"):
            infer.profile(steps=1)
        assert infer.pieces_left == 0
        held = infer.step_chunk(chunks=1, max_ms=1e9, at_least_one=True)  # packing: nothing
        assert held.cost_ms == 0.0 and infer.pieces_left == 1 and not infer._bound.mid_step
        while train.updating:
            train.step_chunk()
        infer.step_chunk()  # the updates are all submitted: a consistent set
        assert infer.pieces_left == 0
        while train.pieces_left:
            train.step_chunk()
        # the other way round: an inference step in pieces holds the training updates off
        infer.step_chunk(chunks=2)
        with pytest.raises(vkml.InputError, match="part-way through a chunked step"):
            train.step()
        with pytest.raises(vkml.InputError, match="part-way through a chunked step"):
            train.set_param("fc1.bias", np.zeros(16, np.float32))
        # packing by cost stops before the first piece that writes parameters
        left, _ = train.step_chunk(chunks=99, max_ms=1e9)
        assert len(writes) - left == first_update
        with pytest.raises(vkml.InputError, match="part-way through a chunked step"):
            train.step_chunk()
        assert train.step_chunk(max_ms=1e9, at_least_one=True) == (left, 0.0)
        infer.step_chunk()
        while train.pieces_left:
            train.step_chunk()
        train.wait()
        infer.wait()
        assert_same(state(train), reference(device, 2))
    finally:
        infer.close()
        train.close()


def test_parameters_are_never_read_half_updated(device, monkeypatch):
    # Between the pieces of a chunked step that update parameters, reads returned some
    # layers updated and others not, and state_dict() a step count ahead of the moments.
    monkeypatch.setenv("VKML_PLAN_CACHE", "0")  # the plan depends on PACK_BYTES
    monkeypatch.setattr(schedule, "PACK_BYTES", 1024)  # updates in several packs: levels
    train = mlp(device)
    infer = inference(device, owner=train)
    try:
        train.step()
        while not train.updating:
            train.step_chunk(chunks=99)
        for read in (lambda: train.read("fc1.weight"), train.params,
                     lambda: infer.read("fc1.weight"), infer.params):
            with pytest.raises(vkml.InputError, match="part-way through .*parameter updates"):
                read()
        saved = train.state_dict()  # finishes the step first, as save() does
        assert not train.updating and train.pieces_left == 0
        assert_same(saved, reference_state_dict(device, 2))
        np.testing.assert_array_equal(infer.read("fc1.weight"), saved["fc1.weight"])
    finally:
        infer.close()
        train.close()


def test_sharing_refuses_what_it_cannot_share(device):
    with mlp(device) as train:
        g = vkml.Graph(seed=0)
        x = g.input("x", (8, 12))
        g.output("y", vkml.nn.Linear(g, "fc1", 12, 7)(x))  # fc1 of another shape
        with pytest.raises(vkml.GraphError, match="'fc1.weight' is f32\\[7, 12\\] here"):
            vkml.compile(g, device=device, share_params_with=train)
        g = vkml.Graph(seed=0)
        g.output("y", vkml.nn.Linear(g, "other", 12, 7)(g.input("x", (8, 12))))
        with pytest.raises(vkml.GraphError, match="no parameter names in common"):
            vkml.compile(g, device=device, share_params_with=train)
        g = vkml.Graph(seed=0)
        logits = net(g, g.input("x", (8, 12)))
        loss = g.cross_entropy(logits, g.input("labels", (8,), "i32"))
        with pytest.raises(vkml.GraphError, match="only one session"):
            vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device,
                         share_params_with=train)
        with pytest.raises(vkml.InputError, match="takes a vkml Session"):
            inference(device, owner="train")


def test_the_owner_may_close_first(device):
    train = mlp(device)
    infer = inference(device, owner=train)
    infer.set_input("x", inputs(2)[0])
    train.step()
    expected = train.params()
    train.close()  # its memory stays while the inference session uses it
    infer.step()
    np.testing.assert_array_equal(infer.read("fc3.bias"), expected["fc3.bias"])
    infer.close()


def test_owner_and_sharer_closed_at_once_free_each_buffer_once(device, monkeypatch):
    # Closed on two threads at the same moment, both saw the owner closed with no sharer left
    # and both freed its arenas. Every free is counted here, and slowed (letting the other
    # thread run) so that the two closes interleave.
    freed: list[int] = []
    free = device.backend.free_buffer

    def counted(buffer):
        freed.append(id(buffer))
        time.sleep(1e-3)
        free(buffer)
    monkeypatch.setattr(device.backend, "free_buffer", counted)
    before = live_objects(device)
    for _ in range(20):
        train = mlp(device)
        pair = [train, inference(device, owner=train)]
        arenas = [id(b) for s in pair for b in s._bound.arenas]
        ready, errors = threading.Barrier(2), []

        def close(session, ready=ready, errors=errors):
            ready.wait()
            try:
                session.close()
            except Exception as e:  # noqa: BLE001  (reported below, from the main thread)
                errors.append(e)
        threads = [threading.Thread(target=close, args=(s,)) for s in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(i for i in freed if i in arenas) == sorted(arenas)
        assert len(freed) == len(set(freed)), "a buffer was freed twice"
        freed.clear()
    assert live_objects(device) == before


# ---- Device.from_vulkan with the host's whole extension list --------------------------------

def test_declared_names_vkml_does_not_use_are_ignored_when_real():
    adopt = Adopted(0, 0, 0, 0, 0, frozenset({"timelineSemaphore", "samplerAnisotropy"}),
                    frozenset({"VK_KHR_swapchain", "VK_KHR_external_memory_fd"}))
    offered = {"VK_KHR_swapchain", "VK_KHR_external_memory_fd"}
    on = check_declared("gpu", {"timelineSemaphore": True}, offered, adopt,
                        frozenset({"samplerAnisotropy", "timelineSemaphore"}))
    assert on == {"timelineSemaphore"}
    with pytest.raises(vkml.DeviceError, match="'VK_KHR_external_memory_fd' is declared enabled"):
        check_declared("gpu", {"timelineSemaphore": True}, set(), adopt,
                       frozenset({"samplerAnisotropy"}))
    typo = Adopted(0, 0, 0, 0, 0, frozenset({"timelineSemaphores"}))
    with pytest.raises(vkml.DeviceError, match="unknown feature"):
        check_declared("gpu", {"timelineSemaphore": True}, set(), typo,
                       frozenset({"timelineSemaphore"}))


def test_adopting_a_device_declared_with_a_swapchain(device, host):  # noqa: F811
    vulkan_only(device)
    offered = {e.extensionName for e in
               vk.vkEnumerateDeviceExtensionProperties(host.physical, None)}
    if "VK_KHR_swapchain" not in offered:
        pytest.skip("this device offers no VK_KHR_swapchain")
    dev = host.adopt(enabled_extensions=[*host.extensions, "VK_KHR_swapchain"],
                     enabled_features=[*host.features, "robustBufferAccess"])
    with mlp(dev) as s:
        s.step()
        assert np.isfinite(s.read("loss")).all()
    dev.close()


# ---- reductions over axes of size 1 ----------------------------------------------------------

def test_canonical_reductions():
    assert canonical((1, 512, 48), (0,)) == ((512 * 48,), ())
    assert canonical((1, 32, 16, 16), (0, 2, 3)) == ((32, 256), (1,))
    assert canonical((1, 16, 32, 2, 32, 2), (3, 5)) == ((512, 2, 32, 2), (1, 3))
    assert canonical((4, 1, 5), (0, 1, 2)) == ((20,), (0,))
    assert canonical((1, 1), (0,)) == ((), ())


@pytest.mark.parametrize("shape,axes,keepdims", [
    ((1, 6, 5), (0,), False), ((1, 6, 5), (0,), True), ((1, 4, 1, 3, 2), (0, 2, 3), False),
    ((2, 1, 3), (1, 2), True), ((1, 3, 2, 2, 4, 2), (3, 5), False), ((1,), None, False)])
def test_sums_and_maxima_over_axes_of_size_one(device, shape, axes, keepdims):
    rng = np.random.default_rng(3)
    value = rng.standard_normal(shape).astype(np.float32)
    g = vkml.Graph()
    x = g.input("x", shape)
    g.output("sum", g.sum(x, axes, keepdims=keepdims))
    g.output("max", g.amax(x, axes, keepdims=keepdims))
    with vkml.compile(g, device=device) as s:
        s.set_input("x", value)
        s.step()
        np.testing.assert_allclose(s.read("sum"), value.sum(axis=axes, keepdims=keepdims),
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(s.read("max"), value.max(axis=axes, keepdims=keepdims))
        every = axes is None or all(shape[a] == 1 for a in axes)
        assert not s.plan.dispatches if every else len(s.plan.dispatches) == 2


def test_a_batch_of_one_weight_gradient_needs_no_reduction(device):
    """x (1, T, in) @ W^T: the weight gradient's sum over the batch axis of size 1 is a
    reshape, and the gradient is the 2-D product's."""
    rng = np.random.default_rng(5)
    xv = rng.standard_normal((1, 6, 4)).astype(np.float32)
    wv = rng.standard_normal((3, 4)).astype(np.float32)
    g = vkml.Graph()
    x = g.input("x", (1, 6, 4))
    w = g.param("w", (3, 4))
    loss = g.sum(g.square(g.matmul(x, w, transpose_b=True)))
    with vkml.compile(g, loss=loss, device=device) as s:
        assert not [d.name for d in s.plan.dispatches if d.name.startswith("sum_1x3x4")]
        s.set_param("w", wv)
        s.set_input("x", xv)
        s.step()
        y = xv[0] @ wv.T
        np.testing.assert_allclose(s.grad("w"), 2 * y.T @ xv[0], rtol=1e-5)


# ---- outputs the host cannot read in place --------------------------------------------------

def test_outputs_in_device_memory_are_copied_by_the_step_itself(device, host,  # noqa: F811
                                                                 monkeypatch):
    """As on a discrete GPU (arenas in VRAM, which the host cannot read in place; lavapipe's
    can, so it is simulated): every step ends with a copy of the outputs into host-readable
    memory, in its own submission, and read() submits nothing."""
    vulkan_only(device)
    dev = host.adopt()
    monkeypatch.setattr(type(dev.backend), "stage_reads", lambda self, buffer: True)
    expected = reference_with_inputs(device, 3)
    with mlp(dev) as s:
        assert s._bound.download_program is not None
        backend = dev.backend
        for k in range(3):
            x, y = inputs(k)
            s.set_input("x", x)
            s.set_input("labels", y)
            if k == 0:
                s.step()
            elif k == 1:
                while s.step_chunk(chunks=3):
                    pass
            else:  # recorded into the host's command buffer, outputs' copies included
                cb = host.command_buffer()
                host.begin(cb)
                s.record(cb)
                vk.vkEndCommandBuffer(cb)
                host.submit_and_wait(cb)
            s.wait()
            submits: list[object] = []
            monkeypatch.setattr(backend, "submit", submits.append)
            monkeypatch.setattr(backend, "submit_batch", submits.append)
            s.read("loss")
            logits = s.read("logits")
            monkeypatch.undo()
            monkeypatch.setattr(type(dev.backend), "stage_reads", lambda self, buffer: True)
            assert submits == []  # nothing queued to read them
            if k == 1:
                np.testing.assert_array_equal(logits, s._bound.read_slot(
                    s.plan.slots[s.plan.outputs["logits"].slot]).reshape(logits.shape))
        got = state(s)
    dev.close()
    assert_same(got, expected)
