"""Unfused equivalents of megatron-core's fusion entry points."""
