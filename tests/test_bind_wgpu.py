"""Frames in, predictions out on a wgpu host: session.bind_input / bind_output with the host's
wgpu.GPUBuffers and GPUTextures, on its own GPUDevice adopted by vkml.Device.from_wgpu.

The host here is wgpu-py over Vulkan on lavapipe, validating every call (WebGPU's validation is
always on; what it reports outside a call is checked to stay empty). Each bound path is
compared bit for bit with a session of the same graph fed by set_input and read by read()."""

from __future__ import annotations

import numpy as np
import pytest
from test_bind import (
    MEAN,
    STD,
    H,
    W,
    assert_bits,
    check_resize,
    colour_frame,
    conv_graph,
    identity_session,
    train,
)

import vkml
from vkml.kernels.frames import table
from vkml.webgpu.host_resources import TEXTURE_FORMATS

wgpu = pytest.importorskip("wgpu", reason="the wgpu host needs `pip install vkml[wgpu]`")

BUF, TEX = wgpu.BufferUsage, wgpu.TextureUsage


class Host:
    """A wgpu application: its own adapter and device (with the adapter's limits, as a host
    running large models asks for), and helpers making buffers and textures as a renderer
    would, written through its queue."""

    def __init__(self) -> None:
        adapter = next(a for a in wgpu.gpu.enumerate_adapters_sync()
                       if a.info["backend_type"] == "Vulkan")
        limits = {k: adapter.limits[k] for k in ("max-storage-buffers-per-shader-stage",
                                                 "max-storage-buffer-binding-size")}
        self.device = adapter.request_device_sync(label="host", required_limits=limits)
        self.other_device = adapter.request_device_sync(label="another host device")
        self.queue = self.device.queue
        self.vkml = vkml.Device.from_wgpu(self.device)

    def buffer(self, nbytes: int, usage: int, device=None):
        return (device or self.device).create_buffer(size=nbytes, usage=usage)

    def texture(self, format: str, width: int, height: int, usage: int):
        return self.device.create_texture(size=(width, height, 1), format=format, usage=usage)

    def write_texture(self, texture, data: np.ndarray) -> None:
        height, width = data.shape[:2]
        self.queue.write_texture({"texture": texture}, np.ascontiguousarray(data),
                                 {"bytes_per_row": data.nbytes // height},
                                 (width, height, 1))

    def read_texture(self, texture, width: int, height: int) -> np.ndarray:
        """An r32float texture's texels, read back by the host (the test's check)."""
        raw = self.queue.read_texture({"texture": texture}, {"bytes_per_row": 4 * width},
                                      (width, height, 1))
        return np.frombuffer(raw, np.float32).reshape(height, width)

    def close(self) -> None:
        self.vkml.close()
        self.other_device.destroy()
        self.device.destroy()


@pytest.fixture(scope="module")
def host():
    h = Host()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def quiet(host):
    yield
    found = list(host.vkml.backend.validation_messages)
    host.vkml.backend.validation_messages.clear()
    assert not found, "wgpu reported:\n" + "\n".join(found)


def test_an_adopted_device_is_the_hosts_and_outlives_vkml():
    h = Host()
    assert h.vkml.adopted and h.vkml.backend_name == "wgpu"
    with pytest.raises(vkml.DeviceError, match="wgpu.GPUDevice"):
        vkml.Device.from_wgpu(h.other_device.adapter)
    h.vkml.close()
    data = np.arange(4, dtype=np.float32)  # the host's device still works after vkml's close
    buf = h.buffer(16, BUF.COPY_SRC | BUF.COPY_DST)
    h.queue.write_buffer(buf, 0, data)
    assert_bits(np.frombuffer(h.queue.read_buffer(buf), np.float32), data)
    h.other_device.destroy()
    h.device.destroy()


def test_buffers_in_and_out_equal_set_input_and_read_bit_for_bit(host, rng):
    g, y, loss = conv_graph()
    bound, plain = train(g, y, loss, host.vkml), train(g, y, loss, host.vkml)
    usage = BUF.COPY_SRC | BUF.COPY_DST | BUF.STORAGE
    x_buf, d_buf = host.buffer(4 * 3 * H * W + 64, usage), host.buffer(4 * H * W, usage)
    y_buf = host.buffer(4 * H * W, usage)
    bound.bind_input("x", x_buf, offset=64)
    bound.bind_input("depth", d_buf)
    bound.bind_output("y", y_buf)
    for k in range(3):  # the host writes a new frame into its buffers before each step
        x = rng.standard_normal((1, 3, H, W)).astype(np.float32)
        depth = rng.random((1, 1, H, W)).astype(np.float32)
        host.queue.write_buffer(x_buf, 64, x)
        host.queue.write_buffer(d_buf, 0, depth)
        if k == 1:  # one step in pieces, one level each
            while bound.step_chunk():
                pass
        else:
            bound.step()
        plain.set_input("x", x)
        plain.set_input("depth", depth)
        plain.step()
        drawn = np.frombuffer(host.queue.read_buffer(y_buf), np.float32).reshape(1, 1, H, W)
        assert_bits(drawn, plain.read("y"))
        assert_bits(bound.read("loss"), plain.read("loss"))
    for name, value in plain.params().items():
        assert_bits(bound.params()[name], value)
    assert host.vkml.backend.live_objects()["host_resources"] == 3
    bound.close()
    plain.close()
    assert host.vkml.backend.live_objects()["host_resources"] == 0


@pytest.mark.parametrize("format", ["rgba8unorm", "rgba16float"])
def test_textures_in_and_out_equal_set_input_and_read_bit_for_bit(host, rng, format):
    """A colour texture's region (alpha dropped, normalised) and an r32float depth in, the
    prediction out into an r32float texture the renderer samples; their rows of 8 texels are
    spaced 256 bytes apart for WebGPU's copies."""
    g, y, loss = conv_graph()
    bound, plain = train(g, y, loss, host.vkml), train(g, y, loss, host.vkml)
    usage = TEX.COPY_SRC | TEX.COPY_DST | TEX.TEXTURE_BINDING
    colour = host.texture(format, W + 3, H + 2, usage)
    depth_texture = host.texture("r32float", W, H, usage)
    prediction = host.texture("r32float", W, H, usage)
    bound.bind_input("x", colour, region=(2, 1, W, H), mean=MEAN, std=STD)
    bound.bind_input("depth", depth_texture)
    bound.bind_output("y", prediction)
    for _ in range(2):
        texels, x = colour_frame(rng, TEXTURE_FORMATS[format])
        depth = rng.random((H, W)).astype(np.float32)
        host.write_texture(colour, texels)  # the host's "render pass", before the step
        host.write_texture(depth_texture, depth)
        bound.step()
        plain.set_input("x", x)
        plain.set_input("depth", depth[None, None])
        plain.step()
        assert_bits(host.read_texture(prediction, W, H).reshape(1, 1, H, W), plain.read("y"))
    for name, value in plain.params().items():
        assert_bits(bound.params()[name], value)
    bound.close()
    plain.close()


def test_rows_of_256_bytes_are_copied_as_they_are(host, rng):
    """An r32float region 64 texels wide (WebGPU's row pitch exactly) in and out: its rows
    need no spacing (the other tests' 8-texel rows do)."""
    source = host.texture("r32float", 64, 4, TEX.COPY_SRC | TEX.COPY_DST)
    target = host.texture("r32float", 64, 3, TEX.COPY_SRC | TEX.COPY_DST)
    texels = rng.random((4, 64)).astype(np.float32)
    host.write_texture(source, texels)
    host.write_texture(target, np.zeros((3, 64), np.float32))
    s = identity_session(host.vkml, (2, 64))
    s.bind_input("x", source, region=(0, 1, 64, 2))
    s.bind_output("y", target, region=(0, 1))
    s.forward()
    assert_bits(s.read("y"), texels[1:3])
    assert_bits(host.read_texture(target, 64, 3), np.concatenate(
        [np.zeros((1, 64), np.float32), texels[1:3]]))
    s.close()


def test_resize_and_channel_choice_match_torch_bilinear(host, rng):
    """Through rows spaced 256 bytes apart: the resize's taps read them there."""
    source = host.texture("rgba8unorm", 13, 11, TEX.COPY_SRC | TEX.COPY_DST)
    texels = rng.integers(0, 256, (11, 13, 4), dtype=np.uint8)
    host.write_texture(source, texels)
    check_resize(host.vkml, texels, source)


def test_a_picture_in_a_wgpu_buffer_is_converted_as_a_texture_is(host, rng):
    texels = rng.integers(0, 256, (H, W, 4), dtype=np.uint8)
    buf = host.buffer(16 + texels.nbytes, BUF.COPY_SRC | BUF.COPY_DST)
    host.queue.write_buffer(buf, 16, texels)
    s = identity_session(host.vkml, (1, 3, H, W))
    s.bind_input("x", vkml.HostBuffer(buf, host.device, buf.size, buf.usage, "rgba8_unorm",
                                      (W, H)), offset=16, channels=(2, 1, 0), mean=MEAN, std=STD)
    s.forward()
    lut = table("rgba8_unorm", (*MEAN, 0.0), (*STD, 1.0)).reshape(4, 256)
    expected = np.stack([lut[c][texels[..., c]] for c in (2, 1, 0)])[None]
    assert_bits(s.read("y"), np.maximum(expected, np.float32(0)))  # the session's relu
    s.close()


def test_wrong_resources_are_refused_naming_the_input_and_the_fix(host):
    vk = pytest.importorskip("vulkan")
    s = identity_session(host.vkml, (1, 3, H, W))
    o = identity_session(host.vkml, (H, W))  # an output an r32float texture holds
    nbytes = 4 * 3 * H * W
    good = host.buffer(nbytes, BUF.COPY_SRC | BUF.COPY_DST)
    texture = host.texture("rgba8unorm", W, H, TEX.COPY_SRC | TEX.COPY_DST)
    cases = [
        (lambda: s.bind_input("x", host.buffer(nbytes, BUF.COPY_SRC, host.other_device)),
         "bind_input\\('x'\\).*another wgpu device.*vkml.Device.from_wgpu"),
        (lambda: s.bind_input("x", host.buffer(nbytes - 4, BUF.COPY_SRC)),
         "bind_input\\('x'\\).*do not fit in the .*-byte buffer"),
        (lambda: s.bind_input("x", good, offset=8), "do not fit"),
        (lambda: s.bind_input("x", host.buffer(nbytes, BUF.COPY_DST | BUF.STORAGE)),
         "bind_input\\('x'\\).*lack COPY_SRC.*wgpu.BufferUsage.COPY_SRC"),
        (lambda: s.bind_output("y", host.buffer(nbytes, BUF.COPY_SRC)),
         "bind_output\\('y'\\).*lack COPY_DST.*wgpu.BufferUsage.COPY_DST"),
        (lambda: s.bind_input("x", host.texture("rgba8unorm", W, H, TEX.TEXTURE_BINDING)),
         "lack COPY_SRC.*wgpu.TextureUsage.COPY_SRC"),
        (lambda: o.bind_output("y", host.texture("r32float", W, H, TEX.COPY_SRC)),
         "bind_output\\('y'\\).*lack COPY_DST.*wgpu.TextureUsage.COPY_DST"),
        (lambda: s.bind_input("x", host.texture("bgra8unorm", W, H, TEX.COPY_SRC)),
         "format 'bgra8unorm'.*rgba8_unorm"),
        (lambda: o.bind_output("y", texture), "r32_float"),
        (lambda: o.bind_output("y", host.texture("r32float", W - 1, H, TEX.COPY_DST)),
         "does not fit in the 7x8 image"),
        (lambda: s.bind_input("x", texture, region=(4, 0, W, H)),
         "does not fit in the 8x8 image"),
        (lambda: s.bind_input("x", vkml.HostBuffer(good, host.device, 2 * nbytes,
                                                   int(good.usage))),
         "declared nbytes=.*buffer.size"),
        (lambda: s.bind_input("x", vkml.HostImage(
            12345, None, "rgba8_unorm", (W, H), vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT,
            vk.VK_IMAGE_LAYOUT_GENERAL)),
         "runs on wgpu.*Vulkan handle.*not a wgpu.GPUTexture.*vkml.Device.from_vulkan"),
        (lambda: s.bind_input("x", vkml.HostBuffer(12345, None, nbytes,
                                                   vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT)),
         "runs on wgpu.*not a wgpu.GPUBuffer"),
        (lambda: s.bind_input("x", np.zeros(3)), "expected a wgpu.GPUBuffer or wgpu.GPUTexture"),
    ]
    for call, message in cases:
        with pytest.raises(vkml.InputError, match=message):
            call()
    assert host.vkml.backend.live_objects()["host_resources"] == 0  # nothing kept from refusals
    s.close()
    o.close()


def test_a_vulkan_session_refuses_wgpu_objects(host):
    dev = vkml.Device(backend="vulkan")
    s = identity_session(dev, (2, 3))
    buf = host.buffer(24, BUF.COPY_SRC)
    texture = host.texture("r32float", 3, 2, TEX.COPY_DST)
    with pytest.raises(vkml.InputError, match="GPUBuffer is a wgpu object.*runs on Vulkan.*"
                                              "vkml.Device.from_wgpu"):
        s.bind_input("x", buf)
    with pytest.raises(vkml.InputError, match="GPUTexture is a wgpu object"):
        s.bind_output("y", texture)
    with pytest.raises(vkml.InputError, match="GPUBuffer is a wgpu object"):
        s.bind_input("x", vkml.HostBuffer(buf, host.device, 24, 1))
    s.close()
    dev.close()
