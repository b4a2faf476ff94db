"""Inference: the key/value cache contexts a generation loop hands to ``GPTModel.forward``
(megatron-core 0.16.1's ``megatron.core.inference``; the static context only)."""
