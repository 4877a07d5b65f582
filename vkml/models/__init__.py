"""Reference models, each a builder of graph nodes whose parameter names match PyTorch's.

`mlp` builds an MLP's logits; the workloads of tools/PROTOCOL.md each have a module with a config
dataclass (the full published config by default), `tiny()` (the same code at test size) and
`build(cfg)` -> `Built` (graph, inputs, outputs, loss, `sample_inputs(rng)`): `smollm2`,
`resnet`, `unet`, `whisper_encoder`, `smolvla_expert`. `dinov2` is a backbone (DINOv2's ViT
encoder, Hugging Face's names) for a head to be built on, as xr_demo/ does.
"""

from vkml.models import dinov2, resnet, smollm2, smolvla_expert, unet, whisper_encoder
from vkml.models.common import Built
from vkml.models.mlp import mlp

__all__ = ["Built", "dinov2", "mlp", "resnet", "smollm2", "smolvla_expert", "unet",
           "whisper_encoder"]
