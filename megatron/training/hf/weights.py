"""Parameter names and tensor layouts: HuggingFace safetensors <-> our GPT.

Each family's table (``families/``) says how each of our (one-chunk, global-layer)
parameters is made of HuggingFace tensors: a ``Source`` (``family.py``) = our dim 0 is the
concatenation of ``Segment`` s, each a range of rows of one HuggingFace tensor (or of its
columns, ``transposed``, for GPT-2's Conv1D weights, stored [in, out]). The same table
reads (a TP rank's rows or columns of a parameter, from only the bytes it needs:
``safe_open(...).get_slice``) and writes (each segment copied back into its HuggingFace
tensor), so export is the exact inverse of import.

Layouts on our side (megatron-core's): ``linear_qkv`` rows are, per query group g,
[q heads of g, k_g, v_g] (each head ``kv_channels`` rows); a SwiGLU ``linear_fc1`` is
[gate; up]; a tied output layer is the word embeddings.
"""

import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.training.errors import missing_package
from megatron.training.hf.families import REGISTRY
from megatron.training.hf.families.deepseek import mla_full_shapes
from megatron.training.hf.families.moe import moe_full_shapes
from megatron.training.hf.family import HFArchitecture, Source
from megatron.training.hf.mtp_weights import mtp_copies, mtp_sources
from megatron.training.hf.scatter import scatter_to_hf  # noqa: F401 (its home before)
from megatron.training.hf.target import INDEX_FILENAME, SINGLE_FILENAME

# Tensors some checkpoints carry that hold no weights (buffers recomputed by the model).
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# safetensors' names of the dtypes a weight may have (integers, booleans and float8 are
# quantized or not weights at all).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Rows compared at a time when checking that a tied model's lm_head equals its embeddings.
_COMPARE_ROWS = 4096


def safetensors_module():
    """The ``safetensors`` package; an ImportError naming the ``hf`` extra without it
    (one line, ``errors.missing_package``)."""
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 (save_file, used by export)
    except ImportError:
        raise missing_package("safetensors", "hf", "HuggingFace checkpoints") from None
    return safetensors


def parameter_sources(arch: HFArchitecture, prefix: Optional[str] = None) -> Dict[str, Source]:
    """{our one-chunk parameter name: its segments} for the whole model (``prefix``: the
    HuggingFace key prefix, the family's usual one by default)."""
    sources = dict(global_sources(arch, prefix))
    for layer in range(arch.num_layers):
        sources.update(layer_sources(arch, layer, prefix))
    sources.update(mtp_parameter_sources(arch, prefix))
    return sources


def mtp_parameter_sources(arch: HFArchitecture, prefix: Optional[str] = None):
    """{our ``mtp.layers.*`` name: its segments} of the MTP depths (none without)."""
    if not arch.mtp_num_layers:
        return {}
    return mtp_sources(
        arch,
        arch.mtp_num_layers,
        lambda layer: layer_sources(arch, layer, prefix),
        "model." if prefix is None else prefix,
    )


def global_sources(arch: HFArchitecture, prefix: Optional[str] = None) -> Dict[str, Source]:
    """Embeddings, final norm and (untied) output layer (the family's table)."""
    return REGISTRY[arch.family].global_sources(arch, prefix)


def layer_sources(
    arch: HFArchitecture, layer: int, prefix: Optional[str] = None
) -> Dict[str, Source]:
    """The parameters of global layer ``layer`` (the family's table)."""
    return REGISTRY[arch.family].layer_sources(arch, layer, prefix)


def hf_shapes(arch: HFArchitecture, sources: Dict[str, Source], our_shapes) -> Dict[str, tuple]:
    """{HuggingFace key: shape} of the tensors ``sources`` use, given our full shapes
    ({name: shape}): a segment's HuggingFace tensor has our other dimension and the largest
    row index its segments reach (checked against the file before reading)."""
    rows: Dict[str, int] = {}
    stacked: Dict[str, int] = {}  # key -> sub-tensors (``Segment.index``)
    shapes: Dict[str, tuple] = {}
    for name, source in sources.items():
        shape = tuple(our_shapes[name])
        for seg in source:
            rows[seg.key] = max(rows.get(seg.key, 0), seg.stop)
            if seg.index is not None:
                stacked[seg.key] = max(stacked.get(seg.key, 0), seg.index + 1)
            if len(shape) == 1:
                shapes[seg.key] = (None,)
            elif seg.transposed:
                shapes[seg.key] = (shape[1], None)
            else:
                shapes[seg.key] = (None, shape[1])
    out = {}
    for key, shape in shapes.items():
        inner = tuple(rows[key] if s is None else s for s in shape)
        out[key] = (stacked[key],) + inner if key in stacked else inner
    return out


