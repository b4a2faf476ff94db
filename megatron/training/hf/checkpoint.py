"""HuggingFace directory <-> our ``dist_checkpointing`` checkpoint (the trainer's layout).

``import_hf(hf_dir, out_dir)`` writes ``out_dir/iter_0000000`` (the model only, in the
checkpoint's dtype, with the run settings the trainer records and the original
``config.json``) and points ``latest_checkpointed_iteration.txt`` at it; the trainer's
``--load`` reads it at any layout. ``export_hf(load_dir, out_dir)`` reads a checkpoint
(imported or trained) one layer at a time and writes ``config.json`` plus safetensors shards
of at most ``max_shard_size`` bytes (with ``model.safetensors.index.json`` when there are
several), so neither direction holds the model twice.

Export never destroys what it did not write: the target must be new, empty or an earlier
export of ours (its safetensors files carry ``EXPORT_METADATA``; ``overwrite`` allows any
folder), and the files are written into a staging folder beside it and moved in only once
all of them are complete, so a failed export leaves the target as it was.
"""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.communication import barrier, world_group
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.load_aliases import stored_alias
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import checkpointing
from megatron.training.checkpointing import TRACKER_FILENAME, checkpoint_dir
from megatron.training.hf.config import (
    HFArchitecture,
    architecture_from_config,
    architecture_from_model_settings,
    hf_config_for_export,
    read_hf_config,
    training_settings,
)
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.mtp_weights import mtp_copies
from megatron.training.hf.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_shapes,
    lora_of_settings,
    merge_adapters,
    peft_config,
    to_peft,
)
from megatron.training.hf.target import (
    EXPORT_METADATA,
    SIDECAR_FILES,
    STAGING_MARK,
    check_export_target,
)
from megatron.training.hf.weights import (
    INDEX_FILENAME,
    SINGLE_FILENAME,
    global_sources,
    hf_shapes,
    layer_sources,
    mtp_parameter_sources,
    our_full_shapes,
    safetensors_module,
    scatter_to_hf,
)
from megatron.training.lora_base import LORA_BASE_KEY

MODEL_ONLY_KEY = "model_only"
HF_CONFIG_KEY = "hf_config"
HF_FILES_KEY = "hf_files"
SIDECAR_LIMIT = 64 * 1024 * 1024
DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3
# Stored tensors whose rows are the vocabulary: a padded model stores more rows than the
# true vocabulary; export writes the true ones.
PADDED_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_hf(hf_dir, out_dir, dtype: Optional[str] = None, allow_non_finite: bool = False) -> Path:
    """Convert the HuggingFace model in ``hf_dir`` into ``out_dir/iter_0000000`` (one
    process). ``dtype``: the stored dtype (default: the checkpoint's, so export gives the
    original bytes back); ``allow_non_finite``: see ``model_from_hf``. Returns the
    iteration directory."""
    from megatron.training.hf.loading import model_from_hf

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("import_hf runs on one process; launch it without torchrun")
    arch, raw = read_hf_config(hf_dir)
    dtype = dtype or arch.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise NotADirectoryError(f"--out {out_dir} is a file; expected a checkpoint folder")
    model, _ = model_from_hf(
        hf_dir,
        params_dtype=DTYPES[dtype],
        use_cpu_initialization=True,
        allow_non_finite=allow_non_finite,
    )
    directory = checkpoint_dir(str(out_dir), 0)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.sharded_state_dict(),
        "iteration": 0,
        "consumed_samples": 0,
        "layout": {"world_size": 1},
        "run_settings": training_settings(arch),
        "checkpoint_version": 3.0,
        MODEL_ONLY_KEY: True,
        HF_CONFIG_KEY: json.dumps(raw),
        HF_FILES_KEY: _sidecar_files(Path(hf_dir)),
    }
    dist_checkpointing.save(state, str(directory))
    tracker = Path(out_dir) / TRACKER_FILENAME
    tmp = tracker.with_name(tracker.name + ".tmp")
    tmp.write_text("0")
    os.replace(tmp, tracker)
    return directory


