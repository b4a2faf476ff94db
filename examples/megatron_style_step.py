"""A training script written only against megatron-core's public API.

It uses ``initialize_model_parallel``, ``get_forward_backward_func``,
``DistributedDataParallel(config=..., ddp_config=..., module=...)``,
``DistributedDataParallelConfig``, ``finalize_model_grads``, ``TransformerConfig`` and
``ModelType`` exactly as a megatron-core 0.16.1 script does, and runs unchanged on this core:

    torchrun --nproc-per-node 4 examples/megatron_style_step.py --cp 2 --pp 2
    torchrun --nproc-per-node 4 examples/megatron_style_step.py --pp 2 --vpp 2
    torchrun --nproc-per-node 4 examples/megatron_style_step.py --cp 2
"""

import argparse
import os
from typing import List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

VOCAB, HIDDEN, SEQ, MICRO_BATCH, LAYERS = 32, 16, 16, 2, 4


class ToyModel(torch.nn.Module):
    """Token-wise model chunk: embedding (first stage), MLP layers, LM head (last stage)."""

    def __init__(self, config: TransformerConfig, pre_process: bool, post_process: bool):
        super().__init__()
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = False
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN) if pre_process else None
        layers = config.num_layers // (
            config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
        )
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))
        self.head = torch.nn.Linear(HIDDEN, VOCAB) if post_process else None
        self.input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, tokens, labels):
        h = self.embedding(tokens).transpose(0, 1) if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        if not self.post_process:
            return h
        logits = self.head(h).transpose(0, 1).float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
        ).view(labels.shape)


def main(
    cp: int = 1, pp: int = 1, vpp=None, steps: int = 3, num_microbatches: int = 4
) -> List[float]:
    """Train ``steps`` iterations; returns the last stage's loss per step (else empty)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
    )
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        pipeline_dtype=torch.float32,
    )
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1000)
    torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
    model = []
    for v in range(vpp or 1):
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=v)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=v)
        chunk = ToyModel(config, first, last)
        model.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk))
    config.no_sync_func = [m.no_sync for m in model] if vpp else model[0].no_sync
    config.grad_sync_func = [m.start_grad_sync for m in model] if vpp else model[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = torch.optim.SGD([p for m in model for p in m.parameters()], lr=0.1)

    def batches():
        gen = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
        cp_size, cp_rank = cp, parallel_state.get_context_parallel_rank()
        while True:
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
            mask = (
                torch.arange(SEQ) >= torch.randint(1, SEQ, (MICRO_BATCH, 1), generator=gen)
            ).float()
            shard = slice(cp_rank * SEQ // cp_size, (cp_rank + 1) * SEQ // cp_size)
            yield tokens[:, shard], torch.roll(tokens, -1, 1)[:, shard], mask[:, shard]

    def forward_step(data_iterator, model):
        tokens, labels, mask = next(data_iterator)

        def loss_func(output):
            loss_sum = (output * mask).sum()
            num_tokens = mask.sum().to(torch.int)
            return (
                loss_sum,
                num_tokens,
                {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])},
            )

        return model(tokens, labels), loss_func

    forward_backward = get_forward_backward_func()
    losses = []
    for _ in range(steps):
        for m in model:
            m.zero_grad_buffer()
        iterators = [batches() for _ in model]  # each chunk replays this step's batches
        reported = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if vpp else iterators[0],
            model=model if vpp else model[0],
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        for m in model:  # the optimizer reads the reduced gradients from main_grad
            for p in m.parameters():
                p.grad = p.main_grad
        optimizer.step()
        if reported:
            total = torch.stack([r["lm loss"] for r in reported]).sum(0)
            dist.all_reduce(
                total, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
            losses.append((total[0] / total[1]).item())
    parallel_state.destroy_model_parallel()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    args = parser.parse_args()
    losses = main(args.cp, args.pp, args.vpp)
    if losses and parallel_state.model_parallel_is_initialized() is False:
        print(f"rank {os.environ.get('RANK', 0)}: losses {['%.4f' % x for x in losses]}")
