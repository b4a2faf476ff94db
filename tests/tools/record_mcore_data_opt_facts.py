"""Record megatron-core 0.16.1's signatures and config defaults for the data, tokenizer and
optimizer modules (run with megatron-core's interpreter, from outside the repository)::

    cd /tmp && env -u PYTHONPATH /opt/mcore/bin/python \\
        <repo>/tests/tools/record_mcore_data_opt_facts.py

Writes ``tests/unit_tests/data/mcore_facts_data_opt.json`` in the format of
``record_mcore_facts.py`` (names, parameter kinds and default reprs only).
"""

import dataclasses
import importlib
import inspect
import json
import warnings
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "unit_tests" / "data" / "mcore_facts_data_opt.json"

CALLABLES = [
    ("megatron.core.datasets.indexed_dataset", "IndexedDataset.__init__"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDataset.get"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDataset.exists"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.__init__"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.add_item"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.add_document"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.end_document"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.add_index"),
    ("megatron.core.datasets.indexed_dataset", "IndexedDatasetBuilder.finalize"),
    ("megatron.core.datasets.indexed_dataset", "get_idx_path"),
    ("megatron.core.datasets.indexed_dataset", "get_bin_path"),
    ("megatron.core.datasets.gpt_dataset", "GPTDataset.__init__"),
    ("megatron.core.datasets.gpt_dataset", "GPTDataset.__getitem__"),
    ("megatron.core.datasets.gpt_dataset", "MockGPTDataset.__init__"),
    ("megatron.core.datasets.gpt_dataset", "MockGPTLowLevelDataset.__init__"),
    ("megatron.core.datasets.blended_dataset", "BlendedDataset.__init__"),
    (
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "BlendedMegatronDatasetBuilder.__init__",
    ),
    (
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "BlendedMegatronDatasetBuilder.build",
    ),
    (
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "BlendedMegatronDatasetBuilder.build_generic_dataset",
    ),
    ("megatron.core.datasets.utils", "compile_helpers"),
    ("megatron.core.datasets.utils", "get_blend_from_list"),
    ("megatron.core.datasets.helpers", "build_sample_idx"),
    ("megatron.core.tokenizers", "MegatronTokenizer.from_pretrained"),
    ("megatron.core.tokenizers", "MegatronTokenizer.write_metadata"),
    ("megatron.core.optimizer", "get_megatron_optimizer"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.clip_grads", "count_zeros_fp32"),
    ("megatron.core.optimizer", "MegatronOptimizer.step"),
    ("megatron.core.optimizer", "MegatronOptimizer.zero_grad"),
    ("megatron.core.optimizer", "MegatronOptimizer.get_loss_scale"),
    ("megatron.core.optimizer", "MegatronOptimizer.scale_loss"),
    ("megatron.core.optimizer", "MegatronOptimizer.clip_grad_norm"),
    ("megatron.core.optimizer", "FP32Optimizer.__init__"),
    ("megatron.core.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer", "ChainedOptimizer.__init__"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.__init__"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.step"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.get_lr"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.get_wd"),
    ("megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.load_state_dict"),
]

CONFIGS = [
    ("megatron.core.datasets.blended_megatron_dataset_config", "BlendedMegatronDatasetConfig"),
    ("megatron.core.datasets.gpt_dataset", "GPTDatasetConfig"),
    ("megatron.core.optimizer", "OptimizerConfig"),
]


def _resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    warnings.simplefilter("ignore")
    facts = {"signatures": {}, "config_fields": {}}
    for module, qualname in CALLABLES:
        params = inspect.signature(_resolve(module, qualname)).parameters.values()
        facts["signatures"][f"{module}.{qualname}"] = {
            "module": module,
            "qualname": qualname,
            "parameters": [
                {
                    "name": p.name,
                    "kind": p.kind.name,
                    "default": None if p.default is inspect.Parameter.empty else repr(p.default),
                }
                for p in params
            ],
        }
    for module, name in CONFIGS:
        cls = getattr(importlib.import_module(module), name)
        fields = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                value = str(f.default) if "torch" in repr(type(f.default)) else repr(f.default)
            else:
                value = None
            fields[f.name] = {"value": value, "init": f.init}
        facts["config_fields"][f"{module}.{name}"] = {
            "module": module,
            "name": name,
            "fields": fields,
        }
    OUTPUT.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
