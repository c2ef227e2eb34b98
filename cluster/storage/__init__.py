"""Object storage: S3 settings and filesystem, conditional writes, and dataset ingestion into Parquet shards."""
