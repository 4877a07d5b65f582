"""What a session takes it gives back, and it can be shared between threads: close() frees every
object the session made on the device (200 compile -> step -> close cycles neither grow the
process nor leave objects behind), one session stepped from two threads submits one step at a
time (the validation layer stays silent, the results are those of the same steps in a row), and
session.record() refuses a handle that is no command buffer instead of crashing in the driver."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
from conftest import live_objects

import vkml
from vkml.compiler import schedule


def small(device, seed=0, optimizer=None):
    g = vkml.Graph(seed=seed)
    x = g.input("x", (4, 6))
    labels = g.input("labels", (4,), "i32")
    logits = vkml.nn.Linear(g, "fc2", 8, 3)(vkml.nn.Linear(g, "fc1", 6, 8)(x).relu())
    g.output("logits", logits)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels), device=device,
                           optimizer=optimizer or vkml.Adam(lr=1e-2), keep_grads=True)
    session.set_input("x", np.random.default_rng(seed).standard_normal((4, 6))
                      .astype(np.float32))
    session.set_input("labels", np.array([0, 1, 2, 1], np.int32))
    return session


def live(device):
    return live_objects(device) | {"shared pipelines": len(device.pipelines)}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status to read the resident set size from")


def test_200_compile_step_close_cycles_neither_grow_nor_leave_objects(device):
    """Before pipelines were shared and freed with their last session, these cycles grew the
    process by about 5 MB each (918 MB over 200) and left 20 pipelines apiece behind."""
    def cycle(i):
        session = small(device, seed=i)
        session.step()
        session.read("loss")
        session.read("fc1.weight")
        session.close()

    for i in range(3):  # warm-up: caches, the allocator's pools, lazily imported code
        cycle(i)
    objects, rss = live(device), rss_mb()
    for i in range(200):
        cycle(i)
    assert live(device) == objects
    grown = rss_mb() - rss
    assert grown < 30, f"200 cycles grew the process by {grown:.1f} MB"


def test_close_frees_everything_the_session_made(device, tmp_path, monkeypatch):
    """Every feature that makes device objects (steps, chunked steps, profiling, read-backs,
    checkpoints), and pipelines shared with another live session stay until it closes too."""
    if device.backend_name == "vulkan":
        # Make reads go through the cached read-back programs, as on a discrete GPU (lavapipe's
        # memory is all host-visible, so it would read through the mapping).
        import vkml.vk.backend as vkb

        real = vkb.allocate_buffer

        def unmapped_reads(dev, nbytes, kind, label):
            buf = real(dev, nbytes, kind, label)
            if kind == "device":
                buf.host_read = False
            return buf

        monkeypatch.setattr(vkb, "allocate_buffer", unmapped_reads)
    before = live(device)
    first, second = small(device), small(device, seed=1)
    kernels = len(device.pipelines)
    first.step()
    first.forward()
    first.step(chunks=2)
    while first.step_chunk(chunks=3):
        pass
    first.profile(steps=1)
    first.read("loss"), first.grad("fc1.weight"), first.params()
    first.save(tmp_path / "c.safetensors")
    first.load(tmp_path / "c.safetensors")
    first.set_param("fc1.bias", np.ones(8, np.float32))
    during = live(device)
    if device.backend_name == "vulkan":
        assert during["read_backs"] > 0
    assert during != before

    first.close()
    assert len(device.pipelines) == kernels  # the second session still uses them all
    second.step()
    assert np.isfinite(second.read("loss"))
    second.close()
    assert live(device) == before
    first.close()  # twice is harmless
    for call in (lambda: first.read("loss"), first.step, first.params,
                 lambda: first.set_input("x", np.zeros((4, 6), np.float32))):
        with pytest.raises(vkml.DeviceError, match=r"session\.\w+\(\): this session is closed"):
            call()


def test_two_threads_stepping_one_session(device):
    """Each thread steps the same training session; the steps go to the queue one at a time
    (without the session's lock: VUID-vkQueueSubmit-pCommandBuffers-00071, one command buffer
    submitted while still pending), and the result is that of as many steps in a row."""
    steps = 25
    shared, reference = small(device), small(device)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker():
        try:
            start.wait()
            for _ in range(steps):
                shared.step()
                assert np.isfinite(shared.read("loss"))
        except BaseException as exc:  # reported below: pytest does not see other threads
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for _ in range(2 * steps):
        reference.step()
    for name, value in reference.params().items():
        np.testing.assert_array_equal(shared.read(name), value, err_msg=name)
    hp = shared.state_dict()["optimizer/hyperparams"]
    assert hp[shared.plan.hyperparams.index("t")] == 2 * steps

    # A sequence that must not interleave holds the session's lock around it.
    def reader(out):
        for _ in range(10):
            with shared.lock:
                shared.set_input("labels", np.array([0, 1, 2, 1], np.int32))
                shared.forward()
                out.append(shared.read("logits"))

    outs: list[list[np.ndarray]] = [[], []]
    threads = [threading.Thread(target=reader, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in outs[0] + outs[1]:
        np.testing.assert_array_equal(got, outs[0][0])
    shared.close()
    reference.close()


def test_sessions_on_two_threads_share_the_device(device):
    """Two sessions of one device, each compiled, stepped (whole and in pieces, each piece
    recorded on first use), read and closed on its own thread, at the same time: they share
    the queue, the command pool (whose use Vulkan leaves to the application to serialise) and
    the pipeline pool."""
    expected = []
    for s in (0, 1):
        ref = small(device, seed=s)
        for _ in range(6):
            ref.step()
        expected.append(ref.params())
        ref.close()
    before = live(device)
    results: list[dict[str, np.ndarray]] = [{}, {}]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(seed):
        try:
            start.wait()
            for _ in range(5):
                session = small(device, seed=seed)
                for chunks in (None, 2, 3, None, 2, 3):
                    session.step(chunks=chunks)
                    session.read("loss")
                results[seed] = session.params()
                session.close()
        except BaseException as exc:  # reported below: pytest does not see other threads
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected):
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert live(device) == before


# ---- session.record with a handle that is no command buffer -------------------------------------

@pytest.fixture
def host(device):
    """A host application's Vulkan device (tests/test_render_loop.py), checked for messages of
    the validation layer on it."""
    if device.backend_name != "vulkan":
        pytest.skip("session.record() is Vulkan only")
    from test_render_loop import Host

    h = Host()
    yield h
    h.close()
    assert not h.messages, "validation layer reported:\n" + "\n".join(h.messages)


def test_record_refuses_what_is_not_a_command_buffer(host):
    """Each of these crashed the process in the driver (a segfault); now a DeviceError names
    the argument, and the session and the real command buffer work afterwards."""
    import vulkan as vk
    from test_render_loop import mlp

    dev = host.adopt()
    cb = host.command_buffer()
    ffi = vk.ffi

    def as_int(handle):
        return int(ffi.cast("uintptr_t", handle))

    bogus = [
        (12345, "is 0x3039, which cannot be a VkCommandBuffer"),
        (0xDEADBEEF000, "points to no readable memory"),
        (-8, "cannot be a VkCommandBuffer"),
        (0, "is a null handle"),
        (None, "is a null handle"),
        (3.5, "got float"),
        ("command buffer", "got str"),
        (True, "got bool"),
        (ffi.new("int *"), "is a cffi int \\*"),
        (host.device, "is a cffi struct VkDevice_T \\*"),
        (host.queue, "is a cffi struct VkQueue_T \\*"),
        (as_int(host.device), "is the VkDevice vkml runs on"),
        (as_int(host.queue), "is the VkQueue vkml runs on"),
        (as_int(host.physical), "is not a VkCommandBuffer of the device vkml runs on"),
        (ffi.cast("VkCommandBuffer", 0x7F0000001000), "points to no readable memory"),
        (ffi.cast("VkCommandBuffer", 0x7F0000001004), "cannot be a VkCommandBuffer"),
    ]
    with mlp(dev) as session:
        for handle, message in bogus:
            host.begin(cb)
            with pytest.raises(vkml.DeviceError, match=f"command_buffer.*{message}"):
                session.record(handle)
            vk.vkEndCommandBuffer(cb)
        host.begin(cb)
        session.record(as_int(cb))  # the integer form of a real one is fine
        vk.vkEndCommandBuffer(cb)
        host.submit_and_wait(cb)
        assert np.isfinite(session.read("loss"))
        session.step()
        assert np.isfinite(session.read("loss"))
    dev.close()


def test_adopting_bogus_handles_is_refused(host):
    def as_int(handle):
        import vulkan as vk

        return int(vk.ffi.cast("uintptr_t", handle))

    with pytest.raises(vkml.DeviceError, match="device is 0x3039, which cannot be a VkDevice"):
        vkml.Device.from_vulkan(host.instance, host.physical, 12345, host.family, host.queue)
    with pytest.raises(vkml.DeviceError, match="queue .* is not a VkQueue of the device"):
        vkml.Device.from_vulkan(host.instance, host.physical, host.device, host.family,
                                as_int(host.physical))
    dev = host.adopt()  # the real ones still work
    dev.close()


def mlp(seed: int = 0) -> tuple[vkml.Graph, vkml.Tensor, vkml.Tensor]:
    g = vkml.Graph(seed=seed)
    x = g.input("x", (32, 64))
    labels = g.input("labels", (32,), "i32")
    logits = vkml.nn.Linear(g, "fc2", 64, 16)(vkml.nn.Linear(g, "fc1", 64, 64)(x).relu())
    return g, logits, g.cross_entropy(logits, labels)


def test_a_session_after_another_computes_the_same_and_close_gives_its_memory_back(device):
    """On the H200 a session compiled after an f16 training session in the same process ran
    3-4x slower than in a fresh one. Here: an f32 inference session alone; then a training
    session (f32, and f16 where the device has f16 arithmetic) stepped and closed, which
    must leave the device's buffers, their bytes, pipelines and programs as they were; then the
    same inference session again, whose logits must equal those it gave alone, bit for bit, and
    float64 NumPy's."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    labels = rng.integers(0, 16, 32).astype(np.int32)

    def inference() -> tuple[np.ndarray, dict[str, np.ndarray]]:
        g, logits, _ = mlp()
        s = vkml.compile(g, outputs={"logits": logits}, device=device)
        try:
            s.set_input("x", x)
            s.step()
            return s.read("logits"), s.params()
        finally:
            s.close()

    before = live(device)
    alone, params = inference()
    assert live(device) == before
    p = {k: v.astype(np.float64) for k, v in params.items()}
    hidden = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0)
    want = hidden @ p["fc2.weight"].T + p["fc2.bias"]
    assert np.linalg.norm(alone - want) / np.linalg.norm(want) < 1e-5

    f16 = dataclasses.replace(device.caps, precision="f16").f16_products is not None
    precisions = ["f32"] + (["f16"] if f16 else [])
    for precision in precisions:
        g, _, loss = mlp(seed=1)
        train = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=1e-2), device=device,
                             precision=precision)
        train.set_input("x", x)
        train.set_input("labels", labels)
        for _ in range(3):
            train.step()
        assert np.isfinite(train.read("loss")).all()
        held = live(device)
        assert held["buffer_bytes"] > before["buffer_bytes"], (precision, held, before)
        train.close()
        assert live(device) == before, precision
        after, _ = inference()
        assert np.array_equal(after, alone), precision
        assert live(device) == before


