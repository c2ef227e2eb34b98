"""Hyper-parameter search over whole pipelines with Ray Tune and Optuna."""
