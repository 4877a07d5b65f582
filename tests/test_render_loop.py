"""Living in the host's render loop: a device the host created (Device.from_vulkan),
record() into the host's command buffer, chunked steps, the shared queue lock, profile().

The host here is a few lines of the `vulkan` package, like a game engine's own Vulkan code. Its
instance gets a debug messenger, so the validation layer's messages about the adopted device
(vkml's calls on the host's handles included) are checked too, not only the conftest ones."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
from conftest import subprocess_env

import vkml
from vkml.hal import Kernel
from vkml.runtime import chunking
from vkml.runtime.profiling import timestamps_plausible

vk = pytest.importorskip("vulkan", reason="these tests create a host device with `vulkan`")

WANTED = ("timelineSemaphore", "shaderFloat16", "storageBuffer16BitAccess", "vulkanMemoryModel")
FILL_WORDS = 64


def vulkan_only(device):
    if device.backend_name != "vulkan":
        pytest.skip("Vulkan-only: adopting handles, record() into a VkCommandBuffer, timeline "
                    "semaphores and timestamps do not exist on the wgpu backend")


class Host:
    """A host application's Vulkan objects: instance (with a debug messenger), device, one
    universal queue, a command pool, and two host-visible buffers for its own work."""

    def __init__(self, features=WANTED):
        ffi = vk.ffi
        self.messages: list[str] = []
        self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self._on_message)
        names = {e.extensionName for e in vk.vkEnumerateInstanceExtensionProperties(None)}
        exts = ["VK_EXT_debug_utils"] if "VK_EXT_debug_utils" in names else []
        self.app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                                        pApplicationName="host", applicationVersion=1,
                                        pEngineName="host", engineVersion=1,
                                        apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
        self.messenger_info = ffi.new("VkDebugUtilsMessengerCreateInfoEXT*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            "messageSeverity": vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            "messageType": vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT,
            "pfnUserCallback": self._callback})
        ici = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                      pApplicationInfo=self.app,
                                      enabledExtensionCount=len(exts),
                                      ppEnabledExtensionNames=exts or None)
        self.instance = vk.vkCreateInstance(ici, None)
        self.messenger = None
        if exts:
            create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
            self.messenger = create(self.instance, self.messenger_info, None)
        self.physical = vk.vkEnumeratePhysicalDevices(self.instance)[0]
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        self.family = next(i for i, f in enumerate(families)
                           if f.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT
                           and f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT)
        # Enable the wanted features the device has (and say which: vkml cannot ask).
        device_exts = {e.extensionName for e in
                       vk.vkEnumerateDeviceExtensionProperties(self.physical, None)}
        coop_stype = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        q_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {"sType": coop_stype})
        q12 = ffi.new("VkPhysicalDeviceVulkan12Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                       "pNext": q_coop if "VK_KHR_cooperative_matrix" in device_exts
                       else ffi.NULL})
        q11 = ffi.new("VkPhysicalDeviceVulkan11Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                       "pNext": q12})
        q2 = ffi.new("VkPhysicalDeviceFeatures2*",
                     {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": q11})
        vk.lib.vkGetPhysicalDeviceFeatures2(self.physical, q2)
        self.features = [f for f in features
                         if getattr(q12 if hasattr(q12, f) else q11, f)]
        # A GPU with cooperative matrices (the H200): enabled as vkml would, so caps match.
        coop = bool(features and "VK_KHR_cooperative_matrix" in device_exts
                    and q_coop.cooperativeMatrix and q12.vulkanMemoryModelDeviceScope)
        self.extensions = ["VK_KHR_cooperative_matrix"] if coop else []
        if coop:
            self.features += ["cooperativeMatrix", "vulkanMemoryModelDeviceScope"]
        e_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*",
                         {"sType": coop_stype, "cooperativeMatrix": 1})
        e12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
            "pNext": e_coop if coop else ffi.NULL,
            **{f: 1 for f in self.features
               if f not in ("storageBuffer16BitAccess", "cooperativeMatrix")}})
        e11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": e12,
            "storageBuffer16BitAccess": int("storageBuffer16BitAccess" in self.features)})
        self.qci = vk.VkDeviceQueueCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                              queueFamilyIndex=self.family, queueCount=1,
                                              pQueuePriorities=[1.0])
        dci = vk.VkDeviceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=e11,
                                    queueCreateInfoCount=1, pQueueCreateInfos=[self.qci],
                                    enabledExtensionCount=len(self.extensions),
                                    ppEnabledExtensionNames=self.extensions or None)
        self.device = vk.vkCreateDevice(self.physical, dci, None)
        self.queue = vk.vkGetDeviceQueue(self.device, self.family, 0)
        self.pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        memory = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        self.buffers, self.memories = [], []
        for _ in range(2):
            buf = vk.vkCreateBuffer(self.device, vk.VkBufferCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=4 * FILL_WORDS,
                usage=vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
            req = vk.vkGetBufferMemoryRequirements(self.device, buf)
            want = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
            index = next(i for i in range(memory.memoryTypeCount)
                         if req.memoryTypeBits >> i & 1
                         and memory.memoryTypes[i].propertyFlags & want == want)
            mem = vk.vkAllocateMemory(self.device, vk.VkMemoryAllocateInfo(
                sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=req.size,
                memoryTypeIndex=index), None)
            vk.vkBindBufferMemory(self.device, buf, mem, 0)
            self.buffers.append(buf)
            self.memories.append(mem)
        self.lock = threading.Lock()

    def _on_message(self, severity, types, data, user):
        message = vk.ffi.string(data.pMessage).decode(errors="replace") if data.pMessage else ""
        ident = vk.ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        if not (ident == "Loader Message" and message.startswith("env var ")):
            self.messages.append(message)
        return 0

    def adopt(self, **kw):
        return vkml.Device.from_vulkan(self.instance, self.physical, self.device, self.family,
                                       self.queue, kw.pop("queue_lock", self.lock),
                                       enabled_features=kw.pop("enabled_features",
                                                               self.features),
                                       enabled_extensions=kw.pop("enabled_extensions",
                                                                 self.extensions), **kw)

    def command_buffer(self):
        return vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]

    def begin(self, cb):
        vk.vkResetCommandBuffer(cb, 0)
        vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))

    def fill_then_copy_before(self, cb, word):
        """The host's own work: fill buffer 0 with `word`, and a barrier to the copy."""
        vk.vkCmdFillBuffer(cb, self.buffers[0], 0, 4 * FILL_WORDS, word)
        barrier = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                     srcAccessMask=vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                     dstAccessMask=vk.VK_ACCESS_TRANSFER_READ_BIT)
        vk.vkCmdPipelineBarrier(cb, vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                                vk.VK_PIPELINE_STAGE_TRANSFER_BIT, 0, 1, [barrier], 0, None, 0,
                                None)

    def copy_after(self, cb):
        region = vk.VkBufferCopy(srcOffset=0, dstOffset=0, size=4 * FILL_WORDS)
        vk.vkCmdCopyBuffer(cb, self.buffers[0], self.buffers[1], 1, [region])
        barrier = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                     srcAccessMask=vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                     dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT)
        vk.vkCmdPipelineBarrier(cb, vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                                vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [barrier], 0, None, 0, None)

    def submit_and_wait(self, cb):
        submit = vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                                 pCommandBuffers=[cb])
        with self.lock:
            vk.vkQueueSubmit(self.queue, 1, [submit], self.fence)
        vk.vkWaitForFences(self.device, 1, [self.fence], vk.VK_TRUE, 60 * 10**9)
        vk.vkResetFences(self.device, 1, [self.fence])

    def read(self, index):
        ptr = vk.vkMapMemory(self.device, self.memories[index], 0, 4 * FILL_WORDS, 0)
        words = np.frombuffer(bytes(ptr), np.uint32).copy()
        vk.vkUnmapMemory(self.device, self.memories[index])
        return words

    def close(self):
        vk.vkDeviceWaitIdle(self.device)
        for buf, mem in zip(self.buffers, self.memories):
            vk.vkDestroyBuffer(self.device, buf, None)
            vk.vkFreeMemory(self.device, mem, None)
        vk.vkDestroyFence(self.device, self.fence, None)
        vk.vkDestroyCommandPool(self.device, self.pool, None)
        vk.vkDestroyDevice(self.device, None)  # the layer reports any object vkml leaked
        if self.messenger is not None:
            destroy = vk.vkGetInstanceProcAddr(self.instance, "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.instance, self.messenger, None)
        vk.vkDestroyInstance(self.instance, None)


@pytest.fixture
def host():
    h = Host()
    yield h
    h.close()
    assert not h.messages, "validation layer reported on the host's device:\n" + "\n".join(
        h.messages)


def mlp(device, seed=0):
    """A small training MLP (3 layers, Adam) with fixed inputs."""
    g = vkml.Graph(seed=seed)
    x = g.input("x", (8, 12))
    labels = g.input("labels", (8,), "i32")
    h = vkml.nn.Linear(g, "fc1", 12, 16)(x).relu()
    h = vkml.nn.Linear(g, "fc2", 16, 16)(h).tanh()
    logits = g.output("logits", vkml.nn.Linear(g, "fc3", 16, 5)(h))
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                           optimizer=vkml.Adam(lr=1e-2), device=device)
    rng = np.random.default_rng(7)
    session.set_input("x", rng.standard_normal((8, 12)).astype(np.float32))
    session.set_input("labels", rng.integers(0, 5, 8).astype(np.int32))
    return session


