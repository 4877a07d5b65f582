"""Instance, physical-device choice, logical device and queue: everything below the backend.

`vulkan` is imported here lazily (inside `load_vulkan`), so `import vkml.vk` works on a machine
without libvulkan and fails only when a backend is actually constructed.
"""

from __future__ import annotations

import ctypes
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vkml.errors import DeviceError
from vkml.hal import Capabilities, seconds_from_env
from vkml.vk.select import DEVICE_TYPE_NAMES, no_device_message, select_device

VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
# How long a wait may last before the work is declared hung. Generous by default: a CPU driver on
# a loaded machine can take tens of seconds for what a GPU does in milliseconds. "inf" waits for
# ever (UINT64_MAX, Vulkan's "no timeout").
WAIT_TIMEOUT_NS = int(min(seconds_from_env("VKML_WAIT_TIMEOUT", 300.0, 0.001) * 10**9,
                          2**64 - 1))


# Features vkml can use, by their member names in the Vulkan feature structs.
FEATURES_11 = ("storageBuffer16BitAccess",)
FEATURES_12 = ("timelineSemaphore", "shaderFloat16", "vulkanMemoryModel",
               "vulkanMemoryModelDeviceScope")
FEATURES_COOP = ("cooperativeMatrix",)
FEATURES_BFLOAT16 = ("shaderBFloat16Type", "shaderBFloat16CooperativeMatrix")
FEATURE_STRUCT = {**dict.fromkeys(FEATURES_11, "VkPhysicalDeviceVulkan11Features"),
                  **dict.fromkeys(FEATURES_12, "VkPhysicalDeviceVulkan12Features"),
                  **dict.fromkeys(FEATURES_COOP, "VkPhysicalDeviceCooperativeMatrixFeaturesKHR"),
                  **dict.fromkeys(FEATURES_BFLOAT16, "VkPhysicalDeviceShaderBfloat16FeaturesKHR")}
EXTENSIONS = ("VK_KHR_cooperative_matrix", "VK_KHR_shader_bfloat16")

# VK_KHR_shader_bfloat16 is newer than the `vulkan` package's headers (1.3.275): its numbers,
# from the Vulkan registry, and its feature struct, laid out by hand (`Bfloat16Features`).
# VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR
BFLOAT16_FEATURES_STYPE = 1000141000
COMPONENT_TYPE_BFLOAT16 = 1000141000  # VK_COMPONENT_TYPE_BFLOAT16_KHR
# VkPhysicalDeviceShaderBfloat16FeaturesKHR's VkBool32 members in order, from byte 16 (after
# sType and pNext)
BFLOAT16_MEMBERS = ("shaderBFloat16Type", "shaderBFloat16DotProduct",
                    "shaderBFloat16CooperativeMatrix")


class Bfloat16Features:
    """A VkPhysicalDeviceShaderBfloat16FeaturesKHR in memory of its own: sType, pNext (as in
    VkBaseOutStructure), then the three VkBool32 of BFLOAT16_MEMBERS; 32 bytes, 8-aligned.
    `pointer` goes into a pNext chain."""

    def __init__(self, ffi: Any, enable: tuple[str, ...] = ()) -> None:
        self._memory = ffi.new("uint64_t[4]")
        self.pointer = ffi.cast("void *", self._memory)
        ffi.cast("VkBaseOutStructure *", self._memory).sType = BFLOAT16_FEATURES_STYPE
        self._flags = ffi.cast("VkBool32 *", ffi.cast("char *", self._memory) + 16)
        for name in enable:
            self._flags[BFLOAT16_MEMBERS.index(name)] = 1

    def __getitem__(self, name: str) -> bool:
        return bool(self._flags[BFLOAT16_MEMBERS.index(name)])


