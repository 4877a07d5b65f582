"""The on-disk cache directory (`VKML_CACHE_DIR`, default `~/.cache/vkml`): where it is, and
its entries, each written whole or not at all and checked when read.

naga's SPIR-V and compiled-wasm caches (vkml/vk/naga.py), the plan cache
(vkml/compiler/plan_cache.py) and the Vulkan pipeline cache (vkml/vk/pipelines.py) only save
time, and each also lives in memory for the process. So a directory that cannot be written
(read-only file system, no permission, a file in the way) is one warning per directory, and the
process goes on with its in-memory caches.

Every entry is `write_entry`'s header (a magic and the sha256 of the contents) and the contents,
and `read_entry` returns the contents only when the digest matches. A cached entry is trusted by
what reads it (a driver fed corrupted SPIR-V or a pipeline-cache blob may crash; wasmtime
deserializes machine code as is; a changed constant in valid SPIR-V is a silently wrong result),
so a file cut short, with bits flipped or edited is never handed on: it is deleted, reported once
as a `CorruptCacheWarning` naming the file, and its caller compiles the entry again (a file
without the header, an older vkml's, is replaced without a warning).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import warnings
from pathlib import Path


class CacheWarning(UserWarning):
    """A cache file could not be written; vkml goes on with its in-memory cache."""


class CorruptCacheWarning(CacheWarning):
    """A cache file failed its integrity check; vkml deleted it and compiles the entry again."""


# An entry's header: the format's magic, then the sha256 of the contents that follow it.
ENTRY_MAGIC = b"vkml cache entry 1\n"
_DIGEST_BYTES = hashlib.sha256().digest_size


def cache_dir() -> Path:
    if os.environ.get("VKML_CACHE_DIR"):
        return Path(os.environ["VKML_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vkml"


_warned: set[Path] = set()
_warned_lock = threading.Lock()


def _first_time(seen: set[Path], key: Path) -> bool:
    """Whether `key` is new to `seen`, which then holds it: each warning is given once."""
    with _warned_lock:
        new = key not in seen
        seen.add(key)
    return new


def write_atomic(path: Path, data: bytes, root: Path) -> bool:
    """Write `data` to `path` (under the cache directory `root`) so that no reader ever sees a
    torn file. On an OSError, warns once per `root` and returns False instead of raising."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Temp file in the same directory + os.replace: concurrent writers never expose a torn file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError as e:
        if _first_time(_warned, root):
            warnings.warn(
                f"vkml cannot write its cache directory {root} ({e.strerror or e}); caches stay "
                "in memory for this process, so the next one compiles again. Set VKML_CACHE_DIR "
                "to a writable directory to keep them.", CacheWarning, stacklevel=2)
        return False


def write_entry(path: Path, contents: bytes, root: Path) -> bool:
    """Write a cache entry: `contents` behind a header holding their digest, atomically (see
    write_atomic, whose return value this is)."""
    return write_atomic(path, ENTRY_MAGIC + hashlib.sha256(contents).digest() + contents, root)


_reported: set[Path] = set()


def read_entry(path: Path) -> bytes | None:
    """The contents of the cache entry at `path`; None when there is none, or when the file is
    not an intact entry: then it is deleted, so that the caller's fresh entry replaces it. A
    damaged entry (cut short, bits flipped, edited) is reported once; a file without the header
    at all (an older vkml's) is replaced silently."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(ENTRY_MAGIC) + _DIGEST_BYTES
    contents = data[head:]
    if (data.startswith(ENTRY_MAGIC)
            and hashlib.sha256(contents).digest() == data[len(ENTRY_MAGIC):head]):
        return contents
    try:
        path.unlink()
    except OSError:
        pass  # an unwritable directory: the caller's in-memory cache carries on
    if data.startswith(ENTRY_MAGIC) and _first_time(_reported, path):
        warnings.warn(
            f"vkml's cache file {path} is corrupt (its contents do not match the digest written "
            "with them); it was deleted and its entry is compiled again. Nothing read from it "
            "was used.", CorruptCacheWarning, stacklevel=2)
    return None
