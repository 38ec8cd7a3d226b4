from pretrain.model.gpt import GPT, LoopStep, ModelOutput, build_model

__all__ = ["GPT", "LoopStep", "ModelOutput", "build_model"]
