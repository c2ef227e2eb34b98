"""The engine that runs a stage graph on a backend, its progress events and per-process memory hygiene."""
