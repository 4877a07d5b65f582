"""Front ends: models made elsewhere -> a vkml Graph (nothing else; compiling is vkml.compile's).

    imp = vkml.import_onnx("model.onnx", shapes={"pixel_values": (1, 3, 224, 224)})
    imp = vkml.import_torch(module, args=(x,))
    imp.graph, imp.inputs, imp.outputs          # a Graph, {name: Tensor}, {name: Tensor}

`onnx.py` reads ONNX files (the optional `onnx` package, imported only there), `torch_export.py`
PyTorch programs through torch.export (PyTorch is imported only there), `patterns.py` turns the
primitive spellings of LayerNorm, GELU, attention, RMSNorm and gated MLPs back into vkml's own
ops, `common.py` holds the result type and the collection of refusals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vkml.importers.common import ImportedModel


def import_onnx(model: Any, shapes: Mapping[str, Sequence[int]] | None = None,
                training: bool = False, seed: int = 0) -> ImportedModel:
    """An ONNX model (path, bytes or onnx.ModelProto) as a vkml graph (importers/onnx.py)."""
    from vkml.importers import onnx
    return onnx.import_onnx(model, shapes=shapes, training=training, seed=seed)


def import_torch(module: Any, args: tuple = (), kwargs: dict | None = None,
                 training: bool = False, seed: int = 0) -> ImportedModel:
    """A torch.nn.Module, through torch.export, as a vkml graph (importers/torch_export.py)."""
    from vkml.importers import torch_export
    return torch_export.import_torch(module, args, kwargs, training=training, seed=seed)


__all__ = ["ImportedModel", "import_onnx", "import_torch"]
