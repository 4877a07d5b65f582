"""vkml.vk: the Vulkan backend on whatever device is here (lavapipe in CI).

Run with VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation so every test that makes a backend also
checks that the validation layer stayed silent.
"""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vkml.errors import DeviceError, NagaError
from vkml.hal import Barrier, Binding, Capabilities, Copy, Dispatch, Fill, HostWrite, Kernel
from vkml.kernels.common import Buf, assemble
from vkml.vk import VulkanBackend, memory_candidates, rank_devices, select_device
from vkml.vk.buffers import DEVICE_LOCAL, HOST_CACHED, HOST_COHERENT, HOST_VISIBLE

REPO = Path(__file__).resolve().parent.parent

N = 1000
NBYTES = N * 4
GROUPS = ((N + 63) // 64, 1, 1)


def axpb_kernel(caps: Capabilities) -> Kernel:
    """y = 2x + b over bindings x, b (read) and y (written), declared as `caps` allows."""
    return assemble("axpb", caps, [Buf("x"), Buf("b"), Buf("y", writable=True)], (64,),
                    ["fn main(@builtin(global_invocation_id) g: vec3<u32>) {",
                     "    if (g.x < arrayLength(&y)) {", "        y[g.x] = 2.0 * x[g.x] + b[g.x];",
                     "    }", "}"], GROUPS)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # Keep the pipeline cache (and naga's) out of the user's home.
    old = os.environ.get("VKML_CACHE_DIR")
    os.environ["VKML_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    with VulkanBackend() as b:
        yield b
    if old is None:
        del os.environ["VKML_CACHE_DIR"]
    else:
        os.environ["VKML_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def axpb(backend):
    return backend.create_pipeline(axpb_kernel(backend.caps))


def aligned(backend, n: int) -> int:
    a = backend.caps.min_storage_offset_alignment
    return (n + a - 1) // a * a


def floats(backend, buf, offset: int, n: int = N) -> np.ndarray:
    return np.frombuffer(backend.read_buffer(buf, offset, n * 4), dtype=np.float32)


def test_rank_devices_prefers_discrete_then_integrated_virtual_cpu():
    devices = [("llvmpipe", "cpu"), ("NVIDIA H200", "discrete"), ("Intel UHD", "integrated"),
               ("virtio-gpu", "virtual"), ("NVIDIA L4", "discrete")]
    assert rank_devices(devices) == [1, 4, 2, 3, 0]
    assert rank_devices([]) == []
    assert select_device(devices, None) == 1
    assert select_device(devices, "0") == 0
    assert select_device(devices, "nvidia") == 1
    assert select_device(devices, "  l4 ") == 4
    with pytest.raises(DeviceError, match=r"(?s)'radeon'.*\[3\] virtio-gpu \(virtual\)"):
        select_device(devices, "radeon")
    with pytest.raises(DeviceError, match="'9'"):
        select_device(devices, "9")
    with pytest.raises(DeviceError, match="mesa-vulkan-drivers"):
        select_device([], None)


def test_memory_candidates():
    mappable = HOST_VISIBLE | HOST_COHERENT
    # A discrete GPU without resizable BAR: a small mappable window of VRAM.
    types = [(DEVICE_LOCAL, 0), (mappable, 1), (mappable | HOST_CACHED, 1),
             (DEVICE_LOCAL | mappable, 2)]
    heaps = [80 << 30, 128 << 30, 256 << 20]
    assert memory_candidates(types, heaps, 0b1111, "device") == [0, 3]
    assert memory_candidates(types, heaps, 0b1111, "readback") == [2, 1, 3]
    assert memory_candidates(types, heaps, 0b1111, "upload") == [1, 2, 3]
    assert memory_candidates(types, heaps, 0b0110, "device") == []
    # With resizable BAR all of VRAM is mappable, so device buffers get mapped.
    rebar = [80 << 30, 128 << 30, 80 << 30]
    assert memory_candidates(types, rebar, 0b1111, "device") == [3, 0]
    # ... and inputs are staged there too, so a step copies them within VRAM.
    assert memory_candidates(types, rebar, 0b1111, "upload") == [3, 1, 2]
    assert memory_candidates(types, rebar, 0b1111, "readback") == [2, 1, 3]
    # lavapipe: one type that is everything.
    one = [(DEVICE_LOCAL | mappable | HOST_CACHED, 0)]
    for kind in ("device", "upload", "readback"):
        assert memory_candidates(one, [2 << 30], 1, kind) == [0]


@pytest.mark.parametrize("kind", ["device", "upload", "readback"])
@pytest.mark.parametrize("staged", [False, True])
def test_buffer_round_trip(backend, kind, staged):
    buf = backend.create_buffer(10, kind, f"rt-{kind}")
    assert buf.nbytes == 12 and buf.label == f"rt-{kind}"
    if staged:  # force the staging-copy path that discrete GPUs take
        buf.host_read = buf.host_write = False
    data = np.arange(3, dtype=np.float32) + 0.5
    backend.write_buffer(buf, 0, data.tobytes())
    backend.write_buffer(buf, 4, memoryview(np.float32([7.0])))
    assert backend.read_buffer(buf, 0, 12) == np.float32([0.5, 7.0, 2.5]).tobytes()
    assert backend.read_buffer(buf, 5, 3) == np.float32([7.0]).tobytes()[1:]
    assert backend.read_buffer(buf, 8, 0) == b""
    backend.write_buffer(buf, 0, np.float32([9.0]).tobytes())  # a read recorded before re-reads
    assert backend.read_buffer(buf, 0, 12) == np.float32([9.0, 7.0, 2.5]).tobytes()
    with pytest.raises(DeviceError, match="does not fit"):
        backend.write_buffer(buf, 8, b"12345")
    backend.free_buffer(buf)
    assert not any(key[0] == id(buf) for key in backend._readers)  # its read-backs went too
    assert backend.validation_messages == []


@pytest.mark.parametrize("staged, pieces", [(False, False), (False, True), (True, False)])
def test_many_writes_and_zeros_in_few_submissions(backend, staged, pieces, monkeypatch):
    from vkml.vk import backend as vk_backend
    monkeypatch.setattr(vk_backend, "STAGING_BATCH", 64)  # several batches from a few writes
    pools = []
    if pieces:  # mapped writes cut into 24-byte pieces (across writes' ends) on threads
        monkeypatch.setattr(vk_backend, "HOST_PIECE", 24)
        monkeypatch.setattr(vk_backend, "ThreadPoolExecutor", lambda n, f=vk_backend.
                            ThreadPoolExecutor: (pools.append(n), f(n))[1])
    bufs = [backend.create_buffer(400, "device", f"many-{i}") for i in range(2)]
    if staged:  # the staging-copy path of discrete GPUs
        for b in bufs:
            b.host_read = b.host_write = False
    expected = [np.full(100, np.nan, np.float32) for _ in bufs]
    for b, e in zip(bufs, expected):
        backend.write_buffer(b, 0, e.tobytes())  # garbage the zeros must overwrite
    writes, rng = [], np.random.default_rng(0)
    for at, n, zero in [(0, 10, False), (10, 30, True), (40, 20, False), (60, 40, True)]:
        for b, e in zip(bufs, expected):
            if zero:
                writes.append(HostWrite(b, 4 * at, 4 * n))
                e[at:at + n] = 0
            else:
                e[at:at + n] = rng.standard_normal(n)
                writes.append(HostWrite.of(b, 4 * at, e[at:at + n].tobytes()))
    submissions, staging = [], []
    monkeypatch.setattr(backend, "run_now", lambda cmds, f=backend.run_now: (
        submissions.append(len(cmds)), f(cmds))[1])
    monkeypatch.setattr(backend, "create_buffer", lambda n, kind, label, f=backend.create_buffer:
                        (staging.append(n), f(n, kind, label))[1])
    pools.clear()
    backend.write_buffers(writes)
    # one staging buffer for every batch, as large as the largest batch's data: the device
    # fills the zeros
    assert staging == ([80] if staged else []), staging
    for b, e in zip(bufs, expected):
        np.testing.assert_array_equal(floats(backend, b, 0, 100), e)
    if staged:  # 4 data writes of 40 or 80 bytes in batches of up to 64 bytes, 4 fills
        assert 1 < len(submissions) < len(writes), submissions
    else:
        assert submissions == []
    assert len(pools) == int(pieces), pools
    with pytest.raises(DeviceError, match="does not fit"):
        backend.write_buffers([HostWrite(bufs[0], 396, 8)])
    for b in bufs:
        backend.free_buffer(b)
    assert backend.validation_messages == []


@pytest.mark.parametrize("staged", [False, True])
def test_many_reads_in_few_submissions_keep_nothing(backend, staged, monkeypatch):
    from vkml.vk import backend as vk_backend
    monkeypatch.setattr(vk_backend, "STAGING_BATCH", 64)  # several batches from a few reads
    bufs = [backend.create_buffer(400, "device", f"reads-{i}") for i in range(2)]
    values = [np.arange(100, dtype=np.float32) + 1000 * i for i in range(2)]
    for b, v in zip(bufs, values):
        backend.write_buffer(b, 0, v.tobytes())
        if staged:  # the staging-copy path of discrete GPUs
            b.host_read = b.host_write = False
    reads = [(b, 4 * at, 4 * n) for at, n in [(0, 10), (10, 30), (40, 0), (60, 40)]
             for b in bufs]
    submissions, staging = [], []
    monkeypatch.setattr(backend, "run_now", lambda cmds, f=backend.run_now: (
        submissions.append(len(cmds)), f(cmds))[1])
    monkeypatch.setattr(backend, "create_buffer", lambda n, kind, label, f=backend.create_buffer:
                        (staging.append(n), f(n, kind, label))[1])
    before = backend.live_objects()
    got = backend.read_buffers(reads)
    assert got == [v[o // 4:(o + n) // 4].tobytes() for (_, o, n), v in zip(reads, values * 4)]
    assert backend.live_objects() == before  # no staging buffer or program kept
    if staged:  # 6 reads of 40, 120 or 160 bytes in batches of up to 64 bytes or one read
        assert len(submissions) == 6 and staging == [160], (submissions, staging)
    else:
        assert submissions == [] and staging == []
    with pytest.raises(DeviceError, match="does not fit"):
        backend.read_buffers([(bufs[0], 396, 8)])
    for b in bufs:
        backend.free_buffer(b)
    assert backend.validation_messages == []


def test_dispatch_at_offsets_inside_one_buffer(backend, axpb):
    ox = aligned(backend, 64)
    ob = aligned(backend, ox + NBYTES + 4)
    oy = aligned(backend, ob + NBYTES + 4)
    arena = backend.create_buffer(oy + NBYTES, "device", "arena")
    x = np.linspace(-1, 1, N, dtype=np.float32)
    b = np.arange(N, dtype=np.float32)
    backend.write_buffer(arena, ox, x)
    backend.write_buffer(arena, ob, b)
    prog = backend.record([Dispatch(axpb, (Binding(arena, ox, NBYTES, False),
                                           Binding(arena, ob, NBYTES, False),
                                           Binding(arena, oy, NBYTES, True)), GROUPS)], "axpb")
    backend.submit(prog)
    backend.wait()
    np.testing.assert_allclose(floats(backend, arena, oy), 2 * x + b, rtol=1e-6)
    backend.free_program(prog)
    backend.free_program(prog)
    assert backend.validation_messages == []


def test_same_program_resubmitted_without_rerecording(backend, axpb):
    x_buf = backend.create_buffer(NBYTES, "upload", "x")
    b_buf = backend.create_buffer(NBYTES, "device", "b")
    y_buf = backend.create_buffer(NBYTES, "readback", "y")
    b = np.full(N, 3.0, dtype=np.float32)
    backend.write_buffer(b_buf, 0, b)
    prog = backend.record([Dispatch(axpb, (Binding(x_buf, 0, NBYTES, False),
                                           Binding(b_buf, 0, NBYTES, False),
                                           Binding(y_buf, 0, NBYTES, True)), GROUPS)], "resubmit")
    for step in range(3):
        x = np.arange(N, dtype=np.float32) * (step + 1)
        backend.write_buffer(x_buf, 0, x)
        backend.submit(prog)
        backend.wait()
        np.testing.assert_array_equal(floats(backend, y_buf, 0), 2 * x + b)
    # Back-to-back submits of one program: the second waits for the first.
    backend.submit(prog)
    backend.submit(prog)
    backend.wait()
    np.testing.assert_array_equal(floats(backend, y_buf, 0), 2 * x + b)
    backend.free_program(prog)
    assert backend.validation_messages == []


def test_dispatch_in_workgroup_ranges_equals_the_whole_dispatch(backend, axpb):
    check_workgroup_ranges(backend, axpb)


def check_workgroup_ranges(backend, axpb) -> None:
    """Three dispatches of consecutive workgroup ranges (a base workgroup each: Vulkan's
    vkCmdDispatchBase, a uniform on wgpu) write what one dispatch of the whole grid writes; a
    pipeline whose kernel's workgroups are not declared independent, or a range past the
    device's limit, is refused before the driver sees it. Shared with tests/test_wgpu_backend.py."""
    assert backend.caps.dispatch_base and axpb.dispatch_base
    stride = aligned(backend, NBYTES)
    buf = backend.create_buffer(4 * stride, "device", "ranges")
    x = np.linspace(-3, 3, N, dtype=np.float32)
    backend.write_buffer(buf, 0, x)
    backend.write_buffer(buf, stride, x ** 2)
    inputs = (Binding(buf, 0, NBYTES, False), Binding(buf, stride, NBYTES, False))
    whole, cut = (Binding(buf, k * stride, NBYTES, True) for k in (2, 3))
    n = GROUPS[0]
    ranges = [(0, 5), (5, 11), (11, n)]
    prog = backend.record([Dispatch(axpb, (*inputs, whole), GROUPS),
                           *[Dispatch(axpb, (*inputs, cut), (b - a, 1, 1), (a, 0, 0))
                             for a, b in ranges]], "ranges")
    backend.submit(prog)
    backend.wait()
    got = floats(backend, buf, 3 * stride)
    np.testing.assert_array_equal(got, floats(backend, buf, 2 * stride))
    np.testing.assert_allclose(got, 2 * x + x ** 2, rtol=1e-6)
    backend.free_program(prog)
    # the kernel as a backend without dispatch bases would have it (no base in a uniform)
    kernel = axpb_kernel(replace(backend.caps, base_in_uniform=False))
    tied = backend.create_pipeline(Kernel(kernel.name, kernel.wgsl, kernel.access,
                                          kernel.workgroup_size, kernel.groups))
    assert not tied.dispatch_base
    with pytest.raises(DeviceError, match="made without a base"):
        backend.record([Dispatch(tied, (*inputs, cut), (1, 1, 1), (3, 0, 0))], "tied")
    limit = backend.caps.max_workgroup_count[0]
    with pytest.raises(DeviceError, match="exceed the device's workgroup count limits"):
        backend.record([Dispatch(axpb, (*inputs, cut), (2, 1, 1), (limit - 1, 0, 0))], "far")
    backend.free_pipeline(tied)
    backend.free_buffer(buf)
    assert backend.validation_messages == []


def test_copy_barrier_dispatch_chain(backend, axpb):
    staging = backend.create_buffer(2 * NBYTES, "upload", "staging")
    dev = backend.create_buffer(3 * NBYTES, "device", "dev")
    out = backend.create_buffer(NBYTES, "readback", "out")
    x = np.linspace(0, 1, N, dtype=np.float32)
    b = np.float32(-1) * np.arange(N, dtype=np.float32)
    backend.write_buffer(staging, 0, np.concatenate([x, b]))
    prog = backend.record([
        Copy(staging, 0, dev, 0, 2 * NBYTES),
        Barrier(),
        Dispatch(axpb, (Binding(dev, 0, NBYTES, False), Binding(dev, NBYTES, NBYTES, False),
                        Binding(dev, 2 * NBYTES, NBYTES, True)), GROUPS),
        Barrier(),
        Copy(dev, 2 * NBYTES, out, 0, NBYTES),
    ], "chain")
    backend.submit(prog)
    backend.wait()
    np.testing.assert_allclose(floats(backend, out, 0), 2 * x + b, rtol=1e-6)
    backend.free_program(prog)
    assert backend.validation_messages == []


def test_timestamps_one_per_dispatch(backend, axpb):
    buf = backend.create_buffer(3 * NBYTES, "device", "ts")
    bindings = (Binding(buf, 0, NBYTES, False), Binding(buf, NBYTES, NBYTES, False),
                Binding(buf, 2 * NBYTES, NBYTES, True))
    cmds = [Dispatch(axpb, bindings, GROUPS), Barrier(), Dispatch(axpb, bindings, GROUPS)]
    if backend.timestamps is None:
        assert backend.caps.timestamp_period_ns == 0
        return
    prog = backend.timestamps.record(cmds, "timed")
    with pytest.raises(DeviceError, match="not been submitted"):
        backend.timestamps.timings(prog)
    backend.submit(prog)
    backend.wait()
    times = backend.timestamps.timings(prog)
    assert len(times) == 2 and all(t >= 0 for t in times)
    backend.free_program(prog)
    assert backend.validation_messages == []


@pytest.mark.parametrize("threads", [1, 4])
def test_pipelines_made_together_in_order_and_none_left_by_a_failure(backend, threads,
                                                                     monkeypatch):
    monkeypatch.setattr(backend, "pipeline_threads", threads)
    good = [axpb_kernel(backend.caps) for _ in range(3)]
    before = backend.live_objects()["pipelines"]
    made = backend.create_pipelines(good)
    assert [p.name for p in made] == ["axpb"] * 3 and len(set(map(id, made))) == 3
    assert backend.live_objects()["pipelines"] == before + 3
    for p in made:
        backend.free_pipeline(p)
    broken = Kernel("broken", "fn main( {", (), (1, 1, 1), (1, 1, 1))
    with pytest.raises(NagaError, match="naga rejected kernel 'broken'"):
        backend.create_pipelines([good[0], broken, good[1], good[2]])
    assert backend.live_objects()["pipelines"] == before


def test_compile_threads_from_the_environment(monkeypatch):
    from vkml.errors import InputError
    from vkml.threads import compile_threads
    monkeypatch.delenv("VKML_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert compile_threads() == 6 and compile_threads(host_shares_device=True) == 5
    monkeypatch.setenv("VKML_COMPILE_THREADS", "3")
    with VulkanBackend() as b:
        assert b.pipeline_threads == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("VKML_COMPILE_THREADS", bad)
        with pytest.raises(InputError, match=f"VKML_COMPILE_THREADS={bad!r}: give a whole"):
            VulkanBackend()


def test_zeros_are_filled_by_the_device(backend, monkeypatch):
    # a discrete GPU's buffer: zeros need no staging buffer (a zero write that is not in whole
    # 4-byte words goes through one as data)
    buf = backend.create_buffer(400, "device", "zeros")
    backend.write_buffer(buf, 0, np.full(100, np.nan, np.float32).tobytes())
    buf.host_read = buf.host_write = False
    staging = []
    monkeypatch.setattr(backend, "create_buffer", lambda n, kind, label, f=backend.create_buffer:
                        (staging.append(n), f(n, kind, label))[1])
    backend.write_buffers([HostWrite(buf, 0, 200), HostWrite(buf, 300, 100)])
    assert staging == []
    backend.write_buffers([HostWrite(buf, 202, 5)])
    assert staging == [5]
    got = np.frombuffer(backend.read_buffer(buf, 0, 400), np.float32)
    assert (got[:50] == 0).all() and (got[75:] == 0).all() and np.isnan(got[52:75]).all()
    nan = np.float32(np.nan).tobytes()
    assert backend.read_buffer(buf, 200, 8) == nan[:2] + bytes(5) + nan[3:]
    with pytest.raises(DeviceError, match="offset 2 and size 8 must be multiples of 4 bytes"):
        backend.record([Fill(buf, 2, 8)], "misaligned fill")
    backend.free_buffer(buf)
    assert backend.validation_messages == []


def test_zeros_into_uncached_mapped_memory_are_filled_by_the_device(backend, monkeypatch):
    # VRAM mapped through a resizable BAR (host_write, not host_read): data is written in
    # place, zeros are filled by the device instead of crossing the bus from the CPU
    buf = backend.create_buffer(400, "device", "rebar")
    assert buf.host_write  # lavapipe's device memory is mapped
    backend.write_buffer(buf, 0, np.full(100, np.nan, np.float32).tobytes())
    buf.host_read = False
    fills = []
    monkeypatch.setattr(backend, "run_now", lambda commands, f=backend.run_now:
                        (fills.extend(c for c in commands if isinstance(c, Fill)), f(commands)))
    backend.write_buffers([HostWrite(buf, 0, 200), HostWrite.of(buf, 200, bytes(range(8)))])
    assert [(f.offset, f.nbytes) for f in fills] == [(0, 200)]
    buf.host_read = True
    got = np.frombuffer(backend.read_buffer(buf, 0, 400), np.uint8)
    assert (got[:200] == 0).all() and list(got[200:208]) == list(range(8))
    assert np.isnan(np.frombuffer(got[208:].tobytes(), np.float32)).all()
    backend.write_buffers([HostWrite(buf, 300, 100)])  # host memory: the CPU writes the zeros
    assert len(fills) == 1 and (np.frombuffer(backend.read_buffer(buf, 300, 100), np.uint8)
                                == 0).all()
    backend.free_buffer(buf)
    assert backend.validation_messages == []


def test_bad_bindings_are_refused(backend, axpb):
    buf = backend.create_buffer(3 * NBYTES, "device", "bad")
    align = backend.caps.min_storage_offset_alignment
    good = Binding(buf, 0, NBYTES, False)
    with pytest.raises(DeviceError, match="storage offset alignment"):
        backend.record([Dispatch(axpb, (good, good, Binding(buf, align // 2, 8, True)), GROUPS)],
                       "misaligned")
    with pytest.raises(DeviceError, match="2 bindings for a kernel with 3"):
        backend.record([Dispatch(axpb, (good, good), GROUPS)], "short")
    with pytest.raises(DeviceError, match="do not fit"):
        backend.record([Copy(buf, 0, buf, 2 * NBYTES, 2 * NBYTES)], "overflow")
    assert backend.validation_messages == []


def axpb_program(backend, label: str, dispatches: int = 1):
    """x and b = x in one buffer, y = 2x + b after them, and a program of `dispatches` of it."""
    pipe = backend.create_pipeline(axpb_kernel(backend.caps))
    buf = backend.create_buffer(3 * NBYTES, "device", label)
    x = np.arange(N, dtype=np.float32)
    backend.write_buffer(buf, 0, np.concatenate([x, x]))
    bindings = (Binding(buf, 0, NBYTES, False), Binding(buf, NBYTES, NBYTES, False),
                Binding(buf, 2 * NBYTES, NBYTES, True))
    return buf, x, backend.record([Dispatch(pipe, bindings, GROUPS)] * dispatches, label)


def test_fence_path_without_timeline_semaphores():
    with VulkanBackend(timeline_semaphores=False) as backend:
        buf, x, prog = axpb_program(backend, "fence")
        backend.submit(prog)
        backend.submit(prog)
        backend.wait()
        np.testing.assert_array_equal(floats(backend, buf, 2 * NBYTES), 3 * x)
        assert backend.validation_messages == []


class CountingLib:
    """The backend's Vulkan functions, counting the calls that block in the driver."""

    def __init__(self, lib) -> None:
        self.lib, self.blocking = lib, 0

    def __getattr__(self, name):
        if name in ("vkWaitSemaphores", "vkWaitForFences"):
            self.blocking += 1
        return getattr(self.lib, name)


def test_cpu_drivers_never_poll(backend):
    if backend.caps.device_type == "cpu":
        assert backend._poll_s == 0
    else:
        assert backend._poll_s > 0


@pytest.mark.parametrize("timeline", [True, False])
@pytest.mark.parametrize("poll_s", [30.0, 1e-9])
def test_polled_wait(timeline, poll_s):
    """A wait polls for completion (GPUs; forced here), and sleeps in the driver once the
    polling time is up; either way the work is complete when it returns."""
    with VulkanBackend(timeline_semaphores=timeline) as backend:
        backend._poll_s = poll_s
        buf, x, prog = axpb_program(backend, "polled", dispatches=64)
        backend._lib = counting = CountingLib(backend._lib)
        try:
            backend.submit(prog)
            backend.wait()
        finally:
            backend._lib = counting.lib
        assert (counting.blocking == 0) == (poll_s > 1)
        np.testing.assert_array_equal(floats(backend, buf, 2 * NBYTES), 3 * x)
        assert backend.validation_messages == []


def test_bad_selector_lists_devices(monkeypatch):
    monkeypatch.setenv("VKML_DEVICE", "no-such-gpu-anywhere")
    with pytest.raises(DeviceError, match=r"(?s)'no-such-gpu-anywhere'.*\[0\] .*\((cpu|discrete|"
                                          r"integrated|virtual|other)\)"):
        VulkanBackend()
    with pytest.raises(DeviceError, match="'99'"):
        VulkanBackend("99")


# Prints the DeviceError that constructing a backend raises, and exits 3.
_CONSTRUCT = """
from vkml.errors import DeviceError
from vkml.vk import compile_wgsl
from vkml.vk import VulkanBackend
try:
    VulkanBackend()
except DeviceError as exc:
    print(exc)
    raise SystemExit(3)
"""


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, **env}, timeout=60)


def test_zero_devices_explains_how_to_install_a_driver():
    done = _run_python(_CONSTRUCT, VK_DRIVER_FILES="/nonexistent.json",
                       VK_ICD_FILENAMES="/nonexistent.json")
    assert done.returncode == 3, done.stderr
    for hint in ("mesa-vulkan-drivers", "VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        assert hint in done.stdout


def test_import_needs_no_loader_and_a_missing_loader_is_explained():
    # A None entry in sys.modules makes `import vulkan` raise ImportError, as with no libvulkan.
    done = _run_python("import sys\nsys.modules['vulkan'] = None\n" + _CONSTRUCT)
    assert done.returncode == 3, done.stderr
    assert "libvulkan.so.1" in done.stdout and "apt-get install libvulkan1" in done.stdout


def _reversed_through_workgroup_memory(backend, kernel, inputs=()) -> None:
    """Run `kernel` (one workgroup of 64; `inputs`: (buffer, bytes) bound before `out`) and
    check `out` holds (63 - i) * 2, as both kernels below compute it."""
    pipe = backend.create_pipeline(kernel)
    out = backend.create_buffer(64 * 4, "readback", "out")
    bindings = (*[Binding(b, 0, n, False) for b, n in inputs], Binding(out, 0, 64 * 4, True))
    prog = backend.record([Dispatch(pipe, bindings, (1, 1, 1))], kernel.name)
    backend.submit(prog)
    backend.wait()
    np.testing.assert_array_equal(floats(backend, out, 0, 64), (63 - np.arange(64)) * 2.0)
    backend.free_program(prog)
    backend.free_buffer(out)
    assert backend.validation_messages == []


def _instructions(code: bytes, opcode: int) -> list[int]:
    """The first operand of each instruction `opcode` of a SPIR-V module."""
    from vkml.vk.spirv import instructions, words
    found = words(code)
    return [found[at + 1] for op, at, _ in instructions(found) if op == opcode]


def test_workgroup_zeroing_is_dropped_and_the_kernel_still_runs(backend, monkeypatch):
    # naga zero-initialises workgroup memory with stores of null constants from one invocation;
    # vkml.vk.spirv drops exactly those (every vkml kernel writes its workgroup memory before
    # reading it) and keeps the rest: a kernel passing values through workgroup memory still
    # computes its result (the validation layer checks the module too)
    from vkml.vk import compile_wgsl, pipelines
    from vkml.vk.spirv import prepare

    entry = ["fn main(@builtin(local_invocation_index) lid: u32) {",
             "  tile[lid] = f32(lid) * 2.0;", "  workgroupBarrier();",
             "  out[lid] = tile[63u - lid];", "}"]
    kernel = assemble("reverse", backend.caps, [Buf("out", writable=True)], (64,), entry,
                      (1, 1, 1), prelude=["var<workgroup> tile: array<f32, 64>;"])
    spirv = compile_wgsl(kernel.wgsl, kernel.name)
    lean = prepare(spirv)
    # the one null store, into `tile`
    assert len(_instructions(spirv, 62)) - len(_instructions(lean, 62)) == 1
    assert prepare(lean) == lean
    given: list[bytes] = []
    monkeypatch.setattr(pipelines, "prepare", lambda code: given.append(code) or prepare(code))
    _reversed_through_workgroup_memory(backend, kernel)
    assert given == [spirv]  # the pass runs on what naga wrote, before the driver sees it


def test_f16_kernels_declare_only_the_16bit_capabilities_they_use(backend):
    # naga gives a module that uses f16 anywhere every 16-bit storage capability; the device
    # enables shaderFloat16 and storageBuffer16BitAccess only, so the validation layer refused
    # the cooperative GEMM (f16 in workgroup memory) and any f16 storage binding until
    # vkml.vk.spirv dropped UniformAndStorageBuffer16BitAccess and StorageInputOutput16
    from vkml.vk import compile_wgsl
    from vkml.vk.spirv import prepare
    if not backend.caps.shader_f16:
        pytest.skip("the device has no f16")
    entry = ["fn main(@builtin(local_invocation_index) lid: u32) {",
             "  tile[lid] = h[lid / 4u][lid % 4u] * 2.0h;", "  workgroupBarrier();",
             "  out[lid] = f32(tile[63u - lid]);", "}"]
    kernel = assemble("halves", backend.caps, [Buf("h", "vec4<f16>"), Buf("out", writable=True)],
                      (64,), entry, (1, 1, 1),
                      prelude=["enable f16;", "var<workgroup> tile: array<f16, 64>;"])
    spirv = compile_wgsl(kernel.wgsl, kernel.name)
    lean = prepare(spirv)
    capabilities = {code: set(_instructions(code, 17)) for code in (spirv, lean)}
    assert capabilities[spirv] - capabilities[lean] == {4434, 4436}  # uniform, input/output
    assert {9, 4433} <= capabilities[lean]  # Float16, StorageBuffer16BitAccess
    assert prepare(lean) == lean
    h = backend.create_buffer(64 * 2, "upload", "h")
    backend.write_buffer(h, 0, np.arange(64, dtype=np.float16).tobytes())
    _reversed_through_workgroup_memory(backend, kernel, [(h, 64 * 2)])
    backend.free_buffer(h)
