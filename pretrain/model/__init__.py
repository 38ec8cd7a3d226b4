from pretrain.model.gpt import GPT, LoopStep, ModelOutput
from pretrain.model.registry import build_model, model_class

__all__ = ["GPT", "LoopStep", "ModelOutput", "build_model", "model_class"]
