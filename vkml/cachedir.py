"""The on-disk cache directory (`VKML_CACHE_DIR`, default `~/.cache/vkml`): where it is, and
writing to it when it may not be writable.

naga's SPIR-V and compiled-wasm caches (vkml/naga.py) and the Vulkan pipeline cache
(vkml/vk/pipelines.py) only save time, and each also lives in memory for the process. So a
directory that cannot be written (read-only file system, no permission, a file in the way) is one
warning per directory, and the process goes on with its in-memory caches.
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from pathlib import Path


class CacheWarning(UserWarning):
    """A cache file could not be written; vkml goes on with its in-memory cache."""


def cache_dir() -> Path:
    if os.environ.get("VKML_CACHE_DIR"):
        return Path(os.environ["VKML_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vkml"


_warned: set[Path] = set()
_warned_lock = threading.Lock()


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
        with _warned_lock:
            first = root not in _warned
            _warned.add(root)
        if first:
            warnings.warn(
                f"vkml cannot write its cache directory {root} ({e.strerror or e}); caches stay "
                "in memory for this process, so the next one compiles again. Set VKML_CACHE_DIR "
                "to a writable directory to keep them.", CacheWarning, stacklevel=2)
        return False
