"""The remote proxy (DxPU_PROXY in the GPU box): serves the box's devices over the link."""
