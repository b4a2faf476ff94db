"""Record megatron-core 0.16.1's ``GPTModel.sharded_state_dict`` storage keys for every local
layer kind: dense, MoE, MLA dense, MLA MoE and the MTP depth (the last layer's kind).

Run with the interpreter that has the real megatron-core installed, outside this repository:

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \
        /work/main/tests/tools/record_gpt_sharded_keys_facts.py > mcore_gpt_sharded_keys.json

Output (JSON): {case name: {"config": {...}, "tensors": {state-dict key: [storage key, global
shape, global offset]}, "factories": {state-dict key: storage key} (the gated fc1's),
"objects": [unique keys of the ShardedObjects]}}; one process, CPU.
Each case: a dense layer then a MoE layer (``moe_layer_freq`` [0, 1]) and one MoE MTP depth,
built from megatron-core's ``get_gpt_decoder_block_spec`` / ``get_gpt_mtp_block_spec``
(``use_transformer_engine=False``). The MLA case is built by
``tests/unit_tests/dist_checkpointing/scripts/mcore_deepseek_save.py`` (its shims let the
local MLA build without Transformer Engine).
``tests/unit_tests/dist_checkpointing/test_mcore_storage_keys.py`` builds ours and compares.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parents[1] / "unit_tests" / "dist_checkpointing" / "scripts"
MOE = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=24,
    normalization="RMSNorm",
    add_bias_linear=False,
    gated_linear_unit=True,
    num_moe_experts=4,
    moe_layer_freq=[0, 1],
    moe_ffn_hidden_size=8,
    moe_shared_expert_intermediate_size=8,
    moe_router_topk=2,
    mtp_num_layers=1,
    vocab_size=64,
    seq_length=8,
)
MLA = dict(
    MOE,
    q_lora_rank=8,
    kv_lora_rank=6,
    qk_head_dim=4,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    qk_layernorm=True,
    params_dtype="float32",
)
CASES = {"moe": MOE, "mla-moe": MLA}


def build_plain(fields: dict):
    """The non-MLA case: megatron-core's local decoder and MTP block specs."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import TransformerConfig

    fields = dict(fields)
    vocab, seq = fields.pop("vocab_size"), fields.pop("seq_length")
    config = TransformerConfig(
        **fields, activation_func=torch.nn.functional.silu, use_cpu_initialization=True
    )
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    return GPTModel(config, block, vocab, seq, position_embedding_type="rope", mtp_block_spec=mtp)


def describe(model) -> dict:
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    pieces, _ = extract_sharded_base(model.sharded_state_dict())
    tensors, factories, objects = {}, {}, []
    for name, piece in sorted(pieces.items()):
        if isinstance(piece, ShardedTensor):
            tensors[name] = [piece.key, list(piece.global_shape), list(piece.global_offset)]
        elif isinstance(piece, ShardedTensorFactory):
            factories[name] = piece.key
        elif isinstance(piece, ShardedObject):
            objects.append(piece.unique_key)
    return {"tensors": tensors, "factories": factories, "objects": sorted(objects)}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29535")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, str(SCRIPTS))
    import mcore_deepseek_save

    mcore_deepseek_save.apply_shims(cpu=True)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    facts = {}
    for name, fields in CASES.items():
        torch.manual_seed(0)
        if "q_lora_rank" in fields:
            model = mcore_deepseek_save.build(fields, 1, 1)[0]
        else:
            model = build_plain(fields)
        facts[name] = {"config": fields, **describe(model)}
    json.dump(facts, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
