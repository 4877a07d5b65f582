"""Frames in, predictions out, on the GPU: session.bind_input / bind_output with a host's
VkBuffers and VkImages (vkml/runtime/frames.py).

The host here is a few lines of the `vulkan` package with its own instance, on which the
validation layer runs with synchronization validation; every test checks that it stayed silent.
Each bound path is compared bit for bit with a session fed by set_input and read by read() (the
same graph, so the same initial parameters); resizing is compared with torch's bilinear
F.interpolate."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import vkml
from vkml.kernels.frames import table
from xr_demo.vkhost import device_create_info, universal_family

vk = pytest.importorskip("vulkan", reason="the host's buffers and images are made with `vulkan`")
ffi = vk.ffi

H = W = 8
LAYER = "VK_LAYER_KHRONOS_validation"
SRC, DST = vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT, vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
SHADER_READ = vk.VK_IMAGE_LAYOUT_SHADER_READ_ONLY_OPTIMAL
FORMATS = {"rgba8_unorm": vk.VK_FORMAT_R8G8B8A8_UNORM, "rgba16_float":
           vk.VK_FORMAT_R16G16B16A16_SFLOAT, "r32_float": vk.VK_FORMAT_R32_SFLOAT}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Host:
    """A host application: its instance (with the validation layer and synchronization
    validation where the layer is installed), device, queue, and helpers to make and fill
    buffers and images the way a renderer would."""

    def __init__(self):
        self.messages: list[str] = []
        self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self._on_message)
        layers = {p.layerName for p in vk.vkEnumerateInstanceLayerProperties()}
        self.validating = LAYER in layers
        enables = ffi.new("VkValidationFeatureEnableEXT[1]",
                          [vk.VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT])
        self._features = ffi.new("VkValidationFeaturesEXT*", {
            "sType": vk.VK_STRUCTURE_TYPE_VALIDATION_FEATURES_EXT,
            "enabledValidationFeatureCount": 1, "pEnabledValidationFeatures": enables})
        self._enables = enables
        self.app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                                        pApplicationName="host", applicationVersion=1,
                                        pEngineName="host", engineVersion=1,
                                        apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
        info = vk.VkInstanceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
            pNext=self._features if self.validating else ffi.NULL, pApplicationInfo=self.app,
            enabledLayerCount=int(self.validating),
            ppEnabledLayerNames=[LAYER] if self.validating else None,
            enabledExtensionCount=1, ppEnabledExtensionNames=["VK_EXT_debug_utils"])
        self.instance = vk.vkCreateInstance(info, None)
        create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
        self.messenger = create(self.instance, vk.VkDebugUtilsMessengerCreateInfoEXT(
            sType=vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
            messageSeverity=vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            messageType=vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT,
            pfnUserCallback=self._callback), None)
        self.physical = vk.vkEnumeratePhysicalDevices(self.instance)[0]
        self.family = universal_family(self.physical)
        dci = device_create_info(self.physical, self.family)
        self.device = vk.vkCreateDevice(self.physical, dci.info, None)
        self.queue = vk.vkGetDeviceQueue(self.device, self.family, 0)
        self.other_device = vk.vkCreateDevice(self.physical, dci.info, None)  # not vkml's
        self.memory = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        self.pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)
        self.fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        self.vkml = vkml.Device.from_vulkan(self.instance, self.physical, self.device,
                                            self.family, self.queue,
                                            enabled_features=dci.features,
                                            enabled_extensions=dci.extensions)
        self.objects: list[tuple] = []

    def _on_message(self, severity, types, data, user):
        message = ffi.string(data.pMessage).decode(errors="replace") if data.pMessage else ""
        if "env var" not in message:
            self.messages.append(message)
        return 0

    def _memory(self, requirements, flags):
        for i in range(self.memory.memoryTypeCount):
            if requirements.memoryTypeBits >> i & 1 and \
                    self.memory.memoryTypes[i].propertyFlags & flags == flags:
                info = vk.VkMemoryAllocateInfo(sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                               allocationSize=requirements.size,
                                               memoryTypeIndex=i)
                return vk.vkAllocateMemory(self.device, info, None)
        raise AssertionError("no memory type")

    def buffer(self, nbytes, usage):
        """A host-visible buffer and a float32 view of its memory."""
        buf = vk.vkCreateBuffer(self.device, vk.VkBufferCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=nbytes, usage=usage,
            sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        memory = self._memory(vk.vkGetBufferMemoryRequirements(self.device, buf),
                              vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                              | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        vk.vkBindBufferMemory(self.device, buf, memory, 0)
        mapped = vk.vkMapMemory(self.device, memory, 0, nbytes, 0)
        self.objects.append(("buffer", buf, memory))
        return buf, np.frombuffer(mapped, np.uint8)

    def image(self, format, width, height, usage):
        image = vk.vkCreateImage(self.device, vk.VkImageCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_CREATE_INFO, imageType=vk.VK_IMAGE_TYPE_2D,
            format=FORMATS[format], extent=vk.VkExtent3D(width, height, 1), mipLevels=1,
            arrayLayers=1, samples=vk.VK_SAMPLE_COUNT_1_BIT, tiling=vk.VK_IMAGE_TILING_OPTIMAL,
            usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE,
            initialLayout=vk.VK_IMAGE_LAYOUT_UNDEFINED), None)
        memory = self._memory(vk.vkGetImageMemoryRequirements(self.device, image),
                              vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)
        vk.vkBindImageMemory(self.device, image, memory, 0)
        self.objects.append(("image", image, memory))
        return image

    def run(self, record):
        """Record with `record(cb)` into a command buffer, submit it on the shared queue and
        wait, as a frame of the host would."""
        cb = vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=self.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        record(cb)
        vk.vkEndCommandBuffer(cb)
        with self.vkml.queue_lock:
            vk.vkQueueSubmit(self.queue, 1, [vk.VkSubmitInfo(
                sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                pCommandBuffers=[cb])], self.fence)
        vk.vkWaitForFences(self.device, 1, [self.fence], vk.VK_TRUE, 10**11)
        vk.vkResetFences(self.device, 1, [self.fence])
        vk.vkFreeCommandBuffers(self.device, self.pool, 1, [cb])

    def barrier(self, cb, image, old, new, src_stage, src, dst_stage, dst):
        vk.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 0, None, 0, None, 1, [
            vk.VkImageMemoryBarrier(
                sType=vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER, srcAccessMask=src,
                dstAccessMask=dst, oldLayout=old, newLayout=new,
                srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
                dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, image=image,
                subresourceRange=vk.VkImageSubresourceRange(
                    aspectMask=vk.VK_IMAGE_ASPECT_COLOR_BIT, baseMipLevel=0, levelCount=1,
                    baseArrayLayer=0, layerCount=1))])

    def copy(self, cb, image, width, height, buffer, to_image):
        region = vk.VkBufferImageCopy(
            bufferOffset=0, bufferRowLength=0, bufferImageHeight=0,
            imageSubresource=vk.VkImageSubresourceLayers(
                aspectMask=vk.VK_IMAGE_ASPECT_COLOR_BIT, mipLevel=0, baseArrayLayer=0,
                layerCount=1),
            imageOffset=vk.VkOffset3D(0, 0, 0), imageExtent=vk.VkExtent3D(width, height, 1))
        if to_image:
            vk.vkCmdCopyBufferToImage(cb, buffer, image,
                                      vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL, 1, [region])
        else:
            vk.vkCmdCopyImageToBuffer(cb, image, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL,
                                      buffer, 1, [region])

    def upload_commands(self, cb, image, data, width, height, layout):
        """Commands writing `data` into the image through a staging buffer, as a renderer's
        texture upload (or its render pass) would, leaving it in `layout`."""
        staging, view = self.buffer(data.nbytes, SRC)
        view[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        self.barrier(cb, image, vk.VK_IMAGE_LAYOUT_UNDEFINED,
                     vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL,
                     vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_READ_BIT,
                     transfer, vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        self.copy(cb, image, width, height, staging, to_image=True)
        self.barrier(cb, image, vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL, layout, transfer,
                     vk.VK_ACCESS_TRANSFER_WRITE_BIT, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT,
                     vk.VK_ACCESS_MEMORY_READ_BIT)

    def upload(self, image, data, width, height, layout):
        self.run(lambda cb: self.upload_commands(cb, image, data, width, height, layout))

    def download(self, image, width, height, layout, dtype=np.float32):
        """The image's texels, read back by the host (the test's check, not the frame loop)."""
        nbytes = width * height * np.dtype(dtype).itemsize
        buf, view = self.buffer(nbytes, DST)
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT

        def record(cb):
            self.barrier(cb, image, layout, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL,
                         vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_WRITE_BIT,
                         transfer, vk.VK_ACCESS_TRANSFER_READ_BIT)
            self.copy(cb, image, width, height, buf, to_image=False)
            self.barrier(cb, image, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL, layout, transfer,
                         0, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, vk.VK_ACCESS_MEMORY_READ_BIT)
            vk.vkCmdPipelineBarrier(cb, transfer, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [
                vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                   srcAccessMask=vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                   dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT)], 0, None, 0, None)

        self.run(record)
        return view.view(dtype).copy()

    def describe_buffer(self, buf, nbytes, usage):
        return vkml.HostBuffer(buf, self.device, nbytes, usage)

    def describe_image(self, image, format, width, height, usage, layout=SHADER_READ):
        return vkml.HostImage(image, self.device, format, (width, height), usage, layout)

    def close(self):
        self.vkml.close()
        for kind, handle, memory in self.objects:
            (vk.vkDestroyBuffer if kind == "buffer" else vk.vkDestroyImage)(
                self.device, handle, None)
            vk.vkFreeMemory(self.device, memory, None)
        vk.vkDestroyFence(self.device, self.fence, None)
        vk.vkDestroyCommandPool(self.device, self.pool, None)
        vk.vkDestroyDevice(self.device, None)
        vk.vkDestroyDevice(self.other_device, None)
        destroy = vk.vkGetInstanceProcAddr(self.instance, "vkDestroyDebugUtilsMessengerEXT")
        destroy(self.instance, self.messenger, None)
        vk.vkDestroyInstance(self.instance, None)


@pytest.fixture(scope="module")
def host():
    h = Host()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def silent_validation(request):
    yield
    if "host" in request.fixturenames:
        h = request.getfixturevalue("host")
        found, h.messages[:] = list(h.messages), []
        assert not found, "validation layer reported:\n" + "\n".join(found)


def conv_graph(channels=3):
    """A small convolutional depth model: x (1, C, H, W) -> y (1, 1, H, W), MSE to depth."""
    g = vkml.Graph()
    x = g.input("x", (1, channels, H, W))
    depth = g.input("depth", (1, 1, H, W))
    h = g.conv2d(x, g.param("c1.weight", (4, channels, 3, 3), "uniform", 0.3),
                 g.param("c1.bias", (4,), "uniform", 0.3), padding=1).relu()
    y = g.conv2d(h, g.param("c2.weight", (1, 4, 1, 1), "uniform", 0.5),
                 g.param("c2.bias", (1,), "uniform", 0.5))
    return g, y, g.mse(y, depth)


def train(g, y, loss, dev):
    return vkml.compile(g, loss=loss, optimizer=vkml.SGD(lr=0.1), device=dev, outputs={"y": y})


def assert_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_buffers_in_and_out_equal_set_input_and_read_bit_for_bit(host, rng):
    g, y, loss = conv_graph()
    bound, plain = train(g, y, loss, host.vkml), train(g, y, loss, host.vkml)
    x_buf, x_mem = host.buffer(4 * 3 * H * W + 64, SRC)
    d_buf, d_mem = host.buffer(4 * H * W, SRC)
    y_buf, y_mem = host.buffer(4 * H * W, DST)
    bound.bind_input("x", host.describe_buffer(x_buf, 4 * 3 * H * W + 64, SRC), offset=64)
    bound.bind_input("depth", host.describe_buffer(d_buf, 4 * H * W, SRC))
    bound.bind_output("y", host.describe_buffer(y_buf, 4 * H * W, DST))
    for _ in range(3):  # the host writes a new frame into its buffers before each step
        x = rng.standard_normal((1, 3, H, W)).astype(np.float32)
        depth = rng.random((1, 1, H, W)).astype(np.float32)
        x_mem[64:] = x.reshape(-1).view(np.uint8)
        d_mem[:] = depth.reshape(-1).view(np.uint8)
        bound.step()
        plain.set_input("x", x)
        plain.set_input("depth", depth)
        plain.step()
        bound.wait()
        assert_bits(y_mem.view(np.float32).reshape(1, 1, H, W), plain.read("y"))
        assert_bits(bound.read("loss"), plain.read("loss"))
    for name, value in plain.params().items():
        assert_bits(bound.params()[name], value)
    bound.close()
    plain.close()


@pytest.mark.parametrize("format", ["rgba8_unorm", "rgba16_float"])
def test_images_in_and_out_equal_set_input_and_read_bit_for_bit(host, rng, format):
    """A colour image (alpha dropped, normalised) and an r32_float true depth in, the prediction
    out into an r32_float image the renderer samples; the frame is written by the host's
    commands in the same command buffer, right before session.record(cb)."""
    g, y, loss = conv_graph()
    bound, plain = train(g, y, loss, host.vkml), train(g, y, loss, host.vkml)
    usage = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT | vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT \
        | vk.VK_IMAGE_USAGE_SAMPLED_BIT
    colour = host.image(format, W + 3, H + 2, usage)  # the model reads an 8x8 region of it
    depth_image = host.image("r32_float", W, H, usage)
    prediction = host.image("r32_float", W, H, usage)
    host.upload(prediction, np.zeros((H, W), np.float32), W, H, SHADER_READ)
    bound.bind_input("x", host.describe_image(colour, format, W + 3, H + 2, usage),
                     region=(2, 1, W, H), mean=MEAN, std=STD)
    bound.bind_input("depth", host.describe_image(depth_image, "r32_float", W, H, usage))
    bound.bind_output("y", host.describe_image(prediction, "r32_float", W, H, usage))
    for _ in range(2):
        texels, x = colour_frame(rng, format)
        depth = rng.random((H, W)).astype(np.float32)

        def frame_commands(cb, texels=texels, depth=depth):
            host.upload_commands(cb, colour, texels, W + 3, H + 2, SHADER_READ)
            host.upload_commands(cb, depth_image, depth, W, H, SHADER_READ)
            bound.record(cb)  # the step right after the host's "render pass"

        host.run(frame_commands)
        plain.set_input("x", x)
        plain.set_input("depth", depth[None, None])
        plain.step()
        drawn = host.download(prediction, W, H, SHADER_READ)
        assert_bits(drawn.reshape(1, 1, H, W), plain.read("y"))
    for name, value in plain.params().items():
        assert_bits(bound.params()[name], value)
    bound.close()
    plain.close()


def colour_frame(rng, format):
    """Random RGBA texels of an (H + 2) x (W + 3) image in `format` (vkml's name) and the x
    (1, 3, H, W) that set_input gives for its region (2, 1, W, H) with MEAN and STD: the
    8-bit table's entries, or (v - mean) * (1 / std) in f32 as the kernel computes them."""
    if format == "rgba8_unorm":
        texels = rng.integers(0, 256, (H + 2, W + 3, 4), dtype=np.uint8)
        lut = table(format, (*MEAN, 0.0), (*STD, 1.0)).reshape(4, 256)
        x = np.stack([lut[c][texels[1:1 + H, 2:2 + W, c]] for c in range(3)])
    else:
        texels = rng.standard_normal((H + 2, W + 3, 4)).astype(np.float16)
        region = texels[1:1 + H, 2:2 + W, :3].astype(np.float32)
        x = ((region - np.float32(MEAN)) * (1 / np.float64(STD)).astype(np.float32))
        x = x.transpose(2, 0, 1)
    return texels, x[None].astype(np.float32)


def identity_session(dev, shape):
    """An inference session whose output is its input (relu of values >= 0): what the
    conversion made, read back."""
    g = vkml.Graph()
    x = g.input("x", shape)
    return vkml.compile(g, device=dev, outputs={"y": x.relu()})


def check_resize(dev, texels, source):
    """`source` (an RGBA8 image holding `texels`) bound with channels (2, 3) to inputs smaller
    and larger than it: torch's bilinear F.interpolate of the same channels."""
    torch = pytest.importorskip("torch")
    for out in [(6, 5), (24, 20)]:  # down and up
        s = identity_session(dev, (1, 2, *out))
        s.bind_input("x", source, channels=(2, 3))
        s.forward()
        picked = torch.tensor(texels[..., [2, 3]].transpose(2, 0, 1)[None] / 255.0)
        expected = torch.nn.functional.interpolate(picked, size=out, mode="bilinear",
                                                   align_corners=False).numpy()
        np.testing.assert_allclose(s.read("y"), expected, rtol=0, atol=1e-6)
        s.close()


def test_resize_and_channel_choice_match_torch_bilinear(host, rng):
    usage = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT | vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT
    source = host.image("rgba8_unorm", 13, 11, usage)
    texels = rng.integers(0, 256, (11, 13, 4), dtype=np.uint8)
    host.upload(source, texels, 13, 11, vk.VK_IMAGE_LAYOUT_GENERAL)
    check_resize(host.vkml, texels, host.describe_image(source, "rgba8_unorm", 13, 11, usage,
                                                        vk.VK_IMAGE_LAYOUT_GENERAL))


def test_a_picture_in_a_buffer_is_converted_as_an_image_is(host, rng):
    """RGBA8 texels in a host buffer (after 16 bytes of something else), declared with a
    format and extent: the same table, channel choice and layout as an image's."""
    texels = rng.integers(0, 256, (H, W, 4), dtype=np.uint8)
    buf, mem = host.buffer(16 + texels.nbytes, SRC)
    mem[16:] = texels.reshape(-1)
    s = identity_session(host.vkml, (1, 3, H, W))
    s.bind_input("x", vkml.HostBuffer(buf, host.device, 16 + texels.nbytes, SRC,
                                      "rgba8_unorm", (W, H)), offset=16, channels=(2, 1, 0),
                 mean=MEAN, std=STD)
    s.forward()
    lut = table("rgba8_unorm", (*MEAN, 0.0), (*STD, 1.0)).reshape(4, 256)
    expected = np.stack([lut[c][texels[..., c]] for c in (2, 1, 0)])[None]
    assert_bits(s.read("y"), np.maximum(expected, np.float32(0)))  # the session's relu
    with pytest.raises(vkml.InputError, match="region crops images"):
        s.bind_input("x", vkml.HostBuffer(buf, host.device, 16 + texels.nbytes, SRC,
                                          "rgba8_unorm", (W, H)), region=(0, 0, 4, 4))
    with pytest.raises(vkml.InputError, match="do not fit"):
        s.bind_input("x", vkml.HostBuffer(buf, host.device, 16 + texels.nbytes, SRC,
                                          "rgba8_unorm", (W, H + 1)))
    s.close()


def test_bound_inputs_skip_set_input_and_unbind_restores_it(host):
    s = identity_session(host.vkml, (2, 3))
    buf, mem = host.buffer(24, SRC)
    mem.view(np.float32)[:] = np.arange(6, dtype=np.float32)
    s.bind_input("x", host.describe_buffer(buf, 24, SRC))
    with pytest.raises(vkml.InputError, match="bound to the host's GPU memory.*unbind"):
        s.set_input("x", np.ones((2, 3), np.float32))
    s.forward()
    assert_bits(s.read("y"), np.arange(6, dtype=np.float32).reshape(2, 3))
    s.unbind("x")
    with pytest.raises(vkml.InputError, match="never set"):
        s.forward()
    s.set_input("x", np.full((2, 3), 5, np.float32))
    s.forward()
    assert (s.read("y") == 5).all()
    with pytest.raises(vkml.InputError, match="not bound"):
        s.unbind("x")
    s.close()


def test_a_step_waits_for_the_hosts_timeline_semaphore(host):
    """The host writes its buffer after the step was submitted, then signals from the host:
    the step waited for the signal and read what was written."""
    s = identity_session(host.vkml, (2, 3))
    buf, mem = host.buffer(24, SRC)
    s.bind_input("x", host.describe_buffer(buf, 24, SRC))
    kind = vk.VkSemaphoreTypeCreateInfo(sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
                                        semaphoreType=vk.VK_SEMAPHORE_TYPE_TIMELINE)
    semaphore = vk.vkCreateSemaphore(host.device, vk.VkSemaphoreCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, pNext=kind), None)
    with pytest.raises(vkml.InputError, match="value must be an int"):
        s.wait_for_host(semaphore, -1)
    s.wait_for_host(semaphore, 1)
    s.forward()
    done, value = s.done()
    time.sleep(0.2)
    assert vk.vkGetSemaphoreCounterValue(host.device, done) < value  # still waiting
    mem.view(np.float32)[:] = np.arange(6, dtype=np.float32) + 1
    vk.vkSignalSemaphore(host.device, vk.VkSemaphoreSignalInfo(
        sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_SIGNAL_INFO, semaphore=semaphore, value=1))
    assert_bits(s.read("y"), (np.arange(6, dtype=np.float32) + 1).reshape(2, 3))
    s.forward()  # once per step: the next one does not wait
    s.wait()
    s.close()
    vk.vkDestroySemaphore(host.device, semaphore, None)


