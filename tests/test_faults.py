"""Faults injected on purpose: each must end in a clear error or a warning and a correct result,
never a crash, a silently wrong answer, a leak or lost data (the README's "What vkml
guarantees").

- corrupted cache entries (cut short, bits flipped, a constant changed in valid SPIR-V): each
  dropped, reported once by name, compiled again; the loss equals the clean run's exactly;
- a plan larger than the device's memory: refused before anything is allocated, naming the
  sizes (lavapipe reports a 2 GiB heap and would hand out more);
- out of device memory (or any other failure) at any point of binding a compiled plan: the
  error is raised and everything made before it is freed, so a smaller model compiles next;
- Ctrl-C (SIGINT) at random moments of a step loop and the moment a vkQueueSubmit returns, in
  a process of its own under the validation layer: every step is submitted whole or not at
  all, the layer stays silent, and the session goes on stepping;
- SIGKILL while a checkpoint is saved: the file is the old one or the new one, never half.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import live_objects, subprocess_env

import vkml
from vkml import nn
from vkml.cachedir import ENTRY_MAGIC, CorruptCacheWarning, read_entry, write_entry
from vkml.compiler import memory_plan
from vkml.errors import DeviceError
from vkml.interrupts import deferred_interrupts
from vkml.vk import naga

HEADER = len(ENTRY_MAGIC) + hashlib.sha256().digest_size  # an entry's, before its contents


# ---- corrupted caches ------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache directory of this test's own, holding nothing but naga's compiled wasm module
    where the usual cache directory has it intact (it takes seconds to compile), and a naga
    compiler that reads it."""
    warm = naga._compiler()._module_path()
    module = read_entry(warm)
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path))
    naga._reset_for_tests()
    if module is not None:
        write_entry(naga._compiler()._module_path(), module, tmp_path)
    yield tmp_path
    naga._reset_for_tests()


def train_in_a_fresh_process_state() -> float:
    """Two SGD steps of a model with shapes no shipped kernel has (so naga translates), on a
    device of its own (so its pipeline cache is read and written), with naga's in-memory caches
    forgotten: everything comes from the cache directory or is compiled again. The loss after
    them, which depends on every kernel's SPIR-V."""
    naga._reset_for_tests()
    device = vkml.Device(backend="vulkan")
    try:
        g = vkml.Graph(seed=0)
        x, y = g.input("x", (4, 5)), g.input("y", (4, 3))
        loss = g.mse(nn.Linear(g, "fc", 5, 3)(nn.Linear(g, "fc0", 5, 5)(x).tanh()), y)
        session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=device)
        rng = np.random.default_rng(0)
        session.set_input("x", rng.standard_normal((4, 5)).astype(np.float32))
        session.set_input("y", rng.standard_normal((4, 3)).astype(np.float32))
        session.step()
        session.step()
        value = float(session.read("loss"))
        assert device.backend.validation_messages == []
        session.close()
    finally:
        device.close()  # writes the pipeline cache
    for thread in threading.enumerate():  # the plan cache's writer
        if thread.name == "vkml-plan-cache":
            thread.join()
    return value


def kind_of(cache: Path, path: Path) -> str:
    parts = path.relative_to(cache).parts
    return parts[0] if len(parts) > 1 else path.name.split("-")[0]


def entries(cache: Path) -> dict[str, list[Path]]:
    """The cache's files by kind: plans, spirv, wasm, pipelines."""
    found: dict[str, list[Path]] = {}
    for path in sorted(cache.rglob("*")):
        if path.is_file() and not path.name.endswith(".tmp"):
            found.setdefault(kind_of(cache, path), []).append(path)
    return found


def rerun_reporting(files: list[Path]) -> float:
    """train_in_a_fresh_process_state() with `files` damaged: the loss, after checking that each
    file was reported once, by name, and nothing else was, and that each was written again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = train_in_a_fresh_process_state()
    reported = [str(w.message) for w in caught if w.category is CorruptCacheWarning]
    for path in files:
        assert sum(str(path) in m for m in reported) == 1, (path, reported)
    assert len(reported) == len(files), reported
    for path in files:  # written again, intact: the next process finds them
        assert read_entry(path) is not None, path
    return loss


def cut_in_half(data: bytes, rng: np.random.Generator) -> bytes:
    return data[: len(data) // 2]


def flip_bits(data: bytes, rng: np.random.Generator) -> bytes:
    """Eight bits flipped in the entry's contents (behind the header)."""
    out = bytearray(data)
    for pos in rng.integers(HEADER, len(data), 8):
        out[pos] ^= 1 << int(rng.integers(8))
    return bytes(out)


