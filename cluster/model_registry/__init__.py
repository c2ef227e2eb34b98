"""Registered model versions in MLflow: versions and aliases, the pyfunc flavour and the compatibility gate."""
