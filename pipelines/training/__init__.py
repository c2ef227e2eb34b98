"""The training loop shared by every method: task data, precision, checkpoints, data-parallel ranks and loop state."""
