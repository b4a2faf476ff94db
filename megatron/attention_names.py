"""Names of the attention settings, without torch: shared by ``megatron.core`` and the trainer.

``megatron.core`` imports torch; the trainer's argument parsing does not. The names both accept
live here, once: ``TransformerConfig`` checks against them, the trainer's flags offer them, and
the CP attention registry (``megatron.core.transformer.cp_attention.registry``) asserts that it
implements exactly ``CP_COMM_TYPES``.
"""

# megatron-core's cp_comm_type values, in the registry's order ("all_gather" is the default).
CP_COMM_TYPES = ("all_gather", "p2p", "a2a", "a2a+p2p")
