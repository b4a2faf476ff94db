"""megatron-core's ``megatron.core.extensions``: optional back ends (none provided here)."""
