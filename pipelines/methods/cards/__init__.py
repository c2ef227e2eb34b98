"""Method cards: one torch-free module per method family, each registering its MethodCard(s) on import."""
