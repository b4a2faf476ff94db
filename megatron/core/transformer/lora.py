"""LoRA adapters on the tensor-parallel linear layers (Megatron-Bridge's semantics).

A target layer computes y = W x (+ b); with an adapter it computes

    y = W x (+ b) + (alpha / dim) * B A x,     A [dim, in], B [out, dim],

with W (and b) frozen, A drawn by ``lora_A_init_method`` and B by ``lora_B_init_method``
(zero by default, so training starts from the base model). Dropout (``dropout``) acts on the
adapter's input (``dropout_position="pre"``) or on its output (``"post"``).

Sharding follows the base layer, so the adapter's output has the base output's layout under
every TP/SP setting and its gradients are those of the one-process model:

- column-parallel base (``linear_qkv``, ``linear_fc1``; output split over TP): A is a
  column-parallel layer split on the rank dimension whose output is gathered (under SP it
  gathers the sequence as the base does), B is column-parallel on the output like the base
  (the same ``partition_stride``: the gated fc1's [gate; up] halves) and its input's gradient
  is summed over TP, so each A shard receives the whole gradient. ``dim`` must divide by TP.
- row-parallel base (``linear_proj``, ``linear_fc2``; input split over TP): A is row-parallel
  (split on the input, its output summed, or reduce-scattered along the sequence under SP) and
  B is replicated; under SP B sees a sequence shard, so it is marked ``sequence_parallel`` and
  ``finalize_model_grads`` sums its gradient over TP.

Every adapter weight is drawn in full (float32) from a generator seeded by (seed, the layer's
global name), so an adapter starts the same at every TP/PP/VPP layout, and drawing it does not
move any other random stream. Adapters are built in ``params_dtype`` (float32); under a
``Float16Module`` they are cast with the base and compute in bf16/fp16, while the
mixed-precision optimizer keeps their float32 main parameters (megatron's mixed precision; an
adapter kept in float32 would write its [s, b, out] output in float32 at every layer: 1.28x
the step time of full fine-tuning on the 1.1B benchmark model, measured).

The adapter is a child module ``adapter`` of the base layer (``...linear_qkv.adapter.
linear_in.weight``, ``...adapter.linear_out.weight``) and the base layer's ``forward`` adds its
output (``_WithAdapter``), so
the base layer's parameter names, checkpoint keys and HuggingFace mapping are unchanged.
Written here because no library does TP-sharded LoRA on megatron-core's layers (peft wraps
``torch.nn.Linear``).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.core import config_rules
from megatron.core.config_rules import LORA_DROPOUT_POSITIONS as DROPOUT_POSITIONS
from megatron.core.config_rules import LORA_INIT_METHODS as INIT_METHODS
from megatron.core.config_rules import LORA_TARGETS, lora_is_pattern, lora_pattern_matches
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.lora_init import adapter_init_method, adapter_seed


@dataclass
class LoRAConfig:
    """Which layers get an adapter and how (Megatron-Bridge's ``LoRA`` fields).

    ``target_modules``: module names (the last component, e.g. ``linear_qkv``) or wildcard
    patterns matched against the global module name (``*.layers.0.*.linear_qkv``; layer
    indices are global whatever the pipeline layout). ``exclude_modules``: the same forms,
    removed from the targets.
    """

    target_modules: Sequence[str] = LORA_TARGETS
    exclude_modules: Sequence[str] = ()
    dim: int = 32
    alpha: float = 32
    dropout: float = 0.0
    dropout_position: str = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    flags: Dict[str, str] = field(default_factory=dict)  # field -> trainer flag, for errors

    def __post_init__(self) -> None:
        def bad(name: str, value, expected: str) -> ValueError:
            return ValueError(f"{self.flags.get(name, name)} {value!r}: expected {expected}")

        if isinstance(self.target_modules, str):
            self.target_modules = (self.target_modules,)
        if not self.target_modules:
            raise bad("target_modules", list(self.target_modules), "at least one module")
        for pattern in self.target_modules:
            if not lora_is_pattern(pattern) and pattern not in config_rules.LORA_ALL_TARGETS:
                raise bad(
                    "target_modules",
                    pattern,
                    f"one of {config_rules.LORA_ALL_TARGETS} or a wildcard",
                )
        if not isinstance(self.dim, int) or self.dim < 1:
            raise bad("dim", self.dim, "a positive integer")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise bad("alpha", self.alpha, "a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", self.dropout, "a probability in [0, 1)")
        if self.dropout_position not in DROPOUT_POSITIONS:
            raise bad("dropout_position", self.dropout_position, f"one of {DROPOUT_POSITIONS}")
        for name in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, name) not in INIT_METHODS:
                raise bad(name, getattr(self, name), f"one of {INIT_METHODS}")

    @property
    def scale(self) -> float:
        """alpha / dim."""
        return self.alpha / self.dim

    def matches(self, name: str) -> bool:
        """Whether the module with global name ``name`` is a target and not excluded: one
        of the adaptable layers (``LORA_ALL_TARGETS``; a wildcard picks among them, so
        ``*.layers.0.*`` means layer 0's linear layers) that a pattern names."""
        if name.rsplit(".", 1)[-1] not in config_rules.LORA_ALL_TARGETS:
            return False
        return _matches(name, self.target_modules) and not _matches(name, self.exclude_modules)


def apply_lora(model: torch.nn.Module, lora: LoRAConfig) -> List[str]:
    """Freeze every parameter of ``model`` and add an adapter to each target layer; the
    targets' global names, in order. The routed experts' fc1 / fc2 get one adapter per expert
    (``moe.expert_lora``). A target that is not a tensor-parallel linear layer (a Transformer
    Engine layer) is refused by name; so is a configuration that matches no layer on any
    stage (checked by the caller, who sees every stage)."""
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.multi_latent_attention import ReplicatedLinear

    for param in model.parameters():
        param.requires_grad_(False)
    added = []
    for name, module in list(model.named_modules()):
        global_name = global_module_name(model, name)
        if global_name is not None and isinstance(module, (SequentialMLP, GroupedMLP)):
            added += _adapt_experts(module, lora, global_name)
            continue
        if global_name is None or not lora.matches(global_name):
            continue
        if ".experts." in global_name:  # a SequentialMLP expert's layer: adapted above
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            raise ValueError(
                f"LoRA target {global_name} is a {type(module).__name__}; adapters go on "
                "ColumnParallelLinear / RowParallelLinear / ReplicatedLinear layers only"
            )
        if hasattr(module, "adapter"):
            raise ValueError(f"LoRA target {global_name} already has an adapter")
        module.adapter = LoRAAdapter(module, lora, global_name)
        module.adapter.stacked = _in_every_layer(lora, global_name, module.config.num_layers)
        module.forward = _WithAdapter(module.forward, module.adapter)
        added.append(global_name)
    return added


def _adapt_experts(experts: torch.nn.Module, lora: LoRAConfig, global_name: str) -> List[str]:
    """Adapters on the routed experts ``experts`` (global name ``...mlp.experts``) for each
    projection whose every expert ``...experts.local_experts.<g>.<proj>`` is a target; the
    local experts' target names. Some experts of a layer only are refused by name."""
    from megatron.core.transformer.moe.expert_lora import ExpertLoRAAdapter, WithExpertAdapters

    total = experts.config.num_moe_experts
    adapters = torch.nn.ModuleDict()
    for proj in ("linear_fc1", "linear_fc2"):
        names = [f"{global_name}.local_experts.{g}.{proj}" for g in range(total)]
        chosen = [g for g, n in enumerate(names) if lora.matches(n)]
        if chosen and len(chosen) < total:
            raise ValueError(
                f"{lora.flags.get('target_modules', 'target_modules')} (less "
                f"{lora.flags.get('exclude_modules', 'exclude_modules')}) adapt experts "
                f"{chosen} of {global_name}'s {proj} but not the others: adapters go on every "
                "routed expert of a layer's projection or on none"
            )
        if not chosen:
            continue
        if getattr(experts, "fp8_experts", None) is not None:
            excludes = lora.flags.get("exclude_modules", "exclude_modules")
            raise ValueError(
                f"LoRA target {names[0]}: adapters on routed experts do not run with FP8 "
                f"expert GEMMs (--fp8); leave the experts out ({excludes} '*.experts.*')"
            )
        adapters[proj] = ExpertLoRAAdapter(
            experts,
            proj,
            lora,
            f"{global_name}.{proj}",
            lambda g, p=proj: f"{global_name}.local_experts.{g}.{p}",
        )
        adapters[proj].stacked = _in_every_layer(lora, names[0], experts.config.num_layers)
    if not adapters:
        return []
    experts.adapter = adapters
    experts.forward = WithExpertAdapters(experts, experts.forward, adapters)
    first = experts.first_expert
    return [f"{global_name}.local_experts.{first + i}.{proj}"
            for i in range(experts.num_local_experts) for proj in adapters]  # fmt: skip


def separate_partial_adapters(
    model: torch.nn.Module, sharded_state_dict: dict, prefix: str = ""
) -> None:
    """Store the adapters that only some layers have (``*.layers.0.*``) one layer at a
    time, in place (``GPTModel.sharded_state_dict`` calls it): a block stacks each tensor
    over every layer (``decoder.layers.<name>`` [num_layers, ...]), which such an adapter
    would leave with gaps; theirs become ``decoder.layers.<global layer>.<name>`` without the
    layer axis (the non-homogeneous block's form). Decided from the targets alone, so every
    stage and layout agrees."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    layers = f"{prefix}decoder.layers."
    prefixes = tuple(
        layers + _storage_rest(name) + ".adapter."
        for name, adapter in lora_modules(model).items()
        if not getattr(adapter, "stacked", True)
    )
    if not prefixes:
        return

    def separate(x):
        if not isinstance(x, (ShardedTensor, ShardedObject)) or not x.key.startswith(prefixes):
            return x
        layer = x.global_offset[0]
        changes = dict(
            key=f"{layers}{layer}.{x.key[len(layers):]}",
            global_shape=x.global_shape[1:],
            global_offset=x.global_offset[1:],
        )
        if isinstance(x, ShardedTensor):
            fragments = x.axis_fragmentations
            changes.update(
                local_shape=x.local_shape[1:],
                prepend_axis_num=x.prepend_axis_num - 1,
                axis_fragmentations=None if fragments is None else fragments[1:],
            )
        return dataclasses.replace(x, **changes)

    dict_list_map_inplace(separate, sharded_state_dict)


def _storage_rest(name: str) -> str:
    """The checkpoint key of adapted layer ``name`` after ``decoder.layers.``: the routed
    experts' (``...mlp.experts.<proj>``) under megatron-core's ``mlp.experts.experts.``."""
    rest = name.split(".", 3)[3]
    if rest.startswith("mlp.experts.linear_fc"):
        rest = rest.replace("mlp.experts.", "mlp.experts.experts.", 1)
    return rest


def lora_modules(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """{global name of the base layer: its adapter} for the adapters in ``model`` (a routed
    experts' projection ``...mlp.experts.linear_fc1``: its ``ExpertLoRAAdapter``)."""
    from megatron.core.transformer.moe.expert_lora import ExpertLoRAAdapter

    kinds = (LoRAAdapter, ExpertLoRAAdapter)
    return {m.global_name: m for m in model.modules() if isinstance(m, kinds)}


def global_module_name(model: torch.nn.Module, local_name: str) -> Optional[str]:
    """The module's name with the chunk-local layer index replaced by the global one
    (``decoder.layers.3.mlp.linear_fc1`` on any pipeline stage); None for wrappers' names."""
    parts = local_name.split(".")
    if "layers" not in parts:
        return local_name
    i = parts.index("layers")
    if i + 1 >= len(parts) or not parts[i + 1].isdigit():
        return local_name
    layer = model.get_submodule(".".join(parts[: i + 2]))
    number = getattr(layer, "layer_number", None)
    if number is None:
        return local_name
    parts[i + 1] = str(number - 1)
    return ".".join(parts)


class LoRAAdapter(torch.nn.Module):
    """scale * B A x for one base layer, sharded like it (see the module docstring)."""

    def __init__(self, base: torch.nn.Module, lora: LoRAConfig, global_name: str) -> None:
        super().__init__()
        self.global_name = global_name
        self.scale = lora.scale
        self.dropout, self.dropout_position = lora.dropout, lora.dropout_position
        self.row_parallel = isinstance(base, RowParallelLinear)
        tp_group = getattr(base, "tp_group", None)  # a replicated base has none
        tp_size = tp_group.size() if tp_group is not None else 1
        # the base layer's own switch: MLA's up projections turn it off (whole input)
        sequence_parallel = getattr(base, "sequence_parallel", base.config.sequence_parallel)
        config = ModelParallelConfig(
            tensor_model_parallel_size=tp_size,
            sequence_parallel=sequence_parallel and tp_size > 1,
            params_dtype=lora.params_dtype,
            perform_initialization=True,
            use_cpu_initialization=base.config.use_cpu_initialization,
            gradient_accumulation_fusion=base.config.gradient_accumulation_fusion,
        )
        generator = torch.Generator().manual_seed(adapter_seed(lora.seed, global_name))
        init_a = adapter_init_method(lora.lora_A_init_method, generator)
        init_b = adapter_init_method(lora.lora_B_init_method, generator)
        stride = getattr(base.weight, "partition_stride", 1)
        # A [dim, in] is split like the base layer's input: row-parallel when the base is.
        linear_in = dict(config=config, init_method=init_a, bias=False, tp_group=tp_group)
        if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
            self._replicated(base, lora, init_a, init_b)
        elif self.row_parallel:
            self.linear_in = RowParallelLinear(
                base.input_size, lora.dim, input_is_parallel=True, skip_bias_add=True, **linear_in
            )
            weight = torch.empty(base.output_size, lora.dim, dtype=torch.float32)
            init_b(weight)
            self.linear_out = _ReplicatedLinear(
                weight.to(device=base.weight.device, dtype=lora.params_dtype),
                sequence_parallel=base.sequence_parallel,
            )
        else:
            if lora.dim % tp_size:
                raise ValueError(
                    f"{lora.flags.get('dim', 'dim')} {lora.dim} is not divisible by the "
                    f"tensor-parallel size {tp_size} ({global_name}'s adapter splits its "
                    "rank dimension over TP)"
                )
            self.linear_in = ColumnParallelLinear(
                base.input_size, lora.dim, gather_output=True, **linear_in
            )
            self.linear_out = ColumnParallelLinear(
                lora.dim,
                base.output_size,
                config=dataclasses.replace(config, sequence_parallel=False),
                init_method=init_b,
                bias=False,
                gather_output=False,
                stride=stride,
                tp_group=tp_group,
            )

    def _replicated(self, base, lora: LoRAConfig, init_a, init_b) -> None:
        """A and B whole on every TP rank for a replicated base (MLA's down projections:
        whole input, complete output gradient, so complete adapter gradients)."""
        weights = []
        for shape, init in (((lora.dim, base.input_size), init_a), ((base.output_size, lora.dim),
                                                                    init_b)):  # fmt: skip
            weight = torch.empty(shape, dtype=torch.float32)
            init(weight)
            weights.append(weight.to(device=base.weight.device, dtype=lora.params_dtype))
        self.linear_in = _ReplicatedLinear(weights[0], sequence_parallel=False)
        self.linear_out = _ReplicatedLinear(weights[1], sequence_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A dropout(x) (pre) or dropout(scale * B A x) (post), in the adapter's
        dtype, returned in ``x``'s dtype."""
        dtype = self.linear_in.weight.dtype
        h = x.to(dtype)
        if self.dropout_position == "pre" and self.dropout > 0:
            h = F.dropout(h, p=self.dropout, training=self.training)
        h, _ = self.linear_in(h)
        y, _ = self.linear_out(h)
        y = y * self.scale
        if self.dropout_position == "post" and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=self.training)
        return y.to(x.dtype)


class _ReplicatedLinear(torch.nn.Module):
    """y = x B^T with B replicated over TP (the row-parallel adapter's B)."""

    def __init__(self, weight: torch.Tensor, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.weight.allreduce = True
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class _WithAdapter:
    """A base layer's forward with its adapter's output added: (W x + scale B A x, bias).

    Set as the base layer's ``forward`` (an instance attribute) rather than added by a forward
    hook, so that the base layer and its adapter are one call: ``--compile`` keeps each linear
    layer eager as one island around its hand-written autograd, and with a hook the adapter
    was traced on its own (its two linear layers and the add three more graph breaks per
    target: compiled LoRA ran at half the eager LoRA speed on one H200)."""

    def __init__(self, base_forward: Callable, adapter: "LoRAAdapter") -> None:
        self.base_forward = base_forward
        self.adapter = adapter

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> tuple:
        out, bias = self.base_forward(x, *args, **kwargs)
        return out + self.adapter(x), bias


def _in_every_layer(lora: LoRAConfig, global_name: str, num_layers: int) -> bool:
    """Whether every layer's module at ``global_name``'s place gets an adapter (so the
    adapter's tensors stack over the layers); a name outside the layers counts as yes."""
    parts = global_name.split(".")
    if parts[:2] != ["decoder", "layers"] or not parts[2].isdigit():
        return True
    rest = ".".join(parts[3:])
    return all(lora.matches(f"decoder.layers.{i}.{rest}") for i in range(num_layers))


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(lora_pattern_matches(name, p) for p in patterns)
