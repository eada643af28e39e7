"""Tensor parallelism: the group a model shard runs in and its collectives."""
