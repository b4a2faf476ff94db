"""Record megatron-core 0.16.1's checkpointing API signatures (dist_checkpointing, the
sharded-state-dict helpers, the GPT and optimizer methods) into
``tests/unit_tests/data/mcore_facts_checkpointing.json``, in the format of
``record_mcore_facts.py`` (whose recorders it reuses)::

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python REPO/tests/tools/record_checkpoint_facts.py

Only names, parameter kinds and default reprs are recorded.
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_mcore_facts import record_enum, record_signature, to_json  # noqa: E402

OUTPUT = (
    Path(__file__).resolve().parents[2] / "tests/unit_tests/data/mcore_facts_checkpointing.json"
)

_DC = "megatron.core.dist_checkpointing"
TARGETS = (
    [
        (_DC, "save"),
        (_DC, "load"),
        (_DC, "load_common_state_dict"),
        (_DC, "load_tensors_metadata"),
        (_DC, "load_plain_tensors"),
        (_DC, "load_content_metadata"),
        (_DC, "check_is_distributed_checkpoint"),
        (_DC, "ShardedTensor.from_rank_offsets"),
        (_DC, "ShardedTensor.__init__"),
        (_DC, "ShardedObject.__init__"),
        (_DC, "LocalNonpersistentObject.__init__"),
        (f"{_DC}.mapping", "ShardedTensorFactory.__init__"),
        (f"{_DC}.mapping", "is_main_replica"),
        (f"{_DC}.mapping", "apply_factories"),
        (f"{_DC}.mapping", "apply_factory_merges"),
        (f"{_DC}.validation", "parse_strict_flag"),
        (f"{_DC}.optimizer", "get_param_id_to_sharded_param_map"),
        (f"{_DC}.optimizer", "optim_state_to_sharding_state"),
        (f"{_DC}.optimizer", "make_sharded_optimizer_tensor"),
        (f"{_DC}.dict_utils", "extract_matching_values"),
        (f"{_DC}.dict_utils", "dict_list_map_inplace"),
        (f"{_DC}.dict_utils", "dict_list_map_outplace"),
        (f"{_DC}.dict_utils", "merge"),
        (f"{_DC}.dict_utils", "nested_values"),
        (f"{_DC}.dict_utils", "diff"),
    ]
    + [
        (f"{_DC}.utils", name)
        for name in (
            "extract_sharded_tensors",
            "extract_sharded_tensors_and_factories",
            "extract_sharded_tensors_or_nonpersistent",
            "extract_sharded_base",
            "extract_nonpersistent",
            "add_prefix_for_sharding",
            "replace_prefix_for_sharding",
            "apply_prefix_mapping",
        )
    ]
    + [
        ("megatron.core.transformer.utils", "make_sharded_tensors_for_checkpoint"),
        ("megatron.core.transformer.utils", "sharded_state_dict_default"),
        ("megatron.core.transformer.utils", "make_sharded_object_for_checkpoint"),
        ("megatron.core.transformer.utils", "ensure_metadata_has_dp_cp_group"),
        ("megatron.core.transformer.module", "MegatronModule.sharded_state_dict"),
        ("megatron.core.transformer.transformer_block", "TransformerBlock.sharded_state_dict"),
        ("megatron.core.transformer.transformer_layer", "TransformerLayer.sharded_state_dict"),
        ("megatron.core.models.gpt.gpt_model", "GPTModel.sharded_state_dict"),
        ("megatron.core.optimizer.optimizer", "FP32Optimizer.sharded_state_dict"),
        (
            "megatron.core.optimizer.optimizer",
            "Float16OptimizerWithFloat16Params.sharded_state_dict",
        ),
        ("megatron.core.optimizer.optimizer", "ChainedOptimizer.sharded_state_dict"),
    ]
)


def main() -> int:
    warnings.filterwarnings("ignore")
    import megatron.core
    from megatron.core import package_info

    facts = {
        "meta": {
            "megatron_core_version": package_info.__version__,
            "source": megatron.core.__file__,
        },
        "signatures": {f"{m}.{q}": record_signature(m, q) for m, q in TARGETS},
        "enums": {
            f"{_DC}.validation.StrictHandling": record_enum(f"{_DC}.validation", "StrictHandling")
        },
    }
    OUTPUT.write_text(to_json(facts) + "\n")
    print(f"wrote {len(facts['signatures'])} signatures to {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
