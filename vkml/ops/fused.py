"""Fused ops, made only by the rewrite stage (vkml/compiler/rewrite.py) after autodiff (so they
need no gradient rule).

- fused_pointwise: a DAG of pointwise ops as one `Body` (attrs "body").
- fused_matmul: matmul whose result passes through an epilogue `Body` before it is stored;
  inputs (a, b, *epilogue inputs); in the epilogue x0 is the accumulator, x1... the extra inputs.
- fused_conv2d, fused_conv2d_input_grad: the same for a convolution and its input gradient;
  inputs (x or the output gradient, weight, *epilogue inputs).
- fused_sum: a sum whose summand is a prologue `Body` over inputs[:n_prologue] (all read at the
  summed tensor's own index) and whose result passes through an epilogue `Body` (x0 = the sum,
  x1... = inputs[n_prologue:]).
The result's shape and dtype are stored in attrs, as the rewrite already knows them. Each names
its plain op (`unfused`), whose OpDef names it back (`fused`).
"""

from __future__ import annotations

from vkml.graph import OpDef, register
from vkml.kernels import conv, conv_cpu, matmul, reduce
from vkml.ops.conv import by_device, channels_last, stores_channels_last


def _stored(inputs, attrs):
    return attrs["shape"], attrs["dtype"]


def _fused(name: str, unfused: str, fusion: str = "product", **rules) -> None:
    register(OpDef(name, _stored, "kernel", fusion=fusion, fused=name,  # type: ignore[arg-type]
                   unfused=unfused, **rules))


register(OpDef("fused_pointwise", _stored, "pointwise",
               expr=lambda node: node.attrs["body"].result))
_fused("fused_matmul", "matmul", lower=matmul.generate, splits=matmul.splits,
       scaled=matmul.scaled)
_fused("fused_sum", "sum", fusion="sum", lower=reduce.generate_fused_sum,
       stores=stores_channels_last)
_fused("fused_conv2d", "conv2d", layouts=channels_last, stores=stores_channels_last,
       **by_device(conv.generate_conv2d, conv_cpu.generate_conv2d, conv.dims_conv2d))
_fused("fused_conv2d_input_grad", "conv2d_input_grad",
       **by_device(conv.generate_conv2d_input_grad, conv_cpu.generate_conv2d_input_grad,
                   conv.dims_conv2d_input_grad, conv.phase_taps))
