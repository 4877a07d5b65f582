"""Small datasets the project renders itself, so demos and tests need no download.

`make_shapes` draws grey images of six shape classes from signed distance functions: each shape's
edge is anti-aliased by the same rule, so no class can be told apart by its edge quality, only by
its geometry. Position, size, intensity, background and pixel noise vary per image, which keeps a
linear classifier well short of perfect while a small MLP learns it in a few epochs.
"""

from __future__ import annotations

import numpy as np

SHAPE_CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "bar", "ring")


def _signed_distance(kind: str, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Approximate signed distance (pixels, negative inside) to shape `kind` of half-size `r`,
    centred at the origin; y grows downwards as in an image."""
    ax, ay = np.abs(dx), np.abs(dy)
    if kind == "circle":
        return np.hypot(dx, dy) - r
    if kind == "square":
        # 0.85 r gives the square roughly the circle's area, so total brightness is no clue.
        return np.maximum(ax, ay) - 0.85 * r
    if kind == "triangle":
        # Apex at (0, -r), base corners at (+-w, b): the base line and the two slanted edges.
        w, b = 0.95 * r, 0.8 * r
        slant = (ax * (b + r) - (dy + r) * w) / np.hypot(b + r, w)
        return np.maximum(dy - b, slant)
    if kind == "cross":
        t = 0.3 * r
        return np.minimum(np.maximum(ax - t, ay - r), np.maximum(ax - r, ay - t))
    if kind == "bar":
        return np.maximum(ax - 1.2 * r, ay - 0.3 * r)
    if kind == "ring":
        return np.abs(np.hypot(dx, dy) - 0.78 * r) - 0.22 * r
    raise ValueError(f"unknown shape {kind!r}; known: {SHAPE_CLASSES}")


def render_shapes(labels: np.ndarray, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    """Grey images in [0, 1] (before noise), one per label, shape (n, size, size) float32."""
    n = len(labels)
    cx = rng.uniform(0.35, 0.65, n) * size
    cy = rng.uniform(0.35, 0.65, n) * size
    r = rng.uniform(0.2, 0.32, n) * size
    ink = rng.uniform(0.45, 1.0, n)
    paper = rng.uniform(0.0, 0.25, n)
    coords = np.arange(size, dtype=np.float64) + 0.5
    images = np.empty((n, size, size), np.float64)
    for k, kind in enumerate(SHAPE_CLASSES):
        idx = np.flatnonzero(labels == k)
        dx = coords[None, None, :] - cx[idx, None, None]
        dy = coords[None, :, None] - cy[idx, None, None]
        coverage = np.clip(0.5 - _signed_distance(kind, dx, dy, r[idx, None, None]), 0.0, 1.0)
        images[idx] = paper[idx, None, None] + (ink[idx] - paper[idx])[:, None, None] * coverage
    return images.astype(np.float32)


def make_shapes(n: int, seed: int, size: int = 16, noise: float = 0.12
                ) -> tuple[np.ndarray, np.ndarray]:
    """`n` noisy shape images and their labels, the same for the same arguments.

    Returns images as float32 (n, size*size), each standardised to zero mean and unit variance
    (so ink and paper brightness carry no label information), and labels as int32 (n,) indexing
    `SHAPE_CLASSES`, balanced to within one image per class.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(SHAPE_CLASSES)).astype(np.int32)
    images = render_shapes(labels, rng, size)
    images += rng.normal(0.0, noise, images.shape).astype(np.float32)
    flat = images.reshape(n, size * size)
    flat -= flat.mean(axis=1, keepdims=True)
    flat /= flat.std(axis=1, keepdims=True) + 1e-6
    return flat, labels
