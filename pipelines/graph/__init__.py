"""A scenario compiled into a graph of stages keyed by content, the stage kinds and the plan's cost."""