# ---- sessions dropped without close() ----------------------------------------------------------

def held(device):
    """What is alive now, freeing nothing first (live() frees the dropped sessions)."""
    return device.backend.live_objects() | {"shared pipelines": len(device.pipelines)}


def used(device, seed=0):
    """small()'s training session after a whole step, a chunked one, a profile and reads."""
    session = small(device, seed=seed)
    session.step()
    session.step(chunks=2)
    session.profile(steps=1)
    session.read("loss"), session.params()
    return session


def test_sessions_dropped_without_close_are_freed_at_the_devices_next_call(device):
    """A render loop that recompiles, or a notebook re-running a cell, drops sessions without
    close(): each kept its buffers, programs and pipelines until the device closed (five of
    these: 15 buffers, linearly). Now a dropped session is freed by the next compile, or the
    next call of any session of its device; one in a reference cycle once collected."""
    empty = live(device)
    keeper = small(device, seed=99)
    baseline = live(device)
    one = None
    for seed in range(6):
        used(device, seed)  # dropped at once: nothing refers to it
        now = held(device)  # the latest dropped session, not yet freed; the one before, freed
        assert now != baseline
        one = one or now
        assert now == one, seed
    keeper.step()
    assert held(device) == baseline
    session = used(device, 6)
    cycle: list[object] = [session]
    cycle.append(cycle)
    del session, cycle
    gc.collect()
    keeper.step()
    assert held(device) == baseline
    used(device, 7)
    assert device.release_dropped() == 1  # without waiting for a call
    assert held(device) == baseline
    keeper.close()
    assert live(device) == empty


