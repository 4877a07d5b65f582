"""`make setup`: apt-get waits for another apt's lock instead of failing at once, and
TORCH_INDEX_URL takes the pinned torch from another index.

The lock test runs the real apt-get on a private lists directory with no sources (nothing is
downloaded, and no lock of the machine's own apt is touched), holding that directory's lock from
this process for a few seconds, as a concurrent `apt-get update` would."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
APT_WAIT = REPO / "tools" / "apt_get_wait.sh"
HOLD_S = 3.0

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="no apt-get here")
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def hold_lock(path: Path) -> int:
    """Take apt's kind of lock (fcntl) on `path` in this process; closing the fd releases it.
    apt-get, a child process, cannot take it meanwhile."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    return fd


def private_apt(tmp_path: Path) -> list[str]:
    """apt-get options for an `update` that touches only tmp_path and fetches nothing."""
    (tmp_path / "lists" / "partial").mkdir(parents=True)
    (tmp_path / "parts").mkdir()
    return ["-o", f"Dir::State::Lists={tmp_path / 'lists'}", "-o", "Dir::Etc::sourcelist=/dev/null",
            "-o", f"Dir::Etc::sourceparts={tmp_path / 'parts'}",
            "-o", f"Dir::Cache={tmp_path / 'cache'}"]


@needs_apt
def test_plain_apt_get_update_fails_at_once_on_the_lock(tmp_path):
    # Why the wait script exists: apt's own DPkg::Lock::Timeout does not cover the lists lock.
    opts = private_apt(tmp_path)
    fd = hold_lock(tmp_path / "lists" / "lock")
    try:
        proc = subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=60", *opts, "update"],
                              capture_output=True, text=True, timeout=30)
    finally:
        os.close(fd)
    assert proc.returncode != 0 and "Could not get lock" in proc.stderr


@needs_apt
def test_apt_get_wait_waits_for_the_lock(tmp_path):
    opts = private_apt(tmp_path)
    fd = hold_lock(tmp_path / "lists" / "lock")
    threading.Timer(HOLD_S, os.close, [fd]).start()
    t0 = time.monotonic()
    proc = subprocess.run([APT_WAIT, *opts, "update"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "APT_LOCK_RETRY": "1"})
    waited = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert waited >= HOLD_S - 0.1, f"returned after {waited:.1f} s with the lock held"
    assert "holds its lock" in proc.stderr and "Could not get lock" in proc.stdout


@needs_apt
def test_apt_get_wait_gives_up_after_its_limit_and_passes_other_errors_at_once(tmp_path):
    opts = private_apt(tmp_path)
    fd = hold_lock(tmp_path / "lists" / "lock")
    try:
        proc = subprocess.run([APT_WAIT, *opts, "update"], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "APT_LOCK_WAIT": "2",
                                               "APT_LOCK_RETRY": "1"})
    finally:
        os.close(fd)
    assert proc.returncode != 0 and "giving up" in proc.stderr
    t0 = time.monotonic()
    proc = subprocess.run([APT_WAIT, "-s", "install", "vkml-no-such-package"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Unable to locate package" in proc.stdout
    assert "holds its lock" not in proc.stderr and time.monotonic() - t0 < 30


def make_dry_run(*args: str) -> str:
    """The commands `make` would run (nothing is run)."""
    return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout


@needs_make
def test_make_setup_runs_apt_through_the_wait_script():
    out = make_dry_run("system-packages", "APT_PACKAGES=vkml-no-such-package")
    assert re.search(r"tools/apt_get_wait\.sh update", out), out
    assert re.search(r"tools/apt_get_wait\.sh install -y", out), out
    assert not re.search(r"(^|[;&|]\s*)(sudo\s+)?apt-get\b", out, re.M), out


@needs_make
def test_torch_index_url_installs_the_pinned_torch_from_that_index_first():
    pin = re.search(r'"(torch==[^"]+)"', (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins no torch"
    url = "https://download.pytorch.org/whl/cpu"
    lines = make_dry_run("-B", ".venv/.installed", f"TORCH_INDEX_URL={url}").splitlines()
    torch_line = next(i for i, line in enumerate(lines) if f"--index-url '{url}'" in line)
    assert f"'{pin.group(1)}'" in lines[torch_line]
    editable = next(i for i, line in enumerate(lines) if re.search(r"-e '\.\[[\w,]*test", line))
    assert torch_line < editable  # torch first: the test extra then finds its pin satisfied
    assert "--index-url" not in "\n".join(make_dry_run("-B", ".venv/.installed").splitlines())
