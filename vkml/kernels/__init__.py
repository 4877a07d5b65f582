"""WGSL generators, one module per kernel archetype: each turns a dispatch (a node, or an
optimizer update) into a `vkml.hal.Kernel` specialised to its shapes and the device. Shapes are
baked in as constants, so every kernel is straight-line code the driver can optimise and naga
never has to unroll anything. compiler/codegen.py chooses the generator."""
