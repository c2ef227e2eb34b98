"""Scenarios as graphs of stages: validated configs (``config/``), the compiled graph and its content keys
(``graph/``), the engine that runs it on any backend (``engine/``), the stage functions and their typed inputs
(``stages/``), the shared training loop (``training/``), methods (``methods/``), typed records (``records/``), the run
store (``store/``), results and reports (``results/``, ``reports/``). Never imports ``cluster`` (tests/test_core_purity.py).
"""
