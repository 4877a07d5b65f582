"""The host application's Vulkan objects, as a game engine or an OpenXR app owns them: an
instance (with a debug messenger when the validation layer is on), one physical device, a device
with one universal (graphics + compute) queue, the lock that guards that queue, a command pool.

vkml joins through `VulkanHost.vkml_device()` (vkml.Device.from_vulkan): it runs on this device
and this queue, and holds `queue_lock` around every submit, as the host does around its own
submits and presents. Written with the `vulkan` package directly (the host's code, not vkml's).

Two ways in: `VulkanHost.create()` makes everything (headless and window modes);
`VulkanHost.adopt()` wraps handles some else created (OpenXR's xrCreateVulkanDeviceKHR), using
the create infos from `instance_create_info()` / `device_create_info()` so both paths enable the
same features.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import vulkan as vk

ffi = vk.ffi
API_VERSION = vk.VK_MAKE_VERSION(1, 3, 0)
# Vulkan 1.2 features the host enables where the device has them and declares to vkml, so an
# adopted device compiles the same kernels as one vkml would have made itself.
SHARED_FEATURES = ("timelineSemaphore", "shaderFloat16", "vulkanMemoryModel")
DEVICE_TYPES = {vk.VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: 0,
                vk.VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: 1,
                vk.VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: 2, vk.VK_PHYSICAL_DEVICE_TYPE_CPU: 3}


class HostError(RuntimeError):
    """The host could not set up its Vulkan objects (no device, a missing feature)."""


def validation_requested() -> bool:
    return "VK_LAYER_KHRONOS_validation" in os.environ.get("VK_INSTANCE_LAYERS", "")


@dataclass
class CreateInfo:
    """A Vulkan create-info struct and everything it points to (cffi frees what nothing
    references, and a nested struct that dies early loses its strings: keep them together)."""

    info: Any
    keep: list[Any] = field(default_factory=list)
    features: list[str] = field(default_factory=list)  # declared to vkml
    extensions: list[str] = field(default_factory=list)


def instance_create_info(extensions: Sequence[str] = ()) -> CreateInfo:
    """The host's VkInstanceCreateInfo: `extensions` plus VK_EXT_debug_utils when validating."""
    available = {e.extensionName for e in vk.vkEnumerateInstanceExtensionProperties(None)}
    exts = list(dict.fromkeys(extensions))
    if validation_requested() and "VK_EXT_debug_utils" in available:
        exts.append("VK_EXT_debug_utils")
    missing = [e for e in exts if e not in available]
    if missing:
        raise HostError(f"the Vulkan loader lacks instance extension(s) {missing}")
    app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                               pApplicationName="vkml xr_demo", applicationVersion=1,
                               pEngineName="xr_demo", engineVersion=1, apiVersion=API_VERSION)
    info = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                   pApplicationInfo=app, enabledExtensionCount=len(exts),
                                   ppEnabledExtensionNames=exts or None)
    return CreateInfo(info, [app, exts], extensions=exts)


def pick_physical_device(instance: Any, selector: str | None = None) -> Any:
    """A device by index or name substring (`VKML_DEVICE`, as vkml reads it), else a discrete
    GPU, then integrated, then a CPU driver; it must have a graphics + compute queue."""
    devices = vk.vkEnumeratePhysicalDevices(instance)
    if not devices:
        raise HostError("no Vulkan physical device (install a driver, e.g. mesa-vulkan-drivers)")
    props = [vk.vkGetPhysicalDeviceProperties(d) for d in devices]
    selector = selector if selector is not None else os.environ.get("VKML_DEVICE")
    if selector:
        if selector.isdigit() and int(selector) < len(devices):
            return devices[int(selector)]
        named = [d for d, p in zip(devices, props) if selector.lower() in p.deviceName.lower()]
        if not named:
            raise HostError(f"no Vulkan device matches {selector!r}; have "
                            f"{[p.deviceName for p in props]}")
        return named[0]
    usable = [(DEVICE_TYPES.get(p.deviceType, 4), i) for i, (d, p) in
              enumerate(zip(devices, props)) if universal_family(d) is not None]
    if not usable:
        raise HostError("no Vulkan device has a graphics + compute queue family")
    return devices[min(usable)[1]]


