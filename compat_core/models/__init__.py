"""Backbones (``backbones``: the registry of torch-free backbone cards), the compatible model (``compat_model``:
backbone -> junction -> d-Simplex), precision helpers (``precision``) and weight loading (``weights``). Import names
from those modules; this package imports nothing, so code that only needs the backbone registry stays torch-free."""
