"""Depth pictures: the Turbo colour map (Google's polynomial fit, public domain), near = warm."""

from __future__ import annotations

import numpy as np

from xr_demo.scene import FAR

_R = (0.13572138, 4.61539260, -42.66032258, 132.13108234, -152.94239396, 59.28637943)
_G = (0.09140261, 2.19418839, 4.84296658, -14.18503333, 4.27729857, 2.82956604)
_B = (0.10667330, 12.64194608, -60.58204836, 110.36276771, -89.90310912, 27.34824973)


def turbo(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> (..., 3) uint8."""
    x = np.clip(np.asarray(x, np.float64), 0.0, 1.0)
    powers = np.stack([x ** k for k in range(6)], -1)
    rgb = np.stack([powers @ np.asarray(c) for c in (_R, _G, _B)], -1)
    return (np.clip(rgb, 0.0, 1.0) * 255 + 0.5).astype(np.uint8)


NEAR = 1.5  # metres: nearer than this is drawn as this


def depth_fraction(depth_m: np.ndarray) -> np.ndarray:
    """Where a depth lies on the colour scale, in [0, 1]: linear in inverse depth, which
    spreads the near range where the detail is (FAR at 0, NEAR at 1)."""
    return (1.0 / np.clip(depth_m, NEAR, FAR) - 1.0 / FAR) / (1.0 / NEAR - 1.0 / FAR)


def depth_picture(depth_m: np.ndarray) -> np.ndarray:
    """Metres (H, W) -> (H, W, 3) uint8; the background (FAR) is dark blue."""
    return turbo(depth_fraction(depth_m))


def turbo_wgsl() -> str:
    """WGSL for the GPU's depth pictures (xr_demo/panel.py): `depth_colour(metres) -> vec3`,
    depth_picture's arithmetic before the rounding to bytes, from the same constants."""
    def horner(c: tuple[float, ...]) -> str:
        text = f"{c[-1]!r}"
        for k in reversed(c[:-1]):
            text = f"({k!r} + x * {text})"
        return text

    return f"""
const FAR: f32 = {FAR!r};
const NEAR: f32 = {NEAR!r};

fn depth_colour(metres: f32) -> vec3<f32> {{
    let x = clamp((1.0 / clamp(metres, NEAR, FAR) - 1.0 / FAR) / (1.0 / NEAR - 1.0 / FAR),
                  0.0, 1.0);
    let rgb = vec3<f32>({horner(_R)}, {horner(_G)}, {horner(_B)});
    return clamp(rgb, vec3<f32>(0.0), vec3<f32>(1.0));
}}
"""
