"""Multi-token prediction weights in DeepSeek-V3's HuggingFace layout, for a family whose
checkpoints carry them (``num_nextn_predict_layers``; the DeepSeek family calls these).

DeepSeek-V3 stores MTP depth k (0-based) as decoder layer L = ``num_hidden_layers`` + k;
under ``model.layers.<L>.`` (ours under ``mtp.layers.<k>.``, megatron-core 0.16.1's names):

- ``enorm.weight``, ``hnorm.weight``: ``enorm.weight``, ``hnorm.weight``;
- ``eh_proj.weight`` [h, 2h] (its input is [enorm(e); hnorm(h)]): ``eh_proj.weight``;
- ``shared_head.norm.weight``: ``final_layernorm.weight``;
- ``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``:
  ``transformer_layer.*`` (the family's table of decoder layer L);
- ``embed_tokens.weight``, ``shared_head.head.weight``: copies of the word embeddings and
  the output layer (written on export, checked equal on import).

The export and the import use these tables through the model's whole table
(``weights.parameter_sources``, ``weights.check_checkpoint_tensors``,
``checkpoint._export_into``).
"""

from typing import Callable, Dict

from megatron.training.hf.family import HFArchitecture, Segment, Source

# (HuggingFace name under model.layers.<L>., our name under mtp.layers.<k>.)
_OWN = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("shared_head.norm.weight", "final_layernorm.weight"),
)


def mtp_layer_index(arch: HFArchitecture, depth: int) -> int:
    """The HuggingFace decoder layer that holds MTP depth ``depth`` (0-based)."""
    return arch.num_layers + depth


def mtp_sources(
    arch: HFArchitecture,
    mtp_num_layers: int,
    layer_sources: Callable[[int], Dict[str, Source]],
    prefix: str = "model.",
) -> Dict[str, Source]:
    """{our one-chunk name: its HuggingFace segments} of every MTP depth. ``layer_sources(L)``
    is the family's table of decoder layer L (names ``decoder.layers.<L>.*``), renamed here
    to ``mtp.layers.<k>.transformer_layer.*``."""
    table: Dict[str, Source] = {}
    h = arch.hidden_size
    for depth in range(mtp_num_layers):
        layer = mtp_layer_index(arch, depth)
        hf, ours = f"{prefix}layers.{layer}.", f"mtp.layers.{depth}."
        for hf_name, our_name in _OWN:
            table[ours + our_name] = (Segment(hf + hf_name, 0, h),)
        inner = f"decoder.layers.{layer}."
        for name, source in layer_sources(layer).items():
            if not name.startswith(inner):
                raise ValueError(f"mtp_sources: layer {layer}'s table names {name!r}")
            table[ours + "transformer_layer." + name[len(inner) :]] = source
    return table


def mtp_copies(arch: HFArchitecture, mtp_num_layers: int, prefix: str = "model.") -> Dict[str, str]:
    """{HuggingFace key: our parameter it copies} of the shared tensors each MTP layer
    repeats (the embeddings and the output head; a tied head is the word embeddings)."""
    head = "embedding.word_embeddings.weight" if arch.tied else "output_layer.weight"
    copies = {}
    for depth in range(mtp_num_layers):
        hf = f"{prefix}layers.{mtp_layer_index(arch, depth)}."
        copies[hf + "embed_tokens.weight"] = "embedding.word_embeddings.weight"
        copies[hf + "shared_head.head.weight"] = head
    return copies
