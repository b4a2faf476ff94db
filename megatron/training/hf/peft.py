"""LoRA adapters in HuggingFace PEFT's format, out of a checkpoint and back into a model.

Our adapter on a fused layer is one A [r, in] and one B [out, r]; PEFT puts one (A, B) pair
on each HuggingFace module. The family's weight table (``layer_sources``) says which rows of
our layer's output are which rows of which HuggingFace module, so B is cut exactly as the
base weight is (``linear_qkv`` into ``q_proj`` / ``k_proj`` / ``v_proj`` rows, or into
``c_attn``'s interleaved rows for GPT-2; ``linear_fc1`` into ``gate_proj`` / ``up_proj``),
and every module of the layer gets the same A:

    W_m x + (alpha / r) B_m A x   for each HuggingFace module m  ==  our W x + (alpha/r) B A x.

PEFT keeps ``lora_A`` [r, in] / ``lora_B`` [out, r] as linear layers also for GPT-2's
Conv1D (``fan_in_fan_out`` concerns the base weight only). Keys:
``base_model.model.<module>.lora_A.weight``. ``merge_adapters`` folds W + (alpha/r) B A in
float32 for a merged export. Written here because peft converts its own ``nn.Linear``
wrappers only; the table is the converter's.
"""

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.config_rules import lora_attention_names, lora_module_names
from megatron.core.tensor_parallel.utils import strided_shard
from megatron.core.transformer.lora import LoRAConfig
from megatron.training.hf.family import HFArchitecture, Source
from megatron.training.hf.weights import layer_sources, our_full_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# the trainer's run settings that describe the adapters (recorded in every checkpoint)
LORA_SETTINGS = ("lora_dim", "lora_alpha", "lora_dropout", "lora_target_modules",
                 "lora_exclude_modules")  # fmt: skip


def lora_of_settings(settings: Dict[str, Any]) -> Optional[LoRAConfig]:
    """The ``LoRAConfig`` a checkpoint's run settings record (None: no adapters), through
    the trainer's own path (``lora_settings.lora_of_settings``)."""
    from megatron.training import lora_settings

    return lora_settings.lora_of_settings(settings)


def adapted_layers(arch: HFArchitecture, lora: LoRAConfig) -> List[str]:
    """Our one-chunk names of the layers with an adapter (``decoder.layers.3.mlp.linear_fc1``;
    a MoE layer's shared expert ``...mlp.shared_experts.linear_fc1``; a routed expert's
    ``...mlp.experts.local_experts.<g>.linear_fc1``)."""
    moe = arch.num_moe_experts is not None
    names = lora_module_names(
        arch.num_layers,
        [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)] if moe else None,
        arch.num_moe_experts or 0,
        moe and arch.moe_shared_expert_intermediate_size is not None,
        lora_attention_names(arch.multi_latent_attention, arch.q_lora_rank is not None),
    )
    return [n for n in names if lora.matches(n)]


def adapter_shapes(arch: HFArchitecture, lora: LoRAConfig) -> Dict[str, Tuple[int, int]]:
    """{our adapter parameter name: full shape}: A [r, in], B [out, r] of each layer."""
    base = our_full_shapes(arch)
    shapes = {}
    for name in adapted_layers(arch, lora):
        out_features, in_features = base[f"{name}.weight"]
        shapes[f"{name}.adapter.linear_in.weight"] = (lora.dim, in_features)
        shapes[f"{name}.adapter.linear_out.weight"] = (out_features, lora.dim)
    return shapes


def to_peft(
    adapters: Dict[str, torch.Tensor], arch: HFArchitecture, lora: LoRAConfig
) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """(PEFT's tensors, the HuggingFace module names adapted) from our full adapter tensors."""
    tensors: Dict[str, torch.Tensor] = {}
    modules: List[str] = []
    layers = adapted_layers(arch, lora)
    for (layer, proj), key in _expert_keys(arch, layers).items():
        names = [f"{layer}.local_experts.{g}.{proj}" for g in range(arch.num_moe_experts)]
        a = torch.cat([adapters[f"{n}.adapter.linear_in.weight"] for n in names])
        b = torch.stack([adapters[f"{n}.adapter.linear_out.weight"] for n in names], dim=-1)
        b = torch.empty_like(b).index_copy_(0, _expert_output_order(arch, layer, proj), b)
        tensors[f"{key}.lora_A.weight"] = a  # [E r, in]: expert e's A is rows e r .. e r + r
        tensors[f"{key}.lora_B.weight"] = b.flatten(1)  # [out, r E]: column k E + e
        modules.append(_expert_parameter(arch, layer, proj))
    for name in layers:
        if ".local_experts." in name:
            continue
        a = adapters[f"{name}.adapter.linear_in.weight"]
        b = adapters[f"{name}.adapter.linear_out.weight"]
        offset = 0
        for seg in _source(arch, name):
            module = seg.key[: -len(".weight")]
            key = f"{PEFT_PREFIX}{module}"
            if module not in modules:
                modules.append(module)
                tensors[f"{key}.lora_A.weight"] = a.clone()
                rows = _module_rows(arch, name, module)
                tensors[f"{key}.lora_B.weight"] = torch.zeros(rows, lora.dim, dtype=b.dtype)
            tensors[f"{key}.lora_B.weight"][seg.start : seg.stop] = b[offset : offset + seg.length]
            offset += seg.length
    return tensors, modules


