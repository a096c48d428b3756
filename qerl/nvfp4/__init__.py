"""NVFP4: the weight format (``format``), the frozen Linear on it (``linear``), its checkpoints (``checkpoint``) and
its GPU kernels (``kernels``). The ground floor of qerl: nothing here imports the rest of the package."""
