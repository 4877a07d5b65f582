"""Every error vkml raises on purpose; each message names the input at fault and the fix."""


class VkmlError(Exception):
    """Base class: catch this to catch anything vkml raises on purpose."""


class GraphError(VkmlError):
    """A graph cannot be built as written (shape or dtype mismatch, unknown name, bad argument)."""


class InputError(VkmlError):
    """A value handed to a session does not fit (unknown name, wrong shape or dtype)."""


class NagaError(VkmlError):
    """naga rejected a generated kernel; the message carries naga's report and the WGSL."""


class DeviceError(VkmlError):
    """No usable Vulkan device, or the device failed an operation."""