# Every file cut in half, naga's compiled module included (compiled again: seconds); bits
# flipped in every file but that one.
CORRUPTIONS = {"cut_in_half": (cut_in_half, {"plans", "spirv", "wasm", "pipelines"}),
               "bits_flipped": (flip_bits, {"plans", "spirv", "pipelines"})}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_damaged_cache_entry_is_dropped_reported_and_compiled_again(cache, corruption):
    corrupt, kinds = CORRUPTIONS[corruption]
    clean = train_in_a_fresh_process_state()
    found = entries(cache)
    assert set(found) == {"plans", "spirv", "wasm", "pipelines"}, found
    rng = np.random.default_rng(0)
    files = [path for kind in sorted(kinds) for path in found[kind]]
    for path in files:
        path.write_bytes(corrupt(path.read_bytes(), rng))
    assert rerun_reporting(files) == clean


def float_constants_changed(spirv: bytes) -> bytes:
    """`spirv` with every 32-bit float OpConstant doubled plus one: still valid SPIR-V."""
    words = np.frombuffer(spirv, np.uint32).copy()
    float32_types, at = set(), 5  # after the module's header
    while at < len(words):
        count, opcode = int(words[at]) >> 16, int(words[at]) & 0xFFFF
        if opcode == 22 and words[at + 2] == 32:  # OpTypeFloat %result 32
            float32_types.add(int(words[at + 1]))
        elif opcode == 43 and count == 4 and int(words[at + 1]) in float32_types:  # OpConstant
            value = words[at + 3:at + 4].view(np.float32)
            words[at + 3:at + 4] = (value * 2 + 1).view(np.uint32)
        at += count
    return words.tobytes()


def test_a_valid_but_changed_spirv_entry_is_not_used(cache):
    clean = train_in_a_fresh_process_state()
    changed = {}
    for path in entries(cache)["spirv"]:
        spirv = read_entry(path)
        if float_constants_changed(spirv) != spirv:  # a module with float constants
            changed[path] = float_constants_changed(spirv)
    assert changed
    for path, spirv in changed.items():  # as an edit in place leaves them: the old digest
        path.write_bytes(path.read_bytes()[:HEADER] + spirv)
    assert rerun_reporting(list(changed)) == clean
    # The control: the same SPIR-V with digests to match is used, and the loss differs.
    for path, spirv in changed.items():
        write_entry(path, spirv, cache)
    assert train_in_a_fresh_process_state() != clean


