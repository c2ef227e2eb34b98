"""A run's results: the matrix assembled from row records, its metrics, result files and protocol variants."""
