"""Planning: Graph (+ gradients, optimizer) -> Plan, the fixed sequence of dispatches a session
records once, with each tensor's place in memory. No kernel is generated here: what a dispatch
reads and writes follows from the graph, and codegen (compiler/codegen.py) runs last.

Every node that computes something becomes one dispatch; views (reshape) share their input's
storage. The schedule groups dispatches into levels: a dispatch's level is one
more than that of the latest earlier dispatch it depends on (reading what it wrote, or writing
what it read or wrote). Dispatches of one level are independent, so one barrier between levels
keeps every read-after-write, write-after-read and write-after-write ordered, and no more are
needed. Memory planning then shares bytes between tensors whose level intervals do not overlap.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from vkml.compiler.memory_plan import FOREVER, Lifetime, alignment, plan_memory
from vkml.compiler.options import CompileOptions
from vkml.compiler.plan import Phase, Plan, PlannedDispatch, Role, Slot, Update, View
from vkml.compiler.rooted import Rooted
from vkml.errors import GraphError
from vkml.expr import in_order
from vkml.graph import OPS, Tensor, body_of
from vkml.hal import Access, Capabilities
from vkml.optim import Optimizer


@dataclass(frozen=True)
class Scheduled:
    """A plan before codegen, and per dispatch (the prologue's, then the step's) the node it
    computes (None: an optimizer dispatch), which codegen lowers."""

    plan: Plan
    nodes: tuple[Tensor | None, ...]


@dataclass
class _Draft:
    """What make_plan builds a Plan from, as it goes."""

    slots: list[Slot] = field(default_factory=list)
    dispatches: list[PlannedDispatch] = field(default_factory=list)
    nodes: list[Tensor | None] = field(default_factory=list)  # per dispatch
    initial_values: dict[int, np.ndarray] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    optimizer: Optimizer | None = None
    optimizer_state: dict[str, dict[str, int]] = field(default_factory=dict)
    hyperparams_slot: int | None = None
    optimizer_tables: dict[str, int] = field(default_factory=dict)
    hyperparams: tuple[str, ...] = ()
    packs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def new_slot(self, label: str, shape: tuple[int, ...], dtype: str, role: Role) -> int:
        self.slots.append(Slot(len(self.slots), label, shape, dtype, role))
        return len(self.slots) - 1

    def dispatch(self, d: PlannedDispatch, node: Tensor | None = None) -> None:
        self.dispatches.append(d)
        self.nodes.append(node)


def make_plan(rooted: Rooted, options: CompileOptions, caps: Capabilities,
              input_ranges: dict[str, tuple[int, int, str]],
              timings: dict[str, float] | None = None) -> Scheduled:
    """The plan of `rooted`'s graph: its outputs readable after a step, its gradients too
    where the options keep them (else an optimizer consumes them and their memory is reused),
    the options' optimizer's updates (which skip a step whose index checks found an index out
    of range); `input_ranges` as Plan.input_ranges. `timings` (if
    given) gets the seconds spent in "schedule" and "memory"."""
    started = time.perf_counter()
    graph, outputs, grads = rooted.graph, rooted.outputs, rooted.grads
    optimizer, keep_grads = options.optimizer, options.keeps_grads
    check_finite, has_loss = options.check_finite, options.loss is not None
    for name, t in outputs.items():
        if not graph.owns(t):
            raise GraphError(f"output '{name}' ({t.label}) is not a node of this graph")
    roots = rooted.roots
    nodes = graph.reachable(roots)
    grad_ids = {t.id for t in grads.values()}
    checks = [t for t, _ in rooted.checks]  # computed with the outputs, read after the step
    forward_ids = {t.id for t in graph.reachable([*outputs.values(), *checks])}
    draft = _Draft()
    new_slot = draft.new_slot
    slot_of: dict[int, int] = {}
    for node in nodes:
        kind = OPS[node.op].kind
        if kind == "view":
            slot_of[node.id] = slot_of[node.inputs[0].id]
            continue
        role: Role = {"input": "input", "param": "param", "constant": "constant"}.get(
            node.op, "gradient" if node.id in grad_ids else "activation")
        slot_of[node.id] = new_slot(node.name or node.label, node.shape, node.dtype, role)
        if kind == "source":
            if node.id in graph.initial_values:
                draft.initial_values[slot_of[node.id]] = graph.initial_values[node.id]
            continue
        bound = tuple(slot_of[t.id] for t in node.inputs) + (slot_of[node.id],)
        access: tuple[Access, ...] = ("read",) * len(node.inputs) + ("read_write",)
        phase: Phase = "forward" if node.id in forward_ids else "backward"
        draft.dispatch(PlannedDispatch(bound, access, 0, phase, f"{node.label} at {node.where}",
                                       node.op), node)

    draft.params = {name: slot_of[t.id] for name, t in graph.params.items() if t.id in slot_of}
    grad_views = {n: View(slot_of[t.id], t.shape) for n, t in grads.items()}
    output_views = {n: View(slot_of[t.id], t.shape) for n, t in outputs.items()}
    kept_grads = grad_views if keep_grads else {}
    index_checks = tuple((slot_of[t.id], about) for t, about in rooted.checks)
    if optimizer is not None:
        guard = output_views["loss"].slot if check_finite and "loss" in output_views else None
        _add_optimizer(draft, optimizer, {n: v.slot for n, v in grad_views.items()}, guard,
                       tuple(s for s, _ in index_checks), alignment(caps),
                       min(PACK_BYTES, caps.max_storage_buffer_range))
    readable = {v.slot for v in (*output_views.values(), *kept_grads.values())} | {
        s for s, _ in index_checks}
    prologue = hoisted(draft) if options.hoist else set()
    _keep_between_steps(draft, prologue, readable)
    _schedule(draft, prologue)
    aliases = _write_in_place(draft, readable)
    lifetimes = _lifetimes(draft, aliases, readable)
    scheduled = time.perf_counter()
    limit = caps.max_storage_buffer_range
    for slot in draft.slots:  # each is bound whole by the kernels that read it
        if slot.nbytes > limit and slot.id in lifetimes:
            what = slot.label if slot.label.startswith("%") else (
                f"'{slot.label}' {slot.dtype}{list(slot.shape)}")
            raise GraphError(f"tensor {what} takes {slot.nbytes} bytes, more than the largest "
                             f"storage buffer {caps.device_name!r} binds ({limit} bytes): use "
                             "a smaller batch or size, or split the tensor into parts")
    try:
        memory = plan_memory(lifetimes, alignment(caps), caps.max_storage_buffer_range, aliases,
                             draft.packs)
    except ValueError as e:
        raise GraphError(f"{e}; on {caps.device_name}") from None
    if timings is not None:
        timings["schedule"] = scheduled - started
        timings["memory"] = time.perf_counter() - scheduled
    plan = Plan(
        tuple(draft.slots), tuple(draft.dispatches[len(prologue):]), memory,
        inputs={n: slot_of[t.id] for n, t in graph.inputs.items() if t.id in slot_of},
        outputs=output_views, params=draft.params, grads=kept_grads, optimizer=optimizer,
        optimizer_state=draft.optimizer_state, hyperparams_slot=draft.hyperparams_slot,
        optimizer_tables=draft.optimizer_tables, initial_values=draft.initial_values,
        lifetimes=lifetimes, aliases=aliases, trainable=tuple(grads) if has_loss else None,
        hyperparams=draft.hyperparams, input_ranges=input_ranges, packs=draft.packs,
        index_checks=index_checks, prologue=tuple(draft.dispatches[:len(prologue)]))
    return Scheduled(plan, tuple(draft.nodes))


# The parameters whose gradients are computed one after another share an update dispatch, up to
# this many bytes of parameters: a dispatch and the barrier slot it takes cost a few
# microseconds on a GPU whatever its size, while Adam over 16 MiB of parameters moves about
# 112 MB, which takes several times longer. The gradients of a pack stay in memory until its
# update, so the cap also bounds how much memory the packing holds beyond one parameter at a
# time.
PACK_BYTES = 16 << 20


def _add_optimizer(plan: _Draft, optimizer: Optimizer, grads: dict[str, int],
                   guard: int | None, checks: tuple[int, ...], align: int, pack_bytes: int
                   ) -> None:
    """A hyperparameter buffer (the optimizer's values, then the step count t), the tables the
    host computes from them, the step count's dispatch and the updates (parameters and state
    rewritten in place; gradients, hyperparameters and tables read): one per pack of
    parameters whose gradients are computed in turn (`_packs`), the others one each.
    `guard`: the loss's slot, bound to every optimizer dispatch, which then changes nothing
    unless the loss is finite (compile's check_finite); the index checks' slots `checks` are
    bound after it: nothing changes either where one found an index out of range."""
    new_slot = plan.new_slot
    values = optimizer.hyperparams()
    names = (*values, "t")
    hp = new_slot("optimizer hyperparameters", (len(names),), "f32", "hyperparams")
    plan.initial_values[hp] = np.array([values.get(n, 0.0) for n in names], np.float32)
    plan.optimizer, plan.hyperparams_slot, plan.hyperparams = optimizer, hp, names
    for table, data in optimizer.tables(values).items():
        slot = new_slot(f"optimizer {table} table", data.shape, "f32", "hyperparams")
        plan.initial_values[slot] = data
        plan.optimizer_tables[table] = slot
    guards = (*(() if guard is None else (guard,)), *checks)
    extra = (*plan.optimizer_tables.values(), *guards)
    plan.dispatch(PlannedDispatch((hp, *guards), ("read_write", *("read",) * len(guards)),
                                  0, "update", "step count",
                                  update=Update(optimizer, 0, guard is not None, len(checks))))
    for name in grads:  # frozen parameters have no gradient, no state and no update
        shape = plan.slots[plan.params[name]].shape
        plan.optimizer_state[name] = {s: new_slot(f"{name} {s}", shape, "f32", "optimizer_state")
                                      for s in optimizer.state_names}
    access: tuple[Access, ...] = (("read_write", "read", "read")
                                  + ("read_write",) * len(optimizer.state_names)
                                  + ("read",) * len(extra))
    for pack in _packs(plan, grads, align, pack_bytes):
        columns = [[plan.params[n] for n in pack], [grads[n] for n in pack],
                   *[[plan.optimizer_state[n][s] for n in pack] for s in optimizer.state_names]]
        if len(pack) == 1:
            bound, covers = tuple(c[0] for c in columns), ()
            label, size = f"update {pack[0]}", plan.slots[bound[0]].nbytes // 4
        else:
            offsets = np.cumsum([0] + [_padded(plan.slots[s].nbytes, align)
                                       for s in columns[0]])
            label, size = f"update {pack[0]} .. {pack[-1]} ({len(pack)})", int(offsets[-1]) // 4
            bound = tuple(new_slot(f"pack of {what}: {pack[0]} .. {pack[-1]}", (size,), "f32",
                                   "pack")
                          for what in ("parameters", "gradients", *optimizer.state_names))
            for slot, column in zip(bound, columns):
                plan.packs[slot] = tuple(zip(column, map(int, offsets)))
            held = [tuple(c) for c in columns]
            covers = (held[0], held[1], (), *held[2:], *((),) * len(extra))
        plan.dispatch(PlannedDispatch(
            (bound[0], bound[1], hp, *bound[2:], *extra), access, 0, "update", label,
            update=Update(optimizer, size, guard is not None, len(checks)), covers=covers))


def _packs(plan: _Draft, grads: dict[str, int], align: int, pack_bytes: int) -> list[list[str]]:
    """The trained parameters in the order their gradients are first written, cut into runs of
    at most `pack_bytes` (aligned): each run is updated by one dispatch over its parameters,
    gradients and state laid out one after another (Plan.packs). A gradient that is not a
    tensor of its own (an input, a parameter, another parameter's gradient, one no dispatch
    writes) keeps an update of its own."""
    written: dict[int, int] = {}
    for index, d in enumerate(plan.dispatches):
        for s in d.writes:
            written.setdefault(s, index)
    counts = Counter(grads.values())
    packable = sorted((n for n, s in grads.items()
                       if counts[s] == 1 and s in written
                       and plan.slots[s].role in ("gradient", "activation")),
                      key=lambda n: written[grads[n]])
    runs: list[list[str]] = [[n] for n in grads if n not in packable]
    used = pack_bytes
    for name in packable:
        nbytes = _padded(plan.slots[plan.params[name]].nbytes, align)
        if used + nbytes > pack_bytes:
            runs.append([])
            used = 0
        runs[-1].append(name)
        used += nbytes
    return runs


def _padded(nbytes: int, align: int) -> int:
    """The bytes a tensor takes inside a pack: its own, rounded up to the alignment."""
    return -(-nbytes // align) * align


def hoisted(plan: _Draft) -> set[int]:
    """The dispatches (indices) of the prologue: those whose transitive inputs are only
    constants and parameters no dispatch writes (in a training step, the frozen ones), and
    whose result the step reads, directly or through others of them. What they compute is the
    same every step until the host writes a parameter (or, where parameters are shared, the
    owner's step updates one), so the session runs them only then (runtime/bound.py). A result
    nothing else reads (an output) stays in the step: hoisting it saves nothing, and a graph
    of parameters alone (no inputs) keeps its step."""
    written = {s for d in plan.dispatches for s in d.writes}
    static = {s.id for s in plan.slots
              if s.role in ("param", "constant") and s.id not in written}
    candidates = set()
    for i, (d, node) in enumerate(zip(plan.dispatches, plan.nodes)):
        if node is not None and d.reads - d.writes <= static:
            candidates.add(i)
            static |= d.writes
    read_by_step = {s for i, d in enumerate(plan.dispatches) if i not in candidates
                    for s in d.reads}
    writer = {s: i for i in candidates for s in plan.dispatches[i].writes}
    chosen: set[int] = set()
    pending = [writer[s] for s in read_by_step if s in writer]
    while pending:
        i = pending.pop()
        if i not in chosen:
            chosen.add(i)
            pending += [writer[s] for s in plan.dispatches[i].reads if s in writer]
    return chosen


def _keep_between_steps(plan: _Draft, prologue: set[int], readable: set[int]) -> None:
    """The prologue's results that the step (or the host) reads take the role "hoisted":
    pinned in memory, as parameters are, since later steps read them without the prologue
    running again, and never overwritten in place. Its other results are temporaries of the
    prologue's own levels."""
    outside = readable | {s for i, d in enumerate(plan.dispatches) if i not in prologue
                          for s in d.reads}
    for i in prologue:
        for s in plan.dispatches[i].writes & outside:
            plan.slots[s] = dataclasses.replace(plan.slots[s], role="hoisted")


def _schedule(plan: _Draft, prologue: Collection[int] = ()) -> None:
    """Levels as soon as possible, then the dispatches (and their nodes) sorted by level
    (stable). The `prologue`'s dispatches come first, at levels of their own before every
    level of the step's."""
    first = [i for i in range(len(plan.dispatches)) if i in prologue]
    order = first + [i for i in range(len(plan.dispatches)) if i not in prologue]
    written_at: dict[int, int] = {}  # slot -> level of its latest writer
    read_at: dict[int, int] = {}  # slot -> highest level reading it
    leveled = []
    floor = 0
    for k, i in enumerate(order):
        if k == len(first):
            floor = max([d.level + 1 for d in leveled] + [0])
        d = plan.dispatches[i]
        level = max([written_at[s] + 1 for s in d.reads if s in written_at]
                    + [read_at[s] + 1 for s in d.writes if s in read_at] + [floor])
        for s in d.writes:
            written_at[s] = level
        for s in d.reads:
            read_at[s] = max(read_at.get(s, -1), level)
        leveled.append(dataclasses.replace(d, level=level))
    ranked = sorted(range(len(leveled)), key=lambda k: leveled[k].level)
    plan.dispatches = [leveled[k] for k in ranked]
    plan.nodes = [plan.nodes[order[k]] for k in ranked]


def _write_in_place(plan: _Draft, readable: set[int]) -> dict[int, int]:
    """Let a pointwise dispatch overwrite an input instead of writing a new tensor where that is
    safe: the input is a temporary of the same size, read at the very index being written, and
    nothing else reads it at that level or later (`readable`: the slots read after a step).
    Returns output slot -> overwritten slot."""
    readers: Counter[tuple[int, int]] = Counter()
    last_read: dict[int, int] = {}
    for d in plan.dispatches:
        for s in d.reads:
            readers[s, d.level] += 1
            last_read[s] = max(last_read.get(s, -1), d.level)
    packed = {s for held in plan.packs.values() for s, _ in held}  # their place is the pack's
    aliases: dict[int, int] = {}
    for i, (d, node) in enumerate(zip(plan.dispatches, plan.nodes)):
        if node is None or OPS[node.op].kind != "pointwise" or d.slots[-1] in packed:
            continue
        out = plan.slots[d.slots[-1]]
        strides, shape = body_of(node).strides, node.shape
        for k, s in enumerate(d.slots[:-1]):
            slot = plan.slots[s]
            if (slot.role in ("activation", "gradient") and s not in readable | packed
                    and slot.nbytes == out.nbytes and slot.dtype == out.dtype
                    and all(in_order(t, shape) for j, t in enumerate(strides) if d.slots[j] == s)
                    and last_read[s] == d.level and readers[s, d.level] == 1):
                access = tuple("read_write" if j == k else "read" for j in range(len(d.slots) - 1))
                plan.dispatches[i] = dataclasses.replace(d, slots=d.slots[:-1], access=access,
                                                         in_place=k)
                aliases[out.id] = s
                break
    return aliases


def _lifetimes(plan: _Draft, aliases: dict[int, int], readable: set[int]
               ) -> dict[int, Lifetime]:
    """Each slot's interval of levels; pinned slots live from start-up to the end, and those
    read after a step (`readable`) to the end."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for d in plan.dispatches:
        for s in d.writes:
            first.setdefault(s, d.level)
        for s in d.reads:
            last[s] = max(last.get(s, -1), d.level)
    for out, target in aliases.items():  # written in place, at its input's last read
        first.setdefault(out, last[target])
    lifetimes = {}
    for s in plan.slots:
        if s.role in ("param", "constant", "optimizer_state", "hyperparams", "hoisted"):
            start, end = -1, FOREVER
        else:
            start = -1 if s.role == "input" else first.get(s.id, -1)
            end = FOREVER if s.id in readable else last.get(s.id, start)
        lifetimes[s.id] = Lifetime(s.nbytes, start, end)
    for pack, held in plan.packs.items():  # a pack holds its memory while any of its slots does
        spans = [lifetimes[s] for s, _ in held]
        lifetimes[pack] = Lifetime(plan.slots[pack].nbytes, min(lt.first for lt in spans),
                                   max(lt.last for lt in spans))
    return lifetimes