# ---- out of memory ---------------------------------------------------------------------------
def larger_than(nbytes: int, caps: vkml.Capabilities) -> vkml.Graph:
    """An inference graph of more than `nbytes`: parameters as large as a binding may be (no
    host memory is touched: numpy's zeros are allocated lazily), each doubled into an output."""
    g = vkml.Graph(seed=0)
    size = min(caps.max_storage_buffer_range, 1 << 30) // 4
    for i in range(nbytes // (8 * size) + 1):
        g.output(f"out{i}", g.param(f"p{i}", (size,), "zeros") * 2.0)
    return g


def test_a_plan_larger_than_the_device_memory_is_refused_before_allocating(monkeypatch):
    device = vkml.Device(backend="vulkan")
    try:
        backend = device.backend
        memory = backend.device_memory()
        baseline = backend.live_objects()
        with pytest.raises(DeviceError) as refused:
            vkml.compile(larger_than(memory.size, device.caps), device=device)
        message = str(refused.value)
        assert f"heap {memory.heap} holds {memory.size / 2**30:.2f} GiB" in message
        assert "smaller model or batch" in message
        assert backend.live_objects() == baseline
        # Where the driver reports a budget, that is the limit (as VK_EXT_memory_budget says).
        half = dataclasses.replace(memory, available=memory.size // 2)
        monkeypatch.setattr(backend, "device_memory", lambda: half)
        with pytest.raises(DeviceError, match="VK_EXT_memory_budget"):
            vkml.compile(larger_than(memory.size // 2, device.caps), device=device)
        assert backend.live_objects() == baseline
        monkeypatch.undo()
        small = small_training_session(device, 5)  # and a model that fits compiles
        assert backend.live_objects() != baseline
        small.close()
        assert backend.live_objects() == baseline
        assert backend.validation_messages == []
    finally:
        device.close()


def test_a_tensor_larger_than_a_binding_is_refused_naming_it(device):
    # The message named "tensor slot 0" alone; nothing is allocated either way.
    limit = device.caps.max_storage_buffer_range
    g = vkml.Graph()
    x = g.input("x", (limit // 4 + 1,))
    g.output("y", x * 2.0)
    baseline = live_objects(device)
    with pytest.raises(vkml.GraphError, match=rf"tensor 'x' f32\[{limit // 4 + 1}\] takes "
                                              rf"{4 * (limit // 4 + 1)} bytes, more than the "
                                              rf"largest storage buffer .* binds \({limit} "
                                              r"bytes\): use a smaller batch"):
        vkml.compile(g, device=device)
    assert live_objects(device) == baseline


# ---- failures while binding a plan -----------------------------------------------------------
# What binding makes on the device, one object per call.
MAKERS = ("create_buffer", "create_pipeline", "record")


def small_training_session(device: vkml.Device, width: int) -> vkml.Session:
    g = vkml.Graph(seed=0)
    x, y = g.input("x", (2, width)), g.input("y", (2, 3))
    loss = g.mse(nn.Linear(g, "fc", width, 3)(x).relu(), y)
    return vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.1), device=device)


def test_a_failure_at_any_point_of_binding_frees_everything_made_before_it(device, monkeypatch):
    """Each call that makes a device object (a buffer, a pipeline, a program) fails in turn, as
    an out-of-memory would: the compile raises it, and what it had made is gone."""
    # Arenas of at most 1 KiB, so that the plan has several (models have several of 1 GiB),
    # and no plan cache to keep such a plan.
    monkeypatch.setattr(memory_plan, "ARENA_LIMIT", 1024)
    monkeypatch.setenv("VKML_PLAN_CACHE", "0")
    backend = device.backend
    baseline = live_objects(device)
    calls: list[str] = []
    fail_at: list[int] = []  # the number of the call that fails, if any
    lock = threading.Lock()  # pipelines may be made in several threads

    def injected(name: str, make: Callable) -> Callable:
        def call(*args, **kwargs):
            with lock:
                calls.append(name)
                failing = fail_at and len(calls) == fail_at[0]
            if failing:
                raise DeviceError(f"out of memory (injected, call {len(calls)}: {name})")
            return make(*args, **kwargs)
        return call

    for name in MAKERS:
        monkeypatch.setattr(backend, name, injected(name, getattr(backend, name)))
    session = small_training_session(device, 7)
    assert len(session.plan.memory.arena_bytes) > 1
    session.close()
    made = list(calls)
    assert set(made) == set(MAKERS), made
    for n in range(1, len(made) + 1):
        calls.clear()
        fail_at[:] = [n]
        with pytest.raises(DeviceError, match=f"injected, call {n}:"):
            small_training_session(device, 7)
        assert backend.live_objects() == baseline, (n, made[n - 1])
    fail_at.clear()
    session = small_training_session(device, 5)  # and the device is as good as new
    session.set_input("x", np.ones((2, 5), np.float32))
    session.set_input("y", np.ones((2, 3), np.float32))
    session.step()
    assert np.isfinite(session.read("loss"))
    session.close()
    assert backend.live_objects() == baseline


# ---- Ctrl-C in a step loop -------------------------------------------------------------------
# p starts at 0 and each SGD update lowers it by lr * x = 1, so -p counts the updates applied.
# Each trial steps (whole, or in 3 pieces) until a SIGINT stops it: sent after a random delay,
# or (the injected trials) sent the moment the k-th vkQueueSubmit returns, the worst moment,
# which random delays hit only now and then. Then 10 more steps. At the end, a buffer of size
# 0 (VUID-VkBufferCreateInfo-size-00912) shows that the validation layer was on and reporting.
STEP_LOOP_INTERRUPTED = """
import json, os, random, signal, sys, threading, time
import numpy as np
import vkml

device = vkml.Device(backend="vulkan")
g = vkml.Graph(seed=0)
x = g.input("x", (1, 8))
loss = g.sum(g.param("p", (1, 8), "zeros") * x)
session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=1.0), device=device)
session.set_input("x", np.ones((1, 8), np.float32))
updates = lambda: -int(session.read("p")[0, 0])


class InterruptAfterSubmit:  # the backend's Vulkan functions; SIGINT as a submit returns
    def __init__(self, lib):
        self.lib, self.countdown = lib, 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def vkQueueSubmit(self, *args):
        result = self.lib.vkQueueSubmit(*args)
        self.countdown -= 1
        if self.countdown == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return result


injected = device.backend._lib = InterruptAfterSubmit(device.backend._lib)
rng = random.Random(0)
trials, seconds = int(sys.argv[1]), float(sys.argv[2])
results, start = [], time.perf_counter()
while len(results) < trials and time.perf_counter() - start < seconds:
    chunks, at = rng.choice([None, 3]), len(results) % 2 and rng.randint(1, 7)
    before, calls = updates(), 0
    timer = threading.Timer(rng.uniform(0, 0.01), os.kill, (os.getpid(), signal.SIGINT))
    try:
        if at:
            injected.countdown = at
        else:
            timer.start()
        while True:
            session.step(chunks=chunks)
            calls += 1
    except KeyboardInterrupt:
        pass
    if not at:
        timer.join()
    session.wait()
    results.append((chunks, at, calls, updates() - before, session.pieces_left))
before = updates()
for _ in range(10):
    session.step(chunks=3)
tail = updates() - before
messages = list(device.backend.validation_messages)
dev = device.backend._dev
info = dev.ffi.new("VkBufferCreateInfo*", {
    "sType": dev.vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, "size": 0,
    "usage": dev.vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
    "sharingMode": dev.vk.VK_SHARING_MODE_EXCLUSIVE})
out = dev.ffi.new("VkBuffer*")
if dev.lib.vkCreateBuffer(dev.device, info, dev.ffi.NULL, out) == 0:
    dev.lib.vkDestroyBuffer(dev.device, out[0], dev.ffi.NULL)
control = list(device.backend.validation_messages[len(messages):])
print(json.dumps({"results": results, "tail": tail, "messages": messages,
                  "control": control}))
"""


def test_ctrl_c_in_a_step_loop_leaves_every_step_whole_and_vulkan_valid():
    env = subprocess_env(VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation")
    proc = subprocess.run([sys.executable, "-c", STEP_LOOP_INTERRUPTED, "300", "6"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert any("VUID-VkBufferCreateInfo-size-00912" in m for m in report["control"]), (
        "the validation layer was not on", report["control"])
    assert report["messages"] == []
    results = report["results"]
    assert len(results) >= 20, results
    for chunks, at, calls, applied, pieces_left in results:
        # The interrupted call's step went whole or not at all; nothing was left half-way.
        assert applied in (calls, calls + 1) and pieces_left == 0, (chunks, at, calls, applied)
    assert {(chunks, bool(at)) for chunks, at, *_ in results} == {
        (None, False), (None, True), (3, False), (3, True)}
    assert report["tail"] == 10


def test_a_sigint_in_nested_deferred_blocks_is_raised_as_the_outermost_ends():
    handler = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # Python runs its handlers between these
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is handler
    thread = threading.Thread(target=lambda: deferred_interrupts().__enter__())
    thread.start()  # elsewhere than the main thread: nothing to do, nothing held
    thread.join()
    with pytest.raises(KeyboardInterrupt):  # and the next block is an outermost one again
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is handler


def test_step_finishes_a_step_begun_with_step_chunk_then_runs_its_own(device):
    g = vkml.Graph(seed=0)
    x = g.input("x", (1, 8))
    loss = g.sum(g.param("p", (1, 8), "zeros") * x)
    session = vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=1.0), device=device)
    session.set_input("x", np.ones((1, 8), np.float32))
    assert session.step_chunk(chunks=3) > 0  # a step begun, its update not yet submitted
    session.step()
    assert session.read("p")[0, 0] == -2.0  # that step's update, then this one's
    session.close()


# ---- SIGKILL while saving --------------------------------------------------------------------
# Saves a 16 MiB checkpoint over and over, its parameter all 1, then all 2, then all 3...
SAVING_FOREVER = """
import sys
import numpy as np
import vkml

g = vkml.Graph(seed=0)
p = g.param("p", (1 << 22,), "zeros")
g.output("out", p * 2.0)
session = vkml.compile(g, device=vkml.Device(backend="vulkan"))
value = 0
while True:
    value += 1
    session.set_param("p", np.full(1 << 22, value, np.float32))
    session.save(sys.argv[1])
    print(value, flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_the_old_file_or_the_new_one(tmp_path):
    from safetensors.numpy import load_file

    path = tmp_path / "checkpoint.safetensors"
    child = subprocess.Popen([sys.executable, "-c", SAVING_FOREVER, str(path)],
                             env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"  # a save finished: time one
        started = time.perf_counter()
        assert child.stdout.readline().strip() == "2"
        # Most of the loop is saving: killed within the next save or two, most likely in one.
        time.sleep(float(np.random.default_rng().uniform(0, 2) * (time.perf_counter() - started)))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    last = int(["2", *child.stdout.read().split()][-1])  # the last save it finished
    tensors = load_file(path)
    values = np.unique(tensors["p"])
    # That one, or the one it was in: replaced, but not yet printed.
    assert values.size == 1 and values[0] in (last, last + 1), (values, last)
    assert tensors["p"].shape == (1 << 22,)
    # The only other file: a temporary a killed save could not remove, never the checkpoint.
    leftovers = {p.name for p in tmp_path.iterdir()} - {path.name}
    assert all(name.endswith(".tmp") for name in leftovers), leftovers