def test_a_dropped_session_is_not_kept_alive_by_what_it_holds(device, tmp_path):
    """Without the collector (a reference cycle through a bound method, a callback, the
    chunker, the profiler or a cache would keep it), a session whose last reference goes is
    finalized at once, a chunked step left part-way included, and freed at the next call."""
    baseline = live(device)
    keeper = small(device, seed=99)
    session = used(device)
    session.step(budget_ms=1e3)
    session.piece_costs(chunks=2)
    session.grad("fc1.weight"), session.state_dict(), session.explain()
    session.set_hyperparams(lr=1e-3)
    session.save(tmp_path / "s.safetensors")
    session.load(tmp_path / "s.safetensors")
    assert session.step_chunk(chunks=3) > 0  # left part-way
    gone = weakref.ref(session)
    gc.disable()
    try:
        del session
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()
    keeper.step()
    keeper.close()
    assert held(device) == baseline


def spying(method, calls):
    """`method`, noting its name and thread in `calls` first."""
    def spy(*args):
        calls.append((method.__name__, threading.current_thread()))
        return method(*args)
    return spy


def test_the_finalizer_calls_nothing_on_the_device(device, monkeypatch):
    """The collector may finalize a dropped session on any thread, inside any lock: here on a
    thread holding the pipeline pool's lock, which freeing the session's pipelines takes again
    (a deadlock), as a collection that struck inside PipelinePool.acquire would. The finalizer
    only queues the release; the device calls are made by the next call, on its thread."""
    calls: list[tuple[str, threading.Thread]] = []
    for name in ("free_buffer", "free_program", "free_pipeline", "wait_for", "wait", "submit",
                 "submit_batch"):
        monkeypatch.setattr(device.backend, name, spying(getattr(device.backend, name), calls))
    baseline = live(device)
    session = used(device)
    before = held(device)
    cycle: list[object] = [session]
    cycle.append(cycle)
    collected = []

    def collect():
        with device.pipelines._lock:
            collected.append(gc.collect())

    gc.disable()  # so that only that thread's collection finalizes it
    try:
        del session, cycle
        calls.clear()
        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        collector.join(timeout=10)
    finally:
        gc.enable()
    assert not collector.is_alive(), "finalizing the session deadlocked"
    assert collected and collected[0] > 0
    assert calls == [] and held(device) == before
    assert device.release_dropped() == 1
    assert {"free_buffer", "free_program"} <= {name for name, _ in calls}
    assert {thread for _, thread in calls} == {threading.current_thread()}
    assert held(device) == baseline


