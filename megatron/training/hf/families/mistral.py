"""Mistral (``MistralForCausalLM``): Llama-shaped, with optional sliding-window attention."""

from typing import Any, Dict

from megatron.training.hf.families.llama import LlamaShaped
from megatron.training.hf.family import ConfigReader, HFArchitecture


class Mistral(LlamaShaped):
    """``sliding_window`` W: a query sees itself and the W - 1 keys before it."""

    model_type = "mistral"
    architecture = "MistralForCausalLM"

    def read_extra(self, c: ConfigReader) -> Dict[str, Any]:
        return read_sliding_window(c)

    def write_extra(self, arch: HFArchitecture) -> Dict[str, Any]:
        return write_sliding_window(arch)


FAMILY = Mistral()


def read_sliding_window(c: ConfigReader) -> Dict[str, Any]:
    """``window_size`` from ``sliding_window`` W (null: none): the query and W - 1 keys
    before it."""
    window = c.optional("sliding_window", None)
    c.require(
        window is None or (isinstance(window, int) and window >= 1),
        "sliding_window",
        window,
        "null or a positive integer",
    )
    return {"window_size": None if window is None else (window - 1, 0)}


def write_sliding_window(arch: HFArchitecture) -> Dict[str, Any]:
    """``sliding_window`` of ``arch.window_size`` (null without a window)."""
    window = arch.window_size
    return {"sliding_window": None if window is None else window[0] + 1}
