"""Exact cosine retrieval: the staged top-k kernel, its candidate stages, the pruned search, the linear-head bridge and mixed-version galleries."""
