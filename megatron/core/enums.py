"""Enumerations shared with megatron-core."""

import enum


class ModelType(enum.Enum):
    """Model type; only decoder-style (``encoder_or_decoder``) models exist in 0.16.1."""

    encoder_or_decoder = 1

    @property
    def encoder_and_decoder(self):
        """Removed in megatron-core 0.16: say so instead of pretending to support it."""
        raise ValueError(
            "ModelType.encoder_and_decoder is deprecated. Please use "
            "ModelType.encoder_or_decoder instead."
        )
