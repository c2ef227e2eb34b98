"""Model upgrades without re-indexing: adapters between embedding spaces and the order of partial backfilling."""
