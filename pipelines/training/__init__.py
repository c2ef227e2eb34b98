"""The training loop shared by every method: the trainer, model selection, task data, precision, checkpoints,
data-parallel ranks and loop state."""
