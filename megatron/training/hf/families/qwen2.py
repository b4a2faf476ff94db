"""Qwen2 (``Qwen2ForCausalLM``): Llama-shaped with q/k/v biases only; sliding windows and
multimodal rotary embeddings refused."""

from typing import Any, Dict

from megatron.training.hf.families.llama import LlamaShaped
from megatron.training.hf.family import ConfigReader


class Qwen2(LlamaShaped):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    settings_hint = "RMSNorm + swiglu + rope + --add-qkv-bias --disable-bias-linear (Qwen2)"

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        refuse_sliding_windows(c)
        c.expect("use_mrope", False, "false", default=False)
        return {"add_qkv_bias": True}


FAMILY = Qwen2()


def refuse_sliding_windows(c: ConfigReader) -> None:
    """``use_sliding_window`` must be false (and ``layer_types`` full attention)."""
    use_window = c.optional("use_sliding_window", False)
    c.require(
        use_window is False,
        "use_sliding_window",
        use_window,
        "false (sliding-window attention is not supported)",
    )
    c.seen("sliding_window", "max_window_layers")  # unused without use_sliding_window
    layer_types = c.optional("layer_types", None)
    c.require(
        layer_types is None or set(layer_types) <= {"full_attention"},
        "layer_types",
        layer_types,
        "full_attention for every layer",
    )
