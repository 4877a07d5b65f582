"""The schedule and the memory plan: the fewest barriers, shared memory that never races, and the
validation layer's synchronization checks on real training graphs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env

import vkml
from vkml.compiler import schedule

REPO = Path(__file__).resolve().parent.parent


def training_graph(optimizer=None, batch=16):
    g = vkml.Graph(seed=0)
    x = g.input("x", (batch, 32))
    labels = g.input("labels", (batch,), "i32")
    h = vkml.nn.Linear(g, "fc1", 32, 48)(x).gelu()
    h = vkml.nn.Linear(g, "fc2", 48, 48)(h).relu()
    logits = vkml.nn.Linear(g, "fc3", 48, 5)(h)
    # a log_softmax read by an elementwise op where it dies: fused or not, a write in place
    return g, g.cross_entropy(logits.log_softmax() * 2.0, labels)


@pytest.fixture(params=["none", "greedy"])
def plan(request, device):
    g, loss = training_graph()
    return vkml.compile(g, loss=loss, optimizer=vkml.Adam(), device=device,
                        rewrite=request.param).plan


def test_dispatches_of_one_level_are_independent(plan):
    levels: dict[int, list] = {}
    for d in plan.dispatches:
        levels.setdefault(d.level, []).append(d)
    for group in levels.values():
        for a in group:
            for b in group:
                if a is not b:
                    assert not (a.writes & b.reads), (a.label, b.label)
    assert [d.level for d in plan.dispatches] == sorted(d.level for d in plan.dispatches)
    assert plan.barrier_count == len(levels) - 1 < len(plan.dispatches) - 1


def test_tensors_sharing_memory_never_live_at_the_same_time(plan):
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    by_target = {target: out for out, target in plan.aliases.items()}
    assert plan.prologue  # the loss gradient's seed: constants alone
    for d in (*plan.prologue, *plan.dispatches):  # the prologue's levels come first
        for s in d.writes:
            first.setdefault(s, d.level)
            if "_inplace" in d.kernel.name:  # it also produces the tensor it aliases
                first.setdefault(by_target[s], d.level)
        for s in d.reads:
            last[s] = max(last.get(s, -1), d.level)
    forever = float("inf")
    readable = {v.slot for v in plan.outputs.values()} | {v.slot for v in plan.grads.values()}

    packed_in = {s: pack for pack, held in plan.packs.items() for s, _ in held}

    def span(slot):
        if slot.role in ("param", "constant", "optimizer_state", "hyperparams", "hoisted"):
            return -1, forever
        if slot.role == "pack":  # its bytes are its slots': their spans count
            return forever, -1
        start = -1 if slot.role == "input" else first[slot.id]
        return start, forever if slot.id in readable else last.get(slot.id, start)

    def root(slot_id):  # a pointwise op writing in place takes over its input's bytes
        while slot_id in plan.aliases:
            slot_id = plan.aliases[slot_id]
        return packed_in.get(slot_id, slot_id)  # a pack's slots lie inside it

    def group_span(slot):  # the bytes of a tensor and of those written in place over it
        spans = [span(o) for o in plan.slots if root(o.id) == root(slot.id)]
        return min(a for a, _ in spans), max(b for _, b in spans)

    placed = [(s, *plan.memory.placement[s.id]) for s in plan.slots]
    for s, arena, offset in placed:
        for t, arena2, offset2 in placed:
            if s.id >= t.id or arena != arena2 or root(s.id) == root(t.id):
                continue
            if offset < offset2 + max(t.nbytes, 4) and offset2 < offset + max(s.nbytes, 4):
                (s0, s1), (t0, t1) = group_span(s), group_span(t)
                assert s1 < t0 or t1 < s0, (s.label, t.label)
    report = plan.memory_report()
    assert report["physical"] < report["logical"]


def test_updates_run_a_pack_of_parameters_at_a_time(plan):
    updates = [d for d in plan.dispatches if d.update is not None and d.update.size]
    assert len(updates) == 1 and len(plan.packs) == 2 + len(vkml.Adam.state_names)
    (update,) = updates
    for binding, held in zip(update.slots, update.covers):
        pack = plan.packs.get(binding)
        assert [s for s, _ in pack or ()] == list(held)
        if pack:  # each slot at its offset inside the pack, in the order the gradients come
            arena, start = plan.memory.placement[binding]
            assert all(plan.memory.placement[s] == (arena, start + at) for s, at in pack)
            ends = [at + plan.slots[s].nbytes for s, at in pack]
            assert all(e <= at for e, (_, at) in zip(ends, pack[1:]))
            assert ends[-1] <= plan.slots[binding].nbytes
    fc = [name for name in plan.params if name.startswith("fc")]
    assert update.label.startswith(f"update {fc[-1]}")  # the last layer's gradients first


def test_packed_updates_change_parameters_as_single_updates_do(device, monkeypatch):
    def trained(pack_bytes):
        monkeypatch.setattr(schedule, "PACK_BYTES", pack_bytes)
        g, loss = training_graph()
        with vkml.compile(g, loss=loss, optimizer=vkml.AdamW(lr=1e-2), device=device) as s:
            rng = np.random.default_rng(0)
            for _ in range(3):
                s.set_input("x", rng.standard_normal((16, 32)).astype(np.float32))
                s.set_input("labels", rng.integers(0, 5, 16).astype(np.int32))
                s.step()
            updates = sum(1 for d in s.plan.dispatches if d.update and d.update.size)
            return updates, {n: s.read(n) for n in s.plan.params}

    monkeypatch.setenv("VKML_PLAN_CACHE", "0")  # the plan depends on PACK_BYTES
    default = schedule.PACK_BYTES
    alone, packed, split = trained(1), trained(default), trained(10_000)
    assert (alone[0], packed[0], split[0]) == (6, 1, 3)  # fc1's weight alone is 6144 bytes
    for name, value in alone[1].items():
        np.testing.assert_array_equal(packed[1][name], value)
        np.testing.assert_array_equal(split[1][name], value)


def test_in_place_writes_reuse_an_input_that_dies_there(plan):
    written_in_place = [d for d in plan.dispatches if "_inplace" in d.kernel.name]
    assert written_in_place and len(plan.aliases) == len(written_in_place)
    for d in written_in_place:
        (target,) = d.writes
        assert target in plan.aliases.values()
        later = [e for e in plan.dispatches if e.level >= d.level and e is not d]
        assert all(target not in e.reads for e in later if e.level == d.level)


SYNC_SCRIPT = """
import numpy as np, sys, vkml
sys.path.insert(0, {tests!r})
from test_schedule import training_graph
drop_barriers = {drop}
if drop_barriers:  # the control: the same work recorded without barriers must be caught
    import vkml.runtime.bound
    vkml.runtime.bound.Barrier = lambda: None
    # This layer (1.3.239 on lavapipe) reports hazards from a copy to a dispatch inside one
    # command buffer, not between dispatches nor across command buffers; the inputs' copies
    # are a command buffer of their own, so the control puts them back in front of every
    # program's dispatches, with no barrier between.
    commands = vkml.runtime.bound.BoundPlan.commands
    vkml.runtime.bound.BoundPlan.commands = lambda self, indices, dispatches=None: (
        (self.uploads(0) if self.staging_buffers else [])
        + commands(self, indices, dispatches))
    import vkml.vk
    record = vkml.vk.VulkanBackend._record
    vkml.vk.VulkanBackend._record = lambda self, cmds, label, timestamps: record(
        self, [c for c in cmds if c is not None], label, timestamps)
