"""The user's handle: `vkml.compile` makes a Session, which orchestrates what vkml/runtime/ does:
the plan bound to the device (bound.py), chunked steps (chunking.py), profiling (profiling.py)
and checkpoints (checkpoint.py)."""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar, overload

import numpy as np

from vkml.compiler.options import CompileOptions, Trainable
from vkml.compiler.plan import Plan
from vkml.compiler.stages import compile_plan
from vkml.errors import DeviceError, InputError, NonFiniteError, NotComputedError
from vkml.graph import TRAINING_STEP, Graph, Tensor
from vkml.interrupts import deferred_interrupts
from vkml.optim import Optimizer
from vkml.runtime import checkpoint, sharing
from vkml.runtime.bound import BoundPlan
from vkml.runtime.chunking import Chunker
from vkml.runtime.device import Device, default_device
from vkml.runtime.frames import HostBuffer, HostImage
from vkml.runtime.profiling import Profile, Profiler


class ChunkSubmission(NamedTuple):
    """What step_chunk(max_ms=...) submitted."""

    pieces_left: int  # pieces of the step still to submit (0: all of it went)
    cost_ms: float  # the measured GPU time of the pieces submitted by this call


class CompileCalled(Exception):
    """Raised by `vkml.compile` inside `stop_at_compile()`, instead of compiling: the call's graph,
    device (None: the default) and options."""

    def __init__(self, graph: Graph, device: Device | None, options: CompileOptions) -> None:
        super().__init__("vkml.compile called inside stop_at_compile()")
        self.graph, self.device, self.options = graph, device, options


_stopping_at_compile: ContextVar[bool] = ContextVar("vkml_stop_at_compile", default=False)


@contextlib.contextmanager
def stop_at_compile() -> Iterator[None]:
    """Within it, `vkml.compile` raises CompileCalled with its arguments and compiles nothing:
    how `python -m vkml dump` finds what a program compiles without running it further."""
    token = _stopping_at_compile.set(True)
    try:
        yield
    finally:
        _stopping_at_compile.reset(token)


