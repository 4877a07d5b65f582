"""The WebGPU backend (wgpu-py: Metal on macOS; Vulkan, D3D12 or OpenGL elsewhere)."""
