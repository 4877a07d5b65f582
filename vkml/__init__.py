"""vkml: train and run neural networks on any Vulkan GPU, inside your render loop.

    g = vkml.Graph(); x = g.input("x", (32, 784)); ...
    model = vkml.compile(g, loss=loss, optimizer=vkml.Adam(lr=1e-3))
    model.set_input("x", xb); model.step(); model.read("loss")
"""

from vkml import nn, ops  # noqa: F401  (ops: every op registers itself and its Graph method)
from vkml.errors import (
    CheckpointError,
    DeviceError,
    GraphError,
    InputError,
    ModelImportError,
    NagaError,
    NonFiniteError,
    NotComputedError,
    VkmlError,
)
from vkml.graph import Graph, Tensor
from vkml.importers import ImportedModel, import_onnx, import_torch
from vkml.optim import SGD, Adam, AdamW, Optimizer
from vkml.runtime.device import Device
from vkml.runtime.frames import HostBuffer, HostImage
from vkml.session import ChunkSubmission, Session, compile

__all__ = ["Graph", "Tensor", "compile", "Session", "ChunkSubmission", "Device", "SGD", "Adam",
           "AdamW", "Optimizer", "nn", "VkmlError", "GraphError", "InputError", "NotComputedError",
           "NonFiniteError", "CheckpointError", "NagaError", "DeviceError", "ModelImportError",
           "ImportedModel", "import_onnx", "import_torch", "HostBuffer", "HostImage"]
