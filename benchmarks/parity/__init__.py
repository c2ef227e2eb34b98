"""Parts of ``benchmarks/reference_parity.py`` (parity with the public IAM-CL2R code), importable by the tests.

``cifar_pool``: a small pool in CIFAR-100's and CIFAR-10's python formats that both codes read; ``weight_layout``:
our model's state dict in the public code's key layout; ``plan``: the class order, memory and batch order replayed
into both codes; ``traces``: the per-step comparison and its table. ``reference_driver.py`` runs inside the user's
clone's Python and imports only the clone, torch and numpy.
"""