def our_full_shapes(arch: HFArchitecture) -> Dict[str, tuple]:
    """{our one-chunk parameter name: full (unsharded) shape}."""
    h, d, ffn, v = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size, arch.vocab_size
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * d
    q_norm, k_norm = arch.qk_norm_sizes()
    shapes = {
        "embedding.word_embeddings.weight": (v, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.final_layernorm.bias": (h,),
        "embedding.position_embeddings.weight": (arch.max_position_embeddings, h),
        "output_layer.weight": (v, h),
    }
    for layer in range(arch.num_layers):
        p = f"decoder.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "input_layernorm.bias": (h,),
                p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                p + "self_attention.linear_qkv.bias": (qkv_rows,),
                p + "self_attention.linear_proj.weight": (h, arch.num_attention_heads * d),
                p + "self_attention.linear_proj.bias": (h,),
                p + "self_attention.q_layernorm.weight": (q_norm,),
                p + "self_attention.k_layernorm.weight": (k_norm,),
                p + "self_attention.core_attention.softmax_offset": (arch.num_attention_heads,),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "pre_mlp_layernorm.bias": (h,),
                p + "post_self_attn_layernorm.weight": (h,),
                p + "post_mlp_layernorm.weight": (h,),
                p + "mlp.linear_fc1.weight": ((2 if arch.gated else 1) * ffn, h),
                p + "mlp.linear_fc1.bias": ((2 if arch.gated else 1) * ffn,),
                p + "mlp.linear_fc2.weight": (h, ffn),
                p + "mlp.linear_fc2.bias": (h,),
            }
        )
    shapes.update(moe_full_shapes(arch))
    if arch.multi_latent_attention:
        shapes.update(mla_full_shapes(arch))
    last = f"decoder.layers.{arch.num_layers - 1}."
    for depth in range(arch.mtp_num_layers or 0):  # depths repeat the last layer's shapes
        ours = f"mtp.layers.{depth}."
        shapes.update({ours + n: (h,) for n in ("enorm.weight", "hnorm.weight")})
        shapes[ours + "final_layernorm.weight"] = (h,)
        shapes[ours + "eh_proj.weight"] = (h, 2 * h)
        for name, shape in list(shapes.items()):
            if name.startswith(last):
                shapes[ours + "transformer_layer." + name[len(last) :]] = shape
    return shapes


def is_buffer_key(key: str) -> bool:
    """A tensor that some checkpoints carry but that holds no weights."""
    return key.endswith(_BUFFER_SUFFIXES)


