from .build import build_model, set_vocab
from .gpt2 import GPT2Model, Stage
from .virtual import VirtualStages

__all__ = ["GPT2Model", "Stage", "VirtualStages", "build_model", "set_vocab"]