def bfloat16_configuration(configurations: list[tuple[int, ...]], subgroup_scope: int,
                           float32: int) -> bool:
    """Whether the cooperative-matrix configurations a device lists (M, N, K, A, B, C, result
    component types, scope) hold the one the kernels use with bfloat16 operands: 16 x 16 x 16,
    bfloat16 A and B, f32 C and result, in a subgroup."""
    return (16, 16, 16, COMPONENT_TYPE_BFLOAT16, COMPONENT_TYPE_BFLOAT16, float32, float32,
            subgroup_scope) in configurations


# Mesa's llvmpipe (lavapipe) ends a shader invocation's loops after this many iterations in all
# and carries on with what it has (seen with Mesa 22.3): kernels must split longer work there.
LLVMPIPE_LOOP_LIMIT = 65535


def _is_llvmpipe(driver: str, device_name: str) -> bool:
    return "llvmpipe" in device_name.lower() or "llvmpipe" in driver.lower()


@dataclass(frozen=True)
class Adopted:
    """Handles a host created (cffi handles of the `vulkan` package, or integers such as
    pyopenxr hands out), and what the host enabled on the device."""

    instance: Any
    physical_device: Any
    device: Any
    queue_family_index: int
    queue: Any
    enabled_features: frozenset[str] = frozenset()
    enabled_extensions: frozenset[str] = frozenset()
    require: frozenset[str] = frozenset()


def how_to_enable(name: str) -> str:
    if name in FEATURE_STRUCT:
        return (f"set {FEATURE_STRUCT[name]}.{name} = VK_TRUE in the pNext chain of the "
                "VkDeviceCreateInfo that creates the device, then pass "
                f"enabled_features=[..., {name!r}] to vkml.Device.from_vulkan")
    return (f"add {name!r} to VkDeviceCreateInfo.ppEnabledExtensionNames, then pass "
            f"enabled_extensions=[..., {name!r}] to vkml.Device.from_vulkan")


def check_declared(device_name: str, supported: dict[str, bool], extensions: set[str],
                   adopt: Adopted, vulkan_features: frozenset[str] = frozenset()) -> set[str]:
    """The features and extensions vkml may use on an adopted device: those the host declares
    enabled. A declaration the device cannot have, or a required one missing, is an error that
    names it. A host declares everything it enabled (an OpenXR runtime's extensions, a
    swapchain): extensions vkml does not use are ignored when the device has them, and so are
    features vkml does not use that are members of Vulkan's feature structs
    (`vulkan_features`); a name that is neither is refused (a misspelt feature would otherwise
    turn into a silent fallback)."""
    known = set(FEATURE_STRUCT) | set(EXTENSIONS)
    features, exts = set(adopt.enabled_features), set(adopt.enabled_extensions)
    unknown = sorted((features - set(FEATURE_STRUCT) - set(vulkan_features))
                     | (set(adopt.require) - known))
    if unknown:
        raise DeviceError(f"unknown feature or extension name(s) {unknown}; vkml knows features "
                          f"{sorted(FEATURE_STRUCT)} and extensions {list(EXTENSIONS)}")
    for name in sorted(exts - set(EXTENSIONS)):
        if name not in extensions:
            raise DeviceError(f"extension {name!r} is declared enabled but {device_name!r} does "
                              "not offer it, so the host cannot have enabled it")
    declared = (features & set(FEATURE_STRUCT)) | (exts & set(EXTENSIONS))
    for name in sorted(declared):
        ok = name in extensions if name in EXTENSIONS else supported.get(name, False)
        if not ok:
            raise DeviceError(f"{name!r} is declared enabled but {device_name!r} does not "
                              "support it, so the host cannot have enabled it")
    missing = sorted(set(adopt.require) - declared)
    if missing:
        raise DeviceError(f"the host's device lacks {', '.join(map(repr, missing))}, which vkml "
                          "was asked to require: " + "; ".join(how_to_enable(m) for m in missing))
    return declared


