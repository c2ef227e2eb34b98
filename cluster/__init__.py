"""How stages run and where things live: Ray (``ray/``, ``executors/``), object storage and Parquet shards
(``storage/``), MLflow tracking (``tracking/``) and its model registry with the upgrade gate (``model_registry/``),
Tune/Optuna searches (``tune/``) and the search service on Ray Serve (``serving/``).
"""
