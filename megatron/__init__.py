"""Megatron-style training core whose gradients do not depend on the parallel layout."""