def vulkan_feature_names(ffi: Any) -> frozenset[str]:
    """Every member name of the core feature structs this `vulkan` package knows."""
    names: set[str] = set()
    for struct in ("VkPhysicalDeviceFeatures", "VkPhysicalDeviceVulkan11Features",
                   "VkPhysicalDeviceVulkan12Features", "VkPhysicalDeviceVulkan13Features"):
        try:
            names |= {field for field, _ in ffi.typeof(struct).fields}
        except ffi.error:  # an older `vulkan` package without that struct
            continue
    return frozenset(names - {"sType", "pNext"})


def as_handle(ffi: Any, ctype: str, value: Any, what: str, same_device_as: Any = None) -> Any:
    """A cffi handle of the dispatchable type `ctype` from a cffi handle (of that type, `void *`
    or an integer type), a ctypes pointer or an integer, checked before any driver sees it: a
    wrong handle crashes the process there instead of returning an error. The checks: the
    type; that the value is an aligned address above the first pages; that its memory can be
    read; and, given `same_device_as` (a handle of the device it must belong to), that its first
    word is that device's: the Vulkan loader writes its dispatch table pointer at the start of
    every dispatchable object, one table per device (command buffers and queues share their
    device's). Each failure is a DeviceError naming `what`."""
    want = ffi.typeof(ctype)
    expected = (f"expected a {ctype} (a `vulkan` cffi handle, or the handle as an integer as "
                "pyopenxr gives it)")
    if isinstance(value, ffi.CData):
        got = ffi.typeof(value)
        if got is not want and got.cname != "void *" and got.kind != "primitive":
            raise DeviceError(f"{what} is a cffi {got.cname}: {expected}")
        if got.kind == "primitive" and got.cname not in _INTEGER_CTYPES:
            raise DeviceError(f"{what} is a cffi {got.cname}: {expected}")
        raw: Any = int(ffi.cast("uintptr_t", value))
    else:
        raw = getattr(value, "value", value)  # ctypes.c_void_p and friends
        if raw is None:
            raw = 0
        if isinstance(raw, bool) or not isinstance(raw, numbers.Integral):
            raise DeviceError(f"{what}: {expected}, got {type(value).__name__}")
        raw = int(raw)
    if raw == 0:
        raise DeviceError(f"{what} is a null handle: {expected}")
    size = ffi.sizeof("void *")
    if not _MIN_ADDRESS <= raw < 2 ** (8 * size) or raw % size:
        raise DeviceError(f"{what} is {raw:#x}, which cannot be a {ctype} (a pointer the "
                          f"driver returned: aligned, above {_MIN_ADDRESS:#x}): {expected}")
    if _peek is not None:
        first = _peek(raw, size)
        if first is None:
            raise DeviceError(f"{what} is {raw:#x}, which points to no readable memory, so it "
                              f"is no live {ctype}: {expected}")
        if same_device_as is not None:
            reference = _peek(int(ffi.cast("uintptr_t", same_device_as)), size)
            if reference is not None and first != reference:
                raise DeviceError(f"{what} ({raw:#x}) is not a {ctype} of the device vkml runs "
                                  "on (its first word, the Vulkan loader's dispatch table, "
                                  "differs from that device's): give one allocated on that "
                                  "device, from a pool of its queue family")
    return ffi.cast(ctype, raw)


# No driver returns a pointer into the first 64 KiB (Linux's default mmap_min_addr; Windows
# reserves them too): below that a "handle" is a small number passed by mistake.
_MIN_ADDRESS = 0x10000
_INTEGER_CTYPES = frozenset({"uintptr_t", "intptr_t", "uint64_t", "int64_t", "unsigned long",
                             "long", "unsigned long long", "long long", "size_t"})


