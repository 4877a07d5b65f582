"""The graphics pipeline both of the host's renderers build (the scene, xr_demo/renderer.py,
and the synthetic load, xr_demo/loadgen.py): a WGSL module's vs_main and fs_main drawing
triangle lists with dynamic rendering, no culling, one sample, colour written unblended."""

from __future__ import annotations

from typing import Any

import vulkan as vk


def create_pipeline(device: Any, module: Any, layout: Any, width: int, height: int,
                    rendering: Any, vertex: Any, colors: int, depth: Any = None) -> Any:
    """`rendering`: the VkPipelineRenderingCreateInfo (attachment formats); `vertex`: the
    vertex input state; `colors`: how many colour attachments; `depth`: a depth-stencil state,
    or None for none."""
    # Every nested struct in a variable that outlives the call (cffi lifetime trap).
    stages = [vk.VkPipelineShaderStageCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=stage,
        module=module, pName=entry)
        for stage, entry in ((vk.VK_SHADER_STAGE_VERTEX_BIT, "vs_main"),
                             (vk.VK_SHADER_STAGE_FRAGMENT_BIT, "fs_main"))]
    assembly = vk.VkPipelineInputAssemblyStateCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_INPUT_ASSEMBLY_STATE_CREATE_INFO,
        topology=vk.VK_PRIMITIVE_TOPOLOGY_TRIANGLE_LIST)
    viewport = vk.VkViewport(0, 0, width, height, 0, 1)
    scissor = vk.VkRect2D(vk.VkOffset2D(0, 0), vk.VkExtent2D(width, height))
    viewports = vk.VkPipelineViewportStateCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_VIEWPORT_STATE_CREATE_INFO, viewportCount=1,
        pViewports=[viewport], scissorCount=1, pScissors=[scissor])
    # No culling: the procedural meshes' windings are not all alike, and the cost is small.
    raster = vk.VkPipelineRasterizationStateCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_RASTERIZATION_STATE_CREATE_INFO,
        polygonMode=vk.VK_POLYGON_MODE_FILL, cullMode=vk.VK_CULL_MODE_NONE,
        frontFace=vk.VK_FRONT_FACE_COUNTER_CLOCKWISE, lineWidth=1.0)
    multisample = vk.VkPipelineMultisampleStateCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_MULTISAMPLE_STATE_CREATE_INFO,
        rasterizationSamples=vk.VK_SAMPLE_COUNT_1_BIT)
    attachments = [vk.VkPipelineColorBlendAttachmentState(colorWriteMask=0xF)
                   for _ in range(colors)]
    blend = vk.VkPipelineColorBlendStateCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_PIPELINE_COLOR_BLEND_STATE_CREATE_INFO,
        attachmentCount=colors, pAttachments=attachments)
    optional = {"pDepthStencilState": depth} if depth is not None else {}
    info = vk.VkGraphicsPipelineCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_GRAPHICS_PIPELINE_CREATE_INFO, pNext=rendering,
        stageCount=2, pStages=stages, pVertexInputState=vertex,
        pInputAssemblyState=assembly, pViewportState=viewports,
        pRasterizationState=raster, pMultisampleState=multisample,
        pColorBlendState=blend, layout=layout, renderPass=vk.VK_NULL_HANDLE, **optional)
    return vk.vkCreateGraphicsPipelines(device, vk.VK_NULL_HANDLE, 1, [info], None)[0]
