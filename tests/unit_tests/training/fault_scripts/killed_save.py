"""Launched by test_checkpoint_resume on 2 ranks (CP = 2): train 6 iterations saving every
3; at the second save rank 1 writes part of its DCP file and exits without a word
(``os._exit``), as a killed process would."""

import os

import torch.distributed as dist

from megatron.core.dist_checkpointing import storage
from megatron.training import TrainingConfig
from megatron.training.training import pretrain

SMALL = dict(num_layers=4, hidden_size=16, seq_length=16, global_batch_size=8, progress=False)


def main() -> None:
    write = storage.write_pieces
    saves = []

    def dies_on_second_save(checkpoint_dir, boxes, objects):
        saves.append(checkpoint_dir)
        if len(saves) == 2 and dist.get_rank() == 1:
            (checkpoint_dir / "__1_0.distcp").write_bytes(b"part of a file")
            print("rank 1 dies while writing", checkpoint_dir, flush=True)
            os._exit(17)
        return write(checkpoint_dir, boxes, objects)

    storage.write_pieces = dies_on_second_save
    pretrain(
        TrainingConfig(
            **SMALL,
            context_parallel_size=2,
            train_iters=6,
            save=os.environ["CKPT_TEST_DIR"],
            save_interval=3,
        )
    )


if __name__ == "__main__":
    main()
