"""The mechanisms that keep compiling linear in the graph's size, each against the plain
algorithm it replaces (the same result, bit for bit). Speed itself is measured by
tools/bench_compiler.py, never by a timed test."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import vkml
from vkml import expr
from vkml.compiler import plan_cache, stages
from vkml.compiler.memory_plan import ARENA_LIMIT, FOREVER, Lifetime, plan_memory
from vkml.compiler.rewrite import fuse
from vkml.compiler.rooted import Rooted
from vkml.expr import Arg, Axis, Body, Call, Lit, Subst, materialize, substitute


# ---- lazy substitution ----------------------------------------------------------------------
def eager(e, memo=None):
    """A Subst carried out as the rewrite used to: each substitution made at once, once."""
    memo = {} if memo is None else memo
    if not isinstance(e, Subst):
        return e
    if id(e) not in memo:
        memo[id(e)] = substitute(eager(e.expr, memo), {k: eager(v, memo)
                                                        for k, v in enumerate(e.env)})
    return memo[id(e)]


def shape_of(root) -> list:
    """The expression as a list, each distinct node once, children by position in the list:
    equal lists mean equal expressions with the same nodes shared (what rendering shows)."""
    order = expr.postorder(root)
    index = {id(e): i for i, e in enumerate(order)}
    out = []
    for e in order:
        if isinstance(e, Call):
            out.append(("call", e.template, tuple(index[id(a)] for a in e.args)))
        elif isinstance(e, Arg):
            out.append(("arg", e.k))
        elif isinstance(e, Lit):
            out.append(("lit", e.value))
        else:
            out.append(("axis", e.axis))
    return out


def random_lazy(rng: np.random.Generator, depth: int):
    """Nested substitutions as fusion makes them: each body reads Args of its own; a new body
    fills an earlier one's (or a fresh call tree's) Args with its own Args, literals, constant
    calls and earlier bodies inlined over its own Args, one value sometimes filling two."""
    made: list[tuple[object, int]] = []  # (a body's lazy result, how many Args it reads)

    def tree(n: int):
        args = [Arg(k) for k in range(n)]
        pool: list = list(args) + [Lit(float(rng.integers(5))), Axis(0)]
        for _ in range(int(rng.integers(1, 5))):
            picked = [pool[int(rng.integers(len(pool)))] for _ in range(int(rng.integers(1, 3)))]
            pool.append(Call("f(" + ", ".join(f"{{{i}}}" for i in range(len(picked))) + ")",
                             tuple(picked)))
        # every Arg read, as fusion's bodies read every input; the last call on top
        return Call("g(" + ", ".join(f"{{{i}}}" for i in range(n + 1)) + ")",
                    (*args, pool[-1])) if n else pool[-1]

    def value(own: list):
        r = rng.random()
        if r < 0.25 and made:  # an earlier body inlined over this body's Args
            inner, n = made[int(rng.integers(len(made)))]
            return Subst(inner, tuple(value(own) if rng.random() < 0.2 else
                                      (own[int(rng.integers(len(own)))] if own else Lit(3.0))
                                      for _ in range(n)))
        if r < 0.45 or not own:
            return (Lit(float(rng.integers(5))) if rng.random() < 0.5
                    else Call("c({0})", (Lit(1.0),)))
        return own[int(rng.integers(len(own)))]

    for _ in range(depth):
        if made and rng.random() < 0.6:
            inner, n = made[int(rng.integers(len(made)))]
        else:
            n = int(rng.integers(0, 4))
            inner = tree(n)
        own = [Arg(k) for k in range(int(rng.integers(0, 3)))]
        env = [value(own) for _ in range(n)]
        if env and rng.random() < 0.3:
            env[-1] = env[0]
        made.append((Subst(inner, tuple(env)), len(own)))
    return made[-1][0], [m for m, _ in made]


@pytest.mark.parametrize("seed", range(200))
def test_materialize_builds_what_eager_substitution_builds(seed):
    rng = np.random.default_rng(seed)
    root, every = random_lazy(rng, int(rng.integers(1, 12)))
    memo: dict = {}
    want = [eager(e, memo) for e in every]
    got = materialize(every)
    for w, g in zip(want, got):
        assert shape_of(g) == shape_of(w)
    # across expressions too: a call eager substitution shares between them is shared here
    assert shape_of(Call("all", tuple(got))) == shape_of(Call("all", tuple(want)))


def test_constant_copies_are_shared_where_eager_substitution_shares_them():
    """c(x0) with x0 <- a literal is constant after the inner substitution; eager substitution
    keeps that one copy in both places the outer body uses it."""
    inner = Subst(Call("c({0})", (Arg(0),)), (Lit(2.0),))
    body = Subst(Call("m({0}, {1})", (Arg(0), Arg(1))), (Arg(0), inner))
    twice = Subst(Call("p({0}, {1})", (Arg(0), Arg(1))), (body, body))
    (got,) = materialize([twice])
    assert shape_of(got) == shape_of(eager(twice))
    left, right = got.args
    assert left.args[1] is right.args[1]


def chain(n: int) -> tuple[vkml.Graph, vkml.Tensor]:
    g = vkml.Graph()
    x = g.input("x", (8, 8))
    h = x
    for _ in range(n):
        h = (h * 1.5 + x).tanh()
    return g, h


def test_fusing_a_chain_builds_each_call_a_bounded_number_of_times(monkeypatch):
    """Fusion used to copy the growing body at every step: calls made grew with the square of
    the chain's length. Now linearly."""
    made = []
    original = Call.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Call, "__init__", counting)
    counts = []
    for n in (100, 200, 400):
        g, h = chain(n)
        made.clear()
        fused = fuse(Rooted(g, {"h": h}, {}), max_inputs=31)
        counts.append(len(made))
        (kernel,) = [t for t in fused.graph.nodes if t.op == "fused_pointwise"]
        assert str(kernel.attrs["body"]).count("vkml_tanh") == n
    assert counts[2] <= 2.2 * counts[1] <= 4.4 * counts[0]


