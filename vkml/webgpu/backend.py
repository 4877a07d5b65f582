"""WgpuBackend: the vkml.hal.Backend contract on wgpu-py (wgpu-native), for Metal and others.

The same plan and the same WGSL run here as on `vkml/vk/`; wgpu compiles the WGSL itself. This
is the only module that imports `wgpu`, and only when a backend is constructed, so `import vkml`
never needs it.

What WebGPU does not allow, and what this module does about it:
- A command buffer runs once. `record` therefore builds everything that can be reused (bind
  groups, the flat command list), and encoding only replays that list: one compute pass per
  run of dispatches, three calls per dispatch, made straight into wgpu-native's C functions
  (wgpu-py's wrapper of each call, which checks for an error, costs more than the call; a
  compute pass reports its commands' errors when it ends, which still goes through wgpu-py).
  A program submitted a second time is one that repeats (a step), so from then on each
  submission queues a command buffer encoded ahead and then encodes the next one while the
  device runs this one: the host's per-dispatch work overlaps the device's instead of delaying
  it. Encoding ahead is safe because what a command buffer reads is decided when it runs:
  queue writes made after it was encoded land before it.
- There are no explicit barriers: WebGPU makes each dispatch's writes visible to the next one
  by itself, so `Barrier` commands are dropped.
- One buffer may not be copied to itself; such a copy goes through a scratch buffer.
- One buffer may not be bound both read-only and writable in one dispatch: the capabilities say
  `read_only_storage=False`, so codegen declares every storage binding read_write.
- There is no dispatch with a base workgroup (Vulkan's vkCmdDispatchBase), by which a step is
  cut inside a dispatch: the capabilities say `base_in_uniform`, so codegen has a kernel that
  may be cut add a base read from a uniform to its workgroup id, and each dispatch of it binds
  its base there (a 16-byte slot of its program's uniform buffer, one slot per distinct base).
- A texture copy spaces rows in its buffer by a multiple of 256 bytes: host_resources.row_pitch
  says so, and the frame kernels read and write rows that far apart.
Optional capabilities: device timestamps where the adapter has them; a host's GPUBuffers and
GPUTextures (host_resources, on a device adopted with Device.from_wgpu); no timeline semaphore
and no recording into a host's command buffers.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Sequence
from typing import Any

from vkml.errors import DeviceError, NagaError
from vkml.hal import (
    WAIT_POLL_S,
    BackendBase,
    BackendTimestamps,
    BufferKind,
    Capabilities,
    Command,
    Copy,
    CopyFromImage,
    CopyToImage,
    Dispatch,
    Fill,
    HostWrite,
    ImageRegion,
    Kernel,
)
from vkml.interrupts import deferred_interrupts
from vkml.webgpu.buffer import Buffer
from vkml.webgpu.host_resources import ROW_ALIGN, HostResources, ImportedTexture, row_pitch

# WebGPU's default, and what a browser guarantees. Adapters may allow less (lavapipe says 32), but
# a plan laid out for 256 is valid on every WebGPU implementation, so this is not lowered.
STORAGE_OFFSET_ALIGNMENT = 256
# The most queries a WebGPU query set holds (an even number: a dispatch's two stay together).
QUERY_SET_SIZE = 4096
# wgpu's copies, queue writes and mapped ranges work in whole 4-byte words.
COPY_ALIGN = 4
# A dispatch's base workgroup as its kernel reads it (kernels/common.py BASE_UNIFORM: vec4<u32>).
BASE_BYTES = 16

# Limits raised from WebGPU's defaults (128 MiB bindings, 8 storage buffers per stage, 16 KiB of
# workgroup memory, ...) to what the adapter offers, so planning and codegen see the real device.
_RAISED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-compute-workgroups-per-dimension",
)
_OPTIONAL_FEATURES = ("shader-f16", "subgroup", "timestamp-query")
_DEVICE_TYPES = {"DiscreteGPU": "discrete", "IntegratedGPU": "integrated",
                 "VirtualGPU": "virtual", "CPU": "cpu"}


def _aligned_range(offset: int, nbytes: int) -> tuple[int, int]:
    start = offset - offset % COPY_ALIGN
    end = -(-(offset + nbytes) // COPY_ALIGN) * COPY_ALIGN
    return start, end - start


class Pipeline:
    __slots__ = ("dispatch_base", "handle", "layout", "name", "num_bindings")

    def __init__(self, name: str, handle: Any, layout: Any, num_bindings: int,
                 dispatch_base: bool) -> None:
        self.name, self.handle, self.layout, self.num_bindings = name, handle, layout, num_bindings
        # Its kernel reads a base workgroup from a uniform bound after its storage bindings
        # (caps.base_in_uniform), so its dispatches may start at a base.
        self.dispatch_base = dispatch_base

    def __repr__(self) -> str:
        return f"<wgpu.Pipeline {self.name!r}>"


class Program:
    """A recorded command list: `segments` alternate compute passes (lists of (pipeline, bind
    group or None, x, y, z), as wgpu-native's C handles) and the encoder's transfers ((method
    name, its arguments): copies and fills); `objects` holds the wgpu-py objects owning those
    handles (the pipelines, the bind groups), which live as long as the program, as do any
    scratch buffer and the uniform buffer of its dispatches' base workgroups (`bases`).
    `ahead` is its next command buffer, encoded ahead once it has been submitted twice."""

    __slots__ = ("ahead", "bases", "label", "num_dispatches", "objects", "scratch", "segments",
                 "submissions", "queries", "resolved", "timings")

    def __init__(self, label: str) -> None:
        self.label = label
        self.segments: list[list[tuple[Any, ...]] | tuple[Any, ...]] | None = []
        self.num_dispatches = 0
        self.objects: list[Any] = []
        self.submissions = 0
        self.ahead: Any = None
        self.scratch: Any = None
        self.bases: Any = None
        # With timestamps: query sets (a begin and an end per dispatch), the buffer they resolve
        # into and the readable copy of it.
        self.queries: Any = None
        self.resolved: Any = None
        self.timings: Any = None

    def __repr__(self) -> str:
        return f"<wgpu.Program {self.label!r} {self.num_dispatches} dispatches>"


class _ErrorLog(logging.Handler):
    """wgpu-py raises most validation errors from the call that caused them; the rest (errors
    the device reports later, outside any call) it only logs. Those land here."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_wgpu() -> Any:
    try:
        import wgpu
        import wgpu.backends.wgpu_native  # the default backend, imported to read its version
    except ImportError as exc:
        raise DeviceError(
            f"the wgpu backend needs wgpu-py ({exc}); install it with `pip install vkml[wgpu]` "
            "or `pip install wgpu==0.32.0`") from exc
    return wgpu


def _describe(adapter: Any) -> tuple[str, str]:
    info = adapter.info
    return (f"{info['device']} ({info['backend_type']})",
            _DEVICE_TYPES.get(info["adapter_type"], "other"))


def _choose_adapter(adapters: Sequence[Any], selector: str | None) -> Any:
    """The best adapter, or the one `selector` names (an index or part of a name).

    Preference: discrete, integrated, virtual, CPU; within a kind, any backend before OpenGL,
    whose compute support is the weakest.
    """
    described = [_describe(a) for a in adapters]
    listing = "\n".join(f"  [{i}] {name} ({kind})" for i, (name, kind) in enumerate(described))
    if not adapters:
        raise DeviceError("wgpu found no adapter: no Metal, Vulkan, D3D12 or OpenGL driver "
                          "could be loaded (set RUST_LOG=wgpu_hal=info to see why)")
    order = sorted(range(len(adapters)), key=lambda i: (
        ["discrete", "integrated", "virtual", "cpu", "other"].index(described[i][1]),
        adapters[i].info["backend_type"] == "OpenGL", i))
    text = (selector or "").strip()
    if not text:
        return adapters[order[0]]
    if text.isdigit() and int(text) < len(adapters):
        return adapters[int(text)]
    for i in order:
        if text.lower() in described[i][0].lower():
            return adapters[i]
    raise DeviceError(f"no wgpu adapter matches {selector!r} (from the selector argument or "
                      f"VKML_DEVICE); give an index or part of a name. Adapters:\n{listing}")


class WgpuBackend(BackendBase):
    """One wgpu adapter and device (Metal on macOS; Vulkan, D3D12 or OpenGL elsewhere)."""

    def __init__(self, selector: str | None = None, *, adopt: Any = None) -> None:
        """A device of the adapter `selector` picks, opened by vkml; or, with `adopt`, a host's
        wgpu.GPUDevice (Device.from_wgpu), used with the features and limits the host gave it
        and never destroyed by vkml."""
        super().__init__()
        self._wgpu = wgpu = _load_wgpu()
        self._log = _ErrorLog(self.validation_messages)
        self._buffers: set[Buffer] = set()
        self._host_objects: set[object] = set()  # the host's buffers and textures (bind_input)
        # Counted only (wgpu frees what nothing references): see live_objects()
        self._pipelines: set[Pipeline] = set()
        self._programs: set[Program] = set()
        self._pending = False
        if adopt is None:
            adapter = _choose_adapter(wgpu.gpu.enumerate_adapters_sync(), selector)
            features = [f for f in _OPTIONAL_FEATURES if f in adapter.features]
            limits = {k: adapter.limits[k] for k in _RAISED_LIMITS if k in adapter.limits}
            try:
                self._device = adapter.request_device_sync(
                    label="vkml", required_features=features, required_limits=limits)
            except Exception as exc:  # wgpu-py raises RuntimeError or GPUError subclasses
                raise DeviceError(f"wgpu could not open {_describe(adapter)[0]!r}: "
                                  f"{exc}") from exc
        else:
            if not isinstance(adopt, wgpu.GPUDevice):
                raise DeviceError(f"Device.from_wgpu takes the host's wgpu.GPUDevice, got "
                                  f"{type(adopt).__name__}")
            self._device, self.owned = adopt, False
            adapter = adopt.adapter
            features = [f for f in _OPTIONAL_FEATURES if f in adopt.features]
        self._queue = self._device.queue
        logging.getLogger("wgpu").addHandler(self._log)
        # wgpu-native's C functions, cffi's types and wgpu-py's wrappers of both, for what
        # wgpu-py's classes do slowly or not at all (the encoding loop, _shader_module)
        self._api = wgpu.backends.wgpu_native._api
        self._ffi, self._lib, self._null = self._api.ffi, self._api.lib, self._api.ffi.NULL

        info, lim = adapter.info, self._device.limits
        native = wgpu.backends.wgpu_native
        self.caps = Capabilities(
            device_name=info["device"],
            device_type=_describe(adapter)[1],
            api_version=f"wgpu-native {'.'.join(map(str, native.lib_version_info))} over "
                        f"{info['backend_type']}",
            driver=info["description"] or info["vendor"],
            max_workgroup_invocations=lim["max-compute-invocations-per-workgroup"],
            max_workgroup_size=(lim["max-compute-workgroup-size-x"],
                                lim["max-compute-workgroup-size-y"],
                                lim["max-compute-workgroup-size-z"]),
            max_workgroup_count=(lim["max-compute-workgroups-per-dimension"],) * 3,
            max_shared_memory_bytes=lim["max-compute-workgroup-storage-size"],
            min_storage_offset_alignment=max(STORAGE_OFFSET_ALIGNMENT,
                                             lim["min-storage-buffer-offset-alignment"]),
            max_storage_buffer_range=min(lim["max-storage-buffer-binding-size"],
                                         lim["max-buffer-size"]),
            max_bindings_per_stage=lim["max-storage-buffers-per-shader-stage"],
            # WebGPU reports only a range; the smallest size is the one a kernel may rely on.
            # (wgpu-py 0.32 spells the key "stackgroup_min_size".)
            subgroup_size=int(info.get("subgroup_min_size", info.get("stackgroup_min_size", 4))),
            timestamp_period_ns=1.0 if "timestamp-query" in features else 0.0,  # WebGPU: ns
            cooperative_matrix=False,
            shader_f16="shader-f16" in features,
            extensions=frozenset(str(f) for f in self._device.features),
            read_only_storage=False,
            dispatch_base=True,
            base_in_uniform=True,
            # wgpu over Mesa's llvmpipe inherits its loop limit (see vkml/vk/context.py)
            max_loop_iterations=65535 if "llvmpipe" in info["device"].lower() else None,
        )
        self._poll_s = 0.0 if self.caps.device_type == "cpu" else WAIT_POLL_S
        if "timestamp-query" in features:
            self.timestamps = BackendTimestamps(functools.partial(self._record, timestamps=True),
                                                self._timings)

    # -- buffers ------------------------------------------------------------------------------

    def create_buffer(self, nbytes: int, kind: BufferKind, label: str) -> Buffer:
        self._alive()
        usage = self._wgpu.BufferUsage
        if kind == "readback":
            flags = usage.MAP_READ | usage.COPY_DST
        elif kind == "upload":
            # Written with queue.write_buffer, which wgpu orders before the next submission;
            # a MAP_WRITE buffer would need a map/unmap round trip around every step.
            flags = usage.COPY_SRC | usage.COPY_DST
        else:
            flags = usage.STORAGE | usage.COPY_SRC | usage.COPY_DST
        size = max(COPY_ALIGN, -(-nbytes // COPY_ALIGN) * COPY_ALIGN)
        if size > self._device.limits["max-buffer-size"]:
            raise DeviceError(f"buffer {label!r} of {nbytes} bytes exceeds the device's "
                              f"max-buffer-size={self._device.limits['max-buffer-size']}")
        handle = self._device.create_buffer(label=label, size=size, usage=flags)
        buf = Buffer(handle, nbytes, kind, label)
        self._buffers.add(buf)
        return buf

    def free_buffer(self, buffer: Buffer) -> None:
        """Release `buffer`; the caller guarantees no pending or recorded program still uses it."""
        if buffer in self._buffers:
            self._buffers.discard(buffer)
            buffer.handle.destroy()

    def write_buffer(self, buffer: Buffer, offset: int, data: bytes | memoryview) -> None:
        """Host -> buffer, in queue order: it lands before any later submit runs."""
        self.check_transfer("write", buffer, offset, memoryview(data).nbytes)
        self._write(buffer, offset, data)

    def _write(self, buffer: Buffer, offset: int, data: bytes | memoryview) -> None:
        """write_buffer after its range check."""
        n = memoryview(data).nbytes
        if n == 0:
            return
        start, size = _aligned_range(offset, n)
        if (start, size) != (offset, n):  # keep the bytes around a write of partial words
            merged = bytearray(self._read(buffer, start, size))
            merged[offset - start:offset - start + n] = memoryview(data).cast("B")
            data, offset = merged, start
        self._queue.write_buffer(buffer.handle, offset, data)

    def write_buffers(self, writes: Sequence[HostWrite]) -> None:
        """Data as write_buffer writes it; zeros in whole words cleared by the device in one
        submission (a session's optimizer state: SmolLM2 training's 1.1 GB would otherwise
        cross the bus as bytes)."""
        for w in writes:
            self.check_transfer("write", w.buffer, w.offset, w.nbytes)
        fills = [Fill(w.buffer, w.offset, w.nbytes) for w in writes if w.nbytes and w.fills]
        if fills:
            self.run_now(fills)
        for w in writes:
            if not w.fills:
                self._write(w.buffer, w.offset, bytes(w.nbytes) if w.data is None else w.data)

    def read_buffer(self, buffer: Buffer, offset: int, nbytes: int) -> bytes:
        """Buffer -> host, after all submitted work (wgpu waits for it)."""
        self.check_transfer("read", buffer, offset, nbytes)
        return self._read(buffer, offset, nbytes) if nbytes else b""

    # -- pipelines ----------------------------------------------------------------------------

    @property
    def host_resources(self) -> HostResources:  # type: ignore[override]
        return HostResources(self)

    def why_absent(self, capability: str) -> str:
        if capability in ("timeline", "host_recording"):  # Vulkan objects WebGPU does not have
            return (f"the wgpu backend has no {capability!r}: use the Vulkan backend, "
                    "vkml.Device(backend='vulkan')")
        return super().why_absent(capability)

    def create_pipeline(self, kernel: Kernel) -> Pipeline:
        """A compute pipeline from the kernel's WGSL (every binding declared read_write: see the
        module's docstring)."""
        self._alive()
        wgpu, dev, name = self._wgpu, self._device, kernel.name
        try:
            module = self._shader_module(name, kernel.wgsl)
        except wgpu.GPUError as exc:  # wgpu's WGSL front end is naga too: same report
            raise NagaError.for_kernel(f"naga rejected kernel '{name}' (in wgpu):\n{exc}", name,
                                       kernel.wgsl, str(exc)) from None
        based = self.caps.base_in_uniform and kernel.cut_axis is not None
        types = ([wgpu.BufferBindingType.storage] * kernel.num_bindings
                 + [wgpu.BufferBindingType.uniform] * based)
        try:
            layout = dev.create_bind_group_layout(label=name, entries=[
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": t}}
                for i, t in enumerate(types)])
            handle = dev.create_compute_pipeline(
                label=name, layout=dev.create_pipeline_layout(bind_group_layouts=[layout]),
                compute={"module": module, "entry_point": "main"})
        except wgpu.GPUError as exc:
            raise DeviceError(f"wgpu rejected kernel {name!r}: {exc}\n--- WGSL ---\n"
                              f"{kernel.wgsl}") from None
        pipeline = Pipeline(name, handle, layout, kernel.num_bindings, based)
        self._pipelines.add(pipeline)
        return pipeline

    def _shader_module(self, name: str, wgsl: str) -> Any:
        """A shader module of `wgsl` without the checks wgpu compiles into every shader by
        default: a clamp of every array index (vkml generates its kernels' indexing, and the
        Vulkan backend's SPIR-V, naga's default, has none either) and a counter bounding every
        loop (vkml's loops end by construction). wgpu-py has no call for wgpu-native's trusted
        shader modules: its C function is called through wgpu-py's wrapper, which raises the
        errors (naga's report) as create_shader_module does."""
        ffi, lib = self._ffi, self._lib
        code, label = wgsl.encode(), name.encode()
        code_chars, label_chars = ffi.new("char[]", code), ffi.new("char[]", label)
        source = ffi.new("WGPUShaderSourceWGSL *")
        source.chain.sType = lib.WGPUSType_ShaderSourceWGSL
        source.code.data, source.code.length = code_chars, len(code)
        descriptor = ffi.new("WGPUShaderModuleDescriptor *")
        descriptor.nextInChain = ffi.cast("WGPUChainedStruct *", source)
        descriptor.label.data, descriptor.label.length = label_chars, len(label)
        handle = self._api.libf.wgpuDeviceCreateShaderModuleTrusted(
            self._device._internal, descriptor, lib.WGPUShaderRuntimeChecks_None)
        if handle == self._null:
            raise DeviceError(f"wgpu made no shader module of kernel {name!r}")
        return self._api.GPUShaderModule(name, handle, self._device)

    def free_pipeline(self, pipeline: Pipeline) -> None:
        """wgpu releases a pipeline when nothing references it: drop vkml's references."""
        self._pipelines.discard(pipeline)
        pipeline.handle = pipeline.layout = None

    # -- programs -----------------------------------------------------------------------------

    def record(self, commands: Sequence[Command], label: str) -> Program:
        """Check `commands` and build their bind groups once; submit() re-encodes from these."""
        return self._record(commands, label, timestamps=False)

    def _record(self, commands: Sequence[Command], label: str, timestamps: bool) -> Program:
        """With `timestamps` (where the adapter has timestamp queries) each dispatch runs in a
        compute pass of its own that writes a timestamp at its start and end."""
        self._alive()
        self.check(commands, label)
        prog = Program(label)
        count = 2 * sum(isinstance(c, Dispatch) for c in commands)
        if timestamps and self.caps.timestamp_period_ns > 0 and count:
            usage = self._wgpu.BufferUsage
            # WebGPU caps a query set at 4096 queries: a long program gets several.
            prog.queries = [self._device.create_query_set(
                label=f"{label} timestamps {k}", type="timestamp",
                count=min(QUERY_SET_SIZE, count - k * QUERY_SET_SIZE))
                for k in range(-(-count // QUERY_SET_SIZE))]
            prog.resolved = self._device.create_buffer(
                label=f"{label} timestamps", size=8 * count,
                usage=usage.QUERY_RESOLVE | usage.COPY_SRC)
            prog.timings = self._device.create_buffer(
                label=f"{label} timings", size=8 * count, usage=usage.MAP_READ | usage.COPY_DST)
        segments: list[list[tuple[Any, ...]] | tuple[Any, ...]] = []
        scratch_bytes = max((c.nbytes for c in commands
                             if isinstance(c, Copy) and c.src is c.dst), default=0)
        if scratch_bytes:
            prog.scratch = self._device.create_buffer(
                label=f"{label} copy scratch", size=-(-scratch_bytes // COPY_ALIGN) * COPY_ALIGN,
                usage=self._wgpu.BufferUsage.COPY_SRC | self._wgpu.BufferUsage.COPY_DST)
        slots = self._base_slots(prog, commands)
        for cmd in commands:
            if isinstance(cmd, Dispatch):
                if not segments or not isinstance(segments[-1], list):
                    segments.append([])
                group = None
                entries = [{"binding": i, "resource": {"buffer": b.buffer.handle,
                                                       "offset": b.offset, "size": b.nbytes}}
                           for i, b in enumerate(cmd.bindings)]
                if cmd.pipeline.dispatch_base:
                    entries.append({"binding": len(entries), "resource": {
                        "buffer": prog.bases, "offset": slots[cmd.base], "size": BASE_BYTES}})
                if entries:
                    bind_group = self._device.create_bind_group(
                        label=f"{label}:{cmd.pipeline.name}", layout=cmd.pipeline.layout,
                        entries=entries)
                    prog.objects.append(bind_group)
                    group = bind_group._internal
                prog.objects.append(cmd.pipeline.handle)
                segments[-1].append((cmd.pipeline.handle._internal, group, *cmd.groups))
                prog.num_dispatches += 1
            elif isinstance(cmd, Copy):
                src, dst = cmd.src.handle, cmd.dst.handle
                if cmd.src is cmd.dst:
                    segments.append(("copy_buffer_to_buffer",
                                     (src, cmd.src_offset, prog.scratch, 0, cmd.nbytes)))
                    src, so = prog.scratch, 0
                else:
                    so = cmd.src_offset
                segments.append(("copy_buffer_to_buffer",
                                 (src, so, dst, cmd.dst_offset, cmd.nbytes)))
            elif isinstance(cmd, Fill):
                segments.append(("clear_buffer", (cmd.buffer.handle, cmd.offset, cmd.nbytes)))
            elif isinstance(cmd, CopyFromImage):
                texture, buffer, size = _texel_copy(cmd.region, cmd.dst, cmd.dst_offset)
                segments.append(("copy_texture_to_buffer", (texture, buffer, size)))
            elif isinstance(cmd, CopyToImage):
                texture, buffer, size = _texel_copy(cmd.region, cmd.src, cmd.src_offset)
                segments.append(("copy_buffer_to_texture", (buffer, texture, size)))
        prog.segments = segments
        self._programs.add(prog)
        return prog

    def _base_slots(self, prog: Program, commands: Sequence[Command]
                    ) -> dict[tuple[int, int, int], int]:
        """The byte offset of each base workgroup the program's dispatches bind (those of
        kernels that read one: Pipeline.dispatch_base) in the uniform buffer made here for
        them, `prog.bases`, which holds each distinct base once."""
        bases = sorted({c.base for c in commands
                        if isinstance(c, Dispatch) and c.pipeline.dispatch_base})
        if not bases:
            return {}
        step = max(BASE_BYTES, self._device.limits["min-uniform-buffer-offset-alignment"])
        data = bytearray(step * len(bases))
        for k, base in enumerate(bases):
            data[k * step:k * step + BASE_BYTES] = struct.pack("<4I", *base, 0)
        usage = self._wgpu.BufferUsage
        prog.bases = self._device.create_buffer(label=f"{prog.label} base workgroups",
                                                size=len(data),
                                                usage=usage.UNIFORM | usage.COPY_DST)
        self._queue.write_buffer(prog.bases, 0, data)
        return {base: k * step for k, base in enumerate(bases)}

    def submit(self, program: Program) -> None:
        """Queue `program` (wgpu command buffers run once: its command buffer encoded ahead, or
        encoded now); returns once the next one is encoded. Later submissions run after it, in
        queue order."""
        self.submit_batch([program])

    def submit_batch(self, programs: Sequence[Program]) -> None:
        """Queue the programs in one queue.submit, in order, then encode ahead the next command
        buffer of each that repeats (see the module's docstring)."""
        buffers = [self._take(p) for p in programs]
        if not buffers:
            return
        with deferred_interrupts():  # a Ctrl-C in between would have wait() skip the work
            self._queue.submit(buffers)
            self._pending = True
        for p in programs:
            p.submissions += 1
            if p.submissions >= 2 and p.ahead is None:
                p.ahead = self._encode(p)

    def _take(self, program: Program) -> Any:
        """The program's command buffer encoded ahead (which runs once: it is dropped here), or
        one encoded now."""
        buffer, program.ahead = program.ahead, None
        return buffer if buffer is not None else self._encode(program)

    def _encode(self, program: Program) -> Any:
        segments = program.segments
        if segments is None:
            raise DeviceError(f"{program!r} was freed or belongs to a closed backend")
        encoder = self._device.create_command_encoder(label=program.label)
        timed = program.queries is not None
        null = self._null
        # Bound once: three calls a dispatch, so even the attribute lookups show (about 5%).
        set_pipeline = self._lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = self._lib.wgpuComputePassEncoderSetBindGroup
        dispatch = self._lib.wgpuComputePassEncoderDispatchWorkgroups
        query = 0
        for seg in segments:
            if isinstance(seg, list):
                # Timed: a pass per dispatch, since timestamps are written at pass boundaries.
                for run in ([[d] for d in seg] if timed else [seg]):
                    writes = ({"query_set": program.queries[query // QUERY_SET_SIZE],
                               "beginning_of_pass_write_index": query % QUERY_SET_SIZE,
                               "end_of_pass_write_index": query % QUERY_SET_SIZE + 1}
                              if timed else None)
                    query += 2
                    compute = encoder.begin_compute_pass(timestamp_writes=writes)
                    handle, current = compute._internal, None
                    for pipeline, group, x, y, z in run:
                        if pipeline is not current:
                            set_pipeline(handle, pipeline)
                            current = pipeline
                        if group is not None:
                            set_bind_group(handle, 0, group, 0, null)
                        dispatch(handle, x, y, z)
                    compute.end()
            else:
                method, args = seg
                getattr(encoder, method)(*args)
        if timed:
            for k, queries in enumerate(program.queries):
                first = k * QUERY_SET_SIZE
                encoder.resolve_query_set(queries, 0, min(QUERY_SET_SIZE, query - first),
                                          program.resolved, 8 * first)
            encoder.copy_buffer_to_buffer(program.resolved, 0, program.timings, 0, 8 * query)
        return encoder.finish()

    def wait(self) -> None:
        """Block until everything submitted so far has finished: on a GPU, polling first
        (wgpu's device.poll(wait=False), for up to WAIT_POLL_S) as the Vulkan backend does, then
        sleeping in the driver (device.poll(wait=True)).

        wgpu-py 0.32.0's public route to the blocking poll, queue.on_submitted_work_done_sync(),
        raises a TypeError (its callback's C signature no longer matches the bundled wgpu-native
        29), so the device's own poll is called. VKML_WAIT_TIMEOUT is not applied: wgpu's poll
        has no timeout.
        """
        if self._pending:
            if not self._polled(self._queue_empty):
                self._device._poll_wait()
            self._pending = False

    def _queue_empty(self) -> bool:
        """A non-blocking poll: whether no submission is still running. wgpu-native returns a
        Rust bool where its header declares a 32-bit WGPUBool, so only the low byte is set."""
        return bool(self._api.libf.wgpuDevicePoll(self._device._internal, False, self._null)
                    & 0xFF)

    def _timings(self, program: Program) -> list[float]:
        """Milliseconds per dispatch of the latest run of a program recorded with timestamps."""
        if program.timings is None:
            raise DeviceError(f"{program!r} was not recorded with timestamps (or the adapter "
                              "has no timestamp queries)")
        self.wait()
        buffer = program.timings
        buffer.map_sync(self._wgpu.MapMode.READ)
        try:
            stamps = memoryview(buffer.read_mapped()).cast("Q").tolist()
        finally:
            buffer.unmap()
        return [(end - begin) * 1e-6 for begin, end in zip(stamps[::2], stamps[1::2])]

    def free_program(self, program: Program) -> None:
        """Drop a program's bind groups, scratch and command buffer encoded ahead; work already
        submitted is unaffected."""
        if program.scratch is not None:
            self.wait()
            program.scratch.destroy()
            program.scratch = None
        for resource in (*(program.queries or ()), program.resolved, program.timings,
                         program.bases):
            if resource is not None:
                resource.destroy()
        program.queries = program.resolved = program.timings = program.bases = None
        program.segments = program.ahead = None
        program.objects.clear()
        self._programs.discard(program)

    def live_objects(self) -> dict[str, int]:
        """Buffers (and their bytes), pipelines and programs vkml holds (wgpu frees each once
        unreferenced)."""
        return {"buffers": len(self._buffers),
                "buffer_bytes": sum(b.nbytes for b in self._buffers),
                "pipelines": len(self._pipelines),
                "programs": len(self._programs),
                "host_resources": len(self._host_objects)}

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the device, then destroy every buffer and the device; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        for buf in list(self._buffers):
            buf.handle.destroy()
        self._buffers.clear()
        self._pipelines.clear()
        self._programs.clear()
        self._host_objects.clear()
        if self.owned:  # an adopted device is the host's: vkml's buffers alone are destroyed
            self._device.destroy()
        logging.getLogger("wgpu").removeHandler(self._log)

    # -- internals ----------------------------------------------------------------------------

    def _read(self, buffer: Buffer, offset: int, nbytes: int) -> bytes:
        """Bytes [offset, offset + nbytes) of `buffer`, which may reach into the padding that
        rounds every buffer up to whole words."""
        start, size = _aligned_range(offset, nbytes)
        if buffer.kind == "readback":
            start -= start % 8  # map offsets must be multiples of 8
            size = -(-(offset + nbytes - start) // COPY_ALIGN) * COPY_ALIGN
            buffer.handle.map_sync(self._wgpu.MapMode.READ, start, size)
            try:
                raw = buffer.handle.read_mapped(start, size)
            finally:
                buffer.handle.unmap()
        else:
            raw = self._queue.read_buffer(buffer.handle, start, size)
            # Its copy was submitted last and has finished, so everything before it has too.
            self._pending = False
        return bytes(memoryview(raw).cast("B")[offset - start:offset - start + nbytes])

    def _live_buffer(self, buffer: object) -> bool:
        return isinstance(buffer, Buffer) and (buffer in self._buffers
                                               or buffer in self._host_objects)

    def _live_pipeline(self, pipeline: object) -> bool:
        return isinstance(pipeline, Pipeline) and pipeline.handle is not None

    def _check_command(self, n: int, cmd: Command, what: str) -> None:
        """WebGPU's rules beyond the shared ones: storage only from device buffers, and copies,
        offsets and sizes in whole 4-byte words."""
        if isinstance(cmd, CopyFromImage | CopyToImage):
            texture = cmd.region.image
            if not isinstance(texture, ImportedTexture) or texture not in self._host_objects:
                raise DeviceError(f"{what}: {texture!r} is not a texture from this backend's "
                                  "host_resources.image()")
            r = cmd.region
            if r.height > 1 and (r.pitch or r.width * texture.texel_bytes) % ROW_ALIGN:
                raise DeviceError(f"{what}: rows {r.pitch or r.width * texture.texel_bytes} "
                                  f"bytes apart; WebGPU copies rows a multiple of {ROW_ALIGN} "
                                  "apart (host_resources.row_pitch())")
        if isinstance(cmd, Dispatch):
            for i, b in enumerate(cmd.bindings):
                if b.buffer in self._host_objects:
                    raise DeviceError(f"{what} binding {i}: {b.buffer!r} is a host's buffer, "
                                      "which vkml copies from or into, never binds")
                if b.buffer.kind != "device":  # type: ignore[attr-defined]
                    raise DeviceError(f"{what} binding {i}: {b.buffer!r} is not a device "
                                      "buffer; only those can be bound as storage")
                if b.nbytes % COPY_ALIGN:
                    raise DeviceError(f"{what} binding {i}: size {b.nbytes} must be a multiple "
                                      f"of {COPY_ALIGN}")
        elif isinstance(cmd, Copy):
            if any(v % COPY_ALIGN for v in (cmd.src_offset, cmd.dst_offset, cmd.nbytes)):
                raise DeviceError(f"{what}: offsets and size must be multiples of "
                                  f"{COPY_ALIGN} bytes in wgpu")


def _texel_copy(region: ImageRegion, buffer: Buffer, offset: int
                ) -> tuple[dict[str, Any], dict[str, Any], tuple[int, int, int]]:
    """A texture region <-> `buffer` from `offset`, its rows region.pitch bytes apart (a
    multiple of 256, checked by _check_command), as WebGPU copies (texture info, buffer info,
    size)."""
    texture: ImportedTexture = region.image  # type: ignore[assignment]
    pitch = region.pitch or region.width * texture.texel_bytes
    return ({"texture": texture.handle, "origin": (region.x, region.y, 0)},
            {"buffer": buffer.handle, "offset": offset,
             "bytes_per_row": row_pitch(pitch), "rows_per_image": region.height},
            (region.width, region.height, 1))
