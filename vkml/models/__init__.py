"""Reference models, each a builder of graph nodes whose parameter names match PyTorch's.

`mlp` builds an MLP's logits; the workloads of tools/PROTOCOL.md each have a module with a config
dataclass (the full published config by default), `tiny()` (the same code at test size) and
`build(cfg)` -> `Built` (graph, inputs, outputs, loss, `sample_inputs(rng)`): `smollm2`,
`resnet`, `unet`, `whisper_encoder`, `smolvla_expert`.
"""

from vkml.models import resnet, smollm2, smolvla_expert, unet, whisper_encoder
from vkml.models.common import Built
from vkml.models.mlp import mlp

__all__ = ["Built", "mlp", "resnet", "smollm2", "smolvla_expert", "unet", "whisper_encoder"]
