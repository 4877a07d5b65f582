"""How many threads a compile keeps busy (the driver's pipeline compiles, naga's translations):
VKML_COMPILE_THREADS, else every core, one fewer on a device shared with a host application,
whose render thread keeps drawing while vkml compiles."""

from __future__ import annotations

import os

from vkml.errors import InputError


def compile_threads(host_shares_device: bool = False) -> int:
    text = os.environ.get("VKML_COMPILE_THREADS", "").strip()
    if text:
        count = int(text) if text.isdigit() else 0
        if count < 1:
            raise InputError(f"VKML_COMPILE_THREADS={text!r}: give a whole number of threads, "
                             "1 or more (unset: every core)")
        return count
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if host_shares_device else cores
