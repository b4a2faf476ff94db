"""Our GPT from a HuggingFace model directory, at one process or at a parallel layout.

``model_from_hf(path)`` reads ``config.json`` (refusing what we cannot express), builds the
GPT chunk this rank holds (TP shard, pipeline stage; CP needs no weights of its own) without
drawing random weights, and fills every parameter with only the bytes it needs from the
safetensors files (``get_slice``: a TP rank reads its rows or columns, a pipeline stage its
layers).
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_model import padded_vocab_size
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_group
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.utils import openai_gelu
from megatron.core.utils import get_pg_rank, get_pg_size
from megatron.training import chunk
from megatron.training.arguments import TrainingConfig
from megatron.training.hf.config import HFArchitecture, read_hf_config, training_settings
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.weights import (
    SafetensorsReader,
    Source,
    check_checkpoint_tensors,
    our_full_shapes,
    parameter_sources,
    read_rows,
)
from megatron.training.options import GPT_MODEL, TRANSFORMER_CONFIG, library_values

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": openai_gelu, "quick_gelu": quick_gelu}
# Our parameters whose rows are the vocabulary (padded in the model to a multiple of TP).
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_from_hf(
    path,
    *,
    pg_collection: Optional[ProcessGroupCollection] = None,
    vp_stage: Optional[int] = None,
    max_sequence_length: Optional[int] = None,
    allow_non_finite: bool = False,
    **overrides: Any,
) -> Tuple[GPTModel, TransformerConfig]:
    """(this rank's GPT chunk with the HuggingFace weights, its TransformerConfig).

    ``overrides`` are TransformerConfig fields (``params_dtype``, ``sequence_parallel``,
    ``calculate_per_token_loss``, ``virtual_pipeline_model_parallel_size``, dropout, ...); one
    that contradicts ``config.json`` (``num_layers``, ``hidden_size``, ...) or the groups'
    sizes is refused by name (a MoE model takes its expert-parallel and expert-tensor-parallel
    sizes from the groups too). Groups: ``pg_collection``, else ``parallel_state``'s when
    initialized (MPU fallback), else one process. Dropout is 0 unless overridden (config.json's
    dropout probabilities are training choices, not weights). ``max_sequence_length``: the
    position table for learned positions (must be config.json's ``n_positions``), else the
    model's nominal length (default: ``max_position_embeddings``). The files are checked
    against ``config.json`` first (``load_hf_weights``); ``allow_non_finite`` loads NaN or
    infinite weights instead of refusing them.
    """
    arch, _ = read_hf_config(path)
    reader = SafetensorsReader(path)
    config = transformer_config_from_hf(arch, pg_collection, **overrides)
    model = build_gpt_chunk(arch, config, pg_collection, vp_stage, max_sequence_length)
    load_hf_weights(model, reader, arch, allow_non_finite=allow_non_finite)
    return model, config


def transformer_config_from_hf(
    arch: HFArchitecture, pg_collection: Optional[ProcessGroupCollection] = None, **overrides
) -> TransformerConfig:
    """The TransformerConfig of ``arch`` at the layout of the groups (see ``model_from_hf``),
    with ``perform_initialization`` as given (default True)."""
    fields = architecture_fields(arch)
    sizes = _group_sizes(pg_collection, moe=arch.num_moe_experts is not None)
    for name, value in overrides.items():
        expected = fields.get(name, sizes.get(name))
        if (name in fields or name in sizes) and value != expected:
            source = "config.json" if name in fields else "the process groups"
            raise ValueError(
                f"model_from_hf: {name}={value!r} contradicts {source} ({name}={expected!r})"
            )
    values = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **fields, **sizes, **overrides}
    if values.get("pipeline_model_parallel_size", 1) > 1 and values.get("pipeline_dtype") is None:
        values["pipeline_dtype"] = values.get("params_dtype", torch.float32)
    return chunk.transformer_config_class(values)(**values)


def architecture_fields(arch: HFArchitecture) -> Dict[str, Any]:
    """The TransformerConfig fields ``arch`` fixes: the trainer's options' ``library=``
    declarations applied to the settings ``arch`` gives (``training_settings``; a MoE field
    only for a MoE model), with its activation."""
    return dict(
        _library_values(arch, TRANSFORMER_CONFIG), activation_func=ACTIVATIONS[arch.activation]
    )


def gpt_model_kwargs(
    arch: HFArchitecture, max_sequence_length: Optional[int], tp_size: int = 1
) -> Dict[str, Any]:
    """GPTModel's constructor arguments that ``arch`` fixes (the options' ``library=``
    declarations of GPTModel, as for ``architecture_fields``); the vocabulary padded to a
    multiple of ``tp_size`` (the padded ids excluded from the softmax); the position table
    ``max_sequence_length`` (default: config.json's ``max_position_embeddings``)."""
    learned = arch.position_embedding_type == "learned_absolute"
    if learned and max_sequence_length not in (None, arch.max_position_embeddings):
        raise ValueError(
            f"max_sequence_length={max_sequence_length} contradicts config.json's position "
            f"table (n_positions={arch.max_position_embeddings}); leave it out"
        )
    return dict(
        vocab_size=padded_vocab_size(arch.vocab_size, 1, tp_size),
        true_vocab_size=arch.vocab_size,
        **_library_values(
            arch, GPT_MODEL, seq_length=max_sequence_length or arch.max_position_embeddings
        ),
    )


def _library_values(arch: HFArchitecture, target: str, **run_settings: Any) -> Dict[str, Any]:
    """The keywords of ``target`` that the options ``arch`` settles set (``run_settings``:
    other fields of the trainer's config they read)."""
    settings = training_settings(arch)
    config = TrainingConfig(**{**settings, **run_settings})
    return library_values(config, None, target, only=settings)


def build_gpt_chunk(
    arch: HFArchitecture,
    config: TransformerConfig,
    pg_collection: Optional[ProcessGroupCollection],
    vp_stage: Optional[int] = None,
    max_sequence_length: Optional[int] = None,
) -> GPTModel:
    """This rank's chunk (virtual stage ``vp_stage`` x PP + pipeline rank), weights left
    as allocated (``perform_initialization`` off while building)."""
    initialize = config.perform_initialization
    config.perform_initialization = False
    try:
        return chunk.build_gpt_chunk(
            config,
            pg_collection,
            vp_stage,
            _pp_rank(pg_collection),
            **gpt_model_kwargs(arch, max_sequence_length, config.tensor_model_parallel_size),
        )
    finally:
        config.perform_initialization = initialize


@torch.no_grad()
def load_hf_weights(
    model: GPTModel,
    reader,
    arch: Optional[HFArchitecture] = None,
    *,
    allow_non_finite: bool = False,
) -> None:
    """Fill every parameter of ``model`` (one chunk, any TP shard and stage) from the
    HuggingFace checkpoint ``reader`` (a ``SafetensorsReader`` or a directory), reading only
    this shard's bytes. The checkpoint is first checked to be one consistent model: missing,
    misshapen, unused or non-floating tensors, an index that disagrees with its shards, and
    a stored head that differs from tied embeddings are errors naming them; so is a NaN or
    infinite value in the bytes this rank reads, unless ``allow_non_finite``."""
    if not isinstance(reader, SafetensorsReader):
        if arch is None:
            arch, _ = read_hf_config(reader)
        reader = SafetensorsReader(reader)
    if arch is None:
        arch, _ = read_hf_config(reader.directory)
    sources = parameter_sources(arch, hf_prefix(reader, arch))
    check_checkpoint_tensors(reader, arch, sources)
    full_shapes = our_full_shapes(arch)
    finite = not allow_non_finite
    experts = _load_experts(model, reader, sources, full_shapes, finite)
    tp_size, tp_rank = get_pg_size(model.tp_group), get_pg_rank(model.tp_group)
    for name, param in model.named_parameters():
        if id(param) in experts:
            continue
        full_name = one_chunk_name(model, name)
        source = _source_of(full_name, sources, arch)
        full_shape = full_shapes[full_name]
        if full_name in VOCAB_PARAMETERS:  # padded rows (ids >= the true vocabulary): zero
            full_shape = (model.vocab_size,) + tuple(full_shape[1:])
        rows, columns = shard_ranges(param, full_shape, tp_size, tp_rank)
        true_rows = [(a, min(b, arch.vocab_size)) for a, b in rows if a < arch.vocab_size]
        if full_name in VOCAB_PARAMETERS and true_rows != rows:
            value = param.new_zeros(param.shape)
            if true_rows:
                part = read_rows(reader, source, true_rows, columns, finite=finite)
                value[: part.shape[0]] = part
        else:
            value = read_rows(reader, source, rows, columns, finite=finite)
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(
                f"load_hf_weights: {name} has shape {list(param.shape)} but its HuggingFace "
                f"rows give {list(value.shape)}"
            )
        param.copy_(value)
    for name, buffer in model.named_buffers():  # the router's expert bias (replicated)
        full_name = one_chunk_name(model, name)
        if full_name in sources:
            buffer.copy_(read_rows(reader, sources[full_name], [(0, buffer.shape[0])], None))


def _load_experts(model: GPTModel, reader, sources, full_shapes, finite: bool) -> set:
    """Fill the routed experts of every MoE layer of ``model`` (``SequentialMLP`` or
    ``GroupedMLP``): local expert i is global expert ``first_expert + i``, and this
    expert-tensor-parallel rank reads only its rows / columns (the module's
    ``expert_split``) into ``local_expert_weight`` (a transposed view in ``GroupedMLP``).
    Returns the ids of the parameters filled."""
    filled = set()
    for name, module in model.named_modules():
        if not isinstance(module, (SequentialMLP, GroupedMLP)):
            continue
        prefix = one_chunk_name(model, name)
        size, rank = get_pg_size(module.tp_group), get_pg_rank(module.tp_group)
        for i in range(module.num_local_experts):
            for proj in ("linear_fc1", "linear_fc2"):
                full_name = f"{prefix}.local_experts.{module.first_expert + i}.{proj}.weight"
                if full_name not in sources:
                    raise RuntimeError(
                        f"load_hf_weights: our expert weight {full_name!r} has no HuggingFace "
                        "counterpart in the family's mapping"
                    )
                dim, stride = module.expert_split(proj)
                rows, columns = strided_ranges(full_shapes[full_name], dim, stride, size, rank)
                value = read_rows(reader, sources[full_name], rows, columns, finite=finite)
                target = module.local_expert_weight(i, proj)
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(
                        f"load_hf_weights: {name} expert {i} {proj} has shape "
                        f"{list(target.shape)} but its HuggingFace rows give {list(value.shape)}"
                    )
                target.copy_(value)
                _load_expert_bias(module, prefix, i, proj, (sources, reader, finite))
        filled.update(id(p) for p in module.parameters())
    return filled


def _load_expert_bias(module, prefix: str, i: int, proj: str, read) -> None:
    """Local expert ``i``'s ``proj`` bias (``add_bias_linear``: fc1's this expert-TP rank's
    rows, fc2's whole); ``read``: (sources, reader, finite)."""
    bias = module.local_expert_bias(i, proj)
    if bias is None:
        return
    sources, reader, finite = read
    name = f"{prefix}.local_experts.{module.first_expert + i}.{proj}.bias"
    size, rank = get_pg_size(module.tp_group), get_pg_rank(module.tp_group)
    rows = [(0, bias.shape[0])]
    if proj == "linear_fc1":  # split over expert TP like the rows of fc1's weight
        _, stride = module.expert_split(proj)
        rows, _ = strided_ranges((bias.shape[0] * size,), 0, stride, size, rank)
    bias.copy_(read_rows(reader, sources[name], rows, None, finite=finite))


def hf_prefix(reader: SafetensorsReader, arch: HFArchitecture) -> Optional[str]:
    """The key prefix of the checkpoint's transformer tensors when the family writes files
    with and without one (GPT-2's ``transformer.``); None: the family's usual one."""
    return REGISTRY[arch.family].key_prefix(reader.weight_map)


def one_chunk_name(model: GPTModel, name: str) -> str:
    """A chunk's parameter name in the one-chunk model (layers numbered globally)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def shard_ranges(
    param: torch.Tensor, full_shape, tp_size: int, tp_rank: int
) -> Tuple[List[Tuple[int, int]], Optional[Tuple[int, int]]]:
    """(row ranges, column range or None) of the full tensor this TP rank holds: blocks
    rank, rank + T, ... of T x stride equal blocks along ``partition_dim`` (megatron's
    strided split)."""
    if not getattr(param, "tensor_model_parallel", False):
        return [(0, full_shape[0])], None
    stride = getattr(param, "partition_stride", 1)
    return strided_ranges(full_shape, param.partition_dim, stride, tp_size, tp_rank)


def strided_ranges(
    full_shape, dim: int, stride: int, tp_size: int, tp_rank: int
) -> Tuple[List[Tuple[int, int]], Optional[Tuple[int, int]]]:
    """(row ranges, column range or None) of rank ``tp_rank``'s blocks of a tensor split
    over ``tp_size`` ranks along ``dim`` with ``stride`` (see ``shard_ranges``)."""
    rows = [(0, full_shape[0])]
    if tp_size == 1:
        return rows, None
    block = full_shape[dim] // (tp_size * stride)
    ranges = [(k * block, (k + 1) * block) for k in range(tp_rank, tp_size * stride, tp_size)]
    if dim == 0:
        return ranges, None
    if dim == 1 and stride == 1:
        return rows, ranges[0]
    raise NotImplementedError(f"shard_ranges: partition_dim={dim}, stride={stride}")


def _source_of(full_name: str, sources: Dict[str, Source], arch: HFArchitecture) -> Source:
    if full_name == "output_layer.weight" and arch.tied:  # the last stage's tied copy
        return sources["embedding.word_embeddings.weight"]
    if full_name not in sources:
        raise RuntimeError(
            f"load_hf_weights: our parameter {full_name!r} has no HuggingFace counterpart in "
            f"the {arch.family} mapping"
        )
    return sources[full_name]


def _group_sizes(
    pg_collection: Optional[ProcessGroupCollection], moe: bool = False
) -> Dict[str, int]:
    """The TP / CP / PP sizes of the groups (``resolve_group``: explicit, else
    parallel_state's, else 1), and for a MoE model the expert-parallel and
    expert-tensor-parallel sizes."""
    fields = {
        "tensor_model_parallel_size": "tp",
        "context_parallel_size": "cp",
        "pipeline_model_parallel_size": "pp",
    }
    if moe:
        fields.update(expert_model_parallel_size="ep", expert_tensor_parallel_size="expt_tp")
    return {
        field: get_pg_size(resolve_group(group, pg_collection=pg_collection))
        for field, group in fields.items()
    }


def _pp_rank(pg_collection: Optional[ProcessGroupCollection]) -> int:
    return get_pg_rank(resolve_group("pp", pg_collection=pg_collection))
