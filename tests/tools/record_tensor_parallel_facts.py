"""Record the signatures of megatron-core 0.16.1's ``megatron.core.tensor_parallel`` into
``tests/unit_tests/data/mcore_tensor_parallel_facts.json`` (checked by
``tests/unit_tests/tensor_parallel/test_signatures.py``).

Run with the real megatron-core, outside the repository so that ``import megatron`` finds it:

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \\
        /path/to/repo/tests/tools/record_tensor_parallel_facts.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from record_mcore_facts import record_signature

OUT = Path(__file__).resolve().parents[1] / "unit_tests" / "data"
OUT = OUT / "mcore_tensor_parallel_facts.json"

_TP = "megatron.core.tensor_parallel"
TARGETS = (
    [
        (f"{_TP}.layers", name)
        for name in (
            "ColumnParallelLinear.__init__",
            "ColumnParallelLinear.forward",
            "RowParallelLinear.__init__",
            "RowParallelLinear.forward",
            "VocabParallelEmbedding.__init__",
            "VocabParallelEmbedding.forward",
            "linear_with_grad_accumulation_and_async_allreduce",
            "linear_with_frozen_weight",
            "param_is_not_tensor_parallel_duplicate",
            "set_tensor_model_parallel_attributes",
            "set_defaults_if_not_set_tensor_model_parallel_attributes",
            "copy_tensor_model_parallel_attributes",
        )
    ]
    + [
        (f"{_TP}.mappings", name)
        for name in (
            "copy_to_tensor_model_parallel_region",
            "reduce_from_tensor_model_parallel_region",
            "scatter_to_tensor_model_parallel_region",
            "gather_from_tensor_model_parallel_region",
            "scatter_to_sequence_parallel_region",
            "gather_from_sequence_parallel_region",
            "reduce_scatter_to_sequence_parallel_region",
            "all_gather_last_dim_from_tensor_parallel_region",
            "reduce_scatter_last_dim_to_tensor_parallel_region",
            "all_to_all",
            "all_to_all_sp2hp",
            "all_to_all_hp2sp",
        )
    ]
    + [
        (f"{_TP}.cross_entropy", "vocab_parallel_cross_entropy"),
        (f"{_TP}.cross_entropy", "VocabParallelCrossEntropy.calculate_logits_max"),
        (f"{_TP}.cross_entropy", "VocabParallelCrossEntropy.calculate_predicted_logits"),
        (f"{_TP}.cross_entropy", "VocabParallelCrossEntropy.calculate_cross_entropy_loss"),
        (f"{_TP}.cross_entropy", "VocabParallelCrossEntropy.prepare_gradient_calculation_operands"),
        (f"{_TP}.cross_entropy", "VocabParallelCrossEntropy.calculate_gradients"),
        (f"{_TP}.data", "broadcast_data"),
    ]
    + [
        (f"{_TP}.random", name)
        for name in (
            "model_parallel_cuda_manual_seed",
            "get_cuda_rng_tracker",
            "initialize_rng_tracker",
            "get_data_parallel_rng_tracker_name",
            "get_expert_parallel_rng_tracker_name",
            "CudaRNGStatesTracker.__init__",
            "CudaRNGStatesTracker.add",
            "CudaRNGStatesTracker.fork",
            "CudaRNGStatesTracker.get_states",
            "CudaRNGStatesTracker.set_states",
            "CudaRNGStatesTracker.reset",
            "CudaRNGStatesTracker.is_initialized",
            "checkpoint",
            "convert_cuda_rng_state",
            "is_graph_safe_cuda_rng_tracker",
        )
    ]
    + [
        (f"{_TP}.utils", name)
        for name in (
            "split_tensor_along_last_dim",
            "split_tensor_into_1d_equal_chunks",
            "gather_split_1d_tensor",
            "VocabUtility.vocab_range_from_per_partition_vocab_size",
            "VocabUtility.vocab_range_from_global_vocab_size",
        )
    ]
)


def main() -> None:
    warnings.filterwarnings("ignore")
    import megatron.core.tensor_parallel as tp
    from megatron.core import package_info

    signatures = {f"{m}.{q}": record_signature(m, q) for m, q in TARGETS}
    facts = {
        "meta": {
            "megatron_core_version": package_info.__version__,
            "generated_by": "tests/tools/record_tensor_parallel_facts.py",
        },
        "package_all": sorted(tp.__all__),
        "signatures": signatures,
    }
    OUT.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"wrote {len(signatures)} signatures to {OUT}")


if __name__ == "__main__":
    main()