def from_peft(
    tensors: Dict[str, torch.Tensor], arch: HFArchitecture, lora: LoRAConfig, where: str
) -> Dict[str, torch.Tensor]:
    """Our full adapter tensors from PEFT's (the inverse of ``to_peft``). The modules of one
    fused layer must share their A (an adapter trained elsewhere with different A per q/k/v
    has rank 3r as one fused adapter: refused, naming the modules)."""
    out: Dict[str, torch.Tensor] = {}
    layers = adapted_layers(arch, lora)
    for (layer, proj), key in _expert_keys(arch, layers).items():
        experts, r = arch.num_moe_experts, lora.dim
        for suffix in ("lora_A.weight", "lora_B.weight"):
            if f"{key}.{suffix}" not in tensors:
                raise ValueError(f"{where}: no tensor {key}.{suffix} (needed for {layer}.{proj})")
        a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        out_rows, in_cols = our_full_shapes(arch)[f"{layer}.local_experts.0.{proj}.weight"]
        if tuple(a.shape) != (experts * r, in_cols) or tuple(b.shape) != (out_rows, r * experts):
            raise ValueError(
                f"{where}: {key}.lora_A / lora_B have shapes {list(a.shape)} / "
                f"{list(b.shape)}, expected [{experts * r}, {in_cols}] / [{out_rows}, "
                f"{r * experts}] ({experts} experts, r = {r})"
            )
        b = b.reshape(out_rows, r, experts)[_expert_output_order(arch, layer, proj)]
        for g in range(experts):
            name = f"{layer}.local_experts.{g}.{proj}"
            out[f"{name}.adapter.linear_in.weight"] = a[g * r : (g + 1) * r]
            out[f"{name}.adapter.linear_out.weight"] = b[..., g]
    for name in layers:
        if ".local_experts." in name:
            continue
        a, parts = None, []
        for seg in _source(arch, name):
            key = f"{PEFT_PREFIX}{seg.key[: -len('.weight')]}"
            for suffix in ("lora_A.weight", "lora_B.weight"):
                if f"{key}.{suffix}" not in tensors:
                    raise ValueError(f"{where}: no tensor {key}.{suffix} (needed for {name})")
            this_a = tensors[f"{key}.lora_A.weight"]
            if this_a.shape != (lora.dim, our_full_shapes(arch)[f"{name}.weight"][1]):
                raise ValueError(
                    f"{where}: {key}.lora_A.weight has shape {list(this_a.shape)}, expected "
                    f"[{lora.dim}, {our_full_shapes(arch)[f'{name}.weight'][1]}] (r = {lora.dim})"
                )
            if a is None:
                a = this_a
            elif not torch.equal(a, this_a):
                raise ValueError(
                    f"{where}: {key}.lora_A.weight differs from the A of the other modules of "
                    f"{name}; our fused layer has one A (train separate adapters per module "
                    "elsewhere, or merge them first)"
                )
            parts.append(tensors[f"{key}.lora_B.weight"][seg.start : seg.stop])
        out[f"{name}.adapter.linear_in.weight"] = a
        out[f"{name}.adapter.linear_out.weight"] = torch.cat(parts, dim=0)
    return out


def peft_config(
    arch: HFArchitecture, lora: LoRAConfig, modules: List[str], base: Optional[str]
) -> Dict[str, Any]:
    """``adapter_config.json``: exact module names as targets (a wildcard or exclusion that
    adapts some layers only is kept exactly), GPT-2's Conv1D as ``fan_in_fan_out``; routed
    experts' 3-D parameters (``...mlp.experts.gate_up_proj``) as ``target_parameters``, with
    ``lora_dropout`` 0 (peft's parameter wrapper takes no dropout; it acts in training only)."""
    parameters = sorted(m for m in modules if _is_expert_parameter(arch, m))
    modules = [m for m in modules if m not in parameters]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.dim,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if parameters else lora.dropout,
        "target_modules": sorted(modules),
        "target_parameters": parameters or None,
        "fan_in_fan_out": arch.family == "gpt2",
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