def state(session):
    return {**session.state_dict(), "loss": session.read("loss"),
            "logits": session.read("logits")}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def reference(device, steps):
    with mlp(device) as s:
        for _ in range(steps):
            s.step()
        return state(s)


# ---- pure parts: no GPU -------------------------------------------------------------------------

def test_balanced_cuts_minimise_the_largest_piece():
    costs = [1, 1, 1, 1, 4, 1, 1]
    assert chunking.balanced(costs, 1) == []
    cuts = chunking.balanced(costs, 2)
    pieces = chunking.pieces_of(cuts, len(costs))
    assert max(sum(costs[a:b]) for a, b in pieces) == 6
    assert chunking.balanced(costs, 3) == [4, 5]  # [1,1,1,1] [4] [1,1]
    assert len(chunking.pieces_of(chunking.balanced(costs, 99), len(costs))) == len(costs)
    assert chunking.within_budget(costs, 4) == [4, 5]
    assert chunking.within_budget(costs, 3) == [3, 4, 5]  # the 4 alone: a level is never split
    assert chunking.level_ranges([0, 0, 1, 2, 2, 2]) == [(0, 2), (2, 3), (3, 6)]
    small = Kernel("small", "", (), (64, 1, 1), (1, 1, 1), flops=10, nbytes=100)
    big = Kernel("big", "", (), (64, 1, 1), (99, 1, 1), flops=10**9, nbytes=100)
    assert big.cost > small.cost > 0  # the estimate chunks are balanced by before measuring


