"""Scenario configuration: the schema, loading with overrides, validation, local paths and the preflight of inputs."""
