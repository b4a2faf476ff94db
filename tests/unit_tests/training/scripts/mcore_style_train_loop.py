"""A CUDA training script in megatron-core's example style (the public API calls of
megatron-core 0.16.1's ``examples/run_simple_mcore_train_loop.py``, written for this
repository): TP = 2 GPT from the local layer spec, DDP, mock GPT data, three iterations,
then a distributed checkpoint saved and loaded back with ``model.load_state_dict``.

It names CUDA and nccl as a GPU script does; ``test_cuda_on_cpu`` runs it unchanged under
``torchrun --nproc-per-node 2 -m megatron.training.cuda_on_cpu``. The last lines check that
the reloaded weights equal the saved ones and print the example's closing line.
"""

import os
import sys
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tokenizer.tokenizer import _NullTokenizer

SEQ = 32


def setup() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group(
        backend="nccl", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(7)


def batches():
    if torch.distributed.get_rank() == 0:
        compile_helpers()
    torch.distributed.barrier()
    if len(sys.argv) > 1 and sys.argv[1] == "legacy-tokenizer":
        tokenizer = _NullTokenizer(vocab_size=SEQ)
    else:
        tokenizer = MegatronTokenizer.from_pretrained(
            metdata_path={"library": "null-text"}, vocab_size=SEQ
        )
    config = GPTDatasetConfig(
        random_seed=3,
        sequence_length=SEQ,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tokenizer,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [64, None, None], lambda: True, config
    ).build()
    return iter(DataLoader(train, batch_size=4, shuffle=True))


def step_function(device, data_iterator, model):
    batch = next(data_iterator)
    inputs = {k: batch[k].to(device) for k in ("tokens", "position_ids", "attention_mask")}
    output = model(
        inputs["tokens"],
        inputs["position_ids"],
        inputs["attention_mask"],
        labels=batch["labels"].to(device),
    )
    mask = batch["loss_mask"].to(device).view(-1).float()

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss}

    return output, loss_func


def main() -> None:
    setup()
    device = torch.device("cuda")
    gpt = GPTModel(
        config=TransformerConfig(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=4,
            use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
        ),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=SEQ,
    )
    gpt.to(device)
    model = DistributedDataParallel(
        config=gpt.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=False),
        module=gpt,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    run = get_forward_backward_func()
    for iteration in range(3):
        optimizer.zero_grad()
        losses = run(
            forward_step_func=partial(step_function, device),
            data_iterator=data,
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=4,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        finalize_model_grads([model])
        for param in model.parameters():
            param.grad = param.main_grad
        optimizer.step()
        print(f"iteration {iteration}: {losses}", flush=True)

    directory = Path(os.getcwd()) / "ckpt"
    directory.mkdir(exist_ok=True)
    saved = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(
        sharded_state_dict=gpt.sharded_state_dict(prefix=""), checkpoint_dir=str(directory)
    )
    with torch.no_grad():
        for param in gpt.parameters():
            param.zero_()
    loaded = dist_checkpointing.load(
        sharded_state_dict=gpt.sharded_state_dict(prefix=""), checkpoint_dir=str(directory)
    )
    gpt.load_state_dict(loaded)
    gpt.to(device)
    same = all(torch.equal(gpt.state_dict()[k], v) for k, v in saved.items())
    print(f"rank {torch.distributed.get_rank()}: reloaded weights equal the saved ones: {same}")
    print("Successfully loaded the model")


if __name__ == "__main__":
    main()