def test_a_long_level_is_cut_into_parts_of_about_equal_cost():
    # Dispatch costs 1, 4, 1; the middle one has 8 slabs (workgroups along its cut axis).
    parts = chunking.cut_level([1, 4, 1], [1, 8, 1], 3)
    assert parts == [[(0, 0, 1), (1, 0, 2)], [(1, 2, 6)], [(1, 6, 8), (2, 0, 1)]]
    # None can be cut: whole dispatches, each in the part where most of it falls.
    assert chunking.cut_level([1, 4, 1], [1, 1, 1], 3) == [[(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1)]]
    assert chunking.cut_level([1, 4, 1], [1, 8, 1], 1) == [[(0, 0, 1), (1, 0, 8), (2, 0, 1)]]
    assert chunking.cut_level([0, 0], [4, 1], 3) == [[(0, 0, 4), (1, 0, 1)]]
    # parts of one dispatch that end up in one piece run as one dispatch
    part = chunking.Part
    assert chunking.joined([part(0, 0, 1), part(1, 0, 2), part(1, 2, 6), part(2, 0, 3)]) == (
        part(0, 0, 1), part(1, 0, 6), part(2, 0, 3))
    rng = np.random.default_rng(0)
    for _ in range(200):  # every slab of every dispatch once, in order, no part empty
        n = int(rng.integers(1, 5))
        costs = rng.exponential(1.0, n) * (rng.random(n) > 0.2)
        slabs = rng.integers(1, 9, n)
        k = int(rng.integers(1, 12))
        got = chunking.cut_level(list(costs), list(slabs), k)
        assert 1 <= len(got) <= k and all(got)
        flat = [(d, s) for part in got for d, a, b in part for s in range(a, b)]
        assert flat == [(d, s) for d in range(n) for s in range(slabs[d])]


