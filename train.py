"""Train a LoRA adapter on a frozen NVFP4 model with GRPO/DAPO: ``python train.py fit --config configs/smoke.yaml``."""

from qerl.cli import main

if __name__ == "__main__":
    main()