def compile(graph: Graph, loss: Tensor | None = None, optimizer: Optimizer | None = None,
            device: Device | None = None, outputs: Mapping[str, Tensor] | None = None,
            rewrite: str = "greedy", keep_grads: bool | None = None,
            trainable: Trainable = None, precision: str = "f32",
            check_finite: bool = False, share_params_with: Session | None = None,
            hoist: bool = True) -> Session:
    """Compile `graph` into a runnable session.

    - no `loss`: an inference session; `step()` computes the graph's outputs.
    - `loss` and no `optimizer`: `step()` computes the outputs, the loss and every parameter's
      gradient (`session.grad(name)`), changing nothing.
    - `loss` and `optimizer`: `step()` is one training step (forward, backward, update) in a
      single submission.
    The loss is readable as "loss"; `outputs` adds more readable tensors by name.
    `rewrite`: "greedy" fuses kernels (vkml/compiler/rewrite.py); "none" runs one kernel per op.
    `keep_grads`: keep gradients readable after a training step (by default only sessions
    without an optimizer keep them; otherwise their memory is reused).
    `trainable`: which parameters get gradients and updates: by default those built with
    `trainable=True` (the default of `graph.param`); or a collection of names, or a predicate
    on the name (e.g. `lambda n: n.startswith("decoder.")`). The others are frozen; with an
    optimizer, a choice of none is refused (GraphError), as torch.optim refuses an empty
    parameter list. A trainable parameter the loss does not depend on gets no gradient and
    no update (not even weight decay), as torch.optim skips a parameter whose .grad is None;
    a warning names it.
    Parameters the compiled outputs and loss do not use take no device memory: the session
    holds them on the host, frozen, for params(), read, set_param, save and load.
    `precision`: "f32" (strict: f32 arithmetic everywhere) or "f16" (accelerated: large
    matrix products and convolutions take f16 inputs on the device's cooperative matrices
    (tensor cores), accumulating in f32, the backward pass's gradients first scaled by powers
    of two into f16's range; everything else stays f32, parameters and optimizer state
    included). On a device with f16 arithmetic but no cooperative matrices, every matrix
    product is computed in f16 instead (f32 across each 8 or 16 terms of a sum), convolutions
    staying f32 (Capabilities.f16_products). "f16" needs shaderFloat16, else a DeviceError.
    "bf16": as "f16" on cooperative matrices, with bfloat16 inputs (8 significant bits, f32's
    exponent range: no gradient scaling, so backward products take the cooperative tiles as
    forward ones do); it needs VK_KHR_shader_bfloat16's cooperative matrices, else a
    DeviceError.
    `check_finite`: like torch's anomaly detection, a step whose loss is NaN or infinite
    changes nothing (the optimizer's kernels read the loss and skip) and raises
    NonFiniteError; step() then waits for each step to finish, so it costs a sync per step.
    `share_params_with`: another session of the same device whose parameters this one uses,
    by name (same shape), in place: no copy, and its updates are seen by this session's next
    step. This session may not have an optimizer. A step of this session never sees half an
    update of the owner (see vkml/runtime/sharing.py): starting one while the owner is
    part-way through a chunked step's updates (`owner.updating`) raises InputError, and so do
    the owner's pieces that update parameters while this session's chunked step is
    part-way. The owner's memory stays allocated until both are closed (or dropped).
    `hoist`: what the step reads that depends on parameters and constants alone, never on
    inputs or on what a step writes (a transposed or f16 copy of a weight, a position table
    resized from a parameter) is computed by a prologue, run before a step only when a
    parameter it reads was written since it last ran (set_param, load, the owner's updates
    where parameters are shared), its results kept between steps; the same kernels, the same
    values, fewer dispatches a step (compiler/schedule.py `hoisted`). False computes
    everything every step, for comparison.
    """
    options = CompileOptions(loss, optimizer, {} if outputs is None else outputs, rewrite,
                             keep_grads, trainable, precision, check_finite, hoist)
    if _stopping_at_compile.get():
        owner = share_params_with
        raise CompileCalled(graph, device or (owner.device if isinstance(owner, Session) else None),
                            options)
    if share_params_with is not None:
        if not isinstance(share_params_with, Session):
            raise InputError(f"share_params_with takes a vkml Session, got "
                             f"{type(share_params_with).__name__}")
        if device is not None and device is not share_params_with.device:
            raise InputError("share_params_with: both sessions must be on the same device")
        if share_params_with._bound.closed:
            raise InputError("share_params_with: that session is closed")
        if share_params_with._bound.owner is not None:
            # its owner's updates would go unseen: no half-update check, no prologue rerun
            raise InputError("share_params_with: that session uses the parameters of another "
                             "session (its own share_params_with): pass that one, the owner")
        device = share_params_with.device
    device = device or default_device()
    if not isinstance(device, Device):
        raise InputError(f"device takes a vkml.Device (vkml.Device(), Device.from_vulkan(...), "
                         f"Device.from_wgpu(...)), got {type(device).__name__}")
    if device.closed:
        raise DeviceError("compile: this device was closed (device.close()); make a new "
                          "vkml.Device to compile on")
    device.backend.preload()  # a cold cache's translator loads beside the lowering
    plan = compile_plan(graph, device.caps, options)
    return Session(plan, device, options.check_finite, graph=graph,
                   share_params_with=share_params_with)


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialized(method: _F) -> _F:
    """Run `method` holding the session's lock (see Session), on a session not yet closed, of
    a device not yet closed (its memory is gone: touching it would fail deep inside the driver,
    or crash the process)."""
    @functools.wraps(method)
    def locked(self: Session, *args: Any, **kwargs: Any) -> Any:
        self.device.release_dropped()
        with self.lock:
            self._require_open(f"session.{method.__name__}()")
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class Session:
    """A compiled graph bound to a device (made by `vkml.compile`).

    Lifetime: close() frees what it holds on the device at once. A session dropped without
    close() is freed at its device's next call (any session's call, a compile, or
    `device.release_dropped()`), not by the garbage collector itself (see runtime/device.py).

    Thread safety: every method that submits, waits, reads or writes holds the session's
    lock (`session.lock`, re-entrant), so one session may be used from several threads: each
    call runs whole, and two threads' steps are submitted one after the other, never the same
    command buffer twice at once. A sequence of calls that must not interleave with another
    thread's (set_input, step, read) holds the lock around it: `with session.lock: ...`.
    """

    def __init__(self, plan: Plan, device: Device, check_finite: bool = False, *,
                 graph: Graph | None = None, share_params_with: Session | None = None) -> None:
        device.release_dropped()  # before this session allocates
        self.plan, self.device = plan, device
        self.lock = threading.RLock()
        self._closed = False
        # What checkpoints carry beside the plan's tensors, per session: the graph's extras,
        # refused names, and the parameters the plan does not use, frozen on the host (the
        # graph's initial values, never written into: loads and set_param replace them; where
        # parameters are shared, none the owner has, whose values would go stale here).
        self._entries = checkpoint.Entries()
        # The graph's inputs that nothing compiled reads (a loss's labels in an inference
        # session of a training graph): set_input checks and accepts them, as the graph has
        # them, and they change nothing.
        self._unread_inputs: dict[str, tuple[tuple[int, ...], str]] = {}
        if graph is not None:
            self._unread_inputs = {n: (t.shape, t.dtype) for n, t in graph.inputs.items()
                                   if n not in plan.inputs}
            owned = (set(share_params_with.plan.params) | set(share_params_with._entries.params)
                     if share_params_with is not None else set())
            self._entries = checkpoint.Entries(
                {n: v.copy() for n, v in graph.extras.items()}, dict(graph.unsupported_tensors),
                {n: graph.initial_values[t.id] for n, t in graph.params.items()
                 if n not in plan.params and n not in owned})
        owner = share_params_with._bound if share_params_with is not None else None
        shared: dict[int, int] = {}
        if owner is not None:
            shared = sharing.match_params(plan, owner.plan)
            plan = self.plan = plan.without(shared, device.caps)
        self._bound = BoundPlan(plan, device, owner, shared)
        self._external_uploads: list[object] = []  # the inputs' copies prepared for record()
        self._external_download: object | None = None  # and the outputs' copies
        self._chunker = Chunker(self._bound)
        # Nothing it holds may refer to this session, or a dropped one is never collected.
        self._finalizer = device.on_drop(self, functools.partial(_release_dropped,
                                                                 self._chunker))
        self._profiler = Profiler(self._bound)
        self._external: object | None = None  # the step prepared for record()
        self._external_prologue: object | None = None  # and its prologue
        # The bound inputs' and outputs' programs prepared for record() (None: not yet).
        self._external_frames: tuple[object | None, object | None] | None = None
        # What a submitted step or forward pass has computed so far: device memory starts
        # undefined, so reading an output or a gradient before then would return garbage.
        self._computed: set[str] = set()
        self._unchecked = False  # a step's index checks are not read yet (_check_indices)
        # The hyperparameters as the user gave them (float64): the optimizer's host-side tables
        # are computed from these, not from the f32 copies on the GPU.
        self._hyperparams = plan.optimizer.hyperparams() if plan.optimizer is not None else {}
        self.check_finite = check_finite

    def _require_open(self, call: str) -> None:
        if self._closed:
            raise DeviceError(f"{call}: this session is closed; compile the graph again for a "
                              "new one")
        if self.device.closed:
            raise DeviceError(f"{call}: this session's device was closed (device.close() "
                              "frees the device objects of all its sessions); make a new "
                              "vkml.Device and compile the graph again on it")

    @property
    def inputs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each input's (shape, dtype), as `set_input` expects them."""
        return {name: (self.plan.slots[s].shape, self.plan.slots[s].dtype)
                for name, s in self.plan.inputs.items() if name != TRAINING_STEP}

    @property
    def kernel_count(self) -> int:
        """Distinct kernels (pipelines) this session runs."""
        return self._bound.kernel_count

    @property
    def timing_note(self) -> str:
        """How the costs that cut chunked steps were measured ("" while estimated)."""
        return self._chunker.note

    # ---- running ------------------------------------------------------------------------------
    @_serialized
    def set_input(self, name: str, value: np.ndarray | Sequence) -> None:
        """Keep `value` (a copy) as input `name` of the next step, and return at once: the
        step in flight keeps the values it started with (the inputs go through two staging
        buffers, written when a step's first piece is submitted). An input of the graph that
        nothing this session computes reads (the labels of a loss it was compiled without) is
        checked and changes nothing; `inputs` lists those it reads."""
        if name == TRAINING_STEP:
            raise InputError(f"'{name}' numbers the training steps and the session sets it "
                             "itself; it is not for set_input")
        if name in self._unread_inputs:
            _conform(f"input '{name}'", value, *self._unread_inputs[name])
            return  # nothing this session computes reads it
        if name not in self.plan.inputs:
            known = ", ".join(f"'{n}'" for n in self.inputs) or "none"
            raise InputError(f"unknown input '{name}'; this session's inputs are: {known}")
        if name in self._bound.frames.inputs:
            raise InputError(f"input '{name}' is bound to the host's GPU memory (bind_input), "
                             f"which every step reads: call unbind('{name}') first")
        slot = self.plan.slots[self.plan.inputs[name]]
        array = _conform(f"input '{name}'", value, slot.shape, slot.dtype)
        if name in self.plan.input_ranges and array.size:
            _check_range(name, array, *self.plan.input_ranges[name])
        self._bound.write_input(name, array)

    @_serialized
    def bind_input(self, name: str, source: HostBuffer | HostImage, offset: int = 0, *,
                   region: tuple[int, int, int, int] | None = None,
                   channels: Sequence[int] | None = None,
                   mean: float | Sequence[float] | None = None,
                   std: float | Sequence[float] | None = None) -> None:
        """Every later step reads input `name` from the host's GPU memory, never through the
        CPU: `source` describes a VkBuffer or VkImage of this session's device (vkml.HostBuffer,
        vkml.HostImage: Vulkan cannot report a handle's size, format or usage, so the host
        declares them and vkml checks them). On a wgpu host's device (vkml.Device.from_wgpu)
        `source` is the host's wgpu.GPUBuffer or GPUTexture itself (rgba8unorm, rgba8unorm-srgb,
        rgba16float or r32float), with COPY_SRC in its usage; a picture in a GPUBuffer is
        vkml.HostBuffer(buffer, device, buffer.size, buffer.usage, format=, extent=).

        A buffer holds the input as set_input takes it (its dtype, C order) from byte `offset`,
        copied into the step. An image's `region` (x, y, width, height; the whole image by
        default) is copied and converted by a kernel in the step to the input's (1, C, H, W),
        (C, H, W) or (H, W) f32 layout: `channels` picks a source channel per input channel (by
        default the first C: RGB of RGBA), 8-bit texels become k / 255 (sRGB bytes as stored),
        then (v - mean) / std per source channel (one number or one each; three apply to RGB),
        and a region of another size is resized as torch's bilinear F.interpolate
        (align_corners=False). Results equal set_input of the same values bit for bit (8-bit
        texels through a table computed in float64; resizing as the device rounds).

        Ordering: the step's first commands wait for all of the host's earlier work on the
        queue (any stage) and see its writes, and its later work waits for the step's reads;
        so submit the step after the render pass that writes the frame, on the same queue
        (step(), step_chunk()) or record() it into the host's command buffer after the pass.
        The image is in `layout` (HostImage) when the step runs and is left in it. On wgpu,
        WebGPU runs its one queue's submissions in order and tracks each resource's use
        itself: the host's writes submitted before step() (queue.write_buffer, write_texture,
        its command buffers) are seen by the step, and its work submitted after sees the
        step's reads done (and a bound output written)."""
        if self._chunker.in_progress:
            raise InputError("bind_input: a chunked step is in progress; submit the rest of it "
                             "(step_chunk() until it returns 0) first")
        self._bound.wait()
        frames = self._bound.frames
        frames.bind_input(name, source, offset, region, channels,
                          None if mean is None else np.atleast_1d(mean),
                          None if std is None else np.atleast_1d(std))
        self._bound.unset_inputs.discard(name)
        self._rebind()

    @_serialized
    def bind_output(self, name: str, target: HostBuffer | HostImage, offset: int = 0, *,
                    region: tuple[int, int] | None = None) -> None:
        """Every later step (and forward()) ends by writing output `name` into the host's GPU
        memory, for its renderer to draw from without a read-back: a vkml.HostBuffer (f32, C
        order, from byte `offset`) or an r32_float vkml.HostImage (an output of shape (..., H,
        W) with 1 in the leading axes, at texel `region` = (x, y), (0, 0) by default). The
        host's work submitted after the step (sampling the image) waits for it and sees it;
        the image is left in its declared layout. read() still works. On a wgpu host's device
        (vkml.Device.from_wgpu) `target` is its wgpu.GPUBuffer, or an r32float GPUTexture,
        with COPY_DST in its usage; WebGPU's queue order makes the host's later submissions
        see what the step wrote."""
        if self._chunker.in_progress:
            raise InputError("bind_output: a chunked step is in progress; submit the rest of "
                             "it (step_chunk() until it returns 0) first")
        self._bound.wait()
        self._bound.frames.bind_output(name, target, offset, region)
        self._rebind()

    @_serialized
    def unbind(self, name: str) -> None:
        """Undo bind_input or bind_output of `name` (both, where an input and an output share
        the name): the step goes back to set_input's values and read() alone."""
        if self._chunker.in_progress:
            raise InputError("unbind: a chunked step is in progress; submit the rest of it "
                             "first")
        self._bound.wait()
        frames = self._bound.frames
        found = [frames.unbind(name), frames.unbind(name, outputs=True)]
        if not any(found):
            raise InputError(f"'{name}' is not bound; bound inputs: {sorted(frames.inputs)}, "
                             f"outputs: {sorted(frames.outputs)}")
        if found[0] and name not in self._bound._latest:
            self._bound.unset_inputs.add(name)
        self._rebind()

    @_serialized
    def wait_for_host(self, semaphore: object, value: int) -> None:
        """The next step's first submission (step(), its first piece in step_chunk(), or
        forward()) waits on the GPU, in every pipeline stage, until the host's timeline
        `semaphore` (a `vulkan` handle or an int, of this device) reaches `value`: how a host
        whose writes to bound inputs are not before the step in queue order (another queue,
        another thread's submission, a write from the host signalled with
        vkSignalSemaphore) orders them. Once per step; Vulkan with timeline semaphores."""
        timeline = self.device.backend.timeline
        if timeline is None:
            raise DeviceError("wait_for_host needs Vulkan timeline semaphores, which this "
                              "session's device lacks: "
                              + self.device.backend.why_absent("timeline"))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"wait_for_host: value must be an int >= 0, got {value!r}")
        timeline.check_semaphore(semaphore)  # not at the step: it had begun by then
        self._bound.host_wait = (semaphore, value)

    def _rebind(self) -> None:
        bound = self._bound
        bound.rebind()
        for program in [*self._external_uploads, *(self._external_frames or ())]:
            bound.drop(program)
        self._external_uploads, self._external_frames = [], None

    @_serialized
    def step(self, chunks: int | None = None, budget_ms: float | None = None) -> None:
        """Submit one step (a training step for a session with an optimizer) and return at once.
        Reads wait for it; `wait()` blocks explicitly.

        `chunks=N`: the step goes to the queue as N submissions (pieces cut at barrier
        boundaries, balanced by measured GPU time per dispatch when a profile() or budget step
        measured it, else by an estimate), so a host's submits can run between them. A level
        is never split: N above the number of levels gives one piece per level.
        `budget_ms=b`: as many pieces as needed for each to fit b ms of measured GPU time. A
        level longer than b is cut into ranges of its dispatches' workgroups, run as dispatches
        of their own, as far as its kernels allow (Kernel.independent_workgroups; a part is
        never shorter than 0.1 ms), else it is a piece of its own. When nothing was measured
        yet this step runs whole with timestamps, blocks until done, and later steps are cut by
        what it measured. Results are bit-identical to a whole step either way.

        A step is submitted whole or not at all: a KeyboardInterrupt (Ctrl-C) that arrives
        while it is submitted is raised once all its pieces are, so no step is left half-way
        for a later call to finish (which would apply two updates). A step begun with
        step_chunk() and not finished is finished first (its remaining pieces submitted, its
        update applied), as forward(), save(), state_dict(), load(), profile(), record() and
        close() do: then this step runs."""
        if chunks is None and budget_ms is None:
            self._submit(self._bound.step_program, self._bound.step_writes_params,
                         {"outputs", "grads"})
            self._check_loss()
            return
        self._chunker.finish()
        cuts = self._chunker.cuts(chunks, budget_ms)
        self._chunker.chunking = ("chunks", chunks) if chunks is not None else ("budget",
                                                                              budget_ms)
        if cuts is None:
            self._measure_for_budget()
            return
        with deferred_interrupts():
            self._chunker.start(cuts)
            self._chunker.finish()
            self._computed_now("outputs", "grads")
        self._check_loss()

    @overload
    def step_chunk(self, chunks: int | None = None, budget_ms: float | None = None,
                   max_ms: None = None, at_least_one: bool = False) -> int: ...

    @overload
    def step_chunk(self, chunks: int | None = None, budget_ms: float | None = None, *,
                   max_ms: float, at_least_one: bool = False) -> ChunkSubmission: ...

    @_serialized
    def step_chunk(self, chunks: int | None = None, budget_ms: float | None = None,
                   max_ms: float | None = None, at_least_one: bool = False
                   ) -> int | ChunkSubmission:
        """Submit the next piece of the current chunked step (starting a new step when none is
        in progress) and return at once: the number of pieces of this step still to submit (0:
        the whole step is submitted). Call it once per frame. `chunks`/`budget_ms` choose the
        pieces as in step(); they apply from the next new step, and by default the last
        chunking given to step() or step_chunk() is used (one piece if none was).

        `max_ms=X`: instead of one piece, as many of the next pieces as add up to at most X ms
        of measured GPU time (piece_costs()), in ONE queue submission; none if the next piece
        alone is longer (`at_least_one=True`: that piece anyway). Where parameters are shared
        (compile's share_params_with), it also stops where a piece would be refused (a step
        would see half an update): before this session's next piece that updates parameters
        while a sharing session's chunked step is part-way, and at nothing for a sharing
        session whose owner is part-way through its updates. Returns
        `ChunkSubmission(pieces_left, cost_ms)`: pieces of the step still to submit and the
        measured cost of what went now (a tuple, so `left, cost = ...`; test `.pieces_left`,
        not the tuple, in a loop). Without a chunking given, max_ms packs pieces of one level
        each (the finest cut). A new step's inputs are those set when its first piece goes.
        With nothing measured yet, one whole timed step runs, blocking (as budget_ms)."""
        chunker = self._chunker
        if chunks is not None and budget_ms is not None:
            raise InputError("give chunks or budget_ms, not both")
        if max_ms is not None and not (isinstance(max_ms, numbers.Real) and max_ms >= 0):
            raise InputError(f"max_ms must be a number >= 0, got {max_ms!r}")
        if chunks is not None or budget_ms is not None:
            chunker.chunking = ("chunks", chunks) if chunks is not None else ("budget", budget_ms)
        if not chunker.in_progress:
            cuts = chunker.default_cuts(finest=max_ms is not None)
            if cuts is None or (max_ms is not None and chunker.dispatch_ms is None):
                self._measure_for_budget()
                if max_ms is None:
                    return 0
                return ChunkSubmission(0, sum(chunker.dispatch_ms or ()))
        with deferred_interrupts():  # a step is begun together with its first piece
            if not chunker.in_progress:
                chunker.start(cuts)
            if max_ms is None:
                chunker.submit_next()
            else:
                count = min(max(chunker.fitting(max_ms), int(at_least_one)), chunker.allowed())
                cost = chunker.submit(count)
            if not chunker.pieces_left:
                self._computed_now("outputs", "grads")
        if not chunker.pieces_left:
            self._check_loss()
        if max_ms is None:
            return chunker.pieces_left
        return ChunkSubmission(chunker.pieces_left, cost)

    @_serialized
    def piece_costs(self, chunks: int | None = None, budget_ms: float | None = None
                    ) -> list[float]:
        """Measured GPU ms of each piece of a step cut by `chunks` or `budget_ms` (as step()
        cuts it); with neither, the pieces of the chunked step in progress, else those the
        next step_chunk(max_ms=...) would use. Needs measured times (profile(), a budget
        step): InputError before."""
        chunker = self._chunker
        if chunker.dispatch_ms is None:
            raise InputError("piece_costs() needs measured times: run profile() (update=False "
                             "leaves a training session's state as it was) first")
        if chunks is None and budget_ms is None:
            cuts = chunker.current_cuts() if chunker.in_progress else chunker.default_cuts(
                finest=True)
        else:
            cuts = chunker.cuts(chunks, budget_ms)
        assert cuts is not None
        costs = chunker.piece_costs(cuts)
        assert costs is not None
        return costs

    @_serialized
    def record_pieces(self, chunks: int | None = None, budget_ms: float | None = None) -> int:
        """Record the command buffers of the pieces step(chunks=...) / step(budget_ms=...)
        would submit, now (otherwise the first step cut that way records them, which a frame
        loop would feel: milliseconds for a hundred pieces on a CPU driver). Returns how many
        pieces there are. Submits nothing."""
        cuts = self._chunker.cuts(chunks, budget_ms)
        if cuts is None:
            raise InputError("budget_ms needs measured times: run profile() first")
        return len(self._chunker.programs(cuts))

    @property
    def pieces_left(self) -> int:
        """Pieces of the chunked step in progress not yet submitted (0 when none)."""
        return self._chunker.pieces_left

    @property
    def updating(self) -> bool:
        """True while a chunked step of this session has submitted some of its parameter
        updates and not all: sessions sharing its parameters cannot start a step then."""
        return self._bound.updating

    @_serialized
    def chunk_boundaries(self, chunks: int | None = None,
                         budget_ms: float | None = None) -> list[tuple[int, int]]:
        """The pieces step(chunks=...) / step(budget_ms=...) would submit, as [first, end)
        ranges of dispatch indices into session.plan.dispatches (records nothing). The pieces
        of a level that budget_ms cut into workgroup ranges share that level's dispatches."""
        return self._chunker.boundaries(chunks, budget_ms)

    def done(self) -> tuple[object, int]:
        """(timeline semaphore, value): the semaphore reaches the value when everything this
        session has submitted so far has finished (0 before its first submission); work other
        sessions or the host submitted later is not included. A host can wait on it in its
        own vkQueueSubmit (VkTimelineSemaphoreSubmitInfo) or with vkWaitSemaphores. The handle
        is a cffi VkSemaphore of the `vulkan` package (int(vulkan.ffi.cast("uintptr_t", h))
        gives the integer). Vulkan only; needs timeline semaphores on the device."""
        self._require_open("session.done()")
        backend = self.device.backend
        if backend.timeline is None:
            raise DeviceError("session.done() returns a Vulkan timeline semaphore, which this "
                              "session's device lacks: " + backend.why_absent("timeline"))
        return backend.timeline.semaphore, self._bound.done_value()

    @_serialized
    def record(self, command_buffer: object) -> None:
        """Record this session's step (input copies from staging, dispatches, barriers between
        levels) into `command_buffer`, a primary command buffer the host is recording (a
        `vulkan` cffi handle or an integer) from a pool of this device's queue family. Vulkan
        only. Descriptor sets are made on the first call; later calls only record commands.

        Barriers around it (global VkMemoryBarriers): on entry, src ALL_COMMANDS | HOST with
        MEMORY_WRITE | HOST_WRITE -> dst COMPUTE_SHADER | TRANSFER with SHADER_READ |
        SHADER_WRITE | TRANSFER_READ | TRANSFER_WRITE: the host's earlier work in any stage
        finishes and its writes are visible before vkml touches memory. On exit, src
        COMPUTE_SHADER | TRANSFER with SHADER_WRITE | TRANSFER_WRITE -> dst ALL_COMMANDS | HOST
        with MEMORY_READ | MEMORY_WRITE | HOST_READ: the host's later work waits for vkml's
        and sees its results, and so does session.read() once the host has waited for the
        submission (vkml cannot see the host's submit: wait for it before reading, do not run
        step() while a recorded copy may still be executing, and have at most two recorded
        steps in flight: their inputs alternate between two staging buffers). Keep the session
        while the host may submit what was recorded, and close() it once those submissions have
        finished: a session dropped is freed at its device's next call, which waits for vkml's
        submissions only, never for the host's."""
        recording = self.device.backend.host_recording
        if recording is None:
            raise DeviceError("session.record() records into a Vulkan command buffer, which "
                              "this session's device cannot: "
                              + self.device.backend.why_absent("host_recording"))
        bound = self._bound
        bound.require_inputs()
        self._chunker.finish()
        bound.check_submit(True, int(bound.step_writes_params))
        bound.wait()
        if self._external is None:
            self._external = bound.keep(recording.prepare(
                bound.commands(range(len(self.plan.dispatches))), "step (host)"))
        staging = bound.upload()
        if staging is not None:
            if not self._external_uploads:
                self._external_uploads = [
                    bound.keep(recording.prepare(bound.uploads(b), f"inputs {b} (host)"))
                    for b in range(len(bound.staging_buffers))]
            recording.record_into(command_buffer, self._external_uploads[staging])
        if self._external_frames is None:
            frames = bound.frames.input_commands(), bound.frames.output_commands()
            self._external_frames = tuple(  # type: ignore[assignment]
                bound.keep(recording.prepare(c, f"bound {w} (host)")) if c else None
                for c, w in zip(frames, ("inputs", "outputs")))
        bind_in, bind_out = self._external_frames
        if bind_in is not None:
            recording.record_into(command_buffer, bind_in)
        # The prologue goes where a parameter it reads was written since it last ran (or was
        # last recorded: the host submits what it records in the order recorded, before the
        # steps it records later)
        prologue = bound.prologue_due()
        if prologue is not None:
            if self._external_prologue is None:
                self._external_prologue = bound.keep(recording.prepare(
                    bound.prologue_commands(), "prologue (host)"))
            recording.record_into(command_buffer, self._external_prologue)
            bound.prologue_recorded(prologue)
        recording.record_into(command_buffer, self._external)
        if bind_out is not None:
            recording.record_into(command_buffer, bind_out)
        if bound.download_program is not None:  # the outputs, where the host reads them
            if self._external_download is None:
                self._external_download = bound.keep(recording.prepare(
                    bound.downloads(), "outputs (host)"))
            recording.record_into(command_buffer, self._external_download)
        if bound.step_writes_params:  # sharing sessions' prologues follow the update
            bound.step_updates += 1
        self._computed_now("outputs", "grads")  # once the host submits it; read() after that

    @_serialized
    def profile(self, steps: int = 3, update: bool = True) -> Profile:
        """Run `steps` steps with a timestamp after every dispatch and return per-kernel times
        (`print()` it; `.to_trace(path)` writes a Chrome/Perfetto trace of the GPU timeline).

        `update=False`: the steps leave the session's state as it was: the parameters,
        optimizer state and step count they change are copied aside on the device before and
        copied back after (bit for bit; the copies are not timed). Outputs and gradients read
        afterwards are those of the profiled steps. The whole step is timed, update included,
        so the measured costs cover every piece step_chunk() submits.

        Timestamps are checked against the host's wall time of the same submission; when they
        are implausible (lavapipe 22.3 after graphics work) or the device has none, steps are
        timed from the host instead, one submission per dispatch (submit overhead included),
        and the result says so. If the timestamps of the last step turn out implausible, one
        more step is run for host timing. Measured times also steer step(chunks=...)."""
        self._chunker.finish()
        profile = self._profiler.run(steps, update)
        self._computed_now("outputs", "grads")
        self._chunker.set_measured(profile.dispatch_ms,
                                   f"measured by profile() with {profile.source}")
        return profile

    def _measure_for_budget(self) -> None:
        """One whole step with timestamps (blocking) to learn the per-dispatch GPU times."""
        profile = self.profile(steps=1)
        if profile.source != "gpu timestamps":
            # Host timing per dispatch includes a submission each; still the best we have.
            self._chunker.note = "budget chunks cut by host timing: " + profile.note

    @_serialized
    def forward(self) -> None:
        """Compute the outputs (and loss) only: no gradients, no update, and in inference
        form (dropout passes its input through)."""
        self._submit(self._bound.forward_program, False, {"outputs"}, forward_only=True)

    def _submit(self, program: object, updates: bool, computes: set[str],
                forward_only: bool = False) -> None:
        self._chunker.finish()
        self._bound.require_inputs()
        with deferred_interrupts():  # submitted, then known to be
            self._bound.submit([program], updates=int(updates), total_updates=int(updates),
                               forward_only=forward_only)
            self._computed_now(*computes)

    @_serialized
    def wait(self) -> None:
        """Block until this session's submitted work has finished. On a GPU the calling thread
        polls for up to VKML_WAIT_POLL seconds (default 0.02) before it sleeps in the driver,
        whose wake-up costs about 0.1 ms (vkml/vk/context.py). Raises InputError if the
        step had an index out of range (see read())."""
        self._bound.wait()
        self._check_indices()

    # ---- reading and writing tensors ----------------------------------------------------------
    @_serialized
    def read(self, name: str) -> np.ndarray:
        """An output (such as "loss") or a parameter, by name, as a new numpy array. The first
        read or wait after a step whose index operands computed on the GPU (a slice or concat
        of an input, a gather's result) held an index out of range raises InputError naming
        the op, the operand and the value, as PyTorch raises on it; such a step updates no
        parameter (inputs holding such indices are refused by set_input at once). A
        parameter cannot be read while a chunked step is part-way through its updates
        (`updating`: some layers would be new and others old); InputError says so."""
        if name in self.plan.params:
            self._require_whole_params(f"parameter '{name}'")
            value = self._bound.read_slot(self.plan.slots[self.plan.params[name]])
            self._check_indices()
            return value
        if name in self._entries.params:
            return self._entries.params[name].copy()
        if name not in self.plan.outputs:
            raise InputError(f"nothing named '{name}' can be read; outputs: "
                             f"{sorted(self.plan.outputs)}, parameters: {self._param_names()}")
        self._require_computed("outputs", f"output '{name}'")
        view = self.plan.outputs[name]
        value = self._bound.read_output(self.plan.slots[view.slot]).reshape(view.shape)
        self._check_indices()
        return value

    @_serialized
    def grad(self, param: str) -> np.ndarray:
        """The gradient of the loss for parameter `param`, as computed by the last step."""
        plan = self.plan
        if param not in plan.grads:
            known = param in plan.params or param in self._entries.params
            if known and plan.trainable is not None and param not in plan.trainable:
                raise InputError(f"'{param}' has no gradient: it is frozen (not trainable in "
                                 "this compilation), or the loss does not depend on it")
            if known and plan.optimizer is not None:
                raise InputError(f"the gradient of '{param}' is not kept by this training "
                                 "session: compile with keep_grads=True to read it")
            raise InputError(f"no gradient for '{param}': compile with a loss, and name one of "
                             f"the parameters {self._param_names()}")
        self._require_computed("grads", f"the gradient of '{param}'")
        view = plan.grads[param]
        value = self._bound.read_slot(plan.slots[view.slot]).reshape(view.shape)
        self._check_indices()
        return value

    def _check_loss(self) -> None:
        """With check_finite: wait for the step just submitted and refuse a non-finite loss
        (its update was skipped on the GPU, so the parameters are as before the step)."""
        if not self.check_finite or "loss" not in self.plan.outputs:
            return
        loss = float(self.read("loss"))
        if not np.isfinite(loss):
            raise NonFiniteError(f"the loss is {loss} after this step; the update was skipped "
                                 "and the parameters are unchanged. Look at the inputs set "
                                 "for it (compiled with check_finite=True)")

    def _computed_now(self, *what: str) -> None:
        """A step (or forward pass) is submitted whole: `what` it computes can be read."""
        self._computed.update(what)
        self._unchecked = bool(self.plan.index_checks)

    def _check_indices(self) -> None:
        """Once per step, where a read or wait waits for it anyway: refuse it if an index
        check found an index out of range (index operands computed on the GPU; inputs are
        checked by set_input: compiler/stages.py index_checks). Its optimizer update was
        skipped on the GPU."""
        if not self._unchecked or self._chunker.in_progress:
            return
        self._unchecked = False
        for slot, about in self.plan.index_checks:
            found, k, value, at = (int(v) for v in self._bound.read_output(self.plan.slots[slot]))
            if found:
                raise InputError(about[k].format(value=value, at=at) + ": an index out of "
                                 "range, which PyTorch raises on. This step's results are "
                                 "wrong, and it changed no parameter")

    def _require_computed(self, what: str, name: str) -> None:
        if self._chunker.in_progress:
            raise NotComputedError(
                f"{name} cannot be read while a chunked step is in progress "
                f"({self._chunker.pieces_left} piece(s) not yet submitted): call step_chunk() "
                "until it returns 0 first")
        if what not in self._computed:
            how = "step()" if what == "grads" else "step() or forward()"
            raise NotComputedError(f"{name} has not been computed yet: run {how} first "
                                   "(device memory starts undefined)")

    @_serialized
    def params(self) -> dict[str, np.ndarray]:
        """Every parameter of the graph, by name: also those the compiled outputs and loss do
        not use, which this session keeps on the host, frozen, and saves and loads as the
        others. InputError while a chunked step is part-way through its updates (see read)."""
        self._require_whole_params("params()")
        names = list(self.plan.params)
        on_device = dict(zip(names, self._bound.read_slots(
            [self.plan.slots[self.plan.params[n]] for n in names])))
        return on_device | {n: v.copy() for n, v in self._entries.params.items()}

    def _require_whole_params(self, what: str) -> None:
        """Refuse to read parameters between the pieces of a chunked step that update them:
        the values would be some layers' new and others' old, with no error."""
        bound, owner = self._bound, self._bound.owner
        if bound.updating:
            raise InputError(
                f"{what}: this session's chunked step is part-way through its parameter "
                f"updates ({bound.updates_left} of its pieces that write parameters not yet "
                "submitted), so they would read some layers updated and others not: call "
                "step_chunk() until it returns 0 first (`session.updating` says when)")
        if owner is not None and owner.updating:
            raise InputError(
                f"{what}: the session whose parameters this one uses (share_params_with) is "
                "part-way through a chunked step's parameter updates: submit the rest of its "
                "step first (its `updating` property says when)")

    def _param_names(self) -> list[str]:
        return sorted([*self.plan.params, *self._entries.params])

    @_serialized
    def set_param(self, name: str, value: np.ndarray) -> None:
        held = self._entries.params.get(name)
        if held is not None:
            array = _conform(f"parameter '{name}'", value, held.shape, "f32")
            self._entries.params[name] = array.copy()
            return
        if name not in self.plan.params:
            raise InputError(f"unknown parameter '{name}'; parameters: {self._param_names()}")
        slot = self.plan.slots[self.plan.params[name]]
        array = _conform(f"parameter '{name}'", value, slot.shape, slot.dtype)
        # A step begun with step_chunk() is finished first: its update, computed from the old
        # value, would otherwise land on top of this one.
        self._chunker.finish()
        self._bound.wait()
        self._bound.write_slot(slot, array)

    @_serialized
    def set_hyperparams(self, **values: float) -> None:
        """Change optimizer hyperparameters (e.g. lr) from the next step on; nothing is
        recompiled or re-recorded. Values are checked as torch.optim checks them; those the
        compiled update depends on (SGD's momentum when compiled without, nesterov) are
        refused with the reason. A step begun with step_chunk() is finished first, with the
        values it began with (its remaining pieces would read the new ones: layers updated
        with two learning rates in one step)."""
        plan = self.plan
        if plan.optimizer is None or plan.hyperparams_slot is None:
            raise InputError("this session has no optimizer")
        kind = type(plan.optimizer).__name__
        settable = [n for n in plan.hyperparams if n != "t"]
        unknown = set(values) - set(settable)
        if unknown:
            raise InputError(f"unknown hyperparameter(s) {sorted(unknown)}; {kind} has "
                             f"{settable}")
        for name in set(values) & set(plan.optimizer.fixed):
            if values[name] != self._hyperparams[name]:
                raise InputError(
                    f"{kind}'s {name} was {self._hyperparams[name]} when compiled, and the "
                    "compiled update depends on it: compile with the value you want (for SGD, "
                    "a non-zero momentum makes momentum changeable later)")
        plan.optimizer.check(values)
        self._chunker.finish()
        self._hyperparams.update({k: float(v) for k, v in values.items()})
        slot = plan.slots[plan.hyperparams_slot]
        current = self._bound.read_slot(slot)
        for k, v in values.items():
            current[plan.hyperparams.index(k)] = v
        self._bound.write_slot(slot, current)
        for table, data in plan.optimizer.tables(self._hyperparams).items():
            self._bound.write_slot(plan.slots[plan.optimizer_tables[table]], data)

    # ---- checkpoints --------------------------------------------------------------------------
    @_serialized
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters by name, plus optimizer state under "optimizer/<param>/<state>", the
        hyperparameters (step count included) under "optimizer/hyperparams" and the graph's
        checkpoint extras (`Graph.extra`) in their own dtypes. Like save(), it first finishes
        a step begun with step_chunk()."""
        self._chunker.finish()
        self._require_whole_params("state_dict()")
        return checkpoint.state_dict(self._bound, self._entries)

    @_serialized
    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors checkpoint atomically (a crash never leaves half a file), with
        the permissions a new file gets from open() (the umask applies; an existing file keeps
        its own). The metadata names the optimizer and its hyperparameters, and the training
        steps taken where the graph numbers them (dropout's masks)."""
        self._chunker.finish()
        self._require_whole_params("save()")
        checkpoint.save(self._bound, path, self._entries, self._hyperparams)

    @_serialized
    def load(self, path: str | os.PathLike, strict: bool = True,
             optimizer_state: bool = True) -> None:
        """Load parameters (and optimizer state, where the checkpoint has it) by name.
        Everything is checked before anything is written: a bad file changes nothing and
        raises CheckpointError (also for an unreadable or malformed file; the OS's or
        safetensors' exception is its `__cause__`).

        `strict`: every parameter must be present and no unknown tensor may be.
        Floating-point tensors of any precision (F32, F16, BF16, F64) load into the f32
        parameters; integer and boolean tensors are refused. The optimizer state must come
        from the same optimizer (kind and hyperparameter names, and values that compile the
        same update, e.g. SGD's momentum); with it the count of training steps comes back too,
        so dropout draws the masks the saved run would have drawn next.
        `optimizer_state=False` loads the parameters (and extras) alone and keeps this
        session's optimizer state, hyperparameters and step count, e.g. to
        fine-tune with another optimizer; a file without optimizer state loaded into a
        training session with the default `optimizer_state=True` keeps them too, and warns
        where the session has stepped (the moments and step count are not the file's run's;
        a session that has not stepped starts afresh, as fine-tuning does). A tensor the
        graph declares unsupported (`Graph.unsupported`) is refused even with strict=False. A
        session that shares another's parameters (share_params_with) cannot load: load the
        owner."""
        bound = self._bound
        if bound.shared:
            raise InputError("this session uses another session's parameters "
                             "(share_params_with): load the checkpoint into that session")
        if any(s.mid_step for s in bound.sharers):
            raise InputError("a session sharing these parameters is part-way through a "
                             "chunked step: submit the rest of it before loading")
        self._chunker.finish()
        checkpoint.load(bound, path, strict, optimizer_state, self._entries, self._hyperparams)

    # ---- inspection and teardown ----------------------------------------------------------------
    def explain(self) -> str:
        """What was compiled: dispatch and barrier counts, memory, kernels chosen, then the
        plan itself (tensors with their placement, dispatches between barriers)."""
        return self.plan.summary() + "\n\n" + self.plan.dump()

    def close(self) -> None:
        """Finish the work in flight and free what this session made on the device (its
        buffers, programs and the pipelines no other live session uses). Safe to call twice;
        any other call afterwards raises DeviceError. After device.close(), which freed
        everything, it only marks the session closed."""
        self.device.release_dropped()
        with self.lock:
            if self._closed:
                return
            if not self.device.closed:
                self._chunker.finish()
                self._bound.close()
            self._closed = True
            self._finalizer.detach()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_dropped(chunker: Chunker) -> None:
    """Free what a session dropped without close() bound (Device.release_dropped runs it at a
    safe point). A chunked step it left part-way is abandoned (nothing can read its results),
    unless it was part-way through its parameter updates and other sessions share its
    parameters: they would see half an update ever after, so its remaining pieces are submitted
    first (never refused: no sharing session's step can be part-way then, runtime/sharing.py)."""
    bound = chunker.bound
    if bound.updating and bound.sharers:
        chunker.finish()
    bound.close()