def export_hf(
    load_dir,
    out_dir,
    dtype: Optional[str] = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> Path:
    """Write the model of checkpoint ``load_dir`` (a ``--save`` directory, its newest
    complete iteration, or an ``iter_*`` directory) to ``out_dir`` in HuggingFace format.

    ``dtype``: of the written tensors (default: the checkpoint's). ``out_dir`` must be new,
    empty or an earlier export (``check_export_target``; ``overwrite``: any folder, whose
    model files are replaced). The files are staged beside ``out_dir`` and moved in at the
    end: a failure leaves ``out_dir`` as it was. Collective when torch.distributed is
    initialized: every rank calls it, rank 0 reads and writes. A checkpoint with LoRA
    adapters is written as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``, the tokenizer files), or with ``merge_lora`` as the
    merged model (W + alpha/r B A, in float32).
    """
    out_dir = check_export_target(out_dir, overwrite=overwrite)
    directory = resolve_checkpoint(load_dir)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    arch, original = checkpoint_architecture(common, directory)
    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    lora = lora_of_settings(common.get("run_settings") or {})
    if merge_lora and lora is None:
        raise ValueError(f"--merge-lora: checkpoint {directory} has no LoRA adapters to merge")
    if merge_lora and common.get("trainable_params_only"):
        raise ValueError(
            f"--merge-lora: checkpoint {directory} holds the LoRA adapters only (saved with "
            "--save-trainable-params-only), not the base to merge them into; export the "
            "adapter (without --merge-lora), or merge from a full checkpoint"
        )
    adapter_only = lora is not None and not merge_lora
    if adapter_only and arch.moe_router_enable_expert_bias:
        raise ValueError(
            f"export: checkpoint {directory} has LoRA adapters on a model whose routers have "
            "an expert bias (moe_router_enable_expert_bias), which training moved; a PEFT "
            "adapter cannot carry it: export with --merge-lora (the merged model, trained "
            "bias included)"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not adapter_only:  # an adapter-only checkpoint holds no embedding (nor needs one)
        embedding = stored.get("embedding.word_embeddings.weight")
        if embedding is None:
            raise ValueError(
                f"{directory}: no embedding.word_embeddings.weight; not a GPT checkpoint"
            )
        dtype = dtype or _dtype_name(embedding.dtype)
    writing = not dist.is_initialized() or dist.get_rank() == 0
    staging = _make_staging(out_dir) if writing else None
    try:
        if adapter_only:
            _export_adapter_into(staging, directory, common, arch, stored, dtype)
        else:
            merge = lora if merge_lora else None
            _export_into(
                staging, directory, common, arch, original, stored, dtype, max_shard_size, merge
            )
        if writing:
            _move_into(staging, out_dir)
    finally:
        if staging is not None:
            remove_tree(staging)
    barrier(world_group())
    return out_dir


def _make_staging(out_dir: Path) -> Path:
    """A fresh folder beside ``out_dir`` (the same file system, so moving is renaming)."""
    staging = out_dir.parent / f".{out_dir.name}{STAGING_MARK}{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_tree(staging)
        staging.mkdir()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise PermissionError(
            f"--out {out_dir}: cannot write there ({reason}: {err.filename or out_dir.parent})"
        ) from None
    return staging


def _move_into(staging: Path, out_dir: Path) -> None:
    """Put the complete export in ``staging`` at ``out_dir``: a rename when ``out_dir`` does
    not exist; else each file replaced, then the old weight files that the new export does
    not have removed (so ``out_dir`` never lacks a complete set of weights)."""
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    written = {path.name for path in staging.iterdir()}
    for path in staging.iterdir():
        os.replace(path, out_dir / path.name)
    stale = list(out_dir.glob("model*.safetensors")) + [out_dir / INDEX_FILENAME]
    for path in stale:
        if path.name not in written and path.is_file():
            path.unlink()


def _export_into(
    staging, directory, common, arch, original, stored, dtype, max_shard_size, lora=None
):
    """Read the checkpoint one unit at a time (collective) and, on the writing rank
    (``staging`` not None), write the HuggingFace files into ``staging``; ``lora``: fold the
    LoRA adapters into their layers' weights first."""
    writing = staging is not None
    writer = _ShardWriter(staging, max_shard_size) if writing else None
    outer = global_sources(arch)
    embeddings = {k: v for k, v in outer.items() if k.startswith("embedding.")}
    head = {k: v for k, v in outer.items() if k not in embeddings}
    units = [embeddings] + [layer_sources(arch, i) for i in range(arch.num_layers)] + [head]
    units += mtp_units(arch)
    full_shapes = our_full_shapes(arch)
    adapter_full = {} if lora is None else adapter_shapes(arch, lora)
    for sources in units:  # HuggingFace's order: embeddings, layers, final norm, head
        ours = _read_our_tensors(directory, sources, stored, full_shapes, arch, writing)
        mine = [n for n in adapter_full if n.rsplit(".adapter.", 1)[0] + ".weight" in sources]
        if mine:
            adapters = _read_our_tensors(
                directory, dict.fromkeys(mine), stored, adapter_full, arch, writing
            )
            ours = merge_adapters(ours, adapters, lora) if writing else ours
        copies = _mtp_copies_of(arch, sources)
        shared = {}
        if copies:  # the depth's copies of the embeddings and the output head
            names = dict.fromkeys(set(copies.values()))
            shared = _read_our_tensors(directory, names, stored, full_shapes, arch, writing)
        if writing:
            for key, tensor in unit_hf_tensors(arch, sources, ours, shared, full_shapes).items():
                writer.add(key, tensor.to(DTYPES[dtype]))
    if writing:
        writer.finish()
        config = hf_config_for_export(arch, original, dtype)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        sidecars = common.get(HF_FILES_KEY)
        source = (common.get("run_settings") or {}).get("hf_model")
        if sidecars is None and source and Path(source).is_dir():
            sidecars = _sidecar_files(Path(source))  # a run started from --hf-model
        for name, text in (sidecars or {}).items():
            (staging / name).write_text(text)


def unit_hf_tensors(
    arch: HFArchitecture,
    sources: Dict[str, Any],
    ours: Dict[str, torch.Tensor],
    shared: Dict[str, torch.Tensor],
    full_shapes: Dict[str, tuple],
) -> Dict[str, torch.Tensor]:
    """What the export writes for one unit, in order: its tensors ``ours`` under HuggingFace's
    keys, then an MTP depth's copies of the shared tensors (``shared``: {our name: tensor})."""
    hf = scatter_to_hf(ours, sources, hf_shapes(arch, sources, full_shapes))
    hf.update({key: shared[name] for key, name in _mtp_copies_of(arch, sources).items()})
    return hf


def mtp_units(arch: HFArchitecture) -> List[Dict[str, Any]]:
    """The export's units of the MTP depths: one {our name: segments} per depth."""
    sources = mtp_parameter_sources(arch)
    return [
        {n: s for n, s in sources.items() if n.startswith(f"mtp.layers.{depth}.")}
        for depth in range(arch.mtp_num_layers or 0)
    ]


def _mtp_copies_of(arch: HFArchitecture, unit: Dict[str, Any]) -> Dict[str, str]:
    """{HuggingFace key: our shared parameter} of the copies MTP unit ``unit`` writes."""
    names = [n for n in unit if n.startswith("mtp.layers.")]
    if not names:
        return {}
    depth = int(names[0].split(".")[2])
    layer = f"model.layers.{arch.num_layers + depth}."
    copies = mtp_copies(arch, arch.mtp_num_layers)
    return {key: name for key, name in copies.items() if key.startswith(layer)}


def _export_adapter_into(staging, directory, common, arch, stored, dtype=None) -> None:
    """The LoRA adapters of checkpoint ``directory`` as a PEFT folder in ``staging`` (on
    the writing rank; ``dtype``: of the written tensors, default the stored one);
    ``base_model_name_or_path`` is the run's ``--hf-model``."""
    from safetensors.torch import save_file

    settings = common.get("run_settings") or {}
    lora = lora_of_settings(settings)
    shapes = adapter_shapes(arch, lora)
    adapters = _read_our_tensors(
        directory, dict.fromkeys(shapes), stored, shapes, arch, staging is not None
    )
    if staging is None:
        return
    tensors, modules = to_peft(adapters, arch, lora)
    written = DTYPES[dtype] if dtype else None
    tensors = {k: v.to(written or v.dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata=EXPORT_METADATA)
    source = _base_model_path(common)
    config = peft_config(arch, lora, modules, source)
    (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    sidecars = common.get(HF_FILES_KEY)
    if sidecars is None and source and Path(source).is_dir():
        sidecars = _sidecar_files(Path(source))
    for name, text in (sidecars or {}).items():
        if name != "generation_config.json":
            (staging / name).write_text(text)


def _base_model_path(common: Dict[str, Any]) -> Optional[str]:
    """The PEFT adapter's ``base_model_name_or_path``: the absolute path of the run's
    ``--hf-model`` (recorded at save; an older checkpoint's path as typed, made absolute
    when it names a folder from here)."""
    base = common.get(LORA_BASE_KEY) or {}
    if base.get("flag") == "--hf-model":
        return base["path"]
    typed = (common.get("run_settings") or {}).get("hf_model")
    return str(Path(typed).resolve()) if typed and Path(typed).is_dir() else typed


def resolve_checkpoint(load_dir) -> Path:
    """The iteration directory ``--load load_dir`` names: itself when it is one, else the
    newest complete ``iter_*`` in it (the trainer's rule)."""
    directory, _ = checkpointing.resolve_checkpoint(str(load_dir))
    return directory


def checkpoint_architecture(
    common: Dict[str, Any], where
) -> "tuple[HFArchitecture, Optional[dict]]":
    """(architecture, original config.json or None) recorded in a checkpoint's common
    state: the imported ``config.json``, else the trainer's run settings."""
    settings = common.get("run_settings") or {}
    raw = common.get(HF_CONFIG_KEY) or settings.get("hf_config")
    if raw:
        original = json.loads(raw)
        arch = architecture_from_config(original, f"{where} (its recorded config.json)")
        mtp = settings.get("mtp_num_layers") or None  # the run's depths (0: dropped)
        if mtp and not REGISTRY[arch.family].carries_mtp:
            raise ValueError(
                f"{where}: mtp_num_layers={mtp} (multi-token prediction depths) cannot be "
                f"written in the {arch.family} HuggingFace format; expected a model without them"
            )
        return replace(arch, mtp_num_layers=mtp), original
    if not settings:
        raise ValueError(
            f"{where}: the checkpoint records neither a HuggingFace config.json nor the "
            "trainer's run settings; cannot tell its architecture"
        )
    return architecture_from_model_settings(settings), None


def storage_key(
    name: str, moe_layer: bool = False, mla: bool = False
) -> "tuple[str, Optional[int]]":
    """(dist_checkpointing key, layer index or None) of our one-chunk parameter ``name``:
    layers are stacked under ``decoder.layers.<name>``, norms renamed by the layer spec's
    ``sharded_state_dict_keys_map`` (megatron-core's storage names; ``moe_layer``: the MoE
    layer spec's; ``mla``: multi-latent attention's, which keeps both norms under their own
    names)."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return name, None
    rest = ".".join(parts[3:])
    spec = get_gpt_layer_local_spec(
        num_experts=1 if moe_layer else None, multi_latent_attention=mla
    )
    for old, new in spec.submodules.sharded_state_dict_keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
    return f"decoder.layers.{rest}", int(parts[2])


def storage_location(
    name: str, arch: HFArchitecture, stored: Collection[str] = ()
) -> "tuple[str, tuple, tuple]":
    """(dist_checkpointing key, indices of the leading axes, sizes of those axes) of our
    one-chunk parameter ``name``: a global tensor has none, a layer's the layer axis
    [num_layers], a routed expert's weight the layer and GLOBAL expert axes (megatron-core's
    ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight`` [layers, E, out, in]). A
    block of non-homogeneous layers (``transformer_block.non_homogeneous_layers``: dense and
    MoE layers mixed, or any ``moe_layer_freq`` list) stores each layer on its own, under
    ``decoder.layers.<L>.`` without the layer axis: that key is used when ``stored`` (the
    checkpoint's keys) has it; a norm the checkpoint stores under another name (one written
    before the pre-MLP norm took megatron-core's name: ``load_aliases``) under that one."""
    parts = name.split(".")
    if parts[:2] == ["mtp", "layers"] and parts[3:4] == ["transformer_layer"]:
        return _mtp_storage_location(parts, arch, stored)
    if parts[:2] != ["decoder", "layers"]:
        return name, (), ()
    layer = int(parts[2])
    moe_layer = arch.is_moe_layer(layer)
    if moe_layer and parts[3:6] == ["mlp", "experts", "local_experts"]:
        key = "decoder.layers.mlp.experts.experts." + ".".join(parts[7:])
        leading, sizes = (layer, int(parts[6])), (arch.num_layers, arch.num_moe_experts)
    else:
        key, _ = storage_key(name, moe_layer, arch.multi_latent_attention)
        leading, sizes = (layer,), (arch.num_layers,)
    separate = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
    for candidate, at, outer in ((separate, leading[1:], sizes[1:]), (key, leading, sizes)):
        found = _stored_name(candidate, stored)
        if found:
            return found, at, outer
    return key, leading, sizes


def _stored_name(key: str, stored: Collection[str]) -> Optional[str]:
    """``key`` when ``stored`` has it, else its alias there (a checkpoint written by this
    package before it used megatron-core's names for the pre-MLP norm, or by megatron-core's
    TE spec: ``load_aliases.LOAD_ALIASES``), else None."""
    return key if key in stored else stored_alias(key, stored)


def _mtp_storage_location(
    parts: List[str], arch: HFArchitecture, stored: Collection[str]
) -> "tuple[str, tuple, tuple]":
    """``storage_location`` of an MTP depth's layer parameter: the layer's own keys (its
    spec's keys map, or the alias ``stored`` has), a routed expert's weight on the global
    expert axis."""
    head, rest = ".".join(parts[:4]), parts[4:]
    if rest[:3] == ["mlp", "experts", "local_experts"]:
        key = f"{head}.mlp.experts.experts.{'.'.join(rest[4:])}"
        return key, (int(rest[3]),), (arch.num_moe_experts,)
    moe_layer = arch.is_moe_layer(arch.num_layers)  # the depths repeat the last layer's kind
    key, _ = storage_key(
        "decoder.layers.0." + ".".join(rest), moe_layer, arch.multi_latent_attention
    )
    key = f"{head}.{key[len('decoder.layers.'):]}"
    return _stored_name(key, stored) or key, (), ()


def _read_our_tensors(directory, sources, stored, full_shapes, arch, requesting: bool):
    """Our full tensors named in ``sources`` (collective load; only ``requesting`` ranks
    ask for data)."""
    request: Dict[str, ShardedTensor] = {}
    for name in sources:
        key, leading, outer = storage_location(name, arch, stored)
        if key not in stored:
            raise ValueError(f"{directory}: no tensor {key!r} (needed for {name})")
        shape = tuple(full_shapes[name])
        saved = tuple(stored[key].global_shape)
        expected = outer + shape
        if key in PADDED_KEYS and saved[1:] == expected[1:] and saved[0] >= expected[0]:
            expected = saved  # a padded vocabulary: the true rows are read, the padding left
        if saved != expected:
            raise ValueError(
                f"{directory}: {key!r} has shape {list(saved)}; the {arch.family} "
                f"architecture recorded with it needs {list(expected)}"
            )
        if not requesting:
            continue
        prepend = len(leading)
        request[name] = ShardedTensor(
            key=key,
            data=None,
            dtype=stored[key].dtype,
            local_shape=(1,) * prepend + shape,
            global_shape=saved,
            global_offset=tuple(leading) + (0,) * len(shape),
            axis_fragmentations=None,
            prepend_axis_num=prepend,
        )
    loaded = dist_checkpointing.load(request, str(directory), validate_access_integrity=False)
    return {name: loaded[name] for name in request}


def _sidecar_files(directory: Path) -> Dict[str, str]:
    out = {}
    for name in SIDECAR_FILES:
        path = directory / name
        if path.is_file() and path.stat().st_size <= SIDECAR_LIMIT:
            out[name] = path.read_text()
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"checkpoint dtype {dtype} has no HuggingFace counterpart")


class _ShardWriter:
    """Safetensors shards of at most ``limit`` bytes (a bigger tensor gets one of its
    own), named as ``save_pretrained`` names them once the count is known."""

    def __init__(self, directory: Path, limit: int):
        if limit < 1:
            raise ValueError(f"--max-shard-size must be >= 1 byte, got {limit}")
        self.directory, self.limit = directory, limit
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: List[Path] = []
        self.weight_map: Dict[str, int] = {}
        self.total = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size
        self.weight_map[key] = len(self.files)

    def finish(self) -> None:
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            os.replace(self.files[0], self.directory / SINGLE_FILENAME)
            return
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for path, name in zip(self.files, names):
            os.replace(path, self.directory / name)
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {key: names[i] for key, i in sorted(self.weight_map.items())},
        }
        (self.directory / INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n")

    def _flush(self) -> None:
        save_file = safetensors_module().torch.save_file
        path = self.directory / f".partial-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata=dict(EXPORT_METADATA))
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0


def remove_tree(path) -> None:
    """Remove a temporary directory (ignoring one already gone)."""
    shutil.rmtree(path, ignore_errors=True)