def test_an_unmaterialized_body_is_refused():
    with pytest.raises(TypeError, match="materialized"):
        str(Body(Subst(Arg(0), (Lit(1.0),)), ((),)))


# ---- memory planning ------------------------------------------------------------------------
def reference_offset(placed, life, size, alignment):
    """The planner's first fit as it was written before it was vectorized."""
    busy = sorted((start, end) for start, end, other in placed
                  if other.first <= life.last and life.first <= other.last)
    offset = 0
    for start, end in busy:
        if offset + size <= start:
            break
        offset = max(offset, -(-end // alignment) * alignment)
    return offset


def reference_plan(lifetimes, alignment):
    arenas, placement = [], {}
    order = sorted(lifetimes, key=lambda s: (-lifetimes[s].nbytes, lifetimes[s].first, s))
    for slot in order:
        life = lifetimes[slot]
        size = max(life.nbytes, 4)
        for index, placed in enumerate(arenas + [[]]):
            offset = reference_offset(placed, life, size, alignment)
            if offset + size <= ARENA_LIMIT or not placed:
                if index == len(arenas):
                    arenas.append(placed)
                placed.append((offset, offset + size, life))
                placement[slot] = (index, offset)
                break
    return placement, [max(end for _, end, _ in placed) for placed in arenas]


@pytest.mark.parametrize("seed", range(40))
def test_memory_plan_places_as_the_plain_first_fit(seed):
    rng = np.random.default_rng(seed)
    levels = int(rng.integers(1, 60))
    lifetimes = {}
    for slot in range(int(rng.integers(1, 300))):
        # sizes repeat (ties in the order), some tensors are pinned, a few are huge (arenas)
        nbytes = int(rng.choice([4, 12, 64, 100, 256, 1000, 4096, 1 << 20, 300 << 20]))
        if rng.random() < 0.15:
            lifetimes[slot] = Lifetime(nbytes, -1, FOREVER)
        else:
            first = int(rng.integers(-1, levels))
            lifetimes[slot] = Lifetime(nbytes, first, int(rng.integers(first, levels + 1)))
    alignment = int(rng.choice([16, 64, 256]))
    plan = plan_memory(lifetimes, alignment, 1 << 31)
    assert (plan.placement, plan.arena_bytes) == reference_plan(lifetimes, alignment)


# ---- the plan cache -------------------------------------------------------------------------
def tiny_training_graph(scale: float = 0.5, line_shift: bool = False):
    g = vkml.Graph(seed=0)
    x = g.input("x", (4, 6))
    y = g.input("y", (4, 3))
    h = vkml.nn.Linear(g, "fc1", 6, 8)(x).relu() * scale
    if line_shift:
        h = h + 0.0
    out = g.output("out", vkml.nn.Linear(g, "fc2", 8, 3)(h))
    return g, g.mse(out, y)


def lowered(fn, graph, caps, **options):
    """fn(graph, ...) called from this one line: nodes that lowering makes are labelled with
    the line that asked for the compilation."""
    return fn(graph, caps, **options)


@pytest.fixture
def plan_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKML_PLAN_CACHE", raising=False)
    return tmp_path / "plans"


def wait_for_stores():
    for thread in threading.enumerate():
        if thread.name == "vkml-plan-cache":
            thread.join()


def test_a_cached_plan_is_the_plan_lowering_makes(plan_cache_dir, monkeypatch):
    caps = vkml.Device().caps
    g, loss = tiny_training_graph()
    optimizer = vkml.Adam(lr=0.01)
    options = {"loss": loss, "optimizer": optimizer, "outputs": {"out": g.outputs["out"]}}
    fresh = lowered(stages.lower, g, caps, **options).plan
    lowered(stages.compile_plan, g, caps, **options)  # lowers, and stores the plan
    wait_for_stores()
    assert len(list(plan_cache_dir.glob("*.pkl"))) == 1
    monkeypatch.setattr(stages, "_lower", None)  # a hit never lowers
    cached = lowered(stages.compile_plan, g, caps, **options)
    assert cached.dump() == fresh.dump() and cached.dump_memory() == fresh.dump_memory()
    assert [d.kernel for d in cached.dispatches] == [d.kernel for d in fresh.dispatches]
    assert [d.op for d in cached.dispatches if d.op] == [
        d.op for d in fresh.dispatches if d.op]
    assert cached.optimizer is optimizer
    assert all(d.update.optimizer is optimizer for d in cached.dispatches if d.update)
    assert cached.initial_values.keys() == fresh.initial_values.keys()
    for slot, value in fresh.initial_values.items():
        assert np.array_equal(cached.initial_values[slot], value)
        if any(value is v for v in g.initial_values.values()):  # this graph's own arrays
            assert cached.initial_values[slot] is value


def test_the_key_changes_with_whatever_lowering_reads(plan_cache_dir, monkeypatch):
    caps = vkml.Device().caps

    def key_of(graph, loss, optimizer=None, caps=caps, named=None, options=("greedy", None,
                                                                              "f32", True),
               trained="all"):
        named = named if named is not None else {"out": graph.outputs["out"], "loss": loss}
        return plan_cache.key(graph, caps, named, loss, optimizer or vkml.Adam(), options,
                              tuple(graph.params) if trained == "all" else trained)

    g, loss = tiny_training_graph()
    base = key_of(g, loss)
    assert key_of(g, loss) == base
    other, other_loss = tiny_training_graph()  # same graph built again, other param values
    other.initial_values[other.params["fc1.weight"].id] += 1.0
    assert key_of(other, other_loss) == base
    changed = {
        "a constant": key_of(*tiny_training_graph(scale=0.25)),
        "the graph": key_of(*tiny_training_graph(line_shift=True)),
        "an optimizer field": key_of(g, loss, vkml.Adam(weight_decay=0.1)),
        "the optimizer": key_of(g, loss, vkml.AdamW()),
        "the device": key_of(g, loss, caps=dataclasses.replace(caps, subgroup_size=64)),
        "an option": key_of(g, loss, options=("none", None, "f32", True)),
        "what trains": key_of(g, loss, trained=("fc2.weight", "fc2.bias")),
        "the outputs": key_of(g, loss, named={"loss": loss}),
    }
    monkeypatch.setattr(plan_cache, "_fingerprint", "another vkml")
    changed["vkml's code"] = key_of(g, loss)
    assert base not in changed.values() and len(set(changed.values())) == len(changed)
    foreign, _ = tiny_training_graph()
    assert key_of(g, loss, named={"out": foreign.outputs["out"]}) is None


def test_a_session_from_a_cached_plan_computes_the_same(plan_cache_dir):
    device = vkml.Device()
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((4, 6)).astype(np.float32),
              "y": rng.standard_normal((4, 3)).astype(np.float32)}
    results = []
    for _ in range(2):
        g, loss = tiny_training_graph()
        session = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=0.1), device=device)
        for name, value in inputs.items():
            session.set_input(name, value)
        for _ in range(3):
            session.step()
        results.append([session.read("loss"), *session.params().values()])
        session.close()
        wait_for_stores()
    assert len(list(plan_cache_dir.glob("*.pkl"))) == 1
    for a, b in zip(*results):
        assert np.array_equal(a, b)
    device.close()


def test_an_unreadable_cached_plan_is_lowered_again(plan_cache_dir):
    caps = vkml.Device().caps
    g, loss = tiny_training_graph()
    lowered(stages.compile_plan, g, caps, loss=loss)
    wait_for_stores()
    (path,) = plan_cache_dir.glob("*.pkl")
    path.write_bytes(b"torn")
    plan = lowered(stages.compile_plan, g, caps, loss=loss)
    wait_for_stores()
    assert plan.dispatches and path.read_bytes() != b"torn"
