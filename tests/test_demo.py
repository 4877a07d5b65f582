"""The demo's pieces on a small budget: the shapes dataset, the MLP builder, training to
well above chance, the PNG writer, and the CLI's handling of a missing device."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

import vkml
from vkml.__main__ import build_classifier, demo_figure, main, predict, train_epoch
from vkml.datasets import SHAPE_CLASSES, make_shapes
from vkml.errors import GraphError
from vkml.models import mlp
from vkml.png import Canvas, encode_png


def test_shapes_are_deterministic_balanced_and_normalised():
    x, y = make_shapes(120, seed=3, size=12)
    assert x.shape == (120, 144) and x.dtype == np.float32
    assert y.shape == (120,) and y.dtype == np.int32
    assert np.bincount(y, minlength=len(SHAPE_CLASSES)).tolist() == [20] * 6
    np.testing.assert_allclose(x.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=1), 1.0, atol=1e-3)
    x2, y2 = make_shapes(120, seed=3, size=12)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = make_shapes(120, seed=4, size=12)
    assert not np.allclose(x, x3)


def test_shapes_are_not_linearly_trivial():
    # A least-squares linear classifier should do much better than chance but not perfectly,
    # or the demo's MLP would prove nothing.
    x, y = make_shapes(3000, seed=0, size=12)
    xt, yt = make_shapes(600, seed=1, size=12)
    w = np.linalg.lstsq(np.c_[x, np.ones(len(x))], np.eye(6)[y], rcond=None)[0]
    accuracy = (np.c_[xt, np.ones(len(xt))] @ w).argmax(1) == yt
    assert 0.35 < accuracy.mean() < 0.9


def test_mlp_names_layers_like_pytorch():
    g = vkml.Graph()
    logits = mlp(g, g.input("x", (4, 10)), (10, 7, 5, 3))
    assert logits.shape == (4, 3)
    assert list(g.params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                              "fc3.weight", "fc3.bias"]
    assert g.params["fc2.weight"].shape == (5, 7)
    with pytest.raises(GraphError, match="features"):
        mlp(g, g.input("y", (4, 9)), (10, 3))
    with pytest.raises(GraphError, match="activation"):
        mlp(g, g.input("z", (4, 10)), (10, 3), activation="swish")


def test_training_beats_chance(device):
    # 8x8 images and narrow layers keep every kernel small: lavapipe compiles quickly.
    x, y = make_shapes(1600, seed=0, size=8)
    xt, yt = make_shapes(320, seed=1, size=8)
    session = build_classifier(32, (64, 32, 6), seed=0, device=device, lr=1e-2)
    rng = np.random.default_rng(0)
    losses: list[float] = []
    for _ in range(4):  # 200 steps
        losses += train_epoch(session, x, y, rng)[0]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-20:]) < 0.7 * np.mean(losses[:20])
    accuracy = (predict(session, xt) == yt).mean()  # 320 = 10 batches: no padding
    assert accuracy > 0.6, f"test accuracy {accuracy:.2f} (chance 0.17)"
    assert (predict(session, xt[:50]) == predict(session, xt)[:50]).all()  # padded batch
    session.close()


def _read_png(data: bytes) -> np.ndarray:
    """A minimal PNG reader for the writer's output (8-bit, filter 0), via zlib and struct."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    w, h, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and b"IEND" in chunks
    channels = {0: 1, 2: 3}[color_type]
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, -1)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, channels).squeeze()


def test_png_round_trip():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert np.array_equal(_read_png(encode_png(rgb)), rgb)
    grey = rgb[..., 0].copy()
    assert np.array_equal(_read_png(encode_png(grey)), grey)
    with pytest.raises(ValueError):
        encode_png(rgb.astype(np.float32))


def test_canvas_text_and_demo_figure():
    c = Canvas(40, 12)
    end = c.text(1, 1, "Ok 9%", (255, 0, 0))
    assert end == 1 + 5 * 6
    assert (c.pixels == [255, 0, 0]).all(axis=2).any()
    x, y = make_shapes(40, seed=0, size=16)
    preds = y.copy()
    preds[:3] = (preds[:3] + 1) % 6
    losses = list(np.linspace(1.8, 0.2, 30))
    pixels = demo_figure(losses, 10, x, y, preds, 16, "TITLE", "SUBTITLE")
    image = _read_png(encode_png(pixels))
    assert image.shape == pixels.shape and image.shape[2] == 3
    assert (image == [210, 40, 40]).all(axis=2).any()  # mistakes framed red


def test_cli_reports_missing_device_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("VKML_DEVICE", "no such device")
    assert main(["demo", "--epochs", "1", "--train", "64", "--test", "64",
                 "--device", "no such device"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m vkml demo: ") and "no Vulkan device matches" in err
    assert "Traceback" not in err