def universal_family(physical: Any) -> int | None:
    for i, f in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(physical)):
        if f.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT and f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT:
            return i
    return None


def device_create_info(physical: Any, family: int, extensions: Sequence[str] = (),
                       for_openxr: bool = False) -> CreateInfo:
    """The host's VkDeviceCreateInfo: one queue of `family`; dynamic rendering (the renderer);
    timeline semaphores, f16 and the memory model where present (declared to vkml);
    cooperative matrices where the GPU has them, as a vkml-owned device would enable them.

    `for_openxr`: the create info goes through xrCreateVulkanDeviceKHR. Monado 25 puts its own
    VkPhysicalDeviceTimelineSemaphoreFeatures at the head of the pNext chain (enabled when the
    device has it and VK_KHR_timeline_semaphore is in the extension list), so the chain must not
    hold VkPhysicalDeviceVulkan12Features (VUID-VkDeviceCreateInfo-pNext-02830) nor a timeline
    struct of its own: the same features then go in their per-feature structs, and the
    extension is named so that the runtime enables timeline semaphores."""
    have = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)}
    missing = [e for e in extensions if e not in have]
    if missing:
        raise HostError(f"the device lacks extension(s) {missing}")
    coop_stype = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
    q_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {"sType": coop_stype})
    q13 = ffi.new("VkPhysicalDeviceVulkan13Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
        "pNext": q_coop if "VK_KHR_cooperative_matrix" in have else ffi.NULL})
    q12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, "pNext": q13})
    q11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": q12})
    q2 = ffi.new("VkPhysicalDeviceFeatures2*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": q11})
    vk.lib.vkGetPhysicalDeviceFeatures2(physical, q2)
    if not q13.dynamicRendering:
        raise HostError("the device lacks dynamicRendering (Vulkan 1.3), which the renderer uses")
    features = [f for f in SHARED_FEATURES if getattr(q12, f)]
    if "shaderFloat16" in features and q11.storageBuffer16BitAccess:
        features.append("storageBuffer16BitAccess")
    else:
        features = [f for f in features if f != "shaderFloat16"]
    coop = bool("VK_KHR_cooperative_matrix" in have and q_coop.cooperativeMatrix
                and "shaderFloat16" in features and q12.vulkanMemoryModelDeviceScope)
    exts = list(dict.fromkeys(extensions))
    if coop:
        exts.append("VK_KHR_cooperative_matrix")
        features += ["cooperativeMatrix", "vulkanMemoryModelDeviceScope"]
    e_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*",
                     {"sType": coop_stype, "cooperativeMatrix": 1})
    e13 = ffi.new("VkPhysicalDeviceVulkan13Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
        "pNext": e_coop if coop else ffi.NULL, "dynamicRendering": 1})
    if not for_openxr:
        e12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, "pNext": e13,
            **{f: 1 for f in features
               if f in (*SHARED_FEATURES, "vulkanMemoryModelDeviceScope")}})
        chain12 = [e12]
    else:
        f16 = ffi.new("VkPhysicalDeviceShaderFloat16Int8Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES,
            "pNext": e13, "shaderFloat16": int("shaderFloat16" in features)})
        model = ffi.new("VkPhysicalDeviceVulkanMemoryModelFeatures*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES,
            "pNext": f16, "vulkanMemoryModel": int("vulkanMemoryModel" in features),
            "vulkanMemoryModelDeviceScope": int("vulkanMemoryModelDeviceScope" in features)})
        chain12 = [f16, model]
        e12 = model
        if "timelineSemaphore" in features and "VK_KHR_timeline_semaphore" in have:
            exts.append("VK_KHR_timeline_semaphore")
        else:
            features = [f for f in features if f != "timelineSemaphore"]
    e11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
        "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": e12,
        "storageBuffer16BitAccess": int("storageBuffer16BitAccess" in features)})
    priorities = ffi.new("float[1]", [1.0])
    qci = ffi.new("VkDeviceQueueCreateInfo*", {
        "sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, "queueFamilyIndex": family,
        "queueCount": 1, "pQueuePriorities": priorities})
    names = [ffi.new("char[]", e.encode()) for e in exts]
    name_array = ffi.new("char*[]", names) if names else ffi.NULL
    info = ffi.new("VkDeviceCreateInfo*", {
        "sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, "pNext": e11,
        "queueCreateInfoCount": 1, "pQueueCreateInfos": qci,
        "enabledExtensionCount": len(exts), "ppEnabledExtensionNames": name_array})
    return CreateInfo(info, [e_coop, e13, *chain12, e11, priorities, qci, names, name_array],
                      features, exts)