# adapter_config.json keys that give some modules another rank or alpha: peft applies them,
# our fused layers have one --lora-dim and one --lora-alpha, so a non-empty one is refused
PER_MODULE_KEYS = ("rank_pattern", "alpha_pattern")


def read_peft_config(directory: Path) -> Dict[str, Any]:
    """``adapter_config.json`` of a PEFT folder, checked for what we can express: a LoRA
    adapter with ``r`` (a positive integer) and ``lora_alpha`` (a positive number), one rank
    and alpha for every module (``rank_pattern`` / ``alpha_pattern`` empty), no rsLoRA, DoRA
    or bias (else a ValueError naming the file and the key)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    expected = {"peft_type": "LORA", "use_rslora": False, "use_dora": False, "bias": "none"}
    for key, value in expected.items():
        if raw.get(key, value) != value:
            raise ValueError(f"{path}: {key}={raw.get(key)!r} is not supported; expected {value!r}")
    for key, what, kind in (("r", "the adapter's rank", int), ("lora_alpha", "its scale", float)):
        value = raw.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value <= 0 or (kind is int and value != int(value)):
            found = f"no {key!r}" if key not in raw else f"{key}={value!r}"
            expected_value = "a positive integer" if kind is int else "a positive number"
            raise ValueError(f"{path}: {found} ({what}); expected {expected_value}")
    for key in PER_MODULE_KEYS:
        if raw.get(key):
            raise ValueError(
                f"{path}: {key}={raw[key]!r} gives some modules another "
                f"{'rank' if key == 'rank_pattern' else 'alpha'}, which peft applies and our "
                "fused adapters cannot (one --lora-dim and --lora-alpha for every layer); "
                f"expected {key} empty"
            )
    return raw


def merge_adapters(
    ours: Dict[str, torch.Tensor], adapters: Dict[str, torch.Tensor], lora: LoRAConfig
) -> Dict[str, torch.Tensor]:
    """Base weights with W + (alpha/r) B A folded in (float32 arithmetic, the base dtype kept)."""
    merged = dict(ours)
    for name, weight in ours.items():
        layer = name[: -len(".weight")]
        a = adapters.get(f"{layer}.adapter.linear_in.weight")
        if a is None or not name.endswith(".weight"):
            continue
        b = adapters[f"{layer}.adapter.linear_out.weight"]
        delta = lora.scale * (b.float() @ a.float())
        merged[name] = (weight.float() + delta).to(weight.dtype)
    return merged


# The families whose transformers model holds the routed experts as 3-D parameters that
# peft adapts by ``target_parameters`` (one A, B per expert): the experts module and our
# projection -> its parameter, in the module's parameter order (peft nests one wrapper per
# parameter in that order: the first is innermost, its keys ``experts.base_layer.lora_A``).
# GPT-OSS's [E, in, out] parameters are peft's ``is_transposed`` form (transformers marks
# its experts so); their output axis is reordered by ``_expert_output_order``.
PEFT_EXPERTS = {
    family: ("mlp.experts", {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"})
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
}


def check_peft_form(arch: HFArchitecture, lora: LoRAConfig) -> None:
    """Refuse (ValueError naming ``--merge-lora``) adapters on routed experts of a family
    whose expert parameters have no PEFT form here; before a run that would export them."""
    experts = [n for n in adapted_layers(arch, lora) if ".local_experts." in n]
    if experts:
        _expert_parameter(arch, experts[0].split(".local_experts.")[0], "linear_fc1")


def _expert_parameter(arch: HFArchitecture, layer: str, proj: str) -> str:
    """The transformers parameter of our ``<layer>.mlp.experts`` projection ``proj``
    (``model.layers.3.mlp.experts.gate_up_proj``); a family without one is refused."""
    if arch.family not in PEFT_EXPERTS:
        raise ValueError(
            f"LoRA adapters on the routed experts of a {arch.family} model have no PEFT "
            "adapter form here (no expert parameter table for the family); export the merged "
            "model instead (--export-hf DIR --merge-lora), or leave the experts out "
            "(--lora-exclude-modules '*.experts.*')"
        )
    module, params = PEFT_EXPERTS[arch.family]
    return f"model.layers.{layer.split('.')[2]}.{module}.{params[proj]}"


def _expert_output_order(arch: HFArchitecture, layer: str, proj: str) -> torch.Tensor:
    """The index on the expert parameter's output axis (which B's rows follow) of each
    output row of our expert projection ``proj`` of ``layer``, from the family's table: the
    tensors of separate per-expert modules (Mixtral's w1, w3) one after the other, as
    transformers fuses them; GPT-OSS's fused fc1: our [gate; up] rows are its interleaved
    columns 0, 2, ... and 1, 3, ..."""
    table = layer_sources(arch, int(layer.split(".")[2]))
    order, end, offsets = [], 0, {}
    for seg in table[f"{layer}.local_experts.0.{proj}.weight"]:
        offset = offsets.setdefault(seg.key, end)
        order += [offset + i for i in range(seg.start, seg.stop, seg.step)]
        end = max(end, offset + seg.stop)
    return torch.tensor(order)


def _is_expert_parameter(arch: HFArchitecture, name: str) -> bool:
    if arch.family not in PEFT_EXPERTS:
        return False
    module, params = PEFT_EXPERTS[arch.family]
    return any(name.endswith(f".{module}.{p}") for p in params.values())


def _expert_keys(arch: HFArchitecture, layers: List[str]) -> Dict[Tuple[str, str], str]:
    """{(our ``decoder.layers.L.mlp.experts``, projection): PEFT key prefix} of the adapted
    routed experts among ``layers`` (every expert of a projection, as the trainer adapts)."""
    chosen: Dict[str, List[str]] = {}
    for name in layers:
        if ".local_experts." in name:
            layer, rest = name.split(".local_experts.")
            projs = chosen.setdefault(layer, [])
            if rest.split(".")[1] not in projs:
                projs.append(rest.split(".")[1])
    keys = {}
    for layer, projs in chosen.items():
        order = [p for p in ("linear_fc1", "linear_fc2") if p in projs]
        for depth, proj in enumerate(order):
            module = _expert_parameter(arch, layer, proj).rsplit(".", 1)[0]
            nesting = "base_layer." * (len(order) - 1 - depth)
            keys[(layer, proj)] = f"{PEFT_PREFIX}{module}.{nesting}".rstrip(".")
    return keys


def _load_expert_adapter(adapter, full: Dict[str, torch.Tensor]) -> None:
    """Copy this rank's experts' (and expert-TP shards') A and B out of ``full``."""

    group = adapter.group
    size, rank = (1, 0) if group is None else (group.size(), group.rank())
    layer = adapter.global_name.rsplit(".", 1)[0]
    first = adapter.first_expert
    with torch.no_grad():
        for part in ("linear_in", "linear_out"):
            param = getattr(adapter, part).weight
            for i in range(param.shape[0]):
                name = f"{layer}.local_experts.{first + i}.{adapter.proj}"
                value = full[f"{name}.adapter.{part}.weight"]
                dim, stride = param.partition_dim - 1, param.partition_stride
                param[i].copy_(strided_shard(value, dim, stride, size, rank))


def _source(arch: HFArchitecture, name: str) -> Source:
    layer = int(name.split(".")[2])
    return layer_sources(arch, layer)[f"{name}.weight"]


def _module_rows(arch: HFArchitecture, name: str, module: str) -> int:
    """The output size of HuggingFace module ``module`` (rows of its lora_B)."""
    return max(seg.stop for seg in _source(arch, name) if seg.key == f"{module}.weight")


def load_peft_adapter(model: torch.nn.Module, directory, arch: HFArchitecture, lora) -> None:
    """Load a PEFT adapter folder into the adapters of ``model`` (a GPT chunk with
    ``apply_lora`` done, at any TP/PP layout): r and alpha must be the run's, every tensor
    the adapters need must be there and every tensor there must be used (else a ValueError
    naming them)."""
    from safetensors.torch import load_file

    from megatron.core.transformer.lora import global_module_name, lora_modules
    from megatron.core.transformer.moe.expert_lora import ExpertLoRAAdapter

    directory = Path(directory)
    raw = read_peft_config(directory)
    for key, ours, flag in (("r", lora.dim, "--lora-dim"), ("lora_alpha", lora.alpha,
                                                               "--lora-alpha")):  # fmt: skip
        if float(raw[key]) != float(ours):
            raise ValueError(
                f"{directory / ADAPTER_CONFIG}: {key}={raw.get(key)!r}, but {flag} {ours}"
            )
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(path))
    full = from_peft(tensors, arch, lora, str(path))
    layers = adapted_layers(arch, lora)
    used = {f"{key}.{s}" for key in _expert_keys(arch, layers).values()
            for s in ("lora_A.weight", "lora_B.weight")}  # fmt: skip
    for name in layers:
        if ".local_experts." in name:
            continue
        for seg in _source(arch, name):
            key = f"{PEFT_PREFIX}{seg.key[: -len('.weight')]}"
            used.update({f"{key}.lora_A.weight", f"{key}.lora_B.weight"})
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"{path}: {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} adapt layers "
            "this run's --lora-target-modules do not (set the same targets)"
        )
    local = {}
    for local_name, module in model.named_modules():
        if isinstance(module, ExpertLoRAAdapter):
            _load_expert_adapter(module, full)
        elif module in lora_modules(model).values():
            local[global_module_name(model, local_name).rsplit(".adapter", 1)[0]] = module
    with torch.no_grad():
        for layer, adapter in local.items():
            for part in ("linear_in", "linear_out"):
                param = getattr(adapter, part).weight
                value = full[f"{layer}.adapter.{part}.weight"]
                param.copy_(_tp_slice(value, param, getattr(adapter, part)))