def _check_range(name: str, array: np.ndarray, first: int, end: int, what: str) -> None:
    """Refuse indices outside [first, end), naming the first bad one and where it is."""
    bad = (array < first) | (array >= end)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"input '{name}' holds {int(array[at])} at index {at} "
                         f"({int(bad.sum())} value(s) in all), outside [{first}, {end}): it "
                         f"is a {what}; nothing was changed")


def _conform(what: str, value: np.ndarray | Sequence, shape: tuple[int, ...],
             dtype: str) -> np.ndarray:
    """Check a user's array against a tensor's shape and dtype; convert only where lossless in
    kind (any float to f32, any integer to i32 within range)."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, RuntimeError) as exc:  # ragged lists; torch's refusals
        raise InputError(f"{what} takes a numpy array (or what np.asarray converts: nested "
                         f"lists of one shape, a CPU torch tensor that does not require "
                         f"grad); converting this {type(value).__name__} failed: "
                         f"{exc}") from exc
    if array.shape != shape:
        raise InputError(f"{what} expects shape {shape}, got {array.shape}")
    if dtype == "f32":
        if array.dtype.kind != "f":
            raise InputError(f"{what} expects floating-point values (float32), got "
                             f"{array.dtype}; convert with .astype(np.float32)")
        converted, overflowed = checkpoint.to_f32(array)
        if overflowed is not None and overflowed.any():
            raise InputError(f"{what}: {int(overflowed.sum())} finite value(s) lie beyond "
                             f"float32's range (+-3.4e38; the largest magnitude is "
                             f"{float(np.abs(array[overflowed]).max()):.3g}) and would "
                             "become infinite; scale them, or clip with np.clip(x, -3.4e38, "
                             "3.4e38) if infinity is meant")
        return converted
    if array.dtype.kind not in "iu":
        raise InputError(f"{what} expects integers (int32), got {array.dtype}; convert with "
                         ".astype(np.int32)")
    if array.size and (array.min() < -2**31 or array.max() >= 2**31):
        raise InputError(f"{what}: values do not fit in int32")
    return array.astype(np.int32, copy=False)
