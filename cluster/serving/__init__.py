"""The compatible search service: a gallery index of Parquet shards (``index_store``), the models it serves from the
MLflow registry (``models``), the Ray Serve application (``app``) and background backfilling (``backfill``)."""
