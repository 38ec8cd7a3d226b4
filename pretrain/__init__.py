"""GRT pretraining: models (plain PyTorch) and the DeepSpeed trainer."""
