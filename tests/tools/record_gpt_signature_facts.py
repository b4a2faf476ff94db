"""Record the signatures of megatron-core 0.16.1's GPT-building modules (layer specs, the
transformer layer and block, attention, MLP, norms, embeddings, GPTModel) into
``tests/unit_tests/data/mcore_gpt_signatures.json`` (checked by
``tests/unit_tests/models/test_gpt_signatures.py``).

Run with the real megatron-core, outside the repository so that ``import megatron`` finds it:

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \\
        /path/to/repo/tests/tools/record_gpt_signature_facts.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from record_mcore_facts import record_signature

OUT = Path(__file__).resolve().parents[1] / "unit_tests" / "data" / "mcore_gpt_signatures.json"

_T = "megatron.core.transformer"
_E = "megatron.core.models.common.embeddings"
TARGETS = [
    (f"{_T}.spec_utils", "build_module"),
    (f"{_T}.spec_utils", "import_module"),
    (f"{_T}.spec_utils", "get_module"),
    (f"{_T}.spec_utils", "ModuleSpec.__init__"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.__init__"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.forward"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.set_input_tensor"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.shared_embedding_or_output_weight"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.compute_language_model_loss"),
    (f"{_T}.transformer_layer", "TransformerLayer.__init__"),
    (f"{_T}.transformer_layer", "TransformerLayerSubmodules.__init__"),
    (f"{_T}.transformer_layer", "get_transformer_layer_offset"),
    (f"{_T}.transformer_block", "TransformerBlock.__init__"),
    (f"{_T}.transformer_block", "TransformerBlock.forward"),
    (f"{_T}.transformer_block", "TransformerBlock.set_input_tensor"),
    (f"{_T}.transformer_block", "TransformerBlockSubmodules.__init__"),
    (f"{_T}.transformer_block", "get_num_layers_to_build"),
    (f"{_T}.attention", "SelfAttention.__init__"),
    (f"{_T}.attention", "SelfAttention.forward"),
    (f"{_T}.attention", "SelfAttentionSubmodules.__init__"),
    (f"{_T}.dot_product_attention", "DotProductAttention.__init__"),
    (f"{_T}.dot_product_attention", "DotProductAttention.forward"),
    (f"{_T}.mlp", "MLP.__init__"),
    (f"{_T}.mlp", "MLP.forward"),
    (f"{_T}.mlp", "MLPSubmodules.__init__"),
    (f"{_T}.torch_norm", "WrappedTorchNorm.__new__"),
    (f"{_T}.module", "MegatronModule.__init__"),
    ("megatron.core.fusions.fused_bias_dropout", "get_bias_dropout_add"),
    (f"{_E}.language_model_embedding", "LanguageModelEmbedding.__init__"),
    (f"{_E}.language_model_embedding", "LanguageModelEmbedding.forward"),
    (f"{_E}.rotary_pos_embedding", "RotaryEmbedding.__init__"),
    (f"{_E}.rotary_pos_embedding", "RotaryEmbedding.forward"),
    (f"{_E}.rope_utils", "apply_rotary_pos_emb"),
]


def main() -> None:
    import megatron.core

    warnings.simplefilter("ignore")
    facts = {
        "meta": {"megatron_core_version": megatron.core.__version__},
        "signatures": {f"{m}.{q}": record_signature(m, q) for m, q in TARGETS},
    }
    OUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {len(facts['signatures'])} signatures")


if __name__ == "__main__":
    main()
