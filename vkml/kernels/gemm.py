"""The GEMM core every matrix-shaped kernel shares: C[i, j] = sum_k A[i, k] B[k, j] over a grid of
output tiles, with the operands read through loaders, so one generator serves matmul (plain,
transposed, batched) and convolution as implicit GEMM (forward, input gradient, weight gradient):
the caller says how to read an element of A and of B and how to store an element of C.

Four variants, chosen by the device and the product:
- staged (GPUs): a workgroup computes a BM x BN tile; each thread holds a TM x TN register tile
  of scalar accumulators (generated unrolled: a dynamically indexed local array would live in
  slow local memory). Every BK-deep slice of A and B goes through workgroup memory as vec4 rows,
  so a thread reads its TM + TN operands in (TM + TN) / 4 wide loads per step; the next slice is
  read from memory into registers while this one is multiplied, four elements a load from
  operands that run along memory in multiples of 4 (`indexed`, `Operand.wide`). Thread (tx, ty)
  owns rows 4 * (i4 * WY + ty) + 0..3 and columns 4 * (j4 * WX + tx) + 0..3, which keeps the
  vec4 reads of a warp conflict-free and its stores contiguous.
- direct (CPU drivers, where staging gains nothing and barriers make the JIT slow): each thread
  reads its operands straight from memory, rows ty + WY * i and columns tx + WX * j.
- cooperative (precision="f16" on devices with cooperative matrices, and "bf16" on devices with
  bfloat16 ones: the same kernels, their f16 made bfloat16 by the backend; for products of at
  least COOP_MIN in every dimension, for matmuls of COOP_MIN_MATMUL rows and columns and depth,
  plain ones from a shallower depth: kernels/matmul.py): tensor-core tiles. The operands are
  read as f32 like the staged variant's and converted to f16 as they are staged (but for the f16
  copies channels-last convolutions read, `Operand.half`, kernels/conv.py `channels_last`, which
  are staged as they are, from every size); each subgroup multiplies FM x FN 16x16 fragments
  with f32 accumulators (`coop_mat16x16`, loaded transposed as naga needs for row-major data),
  and stores each accumulator through workgroup memory, where its lanes apply the store (a
  product without an epilogue stores its inner tiles' fragments straight to C: `PlainStore`). In
  the f16 backward pass (Capabilities.scaled_operands) each row of a gradient operand is first
  scaled by a power of two into f16's range (`_scales`, from the largest magnitudes
  compiler/scale.py provides), undone as C is stored. Below those the staged f32 kernel is used
  even in accelerated mode.
  Matmuls take cooperative tiles from a smaller size than convolutions: on transformer matmuls
  they beat f32 (over a short k only where fragments store straight to C), while on
  convolutions they were slower on NCHW f32 operands and, in ResNet-50's training, failed the
  gradient gates (batch norm over f16 convolutions; tools/f16_conv_gradients.py).
- staged in f16 (precision="f16" on devices with f16 arithmetic but no cooperative matrices,
  Capabilities.f16_products "simt"; matmuls only, every size): the staged variant with its
  slices held as f16 in workgroup memory (half the bytes) and multiplied in f16, four columns
  a vec4<f16> fma, each slice's BK-term sums added into the f32 accumulators, so no f16 sum
  runs longer than BK terms. Every operand of a backward product is scaled as the cooperative
  kernel scales gradients, here into [2^4, 2^5) (F16_SCALED_TOP): products then stay below
  2^10 and a slice's sums below 2^14, inside f16's range whatever the magnitudes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import Buf, assemble, tree_reduce

# A loader: (row variable, depth variable) -> WGSL lines assigning the element to `v` (a var
# declared 0.0 by the caller), leaving it 0 where the element is padding. The caller guarantees
# row < rows and depth < the operand's depth.
Loader = Callable[[str, str], list[str]]
# A store: (row variable, column variable, accumulator) -> WGSL lines storing one element of C;
# called only inside the matrix.
Store = Callable[[str, str, str], list[str]]


@dataclass(frozen=True)
class WideStore:
    """Where C runs along memory in fours (`along` its rows or its columns), the staged variant
    stores a thread's four neighbouring outputs at once: `store(row, column, accumulators)` gets
    the first element's row and column and the four accumulators in order along `along`; the
    caller guarantees that such a run starts at a multiple of 4 there and that the extent along
    it is a multiple of 4, so the four are all inside or all outside. Scalar stores of a warp
    leave each 32-byte sector a quarter written per instruction; this matters where k is short
    (attention's 64-deep scores write 54 MB each on Whisper)."""

    along: Literal["row", "col"]
    store: Callable[[str, str, list[str]], list[str]]

PAD = 4  # floats added to each staged row: keeps the transposing stores off one bank


@dataclass(frozen=True)
class Operand:
    """A (rows x depth) or B (columns x depth), as the kernel reads it. `contiguous`: which
    index runs along memory, so neighbouring threads read neighbouring addresses. `wide`, where
    the caller can offer it: (row, depth) -> a WGSL vec4<f32> expression of the four elements
    from there along the contiguous index; the caller guarantees that the contiguous index
    starts at a multiple of 4 there and that its extent (rows, or the ends of every k range) is
    a multiple of 4, so four elements are all inside or all outside. `half`: `wide` gives a
    vec4<f16> (an operand held in memory as f16), staged as it is into f16 tiles."""

    load: Loader
    contiguous: Literal["row", "depth"]
    wide: Callable[[str, str], str] | None = None
    half: bool = False


def indexed(buffer: str, wide: bool, at: Callable[[str, str], str],
            contiguous: Literal["row", "depth"]) -> Operand:
    """An operand read from `buffer` at the flat index `at(row, depth)`. Where `wide` (the
    caller guarantees Operand.wide's conditions) the buffer is bound as an array of vec4 (see
    `binding`), so reads along the contiguous index are 16 bytes wide."""
    if not wide:
        return Operand(lambda i, d: [f"v = {buffer}[{at(i, d)}];"], contiguous)
    return Operand(lambda i, d: [f"{{ let e = {at(i, d)}; v = {buffer}[e / 4u][e % 4u]; }}"],
                   contiguous, lambda i, d: f"{buffer}[({at(i, d)}) / 4u]")


def binding(name: str, wide: bool) -> Buf:
    """The read-only binding of an operand made by `indexed`."""
    return Buf(name, "vec4<f32>" if wide else "f32")


@dataclass(frozen=True)
class Tiling:
    bm: int
    bn: int
    tm: int  # register tile rows per thread
    tn: int
    bk: int
    staged: bool
    f16: bool = False  # staged in f16, multiplied in f16 (see the module's docstring)

    @property
    def wx(self) -> int:
        return self.bn // self.tn

    @property
    def wy(self) -> int:
        return self.bm // self.tm

    @property
    def threads(self) -> int:
        return self.wx * self.wy

    def __str__(self) -> str:
        return (f"{'s' if self.staged else 'd'}{self.bm}x{self.bn}k{self.bk}r{self.tm}x{self.tn}"
                f"{'h' if self.f16 else ''}")


# Staged tilings from the largest tile (most reuse per loaded value) to the smallest (most
# workgroups for small matrices). Thread counts are 256 or 64.
STAGED = (Tiling(256, 128, 16, 8, 8, True), Tiling(128, 128, 8, 8, 8, True),
          Tiling(128, 64, 8, 4, 8, True),
          Tiling(64, 128, 4, 8, 8, True), Tiling(64, 64, 4, 4, 16, True),
          Tiling(64, 32, 8, 4, 16, True), Tiling(32, 64, 4, 8, 16, True),
          Tiling(32, 32, 4, 4, 16, True))
STAGED_F16 = tuple(dataclasses.replace(t, f16=True) for t in STAGED)


@dataclass(frozen=True)
class CoopTiling:
    """SG_M x SG_N subgroups of 32 lanes, each with FM x FN 16x16 fragments."""

    sg_m: int
    sg_n: int
    fm: int
    fn: int
    bk: int = 32

    @property
    def bm(self) -> int:
        return 16 * self.sg_m * self.fm

    @property
    def bn(self) -> int:
        return 16 * self.sg_n * self.fn

    @property
    def threads(self) -> int:
        return 32 * self.sg_m * self.sg_n

    def __str__(self) -> str:
        return f"c{self.bm}x{self.bn}k{self.bk}f{self.fm}x{self.fn}"


# Largest first. naga gives each accumulator a variable of its own, and more than 16 a subgroup
# spill on NVIDIA; among the tilings that fit, many subgroups of 4 x 2 fragments ran large
# products fastest, and 32-deep slices staged one at a time as f32 beat the alternatives tried.
COOP = (CoopTiling(2, 8, 4, 2), CoopTiling(2, 2, 4, 4), CoopTiling(2, 2, 2, 4),
        CoopTiling(2, 2, 2, 2), CoopTiling(2, 2, 1, 2), CoopTiling(2, 2, 1, 1))
# Workgroups it takes to fill a large GPU (about 130 multiprocessors, two resident workgroups
# each at these sizes); below this a smaller tile wins by keeping more of it busy.
FILL = 264


def direct_tiling(m: int, n: int) -> Tiling:
    """16 x 16 threads, each with up to 4 x 4 outputs (fewer for small matrices)."""
    def pick(extent: int) -> int:
        return 4 if extent >= 64 else 2 if extent >= 32 else 1
    tm, tn = pick(m), pick(n)
    return Tiling(16 * tm, 16 * tn, tm, tn, 1, False)


def stores_wide(tiling: Tiling | CoopTiling, k: int) -> bool:
    """Whether a kernel whose C runs along memory in fours takes `WideStore`: on the staged
    variant, except for register tiles of more than 16 outputs over a long k, where the wide
    stores made large products slower while they sped up every model's shallow products."""
    return (isinstance(tiling, Tiling) and tiling.staged
            and (tiling.tm * tiling.tn <= 16 or k <= WIDE_STORE_MAX_K))


def in_f16(tiling: Tiling | CoopTiling) -> bool:
    """Whether a kernel of this tiling takes f16 operands (and scales a backward product's)."""
    return isinstance(tiling, CoopTiling) or tiling.f16


def on_cpu(caps: Capabilities) -> bool:
    """Whether kernels for `caps` take the CPU drivers' variants (f16 and bf16 are for GPUs
    only)."""
    return caps.device_type == "cpu" and caps.precision == "f32"


def choose(m: int, n: int, k: int, z: int, caps: Capabilities,
           plain: bool = False, coop_min: tuple[int, int] | None = None
           ) -> Tiling | CoopTiling:
    """The tiling for an (m x n x k) product over `z` grid layers on this device: the largest
    when its tiles alone fill the device (of those above 128 x 128 outputs only over long sums,
    LARGE_TILE_MIN_K, and the next largest where the largest would pad the matrix more; one of
    half its outputs where that covers a quarter fewer), else a
    64 x 64 tile (32 x 32 for thin matrices, and for `plain` products, whose operands are
    matrices in memory rather than gathered like a convolution's patches: matmuls and pointwise
    convolutions, kernels/conv.py `plain`; where 64 x 64 tiles do not fill it either) that the
    split stage gives more workgroups by splitting k where it still needs them (tools/
    kernel_lab.py times the choices: 64 x 64 with splits beats smaller tiles unsplit on
    convolutions, 32 x 32 wins on most of the transformers' smaller products). `coop_min`: the
    fewest rows and columns, and the shallowest depth, that take cooperative tiles in
    accelerated mode (default COOP_MIN for all three); given only for matmuls, which alone
    take f16 staged tiles (Capabilities.f16_products "simt")."""
    if on_cpu(caps):
        return direct_tiling(m, n)
    outputs, depth = (COOP_MIN, COOP_MIN) if coop_min is None else coop_min
    # scaled operands (the backward pass at precision "f16") only in matmuls of many rows:
    # convolutions' gradients stay f32, see SCALED_MIN_ROWS. Unscaled (forward, and bf16's
    # backward pass) by the same rule as any product.
    coop = (caps.f16_products == "cooperative" and min(m, n) >= outputs and k >= depth
            and (not caps.scaled_operands or coop_min is not None and m >= SCALED_MIN_ROWS))
    staged = STAGED_F16 if caps.f16_products == "simt" and coop_min is not None else STAGED
    usable = [t for t in (COOP if coop else staged) if _fits(t, caps)]

    def tiles(t: Tiling | CoopTiling) -> int:
        return _workgroups(t, m, n, z)

    def padded(t: Tiling | CoopTiling) -> int:  # the outputs its tiles cover
        return tiles(t) * t.bm * t.bn

    top = (usable[:2] if k >= LARGE_TILE_MIN_K
           else [] if coop and k < COOP_MIN_MATMUL[1]  # see SHALLOW
           else [t for t in usable if t.bm * t.bn <= 128 * 128][:1])
    for t in top:  # the largest only where it pads the matrix no more than the next
        if tiles(t) >= FILL and padded(t) <= padded(top[-1]):
            # or a tile of half its outputs where that covers a quarter fewer or less (a
            # 64-channel product on 128 x 128 tiles leaves half of each idle)
            halves = [u for u in usable
                      if 2 * u.bm * u.bn == t.bm * t.bn and 4 * padded(u) <= 3 * padded(t)]
            return min(halves, key=padded, default=t)
    middle = [t for t in usable if t.bm == t.bn == 64]
    if not middle or min(m, n) < THIN:
        return usable[-1]
    if plain and not coop and tiles(middle[0]) < FILL:
        return usable[-1]
    return middle[0]


def _workgroups(t: Tiling | CoopTiling, m: int, n: int, z: int) -> int:
    """The workgroups (output tiles) of an (m x n) product over `z` grid layers in `t`."""
    return -(-m // t.bm) * -(-n // t.bn) * z


def splits(m: int, n: int, k: int, z: int, caps: Capabilities, plain: bool = False,
           coop_min: tuple[int, int] | None = None) -> int:
    """Into how many partial sums over splits of k an (m x n x k) product over `z` grid layers
    is cut (the split stage, compiler/split.py, makes them): on GPUs, where its tiles leave
    the device short of workgroups, enough for about twice the workgroups that fill it, each
    split at least 8 k-steps deep; everywhere, enough to keep a shader's loop within the
    device's limit (the direct variant loops k times). `plain`, `coop_min`: as for `choose`."""
    if on_cpu(caps):
        limit = caps.max_loop_iterations
        return -(-k // limit) if limit is not None and k > limit else 1
    t = choose(m, n, k, z, caps, plain, coop_min)
    tiles = _workgroups(t, m, n, z)
    steps = -(-k // t.bk)
    if tiles >= FILL:
        return 1
    return max(1, min(-(-2 * FILL // tiles), steps // MIN_STEPS, MAX_SPLITS))


WIDE_STORE_MAX_K = 256  # see stores_wide
# Tiles of more than 128 x 128 outputs only over sums this long: they speed up long sums and
# slow down shallow ones (depths between 64 and 4096 were not measured).
LARGE_TILE_MIN_K = 1024
COOP_MIN = 2048  # the smallest product where cooperative tiles beat staged f32 (measured)
COOP_MIN_MATMUL = (64, 256)  # rows and columns, depth: matmuls (see the module's docstring)
# SHALLOW: cooperative tiles over sums shallower than COOP_MIN_MATMUL's depth (kernels/matmul.py
# takes them for plain products from 64) are 64 x 64, which ran such products faster than
# larger cooperative tiles or f32 ones.
# Backward products (scaled operands) take cooperative tiles from this many rows: below it the
# extra dispatch and level for the largest magnitudes before each product cost more than the
# tiles gain (SmolLM2's 128-row products). Only matmuls scale (convolutions have no scaled
# form), so a convolution's gradients stay f32 at precision "f16". Both rules exist for the
# scaling alone: at precision "bf16" (f32's exponent range, no scaling) backward products take
# cooperative tiles as forward ones do.
SCALED_MIN_ROWS = 256
THIN = 48  # below this many rows or columns a 64-wide tile is mostly idle
MIN_STEPS = 8  # k-steps a split keeps at the least
MAX_SPLITS = 16


def _fits(t: Tiling | CoopTiling, caps: Capabilities) -> bool:
    if isinstance(t, CoopTiling):
        return (t.threads <= min(caps.max_workgroup_invocations, caps.max_workgroup_size[0])
                and _coop_bytes(t, caps.scaled_operands) <= caps.max_shared_memory_bytes)
    shared = ((2 if t.f16 else 4) * t.bk * ((t.bm + PAD) + (t.bn + PAD))
              + (_scale_bytes(t) if t.f16 and caps.scaled_operands else 0))
    return (t.threads <= caps.max_workgroup_invocations and shared <= caps.max_shared_memory_bytes
            and t.wx <= caps.max_workgroup_size[0] and t.wy <= caps.max_workgroup_size[1])


@dataclass(frozen=True)
class PlainStore:
    """C stored as it is computed, row-major: `at(row, column)` gives the WGSL element of an
    f32 array where C[row, column] goes, `stride` the elements from one row to the next."""

    at: Callable[[str, str], str]
    stride: int


@dataclass(frozen=True)
class Scale:
    """Where the cooperative kernel finds the largest magnitudes it scales an operand by
    (Capabilities.scaled_operands, compiler/scale.py): `read(index)` is a WGSL expression of
    one; `per_row`: there is one for each row of the operand (A's rows, B's columns), else one
    for each index of the sum, of which the kernel takes the largest over its range of k."""

    read: Callable[[str], str]
    per_row: bool


@dataclass(frozen=True)
class Edges:
    """Which extents leave the tiles an edge: rows or columns that the tile does not divide,
    and a depth whose layers' ranges are not whole k-slices (or do not cover the whole depth
    evenly). Only there do loads and stores need a bounds check, so a product that the tiles
    divide, as most large ones are, runs without any (the f32 kernels; the cooperative one
    checks everything, see COOP_EDGES)."""

    rows: bool
    cols: bool
    depth: bool

    def store_guard(self, m: int, n: int) -> str:
        return " && ".join([*([f"r < {m}u"] if self.rows else []),
                            *([f"c < {n}u"] if self.cols else [])]) or "true"


def generate(name: str, caps: Capabilities, buffers: Sequence[Buf], m: int, n: int, k: int,
             z: int, a: Operand, b: Operand, store: Store, tiling: Tiling | CoopTiling, *,
             setup: Sequence[str] = (), k_range: tuple[str, str] | None = None,
             depth: int | None = None, ragged: bool = False,
             prelude: Sequence[str] = (), flops: int = 0, nbytes: int = 0,
             wide_store: WideStore | None = None, plain_store: PlainStore | None = None,
             scales: tuple[Scale | None, Scale | None] = (None, None)) -> Kernel:
    """A kernel over the grid (ceil(n / BN), ceil(m / BM), z). `setup`: WGSL lines run first,
    which may use `z` (the grid layer: a batch index, a group, a split of k) and define what
    the loaders and the store use; `k_range`: WGSL expressions of the first and end depth this
    layer sums over (default 0 and k), ranges of k over a whole `depth` (default k);
    `ragged`: the layers' ranges end where `k_range` says, not on whole ranges of k;
    `wide_store`: used by the staged variant in place of `store` (the others store an element at
    a time); `plain_store`: where the store is a plain write, the cooperative variant's way to
    store whole fragments; `scales`: for A and for B, the cooperative variant's scaling of a
    backward product's operands, if any."""
    begin, end = k_range or ("0u", f"{k}u")
    grid = (-(-n // tiling.bn), -(-m // tiling.bm), z)
    # the kernel's own `enable` directives come first, so a caller's prelude need not repeat them
    prelude = [line for line in prelude if line not in ("enable f16;",)
               or not (isinstance(tiling, CoopTiling) or tiling.f16)]
    if isinstance(tiling, CoopTiling):
        scaled = any(scales)
        return assemble(f"{name}_{tiling}{'_scaled' if scaled else ''}", caps, buffers,
                        (tiling.threads,),
                        _coop(m, n, a, b, store, tiling, begin, end, setup,
                              None if scaled else plain_store, scales), grid,
                        prelude=["enable f16;", "enable wgpu_cooperative_matrix;", *prelude,
                                 *_coop_shared(tiling, scales)], flops=flops, nbytes=nbytes)
    if any(scales) and not tiling.f16:
        raise AssertionError(f"{name}: operands scaled for f32 tiles {tiling}")
    edges = Edges(m % tiling.bm != 0, n % tiling.bn != 0,
                  ragged or k % tiling.bk != 0 or (depth or k) % k != 0)
    body = (_staged(m, n, a, b, store, tiling, begin, end, wide_store, edges, scales)
            if tiling.staged else _direct(m, n, a, b, store, tiling, begin, end, edges))
    head = ["fn main(@builtin(local_invocation_id) lid: vec3<u32>, "
            "@builtin(workgroup_id) wid: vec3<u32>) {",
            f"  let tx = lid.x; let ty = lid.y; let tid = ty * {tiling.wx}u + tx;",
            f"  let row0 = wid.y * {tiling.bm}u; let col0 = wid.x * {tiling.bn}u; let z = wid.z;",
            *setup]
    element = "f16" if tiling.f16 else "f32"
    shared = ([f"var<workgroup> As: array<vec4<{element}>, "
               f"{tiling.bk * (tiling.bm + PAD) // 4}>;",
               f"var<workgroup> Bs: array<vec4<{element}>, "
               f"{tiling.bk * (tiling.bn + PAD) // 4}>;", *_scale_shared(tiling, scales)]
              if tiling.staged else [])
    return assemble(f"{name}_{tiling}{'_scaled' if any(scales) else ''}", caps, buffers,
                    (tiling.wx, tiling.wy), [*head, *body, "}"], grid,
                    prelude=[*(["enable f16;"] if tiling.f16 else []), *prelude, *shared],
                    flops=flops, nbytes=nbytes)


def _element(load: Loader, row: str, depth: str, guard: str, target: str) -> str:
    """One operand element into `target`, 0 where `guard` fails or the loader says padding."""
    inner = " ".join(load(row, depth))
    return (f"{{ var v = 0.0; if ({guard}) {{ {inner} }} {target} = v; }}" if guard
            else f"{{ var v = 0.0; {inner} {target} = v; }}")


def _staged(m: int, n: int, a: Operand, b: Operand, store: Store, t: Tiling, begin: str,
            end: str, wide_store: WideStore | None, edges: Edges,
            scales: tuple[Scale | None, Scale | None]) -> list[str]:
    # f16 tiles: elements converted as they are staged, each slice's products summed in f16
    # (h: a thread's four neighbouring columns, one vec4<f16> fma a step), then into c in f32
    def half(v: str, vector: bool = False) -> str:  # as staged
        return v if not t.f16 else f"vec4<f16>({v})" if vector else f"f16({v})"
    lines = [*[f"  var c{i}_{j} = 0.0;" for i in range(t.tm) for j in range(t.tn)],
             *(_scales(m, n, t, begin, end, scales, F16_SCALED_TOP) if any(scales) else []),
             *_stage(m, n, a, b, t.bm, t.bn, t.bk, t.threads, begin, end, edges,
                     place=lambda tile, ii, kk: f"{kk} * {(t.bm if tile == 'a' else t.bn) + PAD}u"
                                                f" + {ii}",
                     write=lambda tile, at, v: f"{'As' if tile == 'a' else 'Bs'}[{at} / 4u]"
                                               f"[{at} % 4u] = {half(v)};",
                     fast=("row", "row"),
                     write4=lambda tile, at, v: f"{'As' if tile == 'a' else 'Bs'}[{at} / 4u] = "
                                                f"{half(v, vector=True)};",
                     scale=lambda tile, row: (f"Pow{tile}[{row}]" if scales["ab".index(tile)]
                                              else None), half=t.f16)]
    comp = "xyzw"
    if t.f16:
        lines += [f"    var h{i}_{j4} = vec4<f16>();"
                  for i in range(t.tm) for j4 in range(t.tn // 4)]
    for kk in range(t.bk):
        lines.append("    {")
        lines += [f"      let a{i4} = As[{kk * (t.bm + PAD) // 4}u + {i4 * t.wy}u + ty];"
                  for i4 in range(t.tm // 4)]
        lines += [f"      let b{j4} = Bs[{kk * (t.bn + PAD) // 4}u + {j4 * t.wx}u + tx];"
                  for j4 in range(t.tn // 4)]
        if t.f16:
            lines += [f"      h{i}_{j4} = fma(vec4<f16>(a{i // 4}.{comp[i % 4]}), b{j4}, "
                      f"h{i}_{j4});" for i in range(t.tm) for j4 in range(t.tn // 4)]
        else:
            lines += [f"      c{i}_{j} = fma(a{i // 4}.{comp[i % 4]}, b{j // 4}.{comp[j % 4]}, "
                      f"c{i}_{j});" for i in range(t.tm) for j in range(t.tn)]
        lines.append("    }")
    if t.f16:
        lines += [f"    c{i}_{j} += f32(h{i}_{j // 4}.{comp[j % 4]});"
                  for i in range(t.tm) for j in range(t.tn)]
    lines += ["    workgroupBarrier();", "  }"]

    def at(i: int, j: int) -> list[str]:
        return [f"  {{ let r = row0 + {4 * (i // 4) * t.wy + i % 4}u + 4u * ty; "
                f"let c = col0 + {4 * (j // 4) * t.wx + j % 4}u + 4u * tx;",
                f"    if ({edges.store_guard(m, n)}) {{"]

    def value(i: int, j: int, dr: int, dc: int) -> str:  # c_i_j, unscaled; at (r + dr, c + dc)
        return _unscaled(f"c{i}_{j}", f"r - row0 + {dr}u", f"c - col0 + {dc}u", scales)
    # a thread's outputs one at a time, or four along the rows or the columns
    di, dj = {None: (1, 1), "col": (1, 4), "row": (4, 1)}[wide_store and wide_store.along]
    for i in range(0, t.tm, di):
        for j in range(0, t.tn, dj):
            body = (store("r", "c", value(i, j, 0, 0)) if wide_store is None
                    else wide_store.store("r", "c", [
                        value(i + q * (di > 1), j + q * (dj > 1), q * (di > 1), q * (dj > 1))
                        for q in range(4)]))
            lines += [*at(i, j), *body, "  } }"]
    return lines


def _unscaled(acc: str, row: str, col: str, scales: tuple[Scale | None, Scale | None]) -> str:
    """The accumulator `acc` of the tile's `row` and `col` with the operands' scaling undone
    (exact: a power of two)."""
    exps = [f"Exp{tile}[{at}]" for tile, at, scale in (("a", row, scales[0]),
                                                       ("b", col, scales[1])) if scale]
    return f"ldexp({acc}, -({' + '.join(exps)}))" if exps else acc


def _stage(m: int, n: int, a: Operand, b: Operand, bm: int, bn: int, bk: int, threads: int,
           begin: str, end: str, edges: Edges, place: Callable[[str, str, str], str],
           write: Callable[[str, str, str], str], fast: tuple[str, str],
           write4: Callable[[str, str, str], str],
           scale: Callable[[str, str], str | None] | None = None,
           half: bool = False) -> list[str]:
    """Lines staging A's BM x BK and B's BN x BK slices: per thread, the elements it loads (so
    neighbouring threads read along each operand's contiguous index; four at a time from an
    operand that offers `wide` reads), a register for each, the first slice's loads, and the
    loop head that writes the registers into workgroup memory (`place` gives an element's
    index there, `write` the store; `fast`: which index runs along workgroup memory for A and
    for B, so `write4` stores the four elements of a wide read along it at once) and loads the
    next slice while the caller's body multiplies this one. `scale(tile, row in the tile)`:
    the factor each element is multiplied by as it is written (None: none). `half`: workgroup
    memory holds f16, so an f16 operand's wide reads stay f16 on the way. The caller closes
    the loop with a barrier."""
    lines: list[str] = []
    loads: list[str] = []
    fill: list[str] = []
    for tile, op, extent, origin, bound, along_shared, edge in (
            ("a", a, bm, "row0", m, fast[0], edges.rows),
            ("b", b, bn, "col0", n, fast[1], edges.cols)):
        width = 4 if op.wide is not None and (extent * bk) % (4 * threads) == 0 else 1
        along = extent if op.contiguous == "row" else bk  # elements along the contiguous index
        for step in range(extent * bk // (width * threads)):
            e = f"(tid + {step * threads}u)"
            if op.contiguous == "depth":
                ii, kk = f"{e} / {along // width}u", f"{width}u * ({e} % {along // width}u)"
            else:
                ii, kk = f"{width}u * ({e} % {along // width}u)", f"{e} / {along // width}u"
            i, k, p = f"{tile}i{step}", f"{tile}k{step}", f"{tile}p{step}"
            guard = " && ".join([*([f"{i} < {bound}u"] if edge else []),
                                 *([f"kn + {k} < kend"] if edges.depth else [])])
            lines += [f"  let {i} = {origin} + {ii}; let {k} = {kk};",
                      f"  let {tile}s{step} = {place(tile, ii, kk)};"]
            # the tile rows of the elements in `p`: four of them where a wide read runs along
            rows = [f"({ii} + {c}u)" if width == 4 and op.contiguous == "row" else ii
                    for c in range(width)]
            # their scale factors, read once (the rows stay), one or four: p's, p[c]'s
            f, factor = f"{tile}f{step}", [""] * width
            scaled = scale is not None and scale(tile, ii) is not None
            if scaled:
                uniform = len(set(rows)) == 1
                lines.append(f"  let {f} = {scale(tile, ii)};" if uniform else
                             f"  let {f} = vec4<f32>({', '.join(scale(tile, r) for r in rows)});")
                factor = [f" * {f}" if uniform else f" * {f}[{c}]" for c in range(width)]
            whole = f" * {f}" if scaled else ""
            if width == 1:
                lines.append(f"  var {p} = 0.0;")
                loads.append("    " + _element(op.load, i, f"(kn + {k})", guard, p))
                fill.append(f"    {write(tile, f'{tile}s{step}', p + factor[0])}")
                continue
            vector = "vec4<f16>" if op.half and half and not scaled else "vec4<f32>"
            lines.append(f"  var {p} = {vector}();")
            # not select(): it would read the vector past the end too
            read = op.wide(i, f"(kn + {k})")
            wide = f"{p} = {read if op.half == (vector == 'vec4<f16>') else f'{vector}({read})'};"
            loads.append(f"    if ({guard}) {{ {wide} }} else {{ {p} = {vector}(); }}" if guard
                         else f"    {wide}")
            if op.contiguous == along_shared:
                fill.append(f"    {write4(tile, f'{tile}s{step}', p + whole)}")
                continue
            for c in range(1, 4):
                at = (place(tile, rows[c], kk) if op.contiguous == "row"
                      else place(tile, ii, f"({kk} + {c}u)"))
                lines.append(f"  let {tile}s{step}_{c} = {at};")
            fill += [f"    {write(tile, f'{tile}s{step}' + (f'_{c}' if c else ''), value)}"
                     for c, value in enumerate(f"{p}[{c}]{factor[c]}" for c in range(4))]
    return [*lines, f"  let kend = {end};", f"  var kn = {begin};", *loads,
            f"  for (var k0 = {begin}; k0 < kend; k0 += {bk}u) {{", *fill,
            "    workgroupBarrier();", f"    kn = k0 + {bk}u;", *loads]


def _direct(m: int, n: int, a: Operand, b: Operand, store: Store, t: Tiling, begin: str,
            end: str, edges: Edges) -> list[str]:
    # Rows and columns past the edge compute on a clamped (valid) index; their sums are dropped.
    lines = [*[f"  let r{i} = min(row0 + ty + {t.wy * i}u, {m - 1}u);" for i in range(t.tm)],
             *[f"  let q{j} = min(col0 + tx + {t.wx * j}u, {n - 1}u);" for j in range(t.tn)],
             *[f"  var c{i}_{j} = 0.0;" for i in range(t.tm) for j in range(t.tn)],
             *[f"  var a{i} = 0.0;" for i in range(t.tm)],
             *[f"  var b{j} = 0.0;" for j in range(t.tn)],
             f"  for (var kd = {begin}; kd < {end}; kd++) {{",
             *["    " + _element(a.load, f"r{i}", "kd", "", f"a{i}") for i in range(t.tm)],
             *["    " + _element(b.load, f"q{j}", "kd", "", f"b{j}") for j in range(t.tn)],
             *[f"    c{i}_{j} = fma(a{i}, b{j}, c{i}_{j});"
               for i in range(t.tm) for j in range(t.tn)],
             "  }"]
    for i in range(t.tm):
        for j in range(t.tn):
            lines += [f"  {{ let r = row0 + ty + {t.wy * i}u; let c = col0 + tx + {t.wx * j}u;",
                      f"    if ({edges.store_guard(m, n)}) {{", *store("r", "c", f"c{i}_{j}"),
                      "  } }"]
    return lines


COOP_PAD = 8  # f16 elements added to each staged row (16 bytes: keeps rows off one bank)


def _coop_bytes(t: CoopTiling, scaled: bool) -> int:
    return (2 * (t.bm * (t.bk + COOP_PAD) + t.bk * (t.bn + COOP_PAD)) + 4 * 256 * t.sg_m * t.sg_n
            + (_scale_bytes(t) if scaled else 0))


def _coop_shared(t: CoopTiling, scales: tuple[Scale | None, Scale | None]) -> list[str]:
    return [f"var<workgroup> As: array<f16, {t.bm * (t.bk + COOP_PAD)}>;",  # row-major, k fast
            f"var<workgroup> Bs: array<f16, {t.bk * (t.bn + COOP_PAD)}>;",  # k rows, n fast
            f"var<workgroup> Cs: array<f32, {256 * t.sg_m * t.sg_n}>;",  # a fragment a subgroup
            *_scale_shared(t, scales)]


def _scale_bytes(t: Tiling | CoopTiling) -> int:
    """The most workgroup memory `_scale_shared` takes."""
    return 8 * (t.bm + t.bn) + 4 * t.threads


def _scale_shared(t: Tiling | CoopTiling, scales: tuple[Scale | None, Scale | None]
                  ) -> list[str]:
    lines = []
    for tile, extent, scale in (("a", t.bm, scales[0]), ("b", t.bn, scales[1])):
        if scale is not None:  # per row of the tile: the exponent applied, its power of two
            lines += [f"var<workgroup> Exp{tile}: array<i32, {extent}>;",
                      f"var<workgroup> Pow{tile}: array<f32, {extent}>;",
                      *([] if scale.per_row else
                        [f"var<workgroup> Top{tile}: array<f32, {t.threads}>;"])]
    return lines


# The exponent e with 2^(e - 1) <= a scaled operand's largest magnitude < 2^e. Cooperative
# tiles sum in f32: 2^14 uses f16's range (65504) to the full. Staged f16 tiles multiply and
# sum a slice in f16, every operand scaled: products below 2^10, a slice of at most 16 of them
# below 2^14.
COOP_SCALED_TOP = 14
F16_SCALED_TOP = 5


def _scales(m: int, n: int, t: Tiling | CoopTiling, begin: str, end: str,
            scales: tuple[Scale | None, Scale | None], top_exp: int) -> list[str]:
    """Lines choosing, for each row of A and column of B in the tile, the power of two 2^e
    that brings its largest magnitude into [2^(top_exp - 1), 2^top_exp) (f16 holds up to
    65504), so a row of gradients around 1e-7 keeps its 11 bits instead of flushing to zero;
    the product of a row and a column is then 2^(ea + eb) too large, and the store multiplies
    by 2^-(ea + eb), exactly. An operand without a magnitude per row takes the largest over
    the layer's range of k (a tree reduction in workgroup memory)."""
    tiles = [(tile, extent, origin, bound, scale)
             for tile, extent, origin, bound, scale in (("a", t.bm, "row0", m, scales[0]),
                                                        ("b", t.bn, "col0", n, scales[1]))
             if scale is not None]
    whole = [(tile, scale) for tile, _, _, _, scale in tiles if not scale.per_row]
    lines = []
    for tile, scale in whole:
        lines += ["  {", "    var top = 0.0;",
                  f"    for (var d = {begin} + tid; d < {end}; d += {t.threads}u) {{",
                  f"      top = max(top, {scale.read('d')});", "    }",
                  f"    Top{tile}[tid] = top;", "  }"]
    if whole:
        lines += tree_reduce([f"Top{tile}" for tile, _ in whole], t.threads, "max({a}, {b})",
                             index="tid")
    for tile, extent, origin, bound, scale in tiles:
        # not select(): it would read past the end of the magnitudes too
        top = ([f"    var top = 0.0; if ({origin} + i < {bound}u) "
                f"{{ top = {scale.read(f'{origin} + i')}; }}"] if scale.per_row
               else [f"    let top = Top{tile}[0];"])
        lines += [f"  for (var i = tid; i < {extent}u; i += {t.threads}u) {{", *top,
                  f"    let e = min({top_exp} - frexp(top).exp, 126);",
                  f"    Exp{tile}[i] = e; Pow{tile}[i] = ldexp(1.0, e);", "  }"]
    return [*lines, "  workgroupBarrier();"]


# The cooperative kernel checks every edge, needed or not: dropping the checks made it slower
# (it made the f32 kernels faster).
COOP_EDGES = Edges(True, True, True)


def _coop(m: int, n: int, a: Operand, b: Operand, store: Store, t: CoopTiling, begin: str,
          end: str, setup: Sequence[str], plain_store: PlainStore | None,
          scales: tuple[Scale | None, Scale | None]) -> list[str]:
    sa, sb = t.bk + COOP_PAD, t.bn + COOP_PAD
    lines = ["fn main(@builtin(local_invocation_index) tid: u32, "
             "@builtin(workgroup_id) wid: vec3<u32>) {",
             f"  let row0 = wid.y * {t.bm}u; let col0 = wid.x * {t.bn}u; let z = wid.z;",
             *setup,
             # Subgroups are consecutive runs of 32 invocations (NVIDIA's warps).
             "  let sg = tid / 32u; let lane = tid % 32u;",
             f"  let sr = (sg / {t.sg_n}u) * {16 * t.fm}u;",
             f"  let sc = (sg % {t.sg_n}u) * {16 * t.fn}u;",
             *[f"  var acc{i}_{j} = coop_mat16x16<f32, C>();"
               for i in range(t.fm) for j in range(t.fn)],
             *(_scales(m, n, t, begin, end, scales, COOP_SCALED_TOP) if any(scales) else [])]
    lines += _stage(m, n, a, b, t.bm, t.bn, t.bk, t.threads, begin, end, COOP_EDGES,
                    place=lambda tile, ii, kk: (f"{ii} * {sa}u + {kk}" if tile == "a"
                                                else f"{kk} * {sb}u + {ii}"),
                    write=lambda tile, at, v: f"{'As' if tile == 'a' else 'Bs'}[{at}] = f16({v});",
                    fast=("depth", "row"),
                    write4=lambda tile, at, v: f"{{ let h = vec4<f16>({v}); " + " ".join(
                        f"{'As' if tile == 'a' else 'Bs'}[{at} + {c}u] = h.{'xyzw'[c]};"
                        for c in range(4)) + " }",
                    scale=lambda tile, row: (f"Pow{tile}[{row}]" if scales["ab".index(tile)]
                                             else None), half=True)
    for kk in range(0, t.bk, 16):
        lines.append("    {")
        lines += [f"      let fa{i} = coopLoadT<coop_mat16x16<f16, A>>("
                  f"&As[(sr + {16 * i}u) * {sa}u + {kk}u], {sa}u);" for i in range(t.fm)]
        lines += [f"      let fb{j} = coopLoadT<coop_mat16x16<f16, B>>("
                  f"&Bs[{kk * sb}u + sc + {16 * j}u], {sb}u);" for j in range(t.fn)]
        lines += [f"      acc{i}_{j} = coopMultiplyAdd(fa{i}, fb{j}, acc{i}_{j});"
                  for i in range(t.fm) for j in range(t.fn)]
        lines.append("    }")
    lines += ["    workgroupBarrier();", "  }"]
    through_shared: list[str] = []
    for i in range(t.fm):
        for j in range(t.fn):
            value = _unscaled("Cs[sg * 256u + e]", f"sr + {16 * i}u + e / 16u",
                              f"sc + {16 * j}u + e % 16u", scales)
            through_shared += [
                f"  coopStoreT(acc{i}_{j}, &Cs[sg * 256u], 16u);", "  workgroupBarrier();",
                "  for (var e = lane; e < 256u; e += 32u) {",
                f"    let r = row0 + sr + {16 * i}u + e / 16u; "
                f"let c = col0 + sc + {16 * j}u + e % 16u;",
                f"    if ({COOP_EDGES.store_guard(m, n)}) {{",
                *["  " + line for line in store("r", "c", value)],
                "    }", "  }", "  workgroupBarrier();"]
    if plain_store is None:
        return [*lines, *through_shared, "}"]
    # A workgroup whose tile lies inside C (a uniform condition, so the other branch keeps its
    # barriers) stores each fragment straight to C; where the tiles divide C, every one does.
    direct = [f"    coopStoreT(acc{i}_{j}, "
              f"&{plain_store.at(f'row0 + sr + {16 * i}u', f'col0 + sc + {16 * j}u')}, "
              f"{plain_store.stride}u);" for i in range(t.fm) for j in range(t.fn)]
    if m % t.bm == 0 and n % t.bn == 0:
        return [*lines, *direct, "}"]
    return [*lines, f"  if (row0 + {t.bm}u <= {m}u && col0 + {t.bn}u <= {n}u) {{", *direct,
            "  } else {", *["  " + line for line in through_shared], "  }", "}"]
