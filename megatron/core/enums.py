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


class Fp8Recipe(str, enum.Enum):
    """megatron-core's FP8 recipe names (``TransformerConfig.fp8_recipe``); this core
    implements ``tensorwise`` (``megatron.core.fp8``)."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """megatron-core's FP4 recipe names (FP4 is not implemented)."""

    nvfp4 = "nvfp4"
    custom = "custom"