class SafetensorsReader:
    """The tensors of a HuggingFace model directory (``model.safetensors`` or shards listed
    in ``model.safetensors.index.json``), read lazily with ``safe_open``."""

    def __init__(self, directory) -> None:
        self._safe_open = safetensors_module().safe_open
        self.directory = Path(directory)
        index = self.directory / INDEX_FILENAME
        single = self.directory / SINGLE_FILENAME
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{index}: expected a JSON object with a 'weight_map' of tensor name -> "
                    f"file ({type(err).__name__}: {err})"
                ) from None
            self.weight_map = {key: self.directory / name for key, name in weight_map.items()}
            for path in sorted(set(self.weight_map.values())):
                if not path.is_file():
                    raise FileNotFoundError(f"{index} names {path.name}, which does not exist")
            self._check_index(index)
        elif single.is_file():
            with self._open(single) as handle:
                self.weight_map = {key: single for key in handle.keys()}
        else:
            found = sorted(p.name for p in self.directory.glob("*"))[:10]
            raise FileNotFoundError(
                f"{self.directory}: neither {SINGLE_FILENAME} nor {INDEX_FILENAME} (found: "
                f"{', '.join(found) or 'nothing'}); expected safetensors weights (.bin "
                "checkpoints are not read: they need unpickling)"
            )

    def _check_index(self, index: Path) -> None:
        """Every tensor the index names is in the file it names (ValueError naming the
        tensor, the index and the file, and where the tensor is when another shard has it)."""
        held = {}
        for path in sorted(set(self.weight_map.values())):
            with self._open(path) as handle:
                held[path] = set(handle.keys())
        for key, path in self.weight_map.items():
            if key not in held[path]:
                elsewhere = [p.name for p, keys in held.items() if key in keys]
                where = f" (it is in {elsewhere[0]})" if elsewhere else ""
                raise ValueError(
                    f"{index}: tensor {key!r} is listed in file {path.name}, which does not "
                    f"hold it{where}; the index and the shard files disagree"
                )

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def file_of(self, key: str) -> Path:
        """The file holding tensor ``key``."""
        return self._file_of(key)

    def dtype(self, key: str) -> str:
        """safetensors' name of tensor ``key``'s dtype (``F32``, ``BF16``, ``I32``, ...)."""
        with self._open(self._file_of(key)) as handle:
            return handle.get_slice(key).get_dtype()

    def shape(self, key: str) -> Tuple[int, ...]:
        if key not in self._shapes:
            with self._open(self._file_of(key)) as handle:
                self._shapes[key] = tuple(handle.get_slice(key).get_shape())
        return self._shapes[key]

    def read(self, key: str, index: Tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` (a copy), reading only those bytes. The file is mapped only
        for the read, so a conversion's resident memory never includes the files."""
        with self._open(self._file_of(key)) as handle:
            return handle.get_slice(key)[index]

    def _file_of(self, key: str) -> Path:
        if key not in self.weight_map:
            raise KeyError(
                f"{self.directory}: the checkpoint has no tensor {key!r}; expected by the "
                "architecture config.json describes"
            )
        return self.weight_map[key]

    def _open(self, path: Path):
        try:
            return self._safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def check_checkpoint_tensors(
    reader: SafetensorsReader, arch: HFArchitecture, sources: Dict[str, Source]
) -> None:
    """Every tensor the architecture needs exists with the expected shape, and the
    checkpoint holds no weight the architecture does not use (ValueError naming them)."""
    expected = hf_shapes(arch, sources, our_full_shapes(arch))
    present = set(reader.keys())
    REGISTRY[arch.family].check_keys(arch, present, str(reader.directory))
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(
            f"{reader.directory}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}"
            f" that config.json's {arch.family} architecture needs"
        )
    for key, shape in expected.items():
        got = reader.shape(key)
        if got != shape:
            raise ValueError(
                f"{reader.directory}: tensor {key!r} has shape {list(got)}; config.json's "
                f"architecture needs {list(shape)}"
            )
    ignorable = {"lm_head.weight"} if arch.tied else set()
    copies = mtp_copy_keys(arch, sources)
    ignorable.update(copies)
    unused = sorted(k for k in present - set(expected) - ignorable if not is_buffer_key(k))
    if unused:
        raise ValueError(
            f"{reader.directory}: tensors {unused[:6]}{' ...' if len(unused) > 6 else ''} are "
            f"not part of the {arch.family} architecture config.json describes (e.g. biases "
            "or norms we do not have); refusing rather than dropping them"
        )
    for key in expected:
        dtype = reader.dtype(key)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{reader.file_of(key)}: tensor {key!r} has dtype {dtype}; expected a floating "
                f"dtype ({', '.join(FLOAT_DTYPES)}): quantized or integer weights are not read"
            )
    if arch.tied and "lm_head.weight" in present:
        embedding = sources["embedding.word_embeddings.weight"][0].key
        check_tied_head(reader, embedding, "lm_head.weight")
    for copy, original in copies.items():
        if copy in present and not same_tensor(reader, copy, original):
            raise ValueError(
                f"{reader.directory}: multi-token prediction tensor {copy!r} differs from "
                f"{original!r}; expected a copy (our MTP depths share the embeddings and the "
                "output head)"
            )


def mtp_copy_keys(arch: HFArchitecture, sources: Dict[str, Source]) -> Dict[str, str]:
    """{HuggingFace key of an MTP layer's copy of a shared tensor: the key it copies}."""
    if not arch.mtp_num_layers:
        return {}
    prefix = sources["embedding.word_embeddings.weight"][0].key.split("embed_tokens")[0]
    copies = mtp_copies(arch, arch.mtp_num_layers, prefix)
    return {key: sources[name][0].key for key, name in copies.items()}


def same_tensor(reader: "SafetensorsReader", a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` are equal (compared ``_COMPARE_ROWS`` rows at a time)."""
    if reader.shape(a) != reader.shape(b):
        return False
    for start in range(0, reader.shape(a)[0], _COMPARE_ROWS):
        index = (slice(start, min(reader.shape(a)[0], start + _COMPARE_ROWS)),)
        if not torch.equal(reader.read(a, index), reader.read(b, index)):
            return False
    return True


def check_tied_head(reader: "SafetensorsReader", embedding: str, head: str) -> None:
    """Under ``tie_word_embeddings: true`` a stored ``head`` must equal ``embedding``
    (ValueError naming both otherwise: dropping a different head would change the logits).
    Compared ``_COMPARE_ROWS`` rows at a time."""
    rows = reader.shape(embedding)[0]
    same = reader.shape(head) == reader.shape(embedding)
    for start in range(0, rows, _COMPARE_ROWS):
        if not same:
            break
        index = (slice(start, min(rows, start + _COMPARE_ROWS)),)
        same = torch.equal(reader.read(head, index), reader.read(embedding, index))
    if not same:
        raise ValueError(
            f"{reader.directory}: config.json says tie_word_embeddings: true, but {head!r} "
            f"differs from {embedding!r}; expected them equal (set tie_word_embeddings to "
            f"false if the head is its own, or remove {head})"
        )


def read_rows(
    reader: SafetensorsReader,
    source: Source,
    row_ranges: Sequence[Tuple[int, int]],
    columns: Optional[Tuple[int, int]],
    finite: bool = False,
) -> torch.Tensor:
    """Rows ``row_ranges`` (concatenated) and ``columns`` (None: all) of our tensor made of
    ``source``, reading only the needed parts of each HuggingFace tensor. ``finite``: a NaN
    or infinite value is a ValueError naming its HuggingFace tensor and file."""
    pieces = []
    for first, last in row_ranges:
        offset = 0
        for seg in source:
            lo, hi = max(first, offset), min(last, offset + seg.length)
            if lo < hi:
                pieces.append(_read_segment(reader, seg, lo - offset, hi - offset, columns))
                if finite and not torch.isfinite(pieces[-1]).all():
                    raise ValueError(
                        f"{reader.file_of(seg.key)}: tensor {seg.key!r} holds NaN or infinite "
                        "values; refusing a broken model (allow_non_finite=True, or import "
                        "--allow-non-finite, loads it anyway)"
                    )
            offset += seg.length
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0].contiguous()


def _read_segment(reader, seg, first: int, last: int, columns) -> torch.Tensor:
    """Our rows [first, last) of ``seg`` (and ``columns``, None: all) from its tensor: the
    contiguous span of HuggingFace rows read, then every ``step``-th kept."""
    rows = seg.hf_rows(first, last)
    span = slice(rows.start, rows.start + (last - first - 1) * seg.step + 1)
    cols = slice(None) if columns is None else slice(*columns)
    lead = () if seg.index is None else (slice(seg.index, seg.index + 1),)
    dims = len(reader.shape(seg.key)) - len(lead)
    if seg.transposed:
        part = reader.read(seg.key, lead + (cols, span))
        part = (part[0] if lead else part)[:, :: seg.step].t()
    else:
        index = (span,) if columns is None and dims == 1 else (span, cols)
        part = reader.read(seg.key, lead + index)
        part = (part[0] if lead else part)[:: seg.step]
    return part.contiguous() if seg.step > 1 or lead else part


def keys_of(sources: Iterable[Source]) -> List[str]:
    """The HuggingFace keys a set of sources uses, in first-use order."""
    seen: Dict[str, None] = {}
    for source in sources:
        for seg in source:
            seen.setdefault(seg.key)
    return list(seen)
