"""A pass over the SPIR-V naga writes, before the driver sees it.

WGSL zero-initialises workgroup memory. naga's SPIR-V writer does it with a polyfill: invocation
(0, 0, 0) stores a null constant to every workgroup variable, then the workgroup waits at a
barrier. The driver expands that store into one element after another, all on one thread: for
the GEMM core's 8-9 KB of staged tiles every workgroup starts with thousands of serial stores
(and lavapipe's compiler takes tens of seconds over a 12 KB one). No vkml kernel reads workgroup
memory it has not written first (each stages its tiles in full, padding included, and each
tree reduction writes every slot), so the stores are dropped; the barrier stays. Dawn offers the
same as its `disable_workgroup_init` toggle; naga's `ZeroInitializeWorkgroupMemoryMode::None` is
not exposed by the naga-wasm build vkml ships."""

from __future__ import annotations

import struct

_OP_VARIABLE, _OP_STORE, _OP_CONSTANT_NULL = 59, 62, 46
_WORKGROUP = 4  # StorageClass Workgroup
_HEADER = 5  # words before the first instruction


def instructions(words: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(opcode, first word, word count) of each instruction."""
    found, at = [], _HEADER
    while at < len(words):
        count = words[at] >> 16
        if count == 0:
            raise ValueError(f"SPIR-V instruction of length 0 at word {at}")
        found.append((words[at] & 0xFFFF, at, count))
        at += count
    return found


def drop_workgroup_zeroing(spirv: bytes) -> bytes:
    """`spirv` without its stores of null constants into workgroup variables."""
    words = struct.unpack(f"<{len(spirv) // 4}I", spirv)
    found = instructions(words)
    shared = {words[at + 2] for op, at, _ in found if op == _OP_VARIABLE
              and words[at + 3] == _WORKGROUP}
    nulls = {words[at + 2] for op, at, _ in found if op == _OP_CONSTANT_NULL}
    dropped = {at for op, at, _ in found if op == _OP_STORE and words[at + 1] in shared
               and words[at + 2] in nulls}
    if not dropped:
        return spirv
    kept = [w for op, at, count in found if at not in dropped
            for w in words[at:at + count]]
    return struct.pack(f"<{_HEADER + len(kept)}I", *words[:_HEADER], *kept)
