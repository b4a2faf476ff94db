"""One model description: each option that configures the library declares the field it sets
(``option(..., library=...)``); the TransformerConfig, GPTModel, LoRAConfig and DDP keywords
are built from that table and the reverse names of the error messages (``LIBRARY_NAMES``)
are generated from it, so a new field is one declaration.
"""

import dataclasses
import inspect

import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.lora import LoRAConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.config_errors import LIBRARY_NAMES, name_the_flags
from megatron.training.options import (
    DDP_CONFIG,
    GPT_MODEL,
    LORA_CONFIG,
    MODEL,
    TRANSFORMER_CONFIG,
    library_names,
    library_table,
    option_of,
)

pytestmark = pytest.mark.world(1)

# MODEL options that set no library field, and where each goes instead.
MODEL_OPTIONS_ELSEWHERE = {
    "vocab_size": "GPTModel's padded vocabulary (model.build_model)",
    "seq_length": "the data; the default position table (max_position_embeddings)",
    "tokenizer": "the data",
    "openai_gelu": "activation_func (model.computed_fields, with --swiglu)",
    "quick_geglu": "activation_func (model.computed_fields) and gated_linear_unit (--swiglu's "
    "declaration)",
    "geglu": "gated_linear_unit (through --swiglu's declaration) and activation_func",
    "pretrained_checkpoint": "the weights loaded",
}
TARGET_FIELDS = {
    # the target is TransformerConfig or, with --multi-latent-attention, its MLA subclass
    TRANSFORMER_CONFIG: {f.name for f in dataclasses.fields(MLATransformerConfig)},
    GPT_MODEL: set(inspect.signature(GPTModel.__init__).parameters),
    LORA_CONFIG: {f.name for f in dataclasses.fields(LoRAConfig)},
    DDP_CONFIG: {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
}


def test_every_model_option_declares_the_library_field_it_sets():
    """A model option (kind MODEL) sets a library field, or is listed above with where it
    goes; every declared field exists in its library config (a typo fails here)."""
    for config_field in dataclasses.fields(TrainingConfig):
        spec = option_of(config_field)
        if spec.kind == MODEL and config_field.name not in MODEL_OPTIONS_ELSEWHERE:
            assert spec.library, f"{spec.flag} declares no library field (library=...)"
    for target, names in TARGET_FIELDS.items():
        for option_name, sets in library_table(TrainingConfig, target):
            assert sets.field in names, f"{option_name}: {target} has no field {sets.field}"


def test_the_transformer_config_is_the_table_and_the_computed_fields():
    """Every TransformerConfig field a MoE run (with --compile, --bf16, a window) sets away
    from its default is declared by an option or computed in one place (model.py)."""
    from megatron.training.model import computed_fields, transformer_config_from

    config = TrainingConfig(
        num_experts=4, disable_bias_linear=True, compile=True, bf16=True, window_size=[4, 0],
        moe_router_dtype="fp32", swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6,
        position_embedding_type="rope",
    )  # fmt: skip
    built = transformer_config_from(config, validate_config(config, 1))
    default = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    declared = {sets.field for _, sets in library_table(TrainingConfig, TRANSFORMER_CONFIG)}
    sources = declared | set(computed_fields(config))
    # set by TransformerConfig itself from the fields above
    derived_by_the_library = {
        "ffn_hidden_size", "kv_channels", "num_query_groups", "autocast_dtype",
        "output_layer_init_method",
    }  # fmt: skip
    for f in dataclasses.fields(TransformerConfig):
        if f.name in ("num_layers", "hidden_size", "num_attention_heads"):
            continue
        if getattr(built, f.name) != getattr(default, f.name):
            assert f.name in sources | derived_by_the_library, f.name
    assert (built.num_moe_experts, built.layernorm_epsilon, built.apply_rope_fusion) == (
        4,
        1e-6,
        True,
    )


def test_library_names_are_generated_and_name_the_moe_flags():
    """LIBRARY_NAMES is the table's reverse; it has num_moe_experts (it lacked it when
    written by hand), so a MoE error of the library names --num-experts."""
    assert LIBRARY_NAMES == library_names(
        TrainingConfig, (TRANSFORMER_CONFIG, GPT_MODEL, DDP_CONFIG, "OptimizerParamScheduler")
    )
    assert LIBRARY_NAMES["num_moe_experts"] == "num_experts"
    assert LIBRARY_NAMES["layernorm_epsilon"] == "norm_epsilon"
    with pytest.raises(ValueError) as error:
        TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
            moe_router_topk=5, add_bias_linear=False,
        )  # fmt: skip
    message = str(error.value)
    config = TrainingConfig(num_experts=4, moe_router_topk=5, disable_bias_linear=True)
    assert name_the_flags(message, config) == (f"--moe-router-topk 5, --num-experts 4: {message}")