device = vkml.Device(backend="vulkan")
for optimizer in (vkml.SGD(lr=0.1, momentum=0.9), vkml.AdamW()):
    for rewrite in ("none", "greedy"):
        g, loss = training_graph()
        s = vkml.compile(g, loss=loss, optimizer=optimizer, device=device, rewrite=rewrite)
        s.set_input("x", np.ones((16, 32), np.float32))
        s.set_input("labels", np.arange(16, dtype=np.int32) % 5)
        for _ in range(3):
            s.step()
        s.forward()
        for chunks in (2, 3, 7):  # a step cut into pieces, each its own submission
            s.step(chunks=chunks)
        while s.step_chunk(chunks=3):  # one piece per call, as in a render loop
            pass
        # every level made longer than the budget: cut into workgroup ranges where it can be
        s._chunker.set_measured([1.0] * len(s.plan.dispatches), "made up")
        s.step(budget_ms=0.4)
        s.wait()
print("MESSAGES", len(device.backend.validation_messages))
"""


@pytest.mark.parametrize("drop", [False, True], ids=["as-planned", "control-without-barriers"])
def test_synchronization_validation_finds_no_hazard(drop):
    import vulkan

    layers = [p.layerName for p in vulkan.vkEnumerateInstanceLayerProperties()]
    if "VK_LAYER_KHRONOS_validation" not in layers:
        pytest.skip("the Khronos validation layer is not installed here")
    env = subprocess_env(VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation",
               VK_LAYER_ENABLES="VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT")
    code = SYNC_SCRIPT.format(tests=str(REPO / "tests"), drop=drop)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert "MESSAGES" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    count = int(out.stdout.split("MESSAGES")[1].split()[0])
    if drop:
        assert count > 0 and "SYNC-HAZARD" in out.stderr
    else:
        assert count == 0, out.stderr[-3000:]
