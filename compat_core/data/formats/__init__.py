"""Readers of the published on-disk dataset formats; each module registers its datasets in ``DATASETS`` on import."""