def test_implausible_timestamps_are_detected():
    assert timestamps_plausible([0.5, 0.3], 1.2)[0]
    assert timestamps_plausible([0.002], 0.4)[0]  # a tiny step: the host's overhead dominates
    ok, why = timestamps_plausible([0.004, 0.006], 95.0)  # lavapipe 22.3 after graphics work
    assert not ok and "95.000 ms" in why
    assert not timestamps_plausible([50.0], 10.0)[0]
    assert not timestamps_plausible([-1.0, 2.0], 10.0)[0]


# ---- an adopted device ----------------------------------------------------------------------

def test_adopted_device_gives_the_same_results_as_a_vkml_owned_one(device, host):
    vulkan_only(device)
    expected = reference(device, 3)
    dev = host.adopt()
    assert dev.adopted and dev.queue_lock is host.lock
    assert dev.caps == device.caps  # the host enabled what vkml would have
    # compiles leave a core to the host's render thread (VKML_COMPILE_THREADS unset)
    if "VKML_COMPILE_THREADS" not in os.environ:
        assert dev.backend.pipeline_threads == max(1, (os.cpu_count() or 1) - 1)
    with mlp(dev) as s:
        for _ in range(3):
            s.step()
        assert_same(state(s), expected)
    dev.close()
    dev.close()
    # vkml destroyed none of the host's handles: the host's own work still runs on them.
    cb = host.command_buffer()
    host.begin(cb)
    host.fill_then_copy_before(cb, 7)
    host.copy_after(cb)
    vk.vkEndCommandBuffer(cb)
    host.submit_and_wait(cb)
    assert (host.read(1) == 7).all()


def test_integer_handles_as_pyopenxr_gives_them(device, host):
    vulkan_only(device)

    def as_int(h):
        return int(vk.ffi.cast("uintptr_t", h))

    dev = vkml.Device.from_vulkan(as_int(host.instance), as_int(host.physical),
                                  as_int(host.device), host.family, as_int(host.queue),
                                  enabled_features=host.features,
                                  enabled_extensions=host.extensions)
    assert isinstance(dev.queue_lock, type(threading.Lock()))  # vkml made one
    with mlp(dev) as s:
        s.step()
        assert np.isfinite(s.read("loss")).all()
    dev.close()


def test_record_into_the_hosts_command_buffer_leaves_its_work_intact(device, host):
    vulkan_only(device)
    expected = reference(device, 3)
    dev = host.adopt()
    cb = host.command_buffer()
    with mlp(dev) as s:
        for frame in range(3):
            word = 0x3F800000 + frame
            host.begin(cb)
            host.fill_then_copy_before(cb, word)
            s.record(cb)  # the model's step between the host's fill and its copy
            host.copy_after(cb)
            vk.vkEndCommandBuffer(cb)
            host.submit_and_wait(cb)
            assert (host.read(0) == word).all() and (host.read(1) == word).all()
        assert_same(state(s), expected)
    dev.close()


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
def test_chunked_steps_are_bit_identical_to_whole_steps(device, pieces):
    expected = reference(device, 3)
    with mlp(device) as s:
        s.step(chunks=pieces)  # the whole step, as `pieces` submissions
        left = s.step_chunk(chunks=pieces)  # one piece per call, as a render loop would
        while left:
            left = s.step_chunk()
        s.step()  # a whole step after chunked ones
        s.wait()
        assert_same(state(s), expected)
        bounds = s.chunk_boundaries(chunks=pieces)
        levels = len({d.level for d in s.plan.dispatches})
        assert len(bounds) == min(pieces, levels)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(s.plan.dispatches)
        # recorded once per chunk count: the same programs serve every step
        assert s._chunker.recorded_cuts <= 2


def wide_mlp(device, train):
    """An MLP with wide rows (its pointwise and matmul kernels have many workgroups), for a
    training step (Adam) or for inference only."""
    g = vkml.Graph(seed=3)
    x = g.input("x", (512, 48))
    h = vkml.nn.Linear(g, "fc1", 48, 96)(x).relu()
    logits = g.output("logits", vkml.nn.Linear(g, "fc2", 96, 10)(h))
    loss = None
    if train:
        labels = g.input("labels", (512,), "i32")
        loss = g.cross_entropy(logits, labels)
    session = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=1e-2) if train else None,
                           device=device)
    rng = np.random.default_rng(5)
    session.set_input("x", rng.standard_normal((512, 48)).astype(np.float32))
    if train:
        session.set_input("labels", rng.integers(0, 10, 512).astype(np.int32))
    return session


