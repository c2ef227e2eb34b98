"""Typed records that stages return and the store persists, and their payloads."""
