"""qerl: GRPO/DAPO reinforcement learning on frozen NVFP4 weights with LoRA and Adaptive Quantization Noise."""

__version__ = "0.1.0"
