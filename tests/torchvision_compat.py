"""torchvision beside a CPU build of torch.

PyPI's torchvision is built against PyPI's CUDA torch. Beside a CPU torch (the development
machines' and CI's), its compiled extension cannot load, and the import then fails while it
registers shapes for `torchvision::nms`, taking down every later import that looks for
torchvision (transformers does). The models never call those ops, so their schemas are declared
(without kernels) and the import retried: model code, which is plain PyTorch, works.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

_DECLARED: list = []  # the torch.library.Library that declares the schemas must stay alive


def import_torchvision() -> ModuleType:
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        import torch
        for module in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[module]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(lib)
        import torchvision
    return torchvision


def usable() -> bool:
    """Whether torchvision is installed (and then importable, through the declaration above)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    import_torchvision()
    return True
