from .build import build_model, set_vocab
from .gpt2 import GPT2Model, Stage

__all__ = ["GPT2Model", "Stage", "build_model", "set_vocab"]
