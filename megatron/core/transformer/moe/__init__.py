"""Mixture of experts (megatron-core 0.16.1's ``megatron.core.transformer.moe`` paths)."""
