"""Compatibility metrics over a matrix, 1:1 verification, training-free compatible features (PSP/LSP) and the Theorem 1 check."""