@pytest.mark.parametrize("train", [True, False])
def test_a_level_longer_than_the_budget_is_cut_into_workgroup_ranges(device, train):
    """Costs that make one dispatch (the one with the most workgroups) far longer than the
    budget: its level goes as several pieces of workgroup ranges (a base workgroup per range:
    Vulkan's vkCmdDispatchBase, a uniform the kernel adds on wgpu), and the steps are
    bit-identical to whole ones."""
    def run(session, budget):
        for _ in range(3):
            session.step(budget_ms=budget) if budget else session.step()
        out = session.state_dict() if train else {}
        return {**out, "logits": session.read("logits")}

    with wide_mlp(device, train) as whole:
        expected = run(whole, None)
    with wide_mlp(device, train) as s:
        chunker = s._chunker
        extents = [d.kernel.groups[d.kernel.cut_axis] if d.kernel.cut_axis is not None else 1
                   for d in s.plan.dispatches]
        long = int(np.argmax(extents))
        assert extents[long] >= 4
        ms = [0.2] * len(s.plan.dispatches)
        ms[long] = 4.0
        chunker.set_measured(ms, "made up: one long dispatch")
        bounds = s.chunk_boundaries(budget_ms=1.0)
        touching = sum(first <= long < end for first, end in bounds)  # pieces running it
        # 4 ms in pieces of at most 1 ms, so at least 4 of its workgroup ranges.
        assert device.caps.dispatch_base and touching >= 4
        assert len(s.piece_costs(budget_ms=1.0)) == len(bounds)
        got = run(s, 1.0)
    assert got.keys() == expected.keys()
    for k in got:
        assert np.array_equal(got[k], expected[k]), k


@pytest.mark.parametrize("model", ["smollm2", "resnet"])
def test_reference_models_stepped_in_workgroup_ranges_are_bit_identical(device, model):
    """Attention, embeddings, norms, convolutions and their gradients: two training steps with
    every level, and every dispatch with workgroups to spare, cut (made-up costs against a
    small budget) give bit for bit the whole steps' loss, outputs and parameters."""
    import importlib

    module = importlib.import_module(f"vkml.models.{model}")
    built = module.build(module.tiny())
    results = []
    for budget in (None, 0.3):
        with vkml.compile(built.graph, loss=built.loss, outputs=built.outputs,
                          optimizer=vkml.Adam(lr=1e-2), device=device) as s:
            for key, value in built.sample_inputs(np.random.default_rng(7)).items():
                s.set_input(key, value)
            if budget:
                s._chunker.set_measured([1.0] * len(s.plan.dispatches), "made up")
                bounds = s.chunk_boundaries(budget_ms=budget)
                inside = sum(end > first for (_, end), (first, _) in zip(bounds, bounds[1:]))
                assert inside > len(s.plan.dispatches) // 2  # cut inside many dispatches
            for _ in range(2):
                s.step(budget_ms=budget)
            results.append({**s.params(), "loss": s.read("loss"),
                            **{out: s.read(out) for out in built.outputs}})
    whole, cut = results
    assert whole.keys() == cut.keys()
    for k in whole:
        assert np.array_equal(whole[k], cut[k]), k


