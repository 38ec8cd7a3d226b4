from pretrain.model.gpt import GPT, LoopStep, ModelOutput
from pretrain.model.registry import MODEL_CLASSES, build_model

__all__ = ["GPT", "LoopStep", "ModelOutput", "MODEL_CLASSES", "build_model"]
