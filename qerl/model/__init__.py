"""The policy: a transformers causal LM whose frozen base is NVFP4 (or bf16) with LoRA on top (``policy``), loaded
from HF or compressed-tensors directories (``checkpoint_io``), a mixture of experts' routed experts (``experts``) and
their routing recorded or replayed (``routing``), the Adaptive Quantization Noise put on its norms during rollouts
(``aqn``), and the GPU memory it keeps resident, counted from its config before it loads (``footprint``)."""
