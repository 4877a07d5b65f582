"""Every error vkml raises on purpose; each message names the input at fault and the fix."""

from __future__ import annotations


class VkmlError(Exception):
    """Base class: catch this to catch anything vkml raises on purpose."""


class GraphError(VkmlError):
    """A graph cannot be built as written (shape or dtype mismatch, unknown name, bad argument)."""


class InputError(VkmlError):
    """A value handed to a session does not fit (unknown name, wrong shape or dtype)."""


class NotComputedError(InputError):
    """A session was asked for an output or gradient that no step has computed yet."""


class NonFiniteError(VkmlError):
    """A step's loss was NaN or infinite (compile(..., check_finite=True)); it changed nothing."""


class CheckpointError(InputError):
    """A checkpoint cannot be read, written or loaded into this session (an unreadable or
    malformed file, a tensor that does not fit, another optimizer's state). A load that raises
    it has changed nothing; the cause (an OSError, safetensors' own error) is kept as
    `__cause__`."""


class NagaError(VkmlError):
    """naga rejected a generated kernel; the message carries naga's report and the WGSL."""

    report: str | None = None
    wgsl: str = ""
    kernel_name: str = ""

    @classmethod
    def for_kernel(cls, message: str, name: str, wgsl: str, report: str | None) -> NagaError:
        """`message`, then the kernel's WGSL with line numbers to match naga's report."""
        lines = wgsl.splitlines()
        width = len(str(len(lines)))
        numbered = "\n".join(f"{i:>{width}} | {line}" for i, line in enumerate(lines, 1))
        err = cls(f"{message}\n--- WGSL of '{name}' (numbered) ---\n{numbered}")
        err.report, err.wgsl, err.kernel_name = report, wgsl, name
        return err


class DeviceError(VkmlError):
    """No usable Vulkan device, or the device failed an operation."""


class ModelImportError(VkmlError, ImportError):
    """A model file or program cannot be imported: unreadable, malformed or truncated, an opset
    or external-data file that is not there, or ops vkml cannot run. Everything that is wrong is
    listed at once (every unsupported op type with its count and first nodes, every node whose
    output would depend on data at run time), and nothing is built."""