def test_chunks_follow_the_timeline_and_budget_mode(device, host):
    vulkan_only(device)
    expected = reference(device, 4)
    dev = host.adopt()
    with mlp(dev) as s:
        left = s.step_chunk(chunks=3)
        semaphore, value = s.done()
        assert left == 2 and s.pieces_left == 2
        while s.step_chunk():
            pass
        semaphore, last = s.done()
        assert last == value + 2
        # the host's own submit waits for the model's step on the timeline
        cb = host.command_buffer()
        host.begin(cb)
        host.fill_then_copy_before(cb, 42)
        host.copy_after(cb)
        vk.vkEndCommandBuffer(cb)
        timeline = vk.VkTimelineSemaphoreSubmitInfo(
            sType=vk.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
            waitSemaphoreValueCount=1, pWaitSemaphoreValues=[last])
        submit = vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, pNext=timeline,
                                 waitSemaphoreCount=1, pWaitSemaphores=[semaphore],
                                 pWaitDstStageMask=[vk.VK_PIPELINE_STAGE_TRANSFER_BIT],
                                 commandBufferCount=1, pCommandBuffers=[cb])
        with host.lock:
            vk.vkQueueSubmit(host.queue, 1, [submit], host.fence)
        vk.vkWaitForFences(host.device, 1, [host.fence], vk.VK_TRUE, 60 * 10**9)
        vk.vkResetFences(host.device, 1, [host.fence])
        assert vk.vkGetSemaphoreCounterValue(host.device, semaphore) >= last
        assert (host.read(1) == 42).all()
        info = vk.VkSemaphoreWaitInfo(sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                                      semaphoreCount=1, pSemaphores=[semaphore], pValues=[last])
        vk.vkWaitSemaphores(host.device, info, 60 * 10**9)  # or on the host thread
        s.step(budget_ms=1e-6)  # nothing measured yet: runs whole, timed
        assert s._chunker.dispatch_ms is not None
        s.step(budget_ms=1e-6)  # every level its own piece now, long ones cut further
        tiny = s.chunk_boundaries(budget_ms=1e-6)
        assert len(tiny) >= len({d.level for d in s.plan.dispatches})
        assert len(s.chunk_boundaries(budget_ms=1e9)) == 1
        s.step(chunks=2)
        s.wait()
        got = state(s)
    dev.close()
    assert_same(got, expected)  # 4 steps: chunked, measured whole, budget pieces, 2 chunks


def test_submits_from_two_threads_share_the_lock(device, host):
    vulkan_only(device)
    expected = reference(device, 6)

    class CountingLock:
        def __init__(self):
            self.lock, self.taken = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()
            self.taken += 1

        def __exit__(self, *exc):
            self.lock.release()

        def acquire(self, *a):
            return self.lock.acquire(*a)

        def release(self):
            self.lock.release()

    lock = host.lock = CountingLock()
    dev = host.adopt(queue_lock=lock)
    errors = []

    def host_loop():
        try:
            cb = host.command_buffer()
            for frame in range(20):
                host.begin(cb)
                host.fill_then_copy_before(cb, frame)
                host.copy_after(cb)
                vk.vkEndCommandBuffer(cb)
                host.submit_and_wait(cb)
                if not (host.read(1) == frame).all():
                    errors.append(f"frame {frame}: host copy wrong")
        except Exception as exc:  # noqa: BLE001 - reported on the main thread
            errors.append(repr(exc))

    with mlp(dev) as s:
        thread = threading.Thread(target=host_loop)
        thread.start()
        for k in range(6):
            s.step(chunks=1 + k % 3)
        s.wait()
        thread.join()
        assert not errors, errors
        assert_same(state(s), expected)
    dev.close()
    assert lock.taken >= 20 + 6  # every submit of both went through the one lock


def test_missing_features_are_named(device):
    vulkan_only(device)
    h = Host(features=())  # no timeline semaphores
    try:
        with pytest.raises(vkml.DeviceError, match=r"timelineSemaphore.*VkPhysicalDevice"
                           r"Vulkan12Features\.timelineSemaphore = VK_TRUE"):
            h.adopt(require=["timelineSemaphore"])
        if not device.caps.cooperative_matrix:  # lavapipe: a declaration it cannot have
            with pytest.raises(vkml.DeviceError,
                               match="'cooperativeMatrix' is declared enabled"):
                h.adopt(enabled_features=["cooperativeMatrix"])
        with pytest.raises(vkml.DeviceError, match="unknown feature"):
            h.adopt(enabled_features=["warpDrive"])
        dev = h.adopt()  # falls back to fences
        assert dev.caps.shader_f16 is False
        with mlp(dev) as s:
            s.step(chunks=2)
            assert np.isfinite(s.read("loss")).all()
            with pytest.raises(vkml.DeviceError, match="timelineSemaphore"):
                s.done()
        dev.close()
    finally:
        h.close()
    assert not h.messages, "\n".join(h.messages)


def test_wgpu_says_what_it_cannot_do(device):
    if device.backend_name != "wgpu":
        pytest.skip("checks the wgpu backend's refusals")
    with mlp(device) as s:
        with pytest.raises(vkml.DeviceError, match="Vulkan backend"):
            s.done()
        with pytest.raises(vkml.DeviceError, match="Vulkan backend"):
            s.record(0)


