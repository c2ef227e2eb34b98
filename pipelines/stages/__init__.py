"""The stage functions by kind (train, extract, entry, evaluate, adapt) and what they read and write."""
