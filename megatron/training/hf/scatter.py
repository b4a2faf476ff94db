"""Our full tensors back into HuggingFace tensors (the export's inverse of reading rows)."""

from typing import Dict

import torch

from megatron.training.hf.family import Source


def scatter_to_hf(
    ours: Dict[str, torch.Tensor], sources: Dict[str, Source], shapes: Dict[str, tuple]
) -> Dict[str, torch.Tensor]:
    """The HuggingFace tensors made from our full tensors ``ours`` (each segment's rows
    copied back; the exact inverse of ``read_rows``)."""
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in ours.items():
        offset = 0
        for seg in sources[name]:
            part = tensor[offset : offset + seg.length]
            target = out.get(seg.key)
            if target is None:
                target = out[seg.key] = torch.empty(shapes[seg.key], dtype=tensor.dtype)
            if seg.index is not None:
                target = target[seg.index]
            rows = seg.hf_rows(0, seg.length)
            if seg.transposed:
                target[:, rows] = part.t()
            else:
                target[rows] = part
            offset += seg.length
    return out