def test_wrong_resources_are_refused_naming_the_input_and_the_fix(host):
    s = identity_session(host.vkml, (1, 3, H, W))
    nbytes = 4 * 3 * H * W
    buf, _ = host.buffer(nbytes, SRC | DST)
    usage = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT
    image = host.image("rgba8_unorm", W, H, usage | vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT)
    cases = [
        (lambda: s.bind_input("x", buf), "bind_input\\('x'\\).*vkml.HostBuffer"),
        (lambda: s.bind_input("nope", host.describe_buffer(buf, nbytes, SRC)),
         "unknown input.*'x'"),
        (lambda: s.bind_input("x", host.describe_buffer(buf, nbytes - 4, SRC)),
         "bind_input\\('x'\\).*do not fit in the .*-byte buffer"),
        (lambda: s.bind_input("x", host.describe_buffer(buf, nbytes, DST)),
         "lack TRANSFER_SRC.*VK_BUFFER_USAGE_TRANSFER_SRC_BIT"),
        (lambda: s.bind_input("x", host.describe_buffer(buf, 2 * nbytes, SRC)),
         "declared nbytes=.*smaller"),
        (lambda: s.bind_input("x", vkml.HostBuffer(buf, host.other_device, nbytes, SRC)),
         "another VkDevice"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba9", W, H, usage)),
         "format 'rgba9'.*rgba8_unorm"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba16_float", 4 * W, H, usage)),
         "declare the format and extent"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba8_unorm", W, H, DST)),
         "lack TRANSFER_SRC.*VK_IMAGE_USAGE_TRANSFER_SRC_BIT"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba8_unorm", W, H, usage, 0)),
         "layout 0"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba8_unorm", W, H, usage),
                              channels=(0, 1)), "channels \\[0, 1\\] must name 3"),
        (lambda: s.bind_input("x", host.describe_image(image, "rgba8_unorm", W, H, usage),
                              region=(4, 0, W, H)), "does not fit in the 8x8 image"),
        (lambda: s.bind_output("y", host.describe_image(image, "rgba8_unorm", W, H, usage)),
         "r32_float"),
    ]
    for call, message in cases:
        with pytest.raises(vkml.InputError, match=message):
            call()
    assert s.device.backend.live_objects()["host_resources"] == 0  # nothing kept from refusals
    s.close()