def test_the_trainer_and_the_hf_loader_build_through_one_chunk_builder(tmp_path, monkeypatch):
    """model.build_model and hf.loading.model_from_hf both build with chunk.build_gpt_chunk,
    and give the same parameters for the same HuggingFace model."""
    from megatron.training import chunk
    from megatron.training.hf.loading import model_from_hf
    from megatron.training.hf_settings import resolve_hf_model
    from megatron.training.model import build_model
    from tests.unit_tests.hf.hf_models import LLAMA_CONFIG, write_random_hf_model

    calls = []
    builder = chunk.build_gpt_chunk

    def counted(*args, **kwargs):
        calls.append(args[3])  # the pipeline rank
        return builder(*args, **kwargs)

    monkeypatch.setattr(chunk, "build_gpt_chunk", counted)
    path = write_random_hf_model(tmp_path / "llama", LLAMA_CONFIG)
    loaded, _ = model_from_hf(path)
    config = resolve_hf_model(TrainingConfig(hf_model=str(path), seq_length=16))
    (trained,) = build_model(config, validate_config(config, 1), None)
    assert calls == [0, 0]
    ours = dict(trained.module.named_parameters())
    for name, param in loaded.named_parameters():
        assert ours[name].equal(param), name


def test_recorded_lora_settings_read_through_the_trainers_table():
    """A checkpoint's recorded --lora-* settings give the LoRAConfig the run trained with
    (every declared field: dropout position, init methods, the flags in its errors), the
    ones an older run did not record at their defaults."""
    from megatron.training.hf.peft import lora_of_settings
    from megatron.training.lora_settings import lora_config

    recorded = dict(
        lora_dim=4, lora_alpha=8.0, lora_dropout=0.1, lora_dropout_position="post",
        lora_b_init_method="xavier", lora_target_modules=["linear_qkv"], seed=7, num_layers=2,
    )  # fmt: skip
    lora = lora_of_settings(recorded)
    assert lora == lora_config(
        TrainingConfig(**{**recorded, "lora_target_modules": ("linear_qkv",)})
    )
    assert (lora.dropout_position, lora.lora_B_init_method, lora.seed) == ("post", "xavier", 7)
    assert lora.flags["dropout_position"] == "--lora-dropout-position"
    assert lora_of_settings({"lora_dim": 2}).alpha == 32.0 and lora_of_settings({}) is None


def test_the_hf_loader_takes_its_transformer_config_fields_from_the_options():
    """The options module does not import the HuggingFace converter, so the converter builds
    from the options' table: a HuggingFace model's TransformerConfig fields are those the
    trainer sets from the same settings (``--hf-model``), the layout and run fields aside."""
    import ast
    from pathlib import Path

    import megatron.training.arguments as arguments
    from megatron.training.hf.config import architecture_from_config, training_settings
    from megatron.training.hf.loading import architecture_fields
    from megatron.training.model import transformer_config_from
    from tests.unit_tests.hf.test_hf_refusals import BASE

    tree = ast.parse(Path(arguments.__file__).read_text())
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [m for m in imported if m and m.startswith("megatron.training.hf")]
    arch = architecture_from_config(BASE["olmoe"])
    config = TrainingConfig(**training_settings(arch), seq_length=16)
    trainer = transformer_config_from(config, validate_config(config, 1))
    for name, value in architecture_fields(arch).items():
        if name != "activation_func":
            assert getattr(trainer, name) == value, name


def test_the_hf_loader_takes_its_gpt_model_keywords_from_the_options(monkeypatch):
    """``gpt_model_kwargs``: the padded vocabulary and the GPTModel keywords the trainer's
    table sets from the same settings (the run's seed aside); a GPTModel keyword declared
    in the table reaches it with no second list to edit."""
    from megatron.core.models.gpt.gpt_model import padded_vocab_size
    from megatron.training import options
    from megatron.training.hf.config import architecture_from_config, training_settings
    from megatron.training.hf.loading import gpt_model_kwargs
    from tests.unit_tests.hf.test_hf_refusals import BASE

    arch = architecture_from_config(BASE["olmoe"])
    settings = dict(training_settings(arch), seq_length=arch.max_position_embeddings)
    trainer = options.library_values(TrainingConfig(**settings), None, GPT_MODEL)
    trainer.pop("seed")
    vocab = dict(
        vocab_size=padded_vocab_size(arch.vocab_size, 1, 2), true_vocab_size=arch.vocab_size
    )
    assert gpt_model_kwargs(arch, None, tp_size=2) == dict(trainer, **vocab)
    table = options.library_table
    doubled = options.Sets("new_keyword", GPT_MODEL, lambda c, _: 2 * c.rotary_base)

    def with_new_keyword(config_class, target):
        extra = [("rotary_base", doubled)] if target == GPT_MODEL else []
        return table(config_class, target) + extra

    monkeypatch.setattr(options, "library_table", with_new_keyword)
    assert gpt_model_kwargs(arch, None)["new_keyword"] == 2 * arch.rotary_base