def _make_peek() -> Callable[[int, int], bytes | None] | None:
    """A function reading `n` bytes at an address, None where they are unmapped, without
    touching them from Python: write(2) from that address into a pipe fails with EFAULT rather
    than crash. None where there is no C library to call (Windows): the check is skipped."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        write = libc.write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t

    def peek(address: int, n: int) -> bytes | None:
        read_end, write_end = os.pipe()
        try:
            if write(write_end, address, n) != n:
                return None
            return os.read(read_end, n)
        finally:
            os.close(read_end)
            os.close(write_end)

    return peek


_peek = _make_peek()


def load_vulkan() -> ModuleType:
    try:
        import vulkan
    except (OSError, ImportError) as exc:
        raise DeviceError(
            f"no Vulkan loader (libvulkan.so.1) could be loaded ({exc}); install the loader and "
            "a driver (on Debian: apt-get install libvulkan1 mesa-vulkan-drivers) and the Python "
            "binding (pip install vulkan)"
        ) from exc
    return vulkan


def version_string(v: int) -> str:
    return f"{v >> 22 & 0x7F}.{v >> 12 & 0x3FF}.{v & 0xFFF}"


def _text(value: Any, ffi: Any) -> str:
    # The binding hands back `str` for some char arrays and raw cdata for others.
    return value if isinstance(value, str) else ffi.string(value).decode(errors="replace")


def _check(vk: ModuleType, result: int, what: str) -> None:
    if result != vk.VK_SUCCESS:
        name = getattr(vk.exception_codes.get(result), "__name__", str(result))
        raise DeviceError(f"{what} failed with {name}")


class Device:
    """A Vulkan instance + logical device with one compute queue, and what it can do (`caps`)."""

    def __init__(self, selector: str | None, want_timeline: bool = True,
                 adopt: Adopted | None = None) -> None:
        self.vk = vk = load_vulkan()
        self.ffi = vk.ffi
        self.lib = vk.lib
        self.validation_messages: list[str] = []
        self.instance: Any = None
        self.device: Any = None
        self._messenger: Any = None
        self._destroy_messenger: Any = None
        # cffi frees a callback when its object dies, and the layer would then call freed code.
        self._callback: Any = None
        # An adopted device (handles the host created) is never destroyed by vkml.
        self.owned = adopt is None
        self.enabled_features: frozenset[str] = frozenset()
        try:
            if adopt is None:
                self._create_instance()
                self._choose_physical_device(selector)
            else:
                self._adopt(adopt)
            self._create_device(want_timeline, adopt)
        except BaseException:
            self.close()
            raise

    # -- adopting the host's handles ------------------------------------------------------------

    def _adopt(self, adopt: Adopted) -> None:
        vk, ffi = self.vk, self.ffi
        self.instance = as_handle(ffi, "VkInstance", adopt.instance, "instance")
        self.physical = as_handle(ffi, "VkPhysicalDevice", adopt.physical_device,
                                  "physical_device")
        props = vk.vkGetPhysicalDeviceProperties(self.physical)
        self.device_name = _text(props.deviceName, ffi)
        self.device_type = DEVICE_TYPE_NAMES.get(props.deviceType, "other")
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        qfi = int(adopt.queue_family_index)
        if not 0 <= qfi < len(families):
            raise DeviceError(f"queue_family_index {qfi} does not exist on {self.device_name!r} "
                              f"(it has {len(families)} queue families)")
        if not families[qfi].queueFlags & vk.VK_QUEUE_COMPUTE_BIT:
            raise DeviceError(f"queue family {qfi} of {self.device_name!r} lacks "
                              "VK_QUEUE_COMPUTE_BIT: vkml needs a queue that runs compute "
                              "shaders (a graphics queue family has it on every Vulkan device)")
        self.queue_family = qfi
        self.timestamp_valid_bits = families[qfi].timestampValidBits
        self.device = as_handle(ffi, "VkDevice", adopt.device, "device")
        self.queue = as_handle(ffi, "VkQueue", adopt.queue, "queue", same_device_as=self.device)

    # -- instance -----------------------------------------------------------------------------

    def _create_instance(self) -> None:
        vk, ffi = self.vk, self.ffi
        loader_version = vk.vkEnumerateInstanceVersion()
        if loader_version < vk.VK_MAKE_VERSION(1, 2, 0):
            raise DeviceError(
                f"the Vulkan loader supports only API {version_string(loader_version)}; vkml "
                "needs 1.2 or newer (on Debian: apt-get install libvulkan1 from a current release)"
            )
        api = min(loader_version, vk.VK_MAKE_VERSION(1, 3, 0))

        env_layers = os.environ.get("VK_INSTANCE_LAYERS", "")
        explicit = os.environ.get("VKML_VALIDATION", "") == "1"
        validate = VALIDATION_LAYER in env_layers or explicit
        layers: list[str] = []
        if explicit and VALIDATION_LAYER not in env_layers:
            available = {_text(p.layerName, ffi) for p in vk.vkEnumerateInstanceLayerProperties()}
            if VALIDATION_LAYER in available:
                layers.append(VALIDATION_LAYER)
            else:
                print(f"vkml: VKML_VALIDATION=1 but {VALIDATION_LAYER} is not installed "
                      "(on Debian: apt-get install vulkan-validationlayers)", file=sys.stderr)
        extensions: list[str] = []
        if validate:
            names = {_text(e.extensionName, ffi)
                     for e in vk.vkEnumerateInstanceExtensionProperties(None)}
            if layers or VALIDATION_LAYER in env_layers:
                try:
                    names |= {_text(e.extensionName, ffi)
                              for e in vk.vkEnumerateInstanceExtensionProperties(VALIDATION_LAYER)}
                except vk.VkError:
                    pass  # the layer is named in the env but not installed: the loader says so
            if "VK_EXT_debug_utils" in names:
                extensions.append("VK_EXT_debug_utils")

        # Every string and struct the create call points at lives in a local until it returns.
        app_name = ffi.new("char[]", b"vkml")
        app = ffi.new("VkApplicationInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, "pApplicationName": app_name,
            "pEngineName": app_name, "apiVersion": api,
        })
        layer_strs = [ffi.new("char[]", s.encode()) for s in layers]
        ext_strs = [ffi.new("char[]", s.encode()) for s in extensions]
        layer_arr = ffi.new("char*[]", layer_strs) if layers else ffi.NULL
        ext_arr = ffi.new("char*[]", ext_strs) if extensions else ffi.NULL
        messenger_info = self._messenger_info() if extensions else ffi.NULL
        info = ffi.new("VkInstanceCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
            # Chained here too so messages from vkCreateInstance/vkDestroyInstance are caught.
            "pNext": messenger_info, "pApplicationInfo": app,
            "enabledLayerCount": len(layers), "ppEnabledLayerNames": layer_arr,
            "enabledExtensionCount": len(extensions), "ppEnabledExtensionNames": ext_arr,
        })
        out = ffi.new("VkInstance*")
        result = self.lib.vkCreateInstance(info, ffi.NULL, out)
        if result == vk.VK_ERROR_INCOMPATIBLE_DRIVER:
            raise DeviceError(no_device_message())
        _check(vk, result, "vkCreateInstance")
        self.instance = out[0]
        if extensions:
            create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
            self._destroy_messenger = vk.vkGetInstanceProcAddr(
                self.instance, "vkDestroyDebugUtilsMessengerEXT")
            self._messenger = create(self.instance, messenger_info, None)

    def _messenger_info(self) -> Any:
        vk, ffi = self.vk, self.ffi
        if self._callback is None:
            self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self._on_message)
        return ffi.new("VkDebugUtilsMessengerCreateInfoEXT*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            # INFO/VERBOSE are the loader's and layer's chatter; only problems are recorded.
            "messageSeverity": vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            "messageType": vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT,
            "pfnUserCallback": self._callback,
        })

    def _on_message(self, severity: int, _types: int, data: Any, _user: Any) -> int:
        ffi = self.ffi
        message = ffi.string(data.pMessage).decode(errors="replace") if data.pMessage else ""
        ident = ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        # The loader reports at WARNING that the env var enabled the layer: that is the setup
        # working, not a problem.
        if ident == "Loader Message" and message.startswith("env var "):
            return self.vk.VK_FALSE
        self.validation_messages.append(message)
        if severity & self.vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT:
            print(f"vkml: Vulkan validation error: {message}", file=sys.stderr)
        return self.vk.VK_FALSE

    # -- physical device ----------------------------------------------------------------------

    def _choose_physical_device(self, selector: str | None) -> None:
        vk, ffi = self.vk, self.ffi
        try:
            physical = vk.vkEnumeratePhysicalDevices(self.instance)
        except (vk.VkError, vk.VkException) as exc:
            raise DeviceError(no_device_message()) from exc
        described = []
        for pd in physical:
            props = vk.vkGetPhysicalDeviceProperties(pd)
            described.append((_text(props.deviceName, ffi),
                              DEVICE_TYPE_NAMES.get(props.deviceType, "other")))
        if selector is None:
            selector = os.environ.get("VKML_DEVICE")
        index = select_device(described, selector)
        self.physical = physical[index]
        self.device_name, self.device_type = described[index]

        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        compute = [i for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise DeviceError(f"Vulkan device {self.device_name!r} has no compute queue")
        # A universal (graphics+compute) family: it always supports timestamps, and it is the
        # queue a host renderer shares with us, so one lock can serialize both.
        universal = [i for i in compute if families[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT]
        self.queue_family = (universal or compute)[0]
        self.timestamp_valid_bits = families[self.queue_family].timestampValidBits

    # -- logical device -----------------------------------------------------------------------

    def _create_device(self, want_timeline: bool, adopt: Adopted | None = None) -> None:
        vk, ffi, lib = self.vk, self.ffi, self.lib
        pd = self.physical
        extensions = {_text(e.extensionName, ffi)
                      for e in vk.vkEnumerateDeviceExtensionProperties(pd, None)}
        props = ffi.new("VkPhysicalDeviceProperties2*",
                        {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2})
        lib.vkGetPhysicalDeviceProperties2(pd, props)
        device_api = props.properties.apiVersion
        modern = device_api >= vk.VK_MAKE_VERSION(1, 2, 0)

        subgroup = ffi.new("VkPhysicalDeviceSubgroupProperties*",
                           {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES})
        driver = ffi.new("VkPhysicalDeviceDriverProperties*",
                         {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES,
                          "pNext": subgroup})
        if modern:
            props.pNext = driver
            lib.vkGetPhysicalDeviceProperties2(pd, props)
            subgroup_size = subgroup.subgroupSize
            driver_text = (f"{_text(driver.driverName, ffi)}: {_text(driver.driverInfo, ffi)}")
        else:
            subgroup_size = 32  # a 1.0/1.1 device: the Vulkan 1.2 property chain is not allowed
            driver_text = f"driver version {props.properties.driverVersion:#x}"
        limits = props.properties.limits
        self.pipeline_cache_key = (
            f"{props.properties.vendorID:04x}-{props.properties.deviceID:04x}-"
            f"{props.properties.driverVersion:x}-"
            + bytes(list(props.properties.pipelineCacheUUID)).hex()
        )

        # Query which optional features exist, then enable exactly those we use.
        coop_ext = "VK_KHR_cooperative_matrix" in extensions
        bf16_ext = coop_ext and "VK_KHR_shader_bfloat16" in extensions
        q_bf16 = Bfloat16Features(ffi)
        coop_stype = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        q_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {
            "sType": coop_stype, "pNext": q_bf16.pointer if bf16_ext else ffi.NULL})
        q12 = ffi.new("VkPhysicalDeviceVulkan12Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                       "pNext": q_coop if coop_ext else ffi.NULL})
        q11 = ffi.new("VkPhysicalDeviceVulkan11Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                       "pNext": q12})
        if modern:
            q2 = ffi.new("VkPhysicalDeviceFeatures2*",
                         {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": q11})
            lib.vkGetPhysicalDeviceFeatures2(pd, q2)
        if adopt is not None:
            # Vulkan cannot be asked which features a device was created with: the host says.
            supported = {name: bool(getattr(q, name)) for q, names in (
                (q11, FEATURES_11), (q12, FEATURES_12), (q_coop, FEATURES_COOP))
                for name in names} if modern else {}
            if not coop_ext:
                supported.update(dict.fromkeys(FEATURES_COOP, False))
            if modern:
                supported.update({name: bf16_ext and q_bf16[name] for name in FEATURES_BFLOAT16})
            on = check_declared(self.device_name, supported, extensions, adopt,
                                vulkan_feature_names(ffi))
            self.enabled_features = frozenset(on)
            self.timeline = bool(want_timeline and "timelineSemaphore" in on)
            f16 = {"shaderFloat16", "storageBuffer16BitAccess"} <= on
            memory_model = "vulkanMemoryModel" in on
            coop = bool({"cooperativeMatrix", "VK_KHR_cooperative_matrix"} <= on and f16
                        and memory_model)
            bf16 = (coop and {*FEATURES_BFLOAT16, "VK_KHR_shader_bfloat16"} <= on
                    and self._bfloat16_configuration(pd))
            self._finish(pd, device_api, driver_text, subgroup_size, limits, extensions, f16,
                         coop, bf16)
            return
        self.timeline = bool(want_timeline and q12.timelineSemaphore)
        f16 = bool(q12.shaderFloat16 and q11.storageBuffer16BitAccess)
        memory_model = bool(q12.vulkanMemoryModel)
        coop = bool(coop_ext and q_coop.cooperativeMatrix and f16 and memory_model)
        bf16 = (coop and bf16_ext and all(q_bf16[name] for name in FEATURES_BFLOAT16)
                and self._bfloat16_configuration(pd))
        self.enabled_features = frozenset(
            name for name, on in (("timelineSemaphore", self.timeline), ("shaderFloat16", f16),
                                  ("storageBuffer16BitAccess", f16),
                                  ("vulkanMemoryModel", memory_model),
                                  ("cooperativeMatrix", coop),
                                  *((name, bf16) for name in FEATURES_BFLOAT16)) if on)

        e_bf16 = Bfloat16Features(ffi, enable=FEATURES_BFLOAT16)
        e_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {
            "sType": coop_stype, "pNext": e_bf16.pointer if bf16 else ffi.NULL,
            "cooperativeMatrix": vk.VK_TRUE})
        e12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
            "pNext": e_coop if coop else ffi.NULL,
            "timelineSemaphore": self.timeline, "shaderFloat16": f16,
            "vulkanMemoryModel": memory_model,
            "vulkanMemoryModelDeviceScope": bool(q12.vulkanMemoryModelDeviceScope)})
        e11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": e12,
            "storageBuffer16BitAccess": f16})
        enabled_exts = [*(["VK_KHR_cooperative_matrix"] if coop else []),
                        *(["VK_KHR_shader_bfloat16"] if bf16 else [])]
        ext_strs = [ffi.new("char[]", s.encode()) for s in enabled_exts]
        ext_arr = ffi.new("char*[]", ext_strs) if ext_strs else ffi.NULL
        priority = ffi.new("float[1]", [1.0])
        queue_info = ffi.new("VkDeviceQueueCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
            "queueFamilyIndex": self.queue_family, "queueCount": 1,
            "pQueuePriorities": priority})
        info = ffi.new("VkDeviceCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
            "pNext": e11 if modern else ffi.NULL,
            "queueCreateInfoCount": 1, "pQueueCreateInfos": queue_info,
            "enabledExtensionCount": len(enabled_exts), "ppEnabledExtensionNames": ext_arr})
        out = ffi.new("VkDevice*")
        _check(vk, lib.vkCreateDevice(pd, info, ffi.NULL, out),
               f"vkCreateDevice on {self.device_name!r}")
        self.device = out[0]
        queue = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, self.queue_family, 0, queue)
        self.queue = queue[0]
        self._finish(pd, device_api, driver_text, subgroup_size, limits, extensions, f16, coop,
                     bf16)

    def _bfloat16_configuration(self, pd: Any) -> bool:
        """Whether the device lists the cooperative-matrix configuration the kernels take with
        bfloat16 operands (`bfloat16_configuration`). A failed query is a no."""
        vk, ffi, lib = self.vk, self.ffi, self.lib
        name = "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
        get = ffi.cast(f"PFN_{name}", lib.vkGetInstanceProcAddr(self.instance, name.encode()))
        if get == ffi.NULL:
            return False
        count = ffi.new("uint32_t *")
        if get(pd, count, ffi.NULL) != vk.VK_SUCCESS:
            return False
        listed = ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
        for entry in listed:
            entry.sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
        if get(pd, count, listed) not in (vk.VK_SUCCESS, vk.VK_INCOMPLETE):
            return False
        return bfloat16_configuration(
            [(p.MSize, p.NSize, p.KSize, p.AType, p.BType, p.CType, p.ResultType, p.scope)
             for p in listed[0:count[0]]],
            vk.VK_SCOPE_SUBGROUP_KHR, vk.VK_COMPONENT_TYPE_FLOAT32_KHR)

    def _finish(self, pd: Any, device_api: int, driver_text: str, subgroup_size: int,
                limits: Any, extensions: set[str], f16: bool, coop: bool, bf16: bool) -> None:
        vk = self.vk
        memory = vk.vkGetPhysicalDeviceMemoryProperties(pd)
        self.memory_types = [(memory.memoryTypes[i].propertyFlags, memory.memoryTypes[i].heapIndex)
                             for i in range(memory.memoryTypeCount)]
        self.heap_sizes = [memory.memoryHeaps[i].size for i in range(memory.memoryHeapCount)]

        timestamps = self.timestamp_valid_bits > 0 and limits.timestampPeriod > 0
        self.caps = Capabilities(
            device_name=self.device_name,
            device_type=self.device_type,
            api_version=version_string(device_api),
            driver=driver_text,
            max_workgroup_invocations=limits.maxComputeWorkGroupInvocations,
            max_workgroup_size=tuple(limits.maxComputeWorkGroupSize),
            max_workgroup_count=tuple(limits.maxComputeWorkGroupCount),
            max_shared_memory_bytes=limits.maxComputeSharedMemorySize,
            min_storage_offset_alignment=limits.minStorageBufferOffsetAlignment,
            max_storage_buffer_range=limits.maxStorageBufferRange,
            max_bindings_per_stage=limits.maxPerStageDescriptorStorageBuffers,
            subgroup_size=subgroup_size,
            timestamp_period_ns=float(limits.timestampPeriod) if timestamps else 0.0,
            max_loop_iterations=LLVMPIPE_LOOP_LIMIT if _is_llvmpipe(driver_text,
                                                                   self.device_name) else None,
            cooperative_matrix=coop,
            bf16_cooperative_matrix=bf16,
            shader_f16=f16,
            extensions=frozenset(extensions),
            dispatch_base=device_api >= self.vk.VK_MAKE_VERSION(1, 1, 0),
        )

    def close(self) -> None:
        if not self.owned:  # the host's handles: forget them, destroy nothing
            self.device = self.instance = None
            return
        if self.device is not None:
            self.lib.vkDestroyDevice(self.device, self.ffi.NULL)
            self.device = None
        if self._messenger is not None:
            self._destroy_messenger(self.instance, self._messenger, None)
            self._messenger = None
        if self.instance is not None:
            self.lib.vkDestroyInstance(self.instance, self.ffi.NULL)
            self.instance = None
