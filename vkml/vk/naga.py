"""WGSL -> SPIR-V through naga compiled to WebAssembly (npm `naga-wasm`), run under wasmtime.

Node.js is only needed to fetch the package (`npm ci`); at run time the wasm-bindgen glue that
naga's wasm imports is reimplemented here in Python. Results are cached by content: in memory,
then on disk as `<cache>/spirv/<sha256>.spv`, so a warm process never instantiates the wasm.
Both disk caches (SPIR-V, and the compiled wasm module, which wasmtime would run as machine code
without checking it) are cache entries with a digest (vkml/cachedir.py): a damaged one is
compiled again, never used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import wasmtime

from vkml.cachedir import cache_dir as default_cache_dir
from vkml.cachedir import read_entry, write_entry
from vkml.errors import NagaError
from vkml.threads import compile_threads

SPIRV_MAGIC = 0x07230203
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # vkml/
# What an installed wheel carries (setup.py copies it in at build time): the naga-wasm npm
# package's files, in npm's layout, and the shipped SPIR-V.
PACKAGED = PACKAGE_DIR / "_shipped"
# A checkout (editable install, PYTHONPATH): the same files where npm and tools/build_spirv.py
# put them. An installed vkml has no package.json beside it, so site-packages never counts.
SOURCE_TREE = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "package.json").is_file() else None
WASM_IN_NPM_PACKAGE = Path("dist") / "wasm" / "naga_bg.wasm"


def _first_present(*candidates: Path) -> Path:
    """The first candidate that exists, else the last: the checkout's path where there is one,
    which is where the missing-wasm error should point."""
    return next((c for c in candidates if c.exists()), candidates[-1])


_checkout = [SOURCE_TREE] if SOURCE_TREE else []
DEFAULT_WASM = _first_present(PACKAGED / "naga-wasm" / WASM_IN_NPM_PACKAGE,
                              *(d / "node_modules" / "naga-wasm" / WASM_IN_NPM_PACKAGE
                                for d in _checkout))
# SPIR-V shipped with the project (tools/build_spirv.py), named by the WGSL's sha256: with it, a
# deployed app runs its kernels without naga's wasm at all.
SHIPPED_SPIRV = _first_present(PACKAGED / "spirv", *(d / "spirv" for d in _checkout))


def wgsl_hash(wgsl: str) -> str:
    return hashlib.sha256(wgsl.encode()).hexdigest()


def wasm_package_version() -> str:
    """The naga-wasm npm package's version, from its package.json."""
    package = DEFAULT_WASM.parent.parent.parent / "package.json"
    return json.loads(package.read_text())["version"]


class _Rejected(Exception):
    """naga refused the WGSL. Built by the glue's `new Error(msg)` import and handed back by naga
    as an externref; its text is naga's formatted report (line, column, caret)."""


class _WasmThrew(Exception):
    """naga's wasm called wasm-bindgen's `throw` (a Rust panic surfaced as a JS exception)."""


