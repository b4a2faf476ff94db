"""Record megatron-core 0.16.1's local-spec GPTModel state-dict keys and shapes.

Run with the interpreter that has the real megatron-core installed, outside this repository:

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \
        /work/main/tests/tools/record_gpt_state_dict_facts.py > mcore_gpt_state_dict.json

Output (JSON): {case name: {"config": {...}, "model": {...}, "state_dict": {key: shape}}},
one process, TP = PP = 1, CPU. ``tests/unit_tests/models/test_gpt_state_dict.py`` builds our
GPTModel with the same arguments and compares name for name.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

CASES = {
    "gpt2": dict(
        config=dict(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=4,
            ffn_hidden_size=40,
            normalization="LayerNorm",
            add_bias_linear=True,
        ),
        model=dict(
            vocab_size=64,
            max_sequence_length=32,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
        ),
        spec=dict(normalization="LayerNorm"),
    ),
    "gpt2-untied": dict(
        config=dict(num_layers=2, hidden_size=16, num_attention_heads=4),
        model=dict(vocab_size=64, max_sequence_length=32),
        spec=dict(),
    ),
    "llama": dict(
        config=dict(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=24,
            normalization="RMSNorm",
            gated_linear_unit=True,
            add_bias_linear=False,
        ),
        model=dict(
            vocab_size=64,
            max_sequence_length=32,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        ),
        spec=dict(normalization="RMSNorm"),
    ),
    "qkv-bias": dict(
        config=dict(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=4,
            num_query_groups=1,
            add_bias_linear=False,
            add_qkv_bias=True,
            normalization="RMSNorm",
        ),
        model=dict(vocab_size=64, max_sequence_length=32, position_embedding_type="rope"),
        spec=dict(normalization="RMSNorm"),
    ),
}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    facts = {}
    for name, case in CASES.items():
        config = TransformerConfig(use_cpu_initialization=True, **case["config"])
        if config.gated_linear_unit:
            config.activation_func = torch.nn.functional.silu
        model = GPTModel(config, get_gpt_layer_local_spec(**case["spec"]), **case["model"])
        facts[name] = {
            "config": case["config"],
            "model": case["model"],
            "spec": case["spec"],
            "state_dict": {
                k: list(v.shape)
                for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor)
            },
            "non_tensor_keys": sorted(
                k for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)
            ),
            "parameters": [n for n, _ in model.named_parameters()],
        }
    json.dump(facts, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
