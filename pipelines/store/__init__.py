"""Where a run's artifacts live: the run store, its one-writer lease and the store of shared third-party models."""
