"""What this machine offers and how fast it is: CPU/CUDA capabilities, measured calibration of precisions, and scoped torch settings."""
