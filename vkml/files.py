"""Files a user names (checkpoints, save_onnx's models): written whole or not at all."""

from __future__ import annotations

import os
import secrets

from vkml.errors import CheckpointError


def write_atomic(path: str, data: bytes) -> None:
    """`data` to `path` through a temporary file in the same directory and os.replace (a crash
    leaves the old file or the new one, never a torn one: checkpoints, save_onnx). The
    temporary file is created with mode 0o666 so that the umask applies as it would to
    open(path, "wb") (tempfile.mkstemp would make every checkpoint 0600), and a file that
    already exists keeps its permissions, as open() would leave them."""
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.chmod(tmp, os.stat(path).st_mode & 0o777)
            except FileNotFoundError:
                pass
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc} (check "
                              "that the directory exists and is writable, and that the path "
                              "is not a directory)") from exc