class VulkanHost:
    """Instance, physical device, device, universal queue and its lock, command pool."""

    def __init__(self) -> None:
        self.instance: Any = None
        self.device: Any = None
        self.messenger: Any = None
        self.pool: Any = None
        self.owns = True
        self.messages: list[str] = []
        self._callback: Any = None

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, instance_extensions: Sequence[str] = (),
               device_extensions: Sequence[str] = (), selector: str | None = None
               ) -> VulkanHost:
        """Everything made here: the headless and window modes."""
        host = cls()
        ici = instance_create_info(instance_extensions)
        host.instance = vk.vkCreateInstance(ici.info, None)
        try:
            host._attach_messenger()
            physical = pick_physical_device(host.instance, selector)
            family = universal_family(physical)
            if family is None:
                raise HostError("the chosen device has no graphics + compute queue family")
            dci = device_create_info(physical, family, device_extensions)
            device = vk.vkCreateDevice(physical, dci.info, None)
            host._finish(physical, device, family, dci.features, dci.extensions)
        except BaseException:
            host.close()
            raise
        return host

    @classmethod
    def adopt(cls, instance: Any, physical: Any, device: Any, family: int,
              features: Sequence[str], extensions: Sequence[str]) -> VulkanHost:
        """Handles created elsewhere (OpenXR's runtime created them with our create infos).
        The host still destroys the device and instance at close: it asked for them."""
        host = cls()
        host.instance = instance
        host._attach_messenger()
        host._finish(physical, device, family, list(features), list(extensions))
        return host

    def _attach_messenger(self) -> None:
        if not validation_requested():
            return
        try:
            create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
        except Exception:  # noqa: BLE001 - the extension is absent: nothing to collect
            return
        self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self._on_message)
        info = ffi.new("VkDebugUtilsMessengerCreateInfoEXT*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            "messageSeverity": vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            "messageType": vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT,
            "pfnUserCallback": self._callback})
        self.messenger = create(self.instance, info, None)

    def _on_message(self, severity: int, types: int, data: Any, user: Any) -> int:
        message = ffi.string(data.pMessage).decode(errors="replace") if data.pMessage else ""
        ident = ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        # The loader reports the VK_INSTANCE_LAYERS variable itself: not a finding.
        if not (ident == "Loader Message" and message.startswith("env var ")):
            self.messages.append(message)
        return 0

    def _finish(self, physical: Any, device: Any, family: int, features: list[str],
                extensions: list[str]) -> None:
        self.physical, self.device, self.family = physical, device, family
        self.features, self.extensions = features, extensions
        props = vk.vkGetPhysicalDeviceProperties(physical)
        self.device_name: str = props.deviceName
        self.timestamp_period = props.limits.timestampPeriod
        family_props = vk.vkGetPhysicalDeviceQueueFamilyProperties(physical)[family]
        self.timestamp_bits = family_props.timestampValidBits
        self.queue = vk.vkGetDeviceQueue(device, family, 0)
        self.queue_lock = threading.Lock()
        self.memory = vk.vkGetPhysicalDeviceMemoryProperties(physical)
        self.pool = vk.vkCreateCommandPool(device, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)

    # ---- what the rest of the app uses ------------------------------------------------------
    def vkml_device(self) -> Any:
        """A vkml.Device on this device and queue, sharing `queue_lock`."""
        import vkml

        # Everything the device was created with (a swapchain, what an OpenXR runtime adds):
        # vkml ignores what it does not use.
        return vkml.Device.from_vulkan(self.instance, self.physical, self.device, self.family,
                                       self.queue, self.queue_lock,
                                       enabled_features=self.features,
                                       enabled_extensions=self.extensions)

    def memory_type(self, bits: int, flags: int) -> int:
        for i in range(self.memory.memoryTypeCount):
            if bits >> i & 1 and self.memory.memoryTypes[i].propertyFlags & flags == flags:
                return i
        raise HostError(f"no memory type with flags {flags:#x} in bits {bits:#x}")

    def command_buffers(self, count: int) -> list[Any]:
        return list(vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=count)))

    def fence(self, signaled: bool = False) -> Any:
        return vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO,
            flags=vk.VK_FENCE_CREATE_SIGNALED_BIT if signaled else 0), None)

    def semaphore(self) -> Any:
        return vk.vkCreateSemaphore(self.device, vk.VkSemaphoreCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO), None)

    def submit(self, command_buffer: Any, fence: Any = None,
               wait: Sequence[tuple[Any, int]] = (), signal: Sequence[Any] = ()) -> None:
        """One vkQueueSubmit under the queue lock (vkml holds the same lock: a VkQueue is
        externally synchronized). `wait`: (binary semaphore, stage mask) pairs."""
        info = vk.VkSubmitInfo(
            sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
            waitSemaphoreCount=len(wait), pWaitSemaphores=[s for s, _ in wait] or None,
            pWaitDstStageMask=[m for _, m in wait] or None,
            commandBufferCount=1, pCommandBuffers=[command_buffer],
            signalSemaphoreCount=len(signal), pSignalSemaphores=list(signal) or None)
        with self.queue_lock:
            vk.vkQueueSubmit(self.queue, 1, [info], fence if fence is not None
                             else vk.VK_NULL_HANDLE)

    def run_now(self, command_buffer: Any, fence: Any, record: Callable[[Any], Any]) -> None:
        """Record `command_buffer` anew with `record(cb)`, submit it and wait (work outside a
        frame loop: set-up barriers, copies a check reads)."""
        vk.vkResetCommandBuffer(command_buffer, 0)
        vk.vkBeginCommandBuffer(command_buffer, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        record(command_buffer)
        vk.vkEndCommandBuffer(command_buffer)
        self.submit(command_buffer, fence)
        self.wait_fence(fence)

    def wait_fence(self, fence: Any, reset: bool = True, timeout_s: float = 300.0) -> None:
        try:  # the `vulkan` package raises for any result but VK_SUCCESS
            vk.vkWaitForFences(self.device, 1, [fence], vk.VK_TRUE, int(timeout_s * 1e9))
        except vk.VkTimeout:
            raise HostError(f"a frame did not finish within {timeout_s:g} s") from None
        if reset:
            vk.vkResetFences(self.device, 1, [fence])

    def timeline_value(self, semaphore: Any) -> int:
        return vk.vkGetSemaphoreCounterValue(self.device, semaphore)

    def wait_timeline(self, semaphore: Any, value: int, timeout_s: float = 300.0) -> None:
        info = vk.VkSemaphoreWaitInfo(sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                                      semaphoreCount=1, pSemaphores=[semaphore],
                                      pValues=[value])
        vk.vkWaitSemaphores(self.device, info, int(timeout_s * 1e9))

    def idle(self) -> None:
        """Wait until the queue is idle (under the lock: vkQueueWaitIdle uses the queue)."""
        with self.queue_lock:
            vk.vkQueueWaitIdle(self.queue)

    def close(self) -> None:
        if self.device is not None:
            vk.vkDeviceWaitIdle(self.device)
            if self.pool is not None:
                vk.vkDestroyCommandPool(self.device, self.pool, None)
                self.pool = None
            vk.vkDestroyDevice(self.device, None)
            self.device = None
        if self.messenger is not None:
            destroy = vk.vkGetInstanceProcAddr(self.instance,
                                               "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.instance, self.messenger, None)
            self.messenger = None
        if self.instance is not None:
            vk.vkDestroyInstance(self.instance, None)
            self.instance = None
