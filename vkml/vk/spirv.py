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
their storage classes are dropped.

bfloat16 (`to_bfloat16`). WGSL has no bfloat16 type, so a kernel compiled for precision "bf16"
is written with f16 operands (hal.Kernel.bfloat16) and its SPIR-V is retyped here: the 16-bit
float type becomes SPV_KHR_bfloat16's (`OpTypeFloat 16 BFloat16KHR`), and every type built on
it follows (the staging arrays, vectors, pointers, the cooperative matrices A and B), with the
capabilities and the extension that declares, in place of Float16. bfloat16 allows conversions,
memory access, composites and cooperative-matrix operations only: the cooperative kernels do
nothing else with their f16 values (f32 converted as it is staged, then loaded into fragments),
and a module that does anything else with them is refused rather than retyped in part."""

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
_OP_TYPE_COOPERATIVE_MATRIX = 4456

_OP_EXTENSION, _OP_EXT_INST, _OP_FUNCTION = 10, 12, 54
_OP_UNDEF, _OP_CONSTANT, _OP_CONSTANT_COMPOSITE, _OP_SPEC_CONSTANT = 1, 43, 44, 50
_FLOAT16 = 9  # Capability Float16
_BFLOAT16_TYPE, _BFLOAT16_COOPERATIVE_MATRIX = 5116, 5118  # Capability BFloat16*KHR
_BFLOAT16_ENCODING = 0  # FPEncoding BFloat16KHR, OpTypeFloat's third operand
# What a bfloat16 value may meet inside a function: OpVariable, OpLoad, OpStore, OpAccessChain,
# OpInBoundsAccessChain, OpVectorShuffle, OpCompositeConstruct/Extract/Insert, OpCopyObject,
# OpFConvert, OpCooperativeMatrixLoad/Store/MulAddKHR
_BFLOAT16_OPS = frozenset({59, 61, 62, 65, 66, 79, 80, 81, 82, 83, 115, 4457, 4458, 4459})
_STORES = frozenset({62, 4458})  # of those, the ones that make no value
# Where the literal operands of other instructions start, which are no ids: OpBranchConditional's
# weights, OpSelectionMerge's and OpLoopMerge's controls, OpSwitch's cases, OpLine's line and
# column. OpExtInst has one, word 4 (the instruction's number in its set).
_LITERALS_FROM = {250: 4, 247: 2, 246: 3, 251: 3, 8: 2}


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
    wide = _types_holding(words, found, {words[at + 1] for op, at, _ in found
                                         if op in (_OP_TYPE_INT, _OP_TYPE_FLOAT)
                                         and words[at + 2] == 16})
    used = {words[at + 3] for op, at, _ in found if op == _OP_VARIABLE and words[at + 1] in wide}
    needed = {cap for cap, classes in _STORAGE_16.items() if used & set(classes)}
    if _STORAGE_BUFFER_16 not in declared:  # then this one covers storage buffers too
        needed.add(_UNIFORM_AND_STORAGE_16)
    return {at for op, at, _ in found if op == _OP_CAPABILITY
            and words[at + 1] in _STORAGE_16 and words[at + 1] not in needed}


def _types_holding(words: tuple[int, ...], found: list[tuple[int, int, int]], scalars: set[int]
                   ) -> set[int]:
    """The ids of `scalars` and of every type built on one of them."""
    holding = set(scalars)
    for op, at, count in found:  # types are declared before their use
        if op in _COMPOSITES or op == _OP_TYPE_STRUCT:
            first, end = _COMPOSITES.get(op, (2, count))
            if any(t in holding for t in words[at + first:at + end]):
                holding.add(words[at + 1])
    return holding


def to_bfloat16(spirv: bytes) -> bytes:
    """`spirv` with its 16-bit float type made bfloat16 (see the module's docstring). Raises
    ValueError where it has no such type, or does with its values what bfloat16 does not
    allow."""
    code = words(spirv)
    found = instructions(code)
    half = next((at for op, at, count in found
                 if op == _OP_TYPE_FLOAT and code[at + 2] == 16 and count == 3), None)
    if half is None:
        raise ValueError("the module has no 16-bit float type to make bfloat16")
    typed = _types_holding(code, found, {code[half + 1]})
    values = {code[at + 2] for op, at, _ in found  # the values of those types
              if (op in _BFLOAT16_OPS - _STORES
                  or op in (_OP_UNDEF, _OP_CONSTANT, _OP_CONSTANT_COMPOSITE, _OP_CONSTANT_NULL))
              and code[at + 1] in typed}
    body = next((at for op, at, _ in found if op == _OP_FUNCTION), len(code))
    matrices = any(op == _OP_TYPE_COOPERATIVE_MATRIX and code[at + 2] in typed
                   for op, at, _ in found)
    last_capability = max(at for op, at, _ in found if op == _OP_CAPABILITY)
    extension_after = max((at for op, at, _ in found if op == _OP_EXTENSION),
                          default=last_capability)
    out = list(code[:_HEADER])
    for op, at, count in found:
        ins = list(code[at:at + count])
        if at >= body and op not in _BFLOAT16_OPS:
            ids = ins[1:4] + ins[5:] if op == _OP_EXT_INST else ins[1:_LITERALS_FROM.get(op)]
            if any(i in typed or i in values for i in ids):
                raise ValueError(f"instruction {op} at word {at} computes with 16-bit floats, "
                                 "which bfloat16 does not allow (conversions, memory access, "
                                 "composites and cooperative matrices only)")
        if op == _OP_SPEC_CONSTANT and ins[1] in typed:
            raise ValueError("a 16-bit specialization constant cannot be made bfloat16")
        if at == half:
            ins = [4 << 16 | _OP_TYPE_FLOAT, ins[1], 16, _BFLOAT16_ENCODING]
        elif op == _OP_CONSTANT and ins[1] in typed:
            ins[3] = _bfloat16_bits(ins[3])
        if not (op == _OP_CAPABILITY and ins[1] == _FLOAT16):  # no IEEE 16-bit float is left
            out += ins
        if at == last_capability:
            out += [2 << 16 | _OP_CAPABILITY, _BFLOAT16_TYPE,
                    *([2 << 16 | _OP_CAPABILITY, _BFLOAT16_COOPERATIVE_MATRIX] if matrices
                      else [])]
        if at == extension_after:
            out += _literal_string(_OP_EXTENSION, "SPV_KHR_bfloat16")
    return struct.pack(f"<{len(out)}I", *out)


def _bfloat16_bits(half: int) -> int:
    """The bfloat16 of the f16 constant `half` (its low 16 bits), which must be exact."""
    value = struct.unpack("<e", struct.pack("<H", half & 0xFFFF))[0]
    single = struct.unpack("<I", struct.pack("<f", value))[0]
    if single & 0xFFFF:
        raise ValueError(f"the f16 constant {value!r} has no exact bfloat16")
    return single >> 16


def _literal_string(opcode: int, text: str) -> list[int]:
    """An instruction whose one operand is `text` (nul-terminated, padded to whole words)."""
    data = text.encode() + b"\0" * (4 - len(text) % 4)
    return [(1 + len(data) // 4) << 16 | opcode, *struct.unpack(f"<{len(data) // 4}I", data)]