class _NagaWasm:
    """One naga wasm instance and the wasm-bindgen imports it needs. Not thread-safe."""

    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module) -> None:
        self.store = wasmtime.Store(engine)
        linker = wasmtime.Linker(engine)
        for imp in module.imports:
            linker.define_func(imp.module, imp.name, imp.type, self._import(imp.name))
        self.x = linker.instantiate(self.store, module).exports(self.store)
        self.x["__wbindgen_start"](self.store)

    def _str(self, ptr: int, n: int) -> str:
        return bytes(self.x["memory"].read(self.store, ptr, ptr + n)).decode()

    def _init_table(self) -> None:
        # Mirrors naga.js: wasm-bindgen expects undefined, null, true, false at fixed slots.
        table = self.x["__wbindgen_externrefs"]
        off = table.grow(self.store, 4, None)
        for i, v in enumerate([None, None, True, False]):
            table.set(self.store, off + i, wasmtime.Val.externref(v))

    def _throw(self, ptr: int, n: int) -> None:
        raise _WasmThrew(self._str(ptr, n))

    def _import(self, name: str) -> Callable[..., Any]:
        # Import names carry a per-build hash suffix (`__wbg_Error_67e7...`): match by prefix.
        # With SPIR-V options passed as undefined, naga only calls the handlers below.
        handlers: dict[str, Callable[..., Any]] = {
            "__wbg_Error_": lambda p, n: wasmtime.Val.externref(_Rejected(self._str(p, n))),
            "__wbindgen_generic_": lambda p, n: wasmtime.Val.externref(self._str(p, n)),
            "__wbg___wbindgen_throw_": self._throw,
            "__wbg___wbindgen_is_undefined_": lambda v: v is None,
            "__wbg___wbindgen_is_object_": lambda v: isinstance(v, dict),
            "__wbg___wbindgen_is_string_": lambda v: isinstance(v, str),
            "__wbg___wbindgen_is_function_": callable,
            "__wbg___wbindgen_jsval_loose_eq_": lambda a, b: a == b,
            "__wbindgen_init_externref_table": self._init_table,
        }
        for prefix, fn in handlers.items():
            if name.startswith(prefix):
                return fn

        def unsupported(*args: Any) -> None:
            raise NotImplementedError(f"naga wasm called import {name!r}, which vkml.vk.naga's "
                                      "glue does not implement (see naga.js in naga-wasm)")
        return unsupported

    def _result(self, ret: list[Any]) -> Any:
        # wasm-bindgen returns (value..., err_externref_slot, is_err).
        if ret[-1]:
            table = self.x["__wbindgen_externrefs"]
            err = table.get(self.store, ret[-2])
            self.x["__externref_table_dealloc"](self.store, ret[-2])
            raise err if isinstance(err, _Rejected) else _Rejected(str(err))
        return ret[0] if len(ret) == 3 else ret[:2]

    def wgsl_to_spirv(self, wgsl: str) -> bytes:
        s, x = self.store, self.x
        src = wgsl.encode()
        ptr = x["__wbindgen_malloc"](s, len(src), 1)
        x["memory"].write(s, src, ptr)
        mod = self._result(x["parseWgsl"](s, ptr, len(src)))  # takes ownership of `src`
        owned = [("__wbg_module_free", mod)]
        # Free on success and on rejection only: after a trap the instance is discarded, and
        # calling into it again would only raise a second, misleading error.
        try:
            info = self._result(x["validate"](s, mod))
            owned.append(("__wbg_moduleinfo_free", info))
            out, n = self._result(x["writeSpirv"](s, mod, info, None))
            spirv = bytes(x["memory"].read(s, out, out + 4 * n))
            x["__wbindgen_free"](s, out, 4 * n, 4)
        except _Rejected:
            self._free(owned)
            raise
        self._free(owned)
        return spirv

    def _free(self, owned: list[tuple[str, int]]) -> None:
        for fn, ptr in reversed(owned):
            self.x[fn](self.store, ptr, 0)


def _read_spirv(path: Path) -> bytes | None:
    """A shipped file's SPIR-V, or None when it is absent or not SPIR-V."""
    try:
        spirv = path.read_bytes()
    except OSError:
        return None
    ok = len(spirv) % 4 == 0 and int.from_bytes(spirv[:4], "little") == SPIRV_MAGIC
    return spirv if ok else None


def missing_wasm_advice() -> str:
    """How to get naga's wasm, for where this vkml lives: a checkout or an installed wheel."""
    if SOURCE_TREE is not None:
        return (f"Run `npm ci` in {SOURCE_TREE} (it fetches the naga-wasm package pinned in "
                "package.json), or set VKML_NAGA_WASM to the path of naga_bg.wasm.")
    return (f"This vkml ({PACKAGE_DIR}) was installed from a build without it: vkml's wheels "
            f"carry it as {PACKAGED.name}/naga-wasm/{WASM_IN_NPM_PACKAGE.as_posix()}. Reinstall "
            "vkml from a wheel or sdist that has it (`pip install --force-reinstall --no-deps "
            "<wheel>`), or set VKML_NAGA_WASM to a naga_bg.wasm from the npm package naga-wasm.")


