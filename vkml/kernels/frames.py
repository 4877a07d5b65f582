"""A frame into a model's input: pixels of a host image (copied tightly packed into a buffer)
to an f32 (C, H, W) tensor, choosing channels, normalising, and resizing bilinearly.

8-bit texels go through a table per channel, (k / 255 - mean) / std for k = 0..255 computed in
float64 on the host and rounded once, so the kernel's result is the table's entry exactly (no
rounding the device's division or a fused multiply-add could change). Float texels compute
(v - mean) * (1 / std) in f32: a subtraction then a multiplication, each rounded as IEEE says.
Resizing follows torch's F.interpolate(mode="bilinear", align_corners=False) on the converted
texels."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, grid

WORKGROUP = 256
TABLE_ENTRIES = 256  # per channel, for 8-bit texels


def table(format: str, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """The kernel's `table` binding for four source channels' `mean` and `std`: 8-bit formats
    get 4 x 256 converted values, float formats mean then 1 / std (8 values)."""
    m, s = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    if format.startswith("rgba8"):
        k = np.arange(TABLE_ENTRIES, dtype=np.float64)
        return ((k[None, :] / 255.0 - m[:, None]) / s[:, None]).astype(np.float32).reshape(-1)
    return np.concatenate([m.astype(np.float32), (1.0 / s).astype(np.float32)])


def _texel_function(format: str, row: int) -> list[str]:
    """WGSL `texel(x, y, c)`: source channel c of the texel at (x, y), converted; rows lie
    `row` texels apart."""
    head = "fn texel(x: u32, y: u32, c: u32) -> f32 {"
    if format.startswith("rgba8"):
        body = [f"  let word = src[y * {row}u + x];",
                f"  return table[c * {TABLE_ENTRIES}u + ((word >> (8u * c)) & 255u)];"]
    elif format == "rgba16_float":
        body = [f"  let pair = unpack2x16float(src[(y * {row}u + x) * 2u + c / 2u]);",
                "  return (pair[c % 2u] - table[c]) * table[4u + c];"]
    else:
        body = [f"  return (bitcast<f32>(src[y * {row}u + x]) - table[c]) * table[4u + c];"]
    return [head, *body, "}"]


def _entry(total: int) -> list[str]:
    """The entry point's first lines: one invocation per element `idx` of `total`."""
    return [f"fn main({ENTRY_ARGS}) {{",
            f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
            f"  if (idx >= {total}u) {{ return; }}"]


def _axis(name: str, size: int, out: int) -> list[str]:
    """WGSL lets for one axis of torch's bilinear source coordinate: `{name}0`, `{name}1` (the
    taps) and `l{name}` (the second tap's weight)."""
    scale = np.float32(size) / np.float32(out)
    return [f"  let f{name} = max((f32({name}) + 0.5) * {float(scale)!r} - 0.5, 0.0);",
            f"  let {name}0 = u32(f{name});",
            f"  let {name}1 = min({name}0 + 1u, {size - 1}u);",
            f"  let l{name} = f{name} - f32({name}0);"]


def convert(format: str, source: tuple[int, int], shape: tuple[int, int, int],
            channels: Sequence[int], caps: Capabilities, row: int | None = None) -> Kernel:
    """Bindings: `src` (the texels of a `source` = (width, height) region, u32 words, rows
    `row` texels apart: `width`, tightly packed, by default), `table` (from table()), `out`
    (the (C, H, W) f32 tensor); `channels[c]` is the source channel of output channel c."""
    (width, height), (c_out, h_out, w_out) = source, shape
    row = width if row is None else row
    total = c_out * h_out * w_out
    picks = ", ".join(f"{c}u" for c in channels)
    entry = [*_entry(total),
             f"  let x = idx % {w_out}u;",
             f"  let y = (idx / {w_out}u) % {h_out}u;",
             f"  var picks = array<u32, {c_out}>({picks});",
             f"  let c = picks[idx / {w_out * h_out}u];"]
    if (width, height) == (w_out, h_out):
        entry.append("  out[idx] = texel(x, y, c);")
    else:
        entry += [*_axis("y", height, h_out), *_axis("x", width, w_out),
                  "  let top = (1.0 - lx) * texel(x0, y0, c) + lx * texel(x1, y0, c);",
                  "  let bottom = (1.0 - lx) * texel(x0, y1, c) + lx * texel(x1, y1, c);",
                  "  out[idx] = (1.0 - ly) * top + ly * bottom;"]
    entry.append("}")
    buffers = [Buf("src", "u32"), Buf("table"), Buf("out", writable=True)]
    pitch = "" if row == width else f"_row{row}"
    name = f"frame_{format}_{width}x{height}{pitch}_to_{c_out}x{h_out}x{w_out}"
    return assemble(name, caps, buffers, (WORKGROUP,), entry,
                    grid(-(-total // WORKGROUP), caps), prelude=_texel_function(format, row),
                    flops=total * 12, nbytes=total * 8)


def spaced_rows(rows: int, cols: int, row: int, caps: Capabilities) -> Kernel:
    """Bindings: `src` (a rows x cols map of 32-bit words, tightly packed), `out` (the same
    rows, `row` words apart): an output laid out for one copy into a texture where the API
    spaces a copy's rows (WebGPU: by multiples of 256 bytes). Words are moved, not floats, so
    every bit arrives."""
    total = rows * cols
    entry = [*_entry(total), f"  out[(idx / {cols}u) * {row}u + idx % {cols}u] = src[idx];", "}"]
    return assemble(f"frame_rows_{rows}x{cols}_to_row{row}", caps,
                    [Buf("src", "u32"), Buf("out", "u32", writable=True)], (WORKGROUP,), entry,
                    grid(-(-total // WORKGROUP), caps), nbytes=total * 8)
