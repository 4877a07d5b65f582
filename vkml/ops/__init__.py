"""The ops, one family a module. Each op is defined in one place: `register(OpDef(...))` gives its
shape rule, its gradient (built from other ops) and its lowering (an expression for pointwise ops,
else the kernel generator that computes it), and `@builder` right beside it makes the Graph (and
Tensor) method that builds it. Adding an op touches its family's module and its test, and
`python tools/graph_stub.py` regenerates vkml/graph.pyi for its method.

`composite.py` holds what is built from other ops (losses, norms, attention, pooling, ...), so it
differentiates and fuses for free; `fused.py` the ops only the rewrite stage makes.
"""

from vkml.ops import (  # noqa: F401  (each family registers its ops on import)
    attention,
    composite,
    conv,
    fused,
    indexing,
    layout,
    linalg,
    pointwise,
    reduce,
    source,
)
