"""Pure device-choice logic, kept free of `vulkan` so it is testable on a machine with no GPU."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.errors import DeviceError

# Lower is better: a discrete GPU beats the others; a CPU rasterizer (lavapipe) is the last resort.
_PREFERENCE = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}

# VkPhysicalDeviceType values from the Vulkan spec, mapped to Capabilities.device_type strings.
DEVICE_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


def rank_devices(devices: Sequence[tuple[str, str]]) -> list[int]:
    """Indices of `devices` ((name, type) pairs) from most to least preferred.

    Ties keep enumeration order, so the driver's own ordering decides between equal devices.
    """
    return sorted(range(len(devices)), key=lambda i: (_PREFERENCE.get(devices[i][1], 4), i))


def describe_devices(devices: Sequence[tuple[str, str]]) -> str:
    return "\n".join(f"  [{i}] {name} ({kind})" for i, (name, kind) in enumerate(devices))


def select_device(devices: Sequence[tuple[str, str]], selector: str | None) -> int:
    """The index to use: the best-ranked device, or the one `selector` names.

    `selector` is an index into the enumeration or a case-insensitive substring of the name.
    """
    if not devices:
        raise DeviceError(no_device_message())
    if selector is None or selector.strip() == "":
        return rank_devices(devices)[0]
    text = selector.strip()
    if text.isdigit():
        if int(text) < len(devices):
            return int(text)
    else:
        matches = [i for i, (name, _) in enumerate(devices) if text.lower() in name.lower()]
        if matches:
            return min(matches, key=rank_devices(devices).index)
    raise DeviceError(
        f"no Vulkan device matches {selector!r} (from the selector argument or VKML_DEVICE); "
        f"give an index or part of a name. Devices available:\n{describe_devices(devices)}"
    )


def no_device_message() -> str:
    return (
        "the Vulkan loader found no physical device: no Vulkan driver (ICD) is installed or "
        "the ones named by VK_DRIVER_FILES / VK_ICD_FILENAMES do not exist or failed to load. "
        "On Debian/Ubuntu install a driver with `apt-get install mesa-vulkan-drivers` (lavapipe "
        "runs on the CPU) or your GPU vendor's driver, and unset VK_DRIVER_FILES / "
        "VK_ICD_FILENAMES or point them at an existing ICD json (e.g. "
        "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json). Set VK_LOADER_DEBUG=all to see why."
    )
