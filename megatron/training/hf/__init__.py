"""HuggingFace checkpoints in and out (docs/huggingface.md).

``model_from_hf(path)`` builds our GPT (this rank's shard at a parallel layout) from a
HuggingFace model directory (``config.json`` + safetensors); ``python -m
megatron.training.hf import|export`` converts to and from ``dist_checkpointing``
checkpoints. Llama, Mistral, Qwen2, Qwen3 and GPT-2 decoders and the mixtures of experts
Mixtral, Qwen2-MoE and Qwen3-MoE; anything we cannot express is refused
by name. Needs ``safetensors`` (the ``hf`` extra), never ``transformers``. The model-building
names are imported on first use, so reading a config (``megatron.training.hf.config``, as the
launcher does) needs no torch.
"""

from megatron.training.hf.config import HFArchitecture, architecture_from_config, read_hf_config

__all__ = [
    "model_from_hf",
    "load_hf_weights",
    "read_hf_config",
    "architecture_from_config",
    "HFArchitecture",
]


def __getattr__(name: str):
    if name in ("model_from_hf", "load_hf_weights"):
        from megatron.training.hf import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'megatron.training.hf' has no attribute {name!r}")