# Cranelift's optimization level for naga's wasm (see Compiler._load_module)
WASM_OPT_LEVEL = "none"
# Threads translating at once for `prefetch`, each with its own naga instance (a few MB). Most of
# a translation runs inside wasm, outside Python's lock, so threads scale with the cores
# (vkml.threads), up to a few.
PREFETCH_THREADS = 8


class Compiler:
    """WGSL -> SPIR-V with an in-process memo and an on-disk cache under `cache_dir`.

    Everything expensive (hashing and compiling the wasm, instantiating it) happens on first use,
    so constructing one is free. Any thread may compile: each thread translates with a naga
    instance of its own (a wasmtime Store is not thread-safe), all share the compiled module,
    and a WGSL text asked for by several threads at once is translated once. `prefetch`
    translates in background threads while the caller goes on.
    """

    def __init__(self, cache_dir: Path | str | None = None,
                 wasm_path: Path | str | None = None,
                 shipped_dir: Path | str | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        env = os.environ.get("VKML_NAGA_WASM")
        self.wasm_path = Path(wasm_path or env or DEFAULT_WASM)
        self._wasm_origin = " (given)" if wasm_path else " (VKML_NAGA_WASM)" if env else ""
        self.shipped_dir = Path(shipped_dir or os.environ.get("VKML_SPIRV_DIR") or SHIPPED_SPIRV)
        self.stats = {"memory_hits": 0, "shipped_hits": 0, "disk_hits": 0, "compiles": 0,
                      "module_compiles": 0, "module_deserializes": 0}
        self._lock = threading.Lock()  # the memo, the pending translations and the stats
        self._hash_lock = threading.Lock()  # hashing the wasm, once
        self._module_lock = threading.Lock()  # loading the wasm module, once
        self._memo: dict[str, bytes] = {}
        self._pending: dict[str, Future[bytes]] = {}  # WGSL hash -> its translation under way
        self._wasm_hash: str | None = None
        self._engine_module: tuple[wasmtime.Engine, wasmtime.Module] | None = None
        self._local = threading.local()  # this thread's naga instance
        self._preloading = False

    @property
    def _naga(self) -> _NagaWasm | None:
        """The calling thread's naga instance (None until it translates, or after a trap)."""
        return getattr(self._local, "naga", None)

    @_naga.setter
    def _naga(self, instance: _NagaWasm | None) -> None:
        self._local.naga = instance

    def _hash_wasm(self) -> str:
        with self._hash_lock:  # not the module's lock: cache lookups never wait for a compile
            if self._wasm_hash is None:
                if not self.wasm_path.is_file():
                    raise NagaError(
                        f"naga's wasm file is missing: {self.wasm_path}{self._wasm_origin}. "
                        + missing_wasm_advice())
                self._wasm_hash = hashlib.sha256(self.wasm_path.read_bytes()).hexdigest()
            return self._wasm_hash

    def _module_path(self) -> Path:
        # A serialized module is only valid for the same wasm, wasmtime build and settings.
        ver = importlib.metadata.version("wasmtime")
        return self.cache_dir / "wasm" / (f"naga-{self._hash_wasm()[:24]}-wasmtime-{ver}-"
                                          f"{WASM_OPT_LEVEL}.cwasm")

    def preload(self) -> None:
        """Compile naga's wasm module in a background thread if no serialized one is cached (a
        cold cache: the kernels will need naga, and the ~1 s compile then overlaps whatever
        runs before them); otherwise do nothing, as loading a serialized module takes
        milliseconds when it is needed, and it may not be. Errors wait for that use."""
        if self._engine_module is not None or self._preloading:
            return
        self._preloading = True

        def load() -> None:
            try:
                if not self._module_path().is_file():
                    self._load_module()
            except Exception:  # raised again, with its context, where the module is used
                pass

        threading.Thread(target=load, name="vkml-naga-preload", daemon=True).start()

    def _load_module(self) -> tuple[wasmtime.Engine, wasmtime.Module]:
        # Compiling the 2 MB wasm takes ~1 s; a serialized module loads in milliseconds.
        path = self._module_path()
        with self._module_lock:
            if self._engine_module is None:
                cfg = wasmtime.Config()
                cfg.wasm_reference_types = True  # wasm-bindgen passes JS values as externrefs
                # Unoptimized machine code compiles in half the time (the cold compile's cost);
                # translations run in parallel threads, and a warm compile needs none.
                # The SPIR-V is the same (wasm's semantics do not depend on it).
                cfg.cranelift_opt_level = WASM_OPT_LEVEL
                engine = wasmtime.Engine(cfg)
                module = None
                serialized = read_entry(path)  # intact, or None: deserializing trusts it
                if serialized is not None:
                    try:
                        module = wasmtime.Module.deserialize(engine, serialized)
                        self._count("module_deserializes")
                    except wasmtime.WasmtimeError:  # another wasmtime's build: compile again
                        pass
                if module is None:
                    try:
                        module = wasmtime.Module.from_file(engine, str(self.wasm_path))
                    except wasmtime.WasmtimeError as e:
                        raise NagaError(f"{self.wasm_path} is not naga's WebAssembly build "
                                        f"(wasmtime cannot compile it: {e}); point "
                                        "VKML_NAGA_WASM at naga-wasm's dist/wasm/naga_bg.wasm, "
                                        "or unset it") from e
                    self._count("module_compiles")
                    write_entry(path, module.serialize(), self.cache_dir)
                self._engine_module = engine, module
            return self._engine_module

    def _count(self, stat: str) -> None:
        with self._lock:
            self.stats[stat] += 1

    def _translate(self, wgsl: str, name: str) -> bytes:
        if self._naga is None:
            self._naga = _NagaWasm(*self._load_module())
        self._count("compiles")
        try:
            return self._naga.wgsl_to_spirv(wgsl)
        except _Rejected as e:
            raise NagaError.for_kernel(f"naga rejected kernel '{name}':\n{e}", name, wgsl,
                                       str(e)) from None
        except BaseException as e:
            # A trap can leave naga's heap half-updated: drop the instance, next call starts fresh.
            self._naga = None
            if not isinstance(e, (wasmtime.Trap, wasmtime.WasmtimeError, _WasmThrew)):
                raise
            what = str(e).strip().splitlines()[-1].strip()
            raise NagaError.for_kernel(
                f"naga crashed on kernel '{name}' ({what}). "
                "Known cause: a non-constant stride in a cooperative-matrix load/store "
                "(coopLoad*/coopStore*): bake strides into the WGSL as literals.",
                name, wgsl, str(e)) from e

    def compile(self, wgsl: str, name: str) -> bytes:
        """SPIR-V words (little-endian u32 stream) for `wgsl`; `name` only labels errors."""
        key = wgsl_hash(wgsl)
        with self._lock:
            spirv = self._memo.get(key)
            if spirv is not None:
                self.stats["memory_hits"] += 1
                return spirv
            pending = self._pending.get(key)
            mine = pending is None
            if pending is None:
                pending = self._pending[key] = Future()
        if mine:
            self._produce(key, wgsl, name, pending)
            return pending.result()  # raises the translation's NagaError
        try:
            spirv = pending.result()
        except BaseException:
            with self._lock:  # a prefetch's failure is reported once; then it is retried
                if self._pending.get(key) is pending:
                    del self._pending[key]
            raise
        self._count("memory_hits")  # made by another thread or a prefetch
        return spirv

    def prefetch(self, kernels: Iterable[tuple[str, str]]) -> None:
        """Start translating, in background threads, each (WGSL, name) that no cache holds, and
        return at once; `compile` of one of them then waits for its translation (and raises
        its error, if naga refused it). Cache lookups happen here, so a warm cache starts no
        thread."""
        jobs = []
        for wgsl, name in kernels:
            key = wgsl_hash(wgsl)
            with self._lock:
                if key in self._memo or key in self._pending:
                    continue
            spirv = self._cached(key, wgsl)
            with self._lock:
                if spirv is not None:
                    self._memo[key] = spirv
                elif key not in self._pending:
                    self._pending[key] = future = Future()
                    jobs.append((key, wgsl, name, future))
        if not jobs:
            return
        pool = ThreadPoolExecutor(min(len(jobs), compile_threads(), PREFETCH_THREADS),
                                  thread_name_prefix="vkml-naga")
        for job in jobs:
            pool.submit(self._produce, *job, prefetched=True)
        pool.shutdown(wait=False)  # the threads end when the queue is empty

    def _produce(self, key: str, wgsl: str, name: str, future: Future[bytes],
                 prefetched: bool = False) -> None:
        """Fulfil `future` with `wgsl`'s SPIR-V: from the shipped or disk cache, else naga. A
        failure is not memoized: the next compile tries again (a prefetch's failure stays
        pending until a compile has reported it)."""
        try:
            spirv = self._cached(key, wgsl)
            if spirv is None:
                spirv = self._translate(wgsl, name)
                write_entry(self._disk_path(wgsl), spirv, self.cache_dir)
        except BaseException as e:
            if not prefetched:
                with self._lock:
                    del self._pending[key]
            future.set_exception(e)
            return
        with self._lock:
            self._memo[key] = spirv
            del self._pending[key]
        future.set_result(spirv)

    def _disk_path(self, wgsl: str) -> Path:
        # The cache is keyed by the naga build too: a new naga recompiles everything.
        key = hashlib.sha256(f"{self._hash_wasm()}\0{wgsl}".encode()).hexdigest()
        return self.cache_dir / "spirv" / f"{key}.spv"

    def _cached(self, key: str, wgsl: str) -> bytes | None:
        """The shipped SPIR-V of `wgsl`, else the disk cache's, else None."""
        spirv = _read_spirv(self.shipped_dir / f"{key}.spv")
        if spirv is not None:
            self._count("shipped_hits")
            return spirv
        spirv = read_entry(self._disk_path(wgsl))
        if spirv is not None:
            self._count("disk_hits")
        return spirv


_default: Compiler | None = None
_default_lock = threading.Lock()


def _compiler() -> Compiler:
    global _default
    with _default_lock:
        if _default is None:
            _default = Compiler()
        return _default


def compile_wgsl(wgsl: str, name: str) -> bytes:
    """WGSL -> SPIR-V bytes via the process-wide Compiler (cache dir from the environment)."""
    return _compiler().compile(wgsl, name)


def prefetch(kernels: Iterable[tuple[str, str]]) -> None:
    """Start translating the (WGSL, name) pairs no cache holds, in the background, with the
    process-wide Compiler (see Compiler.prefetch)."""
    _compiler().prefetch(kernels)


def preload() -> None:
    """Compile naga's wasm module in the background if the cache holds none (see
    Compiler.preload): `lower` calls it first, so a cold compile overlaps it with lowering."""
    _compiler().preload()


def cache_stats() -> dict[str, int]:
    """Counts of memory hits, disk hits, wasm translations and wasm-module loads so far."""
    return dict(_compiler().stats)


def _reset_for_tests() -> None:
    """Forget the process-wide Compiler, so it re-reads VKML_CACHE_DIR / VKML_NAGA_WASM."""
    global _default
    with _default_lock:
        _default = None