def _tp_slice(full: torch.Tensor, param: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """This TP rank's part of ``full``: along ``partition_dim``, blocks r, r + T, ... of
    T * ``partition_stride`` blocks (the whole tensor for a replicated parameter)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group = getattr(layer, "tp_group", None)
    size, rank = (1, 0) if group is None else (group.size(), group.rank())
    stride = getattr(param, "partition_stride", 1)
    return strided_shard(full, param.partition_dim, stride, size, rank)


def lora_settings_of_peft(directory, arch: HFArchitecture) -> Dict[str, Any]:
    """The trainer's LoRA settings of PEFT folder ``directory`` on a model of ``arch``:
    ``lora_dim`` and ``lora_alpha`` (``r``, ``lora_alpha``) and, as exact layer names,
    ``lora_target_modules`` (our layers whose HuggingFace modules ``target_modules`` selects,
    less ``exclude_modules`` and layers outside ``layers_to_transform``, as PEFT matches
    them) with no exclusions. A fused layer only some of whose modules are targeted is
    refused naming it."""
    raw = read_peft_config(Path(directory))
    where = Path(directory) / ADAPTER_CONFIG
    targets = []
    for name in adapted_layers(arch, LoRAConfig(target_modules=("*",))):  # every candidate
        if ".local_experts." in name:  # peft's target_parameters (3-D expert parameters)
            if _peft_selects_parameter(raw, arch, name):
                targets.append(name)
            continue
        layer = int(name.split(".")[2])
        sources = layer_sources(arch, layer)
        if f"{name}.weight" not in sources:
            continue
        modules = sorted({seg.key[: -len(".weight")] for seg in sources[f"{name}.weight"]})
        chosen = [m for m in modules if _peft_selects(raw, m, layer)]
        if chosen and len(chosen) < len(modules):
            raise ValueError(
                f"{where}: target_modules adapts {', '.join(chosen)} but not "
                f"{', '.join(sorted(set(modules) - set(chosen)))}; our {name} fuses them "
                "into one layer, so adapt all of them or none"
            )
        if chosen:
            targets.append(name)
    if not targets:
        raise ValueError(
            f"{where}: target_modules {raw.get('target_modules')!r} selects none of this "
            "model's attention or dense MLP layers (the layers LoRA adapts here)"
        )
    return dict(
        lora_dim=int(raw["r"]),
        lora_alpha=float(raw.get("lora_alpha", raw["r"])),
        lora_target_modules=tuple(targets),
        lora_exclude_modules=(),
    )


def _peft_selects_parameter(raw: Dict[str, Any], arch: HFArchitecture, name: str) -> bool:
    """Whether ``target_parameters`` (names or name suffixes, as peft matches them) names
    the expert parameter of routed expert layer ``name``."""
    wanted = raw.get("target_parameters") or ()
    if not wanted or arch.family not in PEFT_EXPERTS:
        return False
    layer, rest = name.split(".local_experts.")
    parameter = _expert_parameter(arch, layer, rest.split(".")[1])
    return any(parameter == t or parameter.endswith("." + t) for t in wanted)


def _peft_selects(raw: Dict[str, Any], module: str, layer: int) -> bool:
    """PEFT's rule: a string is a regular expression on the whole module name, a list holds
    names or name suffixes; ``exclude_modules`` likewise; ``layers_to_transform`` keeps
    the listed layer indices."""

    def matches(spec: Any) -> bool:
        if isinstance(spec, str):
            return re.fullmatch(spec, module) is not None
        return any(module == t or module.endswith("." + t) for t in spec or ())

    layers = raw.get("layers_to_transform")
    if layers is not None and layer not in ([layers] if isinstance(layers, int) else layers):
        return False
    return matches(raw.get("target_modules")) and not matches(raw.get("exclude_modules"))
