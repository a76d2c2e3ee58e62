"""Sequences, scheduling, KV caches, sampling and the model runner."""
