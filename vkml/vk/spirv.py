"""Passes over the SPIR-V naga writes, before the driver sees it.

Workgroup zeroing. WGSL zero-initialises workgroup memory. naga's SPIR-V writer does it with a
polyfill: invocation (0, 0, 0) stores a null constant to every workgroup variable, then the
workgroup waits at a barrier. The driver expands that store into one element after another, all
on one thread: for the GEMM core's 8-9 KB of staged tiles every workgroup starts with thousands
of serial stores (and lavapipe's compiler takes tens of seconds over a 12 KB one). No vkml kernel
reads workgroup memory it has not written first (each stages its tiles in full, padding included,
and each tree reduction writes every slot), so the stores are dropped; the barrier stays. Dawn
offers the same as its `disable_workgroup_init` toggle; naga's
`ZeroInitializeWorkgroupMemoryMode::None` is not exposed by the naga-wasm build vkml ships.

16-bit capabilities. A module that uses f16 anywhere (the cooperative GEMM's staged tiles, in
workgroup memory) gets every 16-bit storage capability from naga, among them
UniformAndStorageBuffer16BitAccess and StorageInputOutput16, whose device features vkml does not
enable (NVIDIA's drivers report no storageInputOutput16: gfx-rs/wgpu#7656, where wgpu stopped
requiring it): the validation layer refuses such a module. Those not used by any variable of
their storage classes are dropped."""

from __future__ import annotations

import struct

_OP_VARIABLE, _OP_STORE, _OP_CONSTANT_NULL, _OP_CAPABILITY = 59, 62, 46, 17
_WORKGROUP = 4  # StorageClass Workgroup
_HEADER = 5  # words before the first instruction
# capability -> the storage classes whose 16-bit variables need it (Input, Output; Uniform;
# PushConstant). StorageBuffer16BitAccess (storage buffers) is enabled with shader_f16 and kept.
_STORAGE_BUFFER_16, _UNIFORM_AND_STORAGE_16, _PUSH_CONSTANT_16, _INPUT_OUTPUT_16 = range(4433, 4437)
_STORAGE_16 = {_INPUT_OUTPUT_16: (1, 3), _UNIFORM_AND_STORAGE_16: (2,), _PUSH_CONSTANT_16: (9,)}
# opcode -> where in the instruction (word offsets) the types it is made of are: scalars
# (OpTypeInt, OpTypeFloat: 16-bit where their width is), vectors, matrices, arrays, runtime
# arrays, structs (all members), pointers, cooperative matrices
_OP_TYPE_INT, _OP_TYPE_FLOAT = 21, 22
_COMPOSITES = {23: (2, 3), 24: (2, 3), 28: (2, 3), 29: (2, 3), 32: (3, 4), 4456: (2, 3)}
_OP_TYPE_STRUCT = 30


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


def words(spirv: bytes) -> tuple[int, ...]:
    """The module's 32-bit words."""
    return struct.unpack(f"<{len(spirv) // 4}I", spirv)


def prepare(spirv: bytes) -> bytes:
    """`spirv` as the driver gets it: without naga's workgroup zeroing and without the 16-bit
    capabilities it does not use (both passes over one parse of the module)."""
    code = words(spirv)
    found = instructions(code)
    dropped = _workgroup_zeroing(code, found) | _unused_16bit_capabilities(code, found)
    pieces, start = [], 0  # the bytes between the dropped instructions (a few)
    for at in sorted(dropped):
        pieces.append(spirv[start:4 * at])
        start = 4 * (at + (code[at] >> 16))
    return b"".join([*pieces, spirv[start:]]) if dropped else spirv


def _workgroup_zeroing(words: tuple[int, ...], found: list[tuple[int, int, int]]) -> set[int]:
    """Where the stores of null constants into workgroup variables are."""
    shared = {words[at + 2] for op, at, _ in found if op == _OP_VARIABLE
              and words[at + 3] == _WORKGROUP}
    nulls = {words[at + 2] for op, at, _ in found if op == _OP_CONSTANT_NULL}
    return {at for op, at, _ in found if op == _OP_STORE and words[at + 1] in shared
            and words[at + 2] in nulls}


def _unused_16bit_capabilities(words: tuple[int, ...], found: list[tuple[int, int, int]]
                               ) -> set[int]:
    """Where the 16-bit storage capabilities are that no variable of theirs needs."""
    declared = {words[at + 1] for op, at, _ in found if op == _OP_CAPABILITY}
    if not declared & _STORAGE_16.keys():  # most modules: no f16 at all
        return set()
    wide: set[int] = set()  # ids of types that hold a 16-bit scalar
    for op, at, count in found:  # types are declared before their use
        if op in (_OP_TYPE_INT, _OP_TYPE_FLOAT) and words[at + 2] == 16:
            wide.add(words[at + 1])
        elif op in _COMPOSITES or op == _OP_TYPE_STRUCT:
            first, end = _COMPOSITES.get(op, (2, count))
            if any(t in wide for t in words[at + first:at + end]):
                wide.add(words[at + 1])
    used = {words[at + 3] for op, at, _ in found if op == _OP_VARIABLE and words[at + 1] in wide}
    needed = {cap for cap, classes in _STORAGE_16.items() if used & set(classes)}
    if _STORAGE_BUFFER_16 not in declared:  # then this one covers storage buffers too
        needed.add(_UNIFORM_AND_STORAGE_16)
    return {at for op, at, _ in found if op == _OP_CAPABILITY
            and words[at + 1] in _STORAGE_16 and words[at + 1] not in needed}