def reader(owner: vkml.Session) -> vkml.Session:
    """An inference session of small()'s graph (seed 0) on `owner`'s parameters."""
    g = vkml.Graph(seed=0)
    x = g.input("x", (4, 6))
    logits = vkml.nn.Linear(g, "fc2", 8, 3)(vkml.nn.Linear(g, "fc1", 6, 8)(x).relu())
    return vkml.compile(g, outputs={"logits": logits}, share_params_with=owner)


def test_a_dropped_owner_keeps_its_parameters_for_a_live_sharer(device, monkeypatch):
    """An owner dropped part-way through a chunked step's parameter updates, with a session
    sharing its parameters: its remaining updates are submitted (a sharer's step would
    otherwise see half an update, or be refused forever), the rest of what it holds is freed,
    and its parameters stay until the sharer goes. A dropped sharer part-way through a chunked
    step no longer blocks its owner's updates."""
    monkeypatch.setenv("VKML_PLAN_CACHE", "0")  # the plan depends on PACK_BYTES
    monkeypatch.setattr(schedule, "PACK_BYTES", 128)  # updates in several packs and levels
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    reference = small(device)
    reference.step()
    reference.step()
    want = reference.params()
    reference.close()
    p = {k: v.astype(np.float64) for k, v in want.items()}
    logits = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0) @ p["fc2.weight"].T
    logits += p["fc2.bias"]

    baseline = live(device)
    owner = small(device)
    sharer = reader(owner)
    sharer.set_input("x", x)
    owner.step()
    while not owner.updating:
        assert owner.step_chunk(chunks=99) > 0, "no piece left part-way through the updates"
    both = held(device)
    del owner
    sharer.step()  # frees the owner, after submitting the rest of its update
    freed = held(device)
    assert freed["programs"] < both["programs"] and freed["buffers"] < both["buffers"]
    for _ in range(2):
        got = sharer.read("logits")
        assert np.linalg.norm(got - logits) / np.linalg.norm(logits) < 1e-5
        sharer.step()
    sharer.close()
    assert live(device) == baseline

    owner = small(device)
    sharer = reader(owner)
    sharer.set_input("x", x)
    assert sharer.step_chunk(chunks=2) > 0  # part-way: the owner's updates would be refused
    del sharer
    owner.step()
    owner.close()
    assert live(device) == baseline