def test_a_vkml_owned_device_refuses_the_hosts_buffer_and_wgpu_its_vulkan_handles(device,
                                                                                   host):
    """On vkml's own Vulkan device the host's buffer is another device's; wgpu binds wgpu
    objects (tests/test_bind_wgpu.py), not Vulkan handles, and says so."""
    s = identity_session(device, (2, 3))
    buf, _ = host.buffer(24, SRC)
    message = "another VkDevice" if device.backend_name == "vulkan" else \
        "runs on wgpu.*a Vulkan handle.*not a wgpu.GPUBuffer"
    with pytest.raises(vkml.InputError, match=message):
        s.bind_input("x", host.describe_buffer(buf, 24, SRC))
    s.close()


def test_the_demo_renderer_frame_reaches_its_network_bit_for_bit(tmp_path):
    """tools/frame_latency.py: the demo's rendered RGBA8 frame bound to its depth network,
    the prediction into an r32_float image, against read-back + set_input + read."""
    import subprocess
    import sys

    from conftest import subprocess_env

    out = tmp_path / "latency.json"
    subprocess.run([sys.executable, "tools/frame_latency.py", "--frames", "2", "--resolution",
                    "32", "--out", str(out)], check=True, env=subprocess_env(),
                   cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["bit_identical"] is True
    assert result["validation_messages"] == []
    assert result["bound_path_ms"]["from_render_end"]["n"] == 2
