"""megapar: Megatron-style 3D-parallel (tensor x pipeline x data) GPT-2 pretraining."""

__version__ = "0.1.0"
