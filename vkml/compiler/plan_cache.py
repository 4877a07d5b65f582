"""The plan cache: a graph compiled before, with the same options, for the same device, by the
same vkml, gets its Plan from disk (`<cache>/plans/<key>.pkl`) instead of going through the
stages again (lowering a large model's training step takes tenths of a second).

The key is a sha256 of everything lowering reads, and nothing is cached where that cannot be
told:
- vkml itself: the text of every .py file of the package (any change to the compiler, an op or
  a kernel generator is a new key), and Python's version (pickles);
- the target: every field of the Capabilities, and the precision;
- the compile's options: rewrite, keep_grads, which parameters train, the named outputs and the
  loss, and the optimizer (its type, its fields, its state and update code);
- the graph: every node's op, inputs, shape, dtype, attributes, name and the place in the
  user's code it was made (labels and errors show it; nodes lowering makes are labelled with
  the place `vkml.compile` was called from, which is in the key too), the values of constants
  (scalar ones become literals in the kernels), and the names of inputs, parameters and
  outputs. Not the
  parameters' values: those are this graph's own, put into the cached plan when it is loaded,
  as is the optimizer object. An attribute of a type the key cannot represent exactly (see
  codegen.lowering_key) makes the graph uncacheable.
`VKML_PLAN_CACHE=0` turns the cache off. Each file is a cache entry (vkml/cachedir.py): one that
fails its digest is deleted and reported, one that cannot be unpickled is ignored, and either is
compiled again and rewritten; the directory keeps the MAX_PLANS most recently used plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vkml.cachedir import cache_dir, read_entry, write_entry
from vkml.compiler.codegen import Unkeyable, value_key
from vkml.compiler.plan import Plan
from vkml.graph import Graph, Tensor, user_frame
from vkml.hal import Capabilities
from vkml.optim import Optimizer

FORMAT = b"vkml plan cache 1"
MAX_PLANS = 64
PACKAGE_DIR = Path(__file__).resolve().parent.parent

_fingerprint: str | None = None


def enabled() -> bool:
    return os.environ.get("VKML_PLAN_CACHE", "1") != "0"


def source_fingerprint() -> str:
    """sha256 of vkml's source files (paths and contents), once per process."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        for path in sorted(PACKAGE_DIR.rglob("*.py")):
            h.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
        _fingerprint = h.hexdigest()
    return _fingerprint


def key(graph: Graph, caps: Capabilities, named: Mapping[str, Tensor], loss: Tensor | None,
        optimizer: Optimizer | None, options: tuple, trained: tuple[str, ...] | None
        ) -> str | None:
    """The cache key of a compilation (see the module's doc), or None where it cannot be told:
    a tensor of another graph, an attribute the key cannot represent."""
    if any(not graph.owns(t) for t in [*named.values(), *([loss] if loss is not None else [])]):
        return None
    h = hashlib.sha256(FORMAT)

    def put(value: Any) -> None:
        h.update(repr(value).encode())
        h.update(b"\0")

    put((sys.version_info[:2], source_fingerprint(), user_frame()))
    put([(f.name, sorted(v) if isinstance(v, frozenset) else v)
         for f in dataclasses.fields(caps) for v in [getattr(caps, f.name)]])
    put((options, trained, [(n, t.id) for n, t in named.items()],
         None if loss is None else loss.id))
    if optimizer is not None:
        put((type(optimizer).__module__, type(optimizer).__qualname__, repr(optimizer),
             optimizer.state_names, sorted(optimizer.hyperparams()), optimizer.update()))
    for table in (graph.inputs, graph.params, graph.outputs):
        put([(n, t.id) for n, t in table.items()])
    try:
        for t in graph.nodes:
            put((t.id, t.op, [x.id for x in t.inputs], t.shape, t.dtype, value_key(t.attrs),
                 t.name, t.where))
            if t.op == "constant":
                value = np.ascontiguousarray(graph.initial_values[t.id])
                put((value.dtype.str, value.shape, hashlib.sha256(value.tobytes()).hexdigest()))
    except Unkeyable:
        return None
    return h.hexdigest()


def _path(cache_key: str) -> Path:
    return cache_dir() / "plans" / f"{cache_key}.pkl"


def load(cache_key: str, graph: Graph, optimizer: Optimizer | None) -> Plan | None:
    """The cached plan with this graph's initial values and this optimizer, or None."""
    path = _path(cache_key)
    data = read_entry(path)  # None where absent or damaged (then deleted and reported)
    if data is None:
        return None
    try:
        unpickler = _Unpickler(io.BytesIO(data), optimizer)
        plan, sources = unpickler.load()
        values = {slot: graph.initial_values[ref] if kind == "graph" else ref
                  for slot, (kind, ref) in sources.items()}
        plan = dataclasses.replace(plan, initial_values=values)
    except Exception:  # a stale file (an intact one from another vkml): compiled again
        return None
    try:
        os.utime(path)  # recently used: kept when the directory is trimmed
    except OSError:
        pass
    return plan


def store(cache_key: str, plan: Plan, graph: Graph, optimizer: Optimizer | None) -> None:
    """Write `plan` for `cache_key`, in a thread of its own: pickling a large plan takes a
    fifth of a second, which then overlaps the session's binding (uploads release Python's
    lock). Initial values are stored as where they come from: the graph's node (parameters,
    the user's constants), or the value itself for those lowering made (autodiff's constants,
    the optimizer's hyperparameters)."""
    of_node = {id(v): node_id for node_id, v in graph.initial_values.items()}
    sources = {slot: ("graph", of_node[id(v)]) if id(v) in of_node else ("value", v)
               for slot, v in plan.initial_values.items()}
    entry = (dataclasses.replace(plan, initial_values={}), sources)
    path, root = _path(cache_key), cache_dir()

    def write() -> None:
        out = io.BytesIO()
        try:
            _Pickler(out, optimizer).dump(entry)
        except Exception:  # only saves time: a plan that cannot be pickled is not cached
            return
        if write_entry(path, out.getvalue(), root):
            _trim(path.parent)

    # Not a daemon: an exiting interpreter waits for it, so no half-written temporary is left.
    threading.Thread(target=write, name="vkml-plan-cache").start()


def _trim(directory: Path) -> None:
    try:
        plans = sorted(directory.glob("*.pkl"), key=lambda p: p.stat().st_mtime)
        for old in plans[:-MAX_PLANS]:
            old.unlink()
    except OSError:
        pass


# ---- pickling: the optimizer by reference (a Plan holds no graph) --------------------------
class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, optimizer: Optimizer | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._optimizer = optimizer

    def persistent_id(self, obj: Any) -> str | None:
        return "optimizer" if obj is not None and obj is self._optimizer else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, optimizer: Optimizer | None) -> None:
        super().__init__(file)
        self._optimizer = optimizer

    def persistent_load(self, pid: Any) -> Any:
        if pid != "optimizer" or self._optimizer is None:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._optimizer

