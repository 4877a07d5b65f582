"""vkml.wgpu_backend: the same plans and kernels through wgpu agree with the Vulkan backend.

Here wgpu runs over its own Vulkan backend on lavapipe; nothing in this file ran on Metal.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import rel_l2, subprocess_env
from test_ops import CASES, Case, build_session
from test_vk_backend import NBYTES, N, axpb_kernel, check_workgroup_ranges

import vkml
from vkml.errors import DeviceError, NagaError
from vkml.hal import WAIT_POLL_S, Barrier, Binding, Copy, Dispatch, Fill, Kernel

pytest.importorskip("wgpu", reason="the wgpu backend needs `pip install vkml[wgpu]`")

from vkml.webgpu.backend import WgpuBackend  # noqa: E402  (only once wgpu is known to exist)

AGREE = 1e-5

# axpb's x and b are read, y written: bound as ranges of ONE buffer this is the usage conflict
# WebGPU rejects unless every binding is declared read_write, as codegen does where the
# capabilities say read_only_storage=False.


@pytest.fixture(scope="module")
def pair():
    devices = {name: vkml.Device(backend=name) for name in ("vulkan", "wgpu")}
    yield devices
    for d in devices.values():
        d.close()


@pytest.fixture
def backend(pair):
    yield pair["wgpu"].backend
    assert_quiet(pair)


def assert_quiet(pair) -> None:
    for name, dev in pair.items():
        found = list(dev.backend.validation_messages)
        dev.backend.validation_messages.clear()
        assert not found, f"{name} reported:\n" + "\n".join(found)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_op_agrees_with_vulkan(case: Case, pair):
    results = {}
    for name, dev in pair.items():
        session, operands, _, _ = build_session(case, dev, np.random.default_rng(1234))
        session.step()
        results[name] = [session.read("out")] + [session.grad(f"p{i}")
                                                 for i in range(len(operands))]
        session.close()
    for got, want in zip(results["wgpu"], results["vulkan"], strict=True):
        assert rel_l2(got, want) < AGREE
    assert_quiet(pair)


def test_training_ends_in_the_same_parameters_as_vulkan(pair):
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((8, 12)).astype(np.float32),
                rng.integers(0, 5, 8).astype(np.int32)) for _ in range(20)]
    params = {}
    for name, dev in pair.items():
        g = vkml.Graph(seed=3)
        x = g.input("x", (8, 12))
        labels = g.input("labels", (8,), "i32")
        logits = vkml.nn.Linear(g, "fc2", 16, 5)(vkml.nn.Linear(g, "fc1", 12, 16)(x).gelu())
        session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                               optimizer=vkml.Adam(lr=1e-2), device=dev)
        for xb, yb in batches:
            session.set_input("x", xb)
            session.set_input("labels", yb)
            session.step()
        params[name] = session.params()
        session.close()
    assert params["wgpu"].keys() == params["vulkan"].keys()
    for k, v in params["vulkan"].items():
        assert rel_l2(params["wgpu"][k], v) < AGREE, k
    assert_quiet(pair)


def test_one_buffer_bound_read_only_and_writable_in_one_dispatch(backend):
    assert not backend.caps.read_only_storage
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    align = backend.caps.min_storage_offset_alignment
    assert align >= 256  # WebGPU's default, what the planner must honour
    stride = -(-NBYTES // align) * align
    arena = backend.create_buffer(3 * stride, "device", "arena")
    x = np.arange(N, dtype=np.float32)
    backend.write_buffer(arena, 0, x.tobytes())
    backend.write_buffer(arena, stride, np.ones(N, np.float32).tobytes())
    bindings = (Binding(arena, 0, NBYTES, False), Binding(arena, stride, NBYTES, False),
                Binding(arena, 2 * stride, NBYTES, True))
    program = backend.record([Dispatch(pipe, bindings, (-(-N // 64), 1, 1)), Barrier(),
                              Copy(arena, 2 * stride, arena, 0, NBYTES)], "axpb")
    for _ in range(2):  # a recorded program runs any number of times
        backend.submit(program)
    backend.wait()
    # x -> 2x + 1, twice, through the same-buffer copy that goes via a scratch buffer
    np.testing.assert_array_equal(
        np.frombuffer(backend.read_buffer(arena, 0, NBYTES), np.float32), 4 * x + 3)
    backend.free_program(program)
    backend.free_buffer(arena)


def test_dispatch_in_workgroup_ranges_equals_the_whole_dispatch(backend):
    """WebGPU has no dispatch base: axpb's global invocation id, as a cut kernel's ids are,
    counts from a base read from a uniform (caps.base_in_uniform), and the ranges write what
    the whole dispatch writes, as on Vulkan."""
    kernel = axpb_kernel(backend.caps)
    assert backend.caps.base_in_uniform and "var<uniform> vkml_base" in kernel.wgsl
    axpb = backend.create_pipeline(kernel)
    check_workgroup_ranges(backend, axpb)
    backend.free_pipeline(axpb)


def test_a_command_buffer_encoded_ahead_reads_what_was_written_after_it(backend):
    # From its second submission on, a program's next command buffer is encoded right after
    # each submission: the data written before the next submit must still be what it reads.
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    stride = -(-NBYTES // 256) * 256
    arena = backend.create_buffer(3 * stride, "device", "arena")
    bindings = (Binding(arena, 0, NBYTES, False), Binding(arena, stride, NBYTES, False),
                Binding(arena, 2 * stride, NBYTES, True))
    program = backend.record([Dispatch(pipe, bindings, (-(-N // 64), 1, 1))], "axpb")
    rng = np.random.default_rng(7)
    for submission in range(4):
        x, b = (rng.standard_normal(N).astype(np.float32) for _ in range(2))
        backend.write_buffer(arena, 0, x.tobytes())
        backend.write_buffer(arena, stride, b.tobytes())
        backend.submit(program)
        assert (program.ahead is not None) == (submission >= 1)
        got = np.frombuffer(backend.read_buffer(arena, 2 * stride, NBYTES), np.float32)
        np.testing.assert_array_equal(got, 2 * x + b)  # one rounding: 2x is exact in f32
    backend.free_program(program)
    assert program.ahead is None
    with pytest.raises(DeviceError, match="was freed"):
        backend.submit(program)
    backend.free_buffer(arena)


def test_timestamps_time_each_dispatch(backend):
    if backend.timestamps is None:
        pytest.skip("this adapter has no timestamp queries")
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    arena = backend.create_buffer(3 * 4096, "device", "arena")
    bindings = (Binding(arena, 0, NBYTES, False), Binding(arena, 4096, NBYTES, False),
                Binding(arena, 8192, NBYTES, True))
    dispatch = Dispatch(pipe, bindings, (-(-N // 64), 1, 1))
    program = backend.timestamps.record([dispatch, Barrier(), dispatch, dispatch], "timed")
    backend.submit(program)
    ms = backend.timestamps.timings(program)
    assert len(ms) == 3 and all(0 <= t < 60_000 for t in ms), ms
    untimed = backend.record([dispatch], "untimed")
    with pytest.raises(DeviceError, match="not recorded with timestamps"):
        backend.timestamps.timings(untimed)
    backend.free_program(program)
    backend.free_program(untimed)
    backend.free_buffer(arena)


def test_partial_words_and_readback_buffers(backend):
    buf = backend.create_buffer(10, "device", "odd")
    backend.write_buffer(buf, 0, bytes(range(10)))
    backend.write_buffer(buf, 3, b"\xff\xfe")
    assert backend.read_buffer(buf, 1, 7) == bytes([1, 2, 0xFF, 0xFE, 5, 6, 7])
    readback = backend.create_buffer(16, "readback", "readback")
    backend.run_now([Copy(buf, 0, readback, 4, 8)])
    assert backend.read_buffer(readback, 5, 6) == bytes([1, 2, 0xFF, 0xFE, 5, 6])
    backend.run_now([Fill(readback, 8, 4)])  # zeros written by the device
    assert backend.read_buffer(readback, 4, 12) == bytes([0, 1, 2, 0xFF]) + bytes(8)
    for b in (buf, readback):
        backend.free_buffer(b)


def test_zeros_are_cleared_by_the_device(backend, monkeypatch):
    # write_buffers clears zero ranges in whole words on the device (one submission); data and
    # a zero range that is not in whole words go as bytes
    from vkml.hal import HostWrite
    buf = backend.create_buffer(400, "device", "zeros")
    backend.write_buffer(buf, 0, np.full(100, np.nan, np.float32).tobytes())
    sent = []
    monkeypatch.setattr(backend, "_write", lambda b, at, data, f=backend._write:
                        (sent.append((at, memoryview(data).nbytes)), f(b, at, data)))
    backend.write_buffers([HostWrite(buf, 0, 200), HostWrite.of(buf, 200, bytes(range(8))),
                           HostWrite(buf, 302, 5)])
    assert sent == [(200, 8), (302, 5)]
    got = np.frombuffer(backend.read_buffer(buf, 0, 400), np.uint8)
    assert (got[:200] == 0).all() and list(got[200:208]) == list(range(8))
    assert (got[302:307] == 0).all()
    assert np.isnan(np.frombuffer(got[208:300].tobytes(), np.float32)).all()
    backend.free_buffer(buf)


def test_bad_commands_raise_device_error_naming_the_problem(backend):
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    buf = backend.create_buffer(4096, "device", "arena")
    misaligned = (Binding(buf, 0, 64, False), Binding(buf, 128, 64, False),
                  Binding(buf, 256, 64, True))
    with pytest.raises(DeviceError, match="offset 128 is not a multiple of the storage offset "
                                          "alignment 256"):
        backend.record([Dispatch(pipe, misaligned, (1, 1, 1))], "bad")
    with pytest.raises(DeviceError, match="overlap"):
        backend.record([Copy(buf, 0, buf, 8, 16)], "bad")
    with pytest.raises(DeviceError, match="does not fit"):
        backend.write_buffer(buf, 4090, b"12345678")
    with pytest.raises(NagaError, match="(?s)naga rejected kernel 'broken'.*1 \\| fn main"):
        backend.create_pipeline(Kernel("broken", "fn main( {", (), (1, 1, 1), (1, 1, 1)))
    backend.free_buffer(buf)


def test_selector_that_matches_no_adapter_lists_the_adapters():
    with pytest.raises(DeviceError, match=r"(?s)'no such gpu'.*\[0\] "):
        WgpuBackend("no such gpu")


def test_device_picks_the_backend_by_argument_or_env(pair, monkeypatch):
    assert pair["wgpu"].backend_name == "wgpu" and "wgpu" in repr(pair["wgpu"])
    assert pair["vulkan"].backend_name == "vulkan" and "Vulkan" in repr(pair["vulkan"])
    monkeypatch.setenv("VKML_BACKEND", "metal")
    with pytest.raises(DeviceError, match="unknown backend 'metal'"):
        vkml.Device()


def test_auto_falls_back_to_wgpu_without_a_vulkan_driver():
    env = subprocess_env(VK_DRIVER_FILES="/nonexistent/icd.json",
                         VK_ICD_FILENAMES="/nonexistent/icd.json")
    env.pop("VKML_BACKEND", None)
    env.pop("VK_INSTANCE_LAYERS", None)  # the layer would report the missing driver
    code = "import vkml\nd = vkml.Device()\nprint(d.backend_name, repr(d))\nd.close()\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("wgpu <vkml.Device"), out.stdout + out.stderr


def test_profile_of_more_dispatches_than_one_query_set_holds(pair):
    """WebGPU caps a query set at 4096 queries (2048 timed dispatches): a longer step is
    timed with several (seen on the H200 with SmolLM2's 4691-dispatch training step)."""
    device = pair["wgpu"]
    if device.backend.timestamps is None:
        pytest.skip("this adapter has no timestamp queries")
    g = vkml.Graph()
    y = g.input("x", (4,))
    for _ in range(2100):
        y = g.add(y, 1.0)
    g.output("y", y)
    session = vkml.compile(g, device=device, rewrite="none")
    session.set_input("x", np.zeros(4, np.float32))
    profile = session.profile(steps=1)
    assert len(profile.dispatch_ms) == len(session.plan.dispatches) >= 2100
    np.testing.assert_array_equal(session.read("y"), np.full(4, 2100, np.float32))
    assert_quiet(pair)


@pytest.mark.parametrize("poll_s", [30.0, 1e-9])
def test_polled_wait(backend, poll_s, monkeypatch):
    """A wait polls for the queue to empty (GPUs; forced here) and sleeps in the driver once
    the polling time is up; either way the work is complete when it returns."""
    assert backend._poll_s == (0 if backend.caps.device_type == "cpu" else WAIT_POLL_S)
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    stride = -(-NBYTES // 256) * 256
    arena = backend.create_buffer(3 * stride, "device", "arena")
    x = np.arange(N, dtype=np.float32)
    backend.write_buffer(arena, 0, x.tobytes())
    backend.write_buffer(arena, stride, x.tobytes())
    bindings = (Binding(arena, 0, NBYTES, False), Binding(arena, stride, NBYTES, False),
                Binding(arena, 2 * stride, NBYTES, True))
    program = backend.record([Dispatch(pipe, bindings, (-(-N // 64), 1, 1))] * 1024, "polled")
    device_class = type(backend._device)
    blocking = []

    def counted_poll_wait(device):
        blocking.append(device)
        return sleeping(device)

    sleeping = device_class._poll_wait
    monkeypatch.setattr(device_class, "_poll_wait", counted_poll_wait)
    monkeypatch.setattr(backend, "_poll_s", poll_s)
    backend.submit(program)
    backend.wait()
    assert backend._queue_empty()
    assert (not blocking) == (poll_s > 1)
    got = np.frombuffer(backend.read_buffer(arena, 2 * stride, NBYTES), np.float32)
    np.testing.assert_array_equal(got, 3 * x)
    backend.free_program(program)
    backend.free_buffer(arena)
    backend.free_pipeline(pipe)
