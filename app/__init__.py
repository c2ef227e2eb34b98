"""The application layer: the ``compat`` command line (``app.cli``, one module per sub-command in ``app.commands``).

It sits above ``pipelines`` (scenarios, configs, stages, the engine) and ``cluster`` (Ray, S3, MLflow, Tune, jobs)
and is the only layer that imports both; ``pipelines`` never imports ``cluster`` (tests/test_core_purity.py).
"""