def test_profile_table_and_trace(device, tmp_path):
    expected = reference(device, 3)  # both backends: wgpu has timestamp queries too
    with mlp(device) as s:
        profile = s.profile(steps=3)
        assert_same(state(s), expected)  # profiled steps are ordinary steps
    text = str(profile)
    assert profile.source in ("gpu timestamps", "host timing")
    assert profile.source in text and "matmul" in text
    names = {d.kernel.name for d in s.plan.dispatches}
    assert {r.name for r in profile.rows} == names
    assert sum(r.calls for r in profile.rows) == 3 * len(s.plan.dispatches)
    assert all(r.total_ms >= 0 and r.mean_ms >= 0 for r in profile.rows)
    path = tmp_path / "trace.json"
    profile.to_trace(path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "dispatch"]
    assert len(spans) == 3 * len(s.plan.dispatches)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in spans)


# ---- the host application's renderer (xr_demo, outside the library) and the co-tenancy tool --

def test_host_renderer_frames_with_the_model_between_them(device):
    vulkan_only(device)
    from xr_demo.loadgen import FullscreenLoad
    from xr_demo.vkhost import VulkanHost

    expected = reference(device, 2)
    ctx = VulkanHost.create()
    try:
        renderer = FullscreenLoad(ctx, 32, 32, iterations=4)  # WGSL through vkml.vk.compile_wgsl
        dev = ctx.vkml_device()
        assert dev.queue_lock is ctx.queue_lock and dev.adopted
        with mlp(dev) as s:
            frames = 0
            for _ in range(2):  # two steps, one piece per frame
                left = 1
                while left:
                    t0 = renderer.render(timed=False)
                    left = s.step_chunk(chunks=3)
                    cpu_ms, _ = renderer.wait(t0)
                    assert cpu_ms > 0
                    frames += 1
            s.wait()
            assert frames == 2 * len(s.chunk_boundaries(chunks=3))
            assert_same(state(s), expected)
        cpu_ms, gpu_ms = renderer.wait(renderer.render(timed=True))
        assert gpu_ms >= 0
        dev.close()
        renderer.close()
    finally:
        ctx.close()
    assert not ctx.messages, "\n".join(ctx.messages)


def test_cotenancy_tool_writes_json_and_png(device, tmp_path):
    vulkan_only(device)
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "cot"
    run = subprocess.run([sys.executable, str(repo / "tools" / "cotenancy.py"), "--frames", "8",
                          "--size", "32", "--iterations", "4", "--width", "16",
                          "--out", str(out)], cwd=repo, capture_output=True, text=True,
                         timeout=600, env=subprocess_env())
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["modes"]) == {"none", "chunks=1", "chunks=2", "chunks=4", "budget",
                                     "slack"}
    for m in result["modes"].values():
        assert m["frame_ms_p50"] > 0 and m["frame_ms_p99"] >= m["frame_ms_p50"]
    for name in ("chunks=1", "chunks=2", "chunks=4", "budget", "slack"):
        m = result["modes"][name]
        # every mode trains, and each step's pieces are the mode's own (never a step that a
        # previous mode left half-submitted: the waiter race of issue 12)
        assert m["steps_done"] >= 1 and m["pieces_per_step"] == m["pieces"], (name, m)
    assert result["modes"]["chunks=1"]["frames_per_step"] == 1
    assert result["step_overhead"]["steady_wall_ms_p50"] > 0
    assert result["validation_messages"] == 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_falls_back_to_host_timing_when_timestamps_are_implausible(device,
                                                                          monkeypatch):
    vulkan_only(device)
    import vkml.runtime.profiling

    monkeypatch.setattr(vkml.runtime.profiling, "timestamps_plausible",
                        lambda ms, host_ms: (False, "0.01 ms in a 95 ms step (simulated)"))
    with mlp(device) as s:
        profile = s.profile(steps=3)  # the first step's timestamps are dropped, 2 host-timed
        assert profile.source == "host timing" and profile.steps == 2
        assert "implausible" in str(profile) and "simulated" in profile.note
        assert_same(state(s), reference(device, 3))
        once = s.profile(steps=1)  # nothing left to time from the host: one more step
        assert once.steps == 1 and "one extra step" in once.note
        assert_same(state(s), reference(device, 5))
        assert "host timing" in s.timing_note
