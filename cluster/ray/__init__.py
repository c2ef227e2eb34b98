"""The engine's Ray backend and everything that talks to a Ray cluster: tasks, Ray Train stages, jobs, heads and auth."""
