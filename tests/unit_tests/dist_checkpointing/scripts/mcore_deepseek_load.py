"""Run by megatron-core 0.16.1's interpreter (``MCORE_PYTHON``), never with this repository on
the path: build the DeepSeek-V3-style ``GPTModel`` of ``mcore_deepseek_save.py`` (its builder
and shims), load a checkpoint written by this package with megatron-core's own
``dist_checkpointing.load`` and write what the loaded model computes on the same fixed batch.

    python mcore_deepseek_load.py CONFIG_JSON CKPT_DIR RESULT_PT

``RESULT_PT``: ``mcore_deepseek_save.compute``'s, plus ``missing`` / ``unexpected`` (the
storage keys megatron-core's load reports: stored and not asked for / asked for and not
stored) and ``not_loaded`` (the model's state-dict keys that loading left unset).
"""

import json
import sys

import torch
import torch.distributed as dist
from mcore_deepseek_save import build, compute, setup


def main() -> None:
    fields, ckpt, result = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    setup()
    from megatron.core import dist_checkpointing

    torch.manual_seed(4321)  # other values than the checkpoint's: loading must set them all
    model, vocab, seq = build(fields, 1, 1)
    state, missing, unexpected = dist_checkpointing.load(
        model.sharded_state_dict(), ckpt, strict="return_all"
    )
    report = model.load_state_dict(state, strict=False)
    out = compute(model, vocab, seq)
    out.update(
        missing=sorted(missing), unexpected=sorted(unexpected), not_loaded=report.missing_keys
    )
    torch.save(out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
