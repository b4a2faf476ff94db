"""Validation: the loss of a fixed held-out set, the same for every layout.

The validation set is a fixed list of samples in a fixed order (``build_validation_set``):
the records of ``--valid-data-path``, or the validation part of ``--split`` (file order),
or held-out generated samples (a stream of their own, never trained on). It is cut into
global batches of ``--global-batch-size`` samples (the last one filled with samples that
train nothing) and each global batch into this rank's microbatches exactly as in training.
``evaluate`` runs them with the layout's schedule, ``forward_only=True``, and returns

    valid_loss = sum over batches b, microbatches m, CP shards c of S_bmc
                 / sum over b, m, c of N_bmc

(S: the masked sum of token losses, N: the count of trained tokens, the training run's
masks), reduced in float64 over microbatches and the dp x cp group of the last pipeline
stage, then broadcast over the pipeline group: one ratio over the whole pass, not a mean of
per-microbatch means, so it does not depend on the layout or the micro-batch size, and a
shard or a microbatch without trained tokens adds 0 / 0 to nothing. ``valid_ppl`` is
``exp(min(valid_loss, 20))`` (megatron's cap).

Evaluation does not perturb training: the RNG states (CPU, CUDA, the model-parallel
tracker) are saved before and restored after, the model is switched to eval mode and back,
no gradient is computed, and the validation batches come from their own data set objects.
"""

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.core.communication import broadcast_from_last_
from megatron.core.device import comm_device
from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_totals
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.data import (
    Batch,
    PackedSFTDataset,
    SFTDataset,
    _GeneratedDocuments,
    empty_sample,
)
from megatron.training.datasets import FileSFTDataset, split_ranges

PERPLEXITY_CAP = 20.0  # valid_ppl = exp(min(loss, 20)), as megatron prints it
WHOLE_SET = -1  # --eval-iters -1: every validation sample once


@dataclass
class ValidationSet:
    """The fixed validation pass: ``batches`` are global batches (dicts of [GBS, ...]
    tensors) in order; ``num_samples`` real samples (the rest of the last batch trains
    nothing); ``source`` says where they come from."""

    batches: List[Batch]
    num_samples: int
    source: str
    notes: List[str] = field(default_factory=list)

    def describe(self) -> str:
        """``validation: 16 samples in 2 global batches of held-out generated pairs``."""
        return (
            f"validation: {self.num_samples} samples in {len(self.batches)} global "
            f"batch(es) of {self.source}"
        )


@dataclass
class Validation:
    """One validation pass: the loss, its perplexity, and the totals behind it."""

    loss: float
    ppl: float
    loss_sum: float
    tokens: int


def validation_enabled(config: Any) -> bool:
    """Validation runs with ``--eval-interval``, ``--valid-data-path``, ``--split`` (with a
    validation part) or ``--skip-train``, unless ``--eval-iters 0``."""
    if config.eval_iters == 0:
        return False
    return bool(config.eval_interval or config.valid_data_path or config.split or config.skip_train)


def evaluation_due(config: Any, iteration: int) -> bool:
    """After every ``--eval-interval`` iterations and after the last one."""
    if not validation_enabled(config):
        return False
    interval = config.eval_interval
    return iteration == config.train_iters or (interval is not None and iteration % interval == 0)


def build_validation_set(config: Any) -> Optional[ValidationSet]:
    """The validation samples of ``config`` (module docstring), at most ``--eval-iters``
    global batches of them (all with ``--eval-iters -1``, or when there are fewer); None
    when validation is off."""
    if not validation_enabled(config):
        return None
    gbs, seq_length = config.global_batch_size, config.seq_length
    limit = None if config.eval_iters == WHOLE_SET else config.eval_iters * gbs
    packed = bool(config.pack_sequences)
    pad, notes = 0, []
    if config.valid_data_path or config.data_path:
        if config.valid_data_path:
            dataset = _file_dataset(config, config.valid_data_path)
            source = f"--valid-data-path {config.valid_data_path}"
        else:
            full = _file_dataset(config, config.data_path)
            bounds = split_ranges(config.split, len(full))[1]
            dataset = full.part(bounds, "--split")
            source = (
                f"--split {config.split}: records {bounds[0]}..{bounds[1] - 1} of {full.data_path}"
            )
        pad, notes = dataset.pad, list(dataset.notes)
        if packed:
            rows = PackedSFTDataset(
                seq_length, dataset.vocab_size, config.seed, _FileOrder(dataset)
            ).all_rows()
            samples = rows[:limit]
        else:
            count = len(dataset) if limit is None else min(limit, len(dataset))
            samples = [dataset.sample_of_record(i) for i in range(count)]
    else:
        # generated data: held-out samples of a stream of their own
        held_out = SFTDataset(seq_length, config.vocab_size, config.seed, stream="sft-valid")
        source = "held-out generated prompt/response pairs"
        if packed:
            packer = PackedSFTDataset(
                seq_length, config.vocab_size, config.seed, _GeneratedDocuments(held_out)
            )
            samples = [packer[i] for i in range(limit)]
        else:
            samples = [held_out[i] for i in range(limit)]
    num_samples = len(samples)
    samples += [empty_sample(seq_length, packed, pad)] * (-num_samples % gbs)
    batches = [
        {key: torch.stack([s[key] for s in samples[i : i + gbs]]) for key in samples[0]}
        for i in range(0, len(samples), gbs)
    ]
    return ValidationSet(batches, num_samples, source, notes)


def evaluate(
    model: List[torch.nn.Module],
    validation: ValidationSet,
    forward_backward_func: Callable,
    forward_step_func: Callable,
    microbatches_of: Callable[[Batch], List[Dict[str, Any]]],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    pg_collection: Optional[ProcessGroupCollection],
    interleaved: bool,
    loss_key: str = "lm loss",
    stop_check: Optional[Callable[[], bool]] = None,
) -> Optional[Validation]:
    """One pass over ``validation`` (module docstring); every rank returns the same value.

    ``microbatches_of(global_batch)`` gives this rank's microbatches of a global batch (on
    the device, this CP rank's shard), as in training. ``stop_check()``, when given, is
    called on every rank before each global batch; when it returns True the pass stops
    and None is returned (it must return the same on every rank, e.g. after agreeing on
    a signal). RNG states and train/eval modes are restored, also on an exception.
    """
    reported: List[dict] = []
    with _preserved_rng_states(), _eval_mode(model), torch.no_grad():
        for global_batch in validation.batches:
            if stop_check is not None and stop_check():
                return None
            microbatches = microbatches_of(global_batch)
            reported += forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=(
                    [iter(microbatches) for _ in model] if interleaved else iter(microbatches)
                ),
                model=model if interleaved else model[0],
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                pg_collection=pg_collection,
                forward_only=True,
            )
    loss_sum, tokens = _reduced_totals(reported, pg_collection, loss_key)
    loss = loss_sum / tokens if tokens > 0 else 0.0
    return Validation(loss, math.exp(min(loss, PERPLEXITY_CAP)), loss_sum, int(tokens))


def _reduced_totals(
    reported: List[dict], pg_collection: Optional[ProcessGroupCollection], loss_key: str
) -> tuple:
    """(sum of S, sum of N) of the pass: over dp x cp on the last stage, then broadcast
    from it over the pipeline group."""
    dp_cp = None if pg_collection is None else pg_collection.dp_cp
    totals = reduce_reported_totals(reported, dp_cp).get(loss_key, (0.0, 0.0))
    value = torch.tensor(totals, dtype=torch.float64, device=comm_device())
    broadcast_from_last_(value, None if pg_collection is None else pg_collection.pp)
    return value[0].item(), value[1].item()


@contextlib.contextmanager
def _preserved_rng_states():
    """Restore the CPU, CUDA and model-parallel tracker RNG states on exit."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracked = tracker.get_states() if tracker.is_initialized() else None
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            if tracked is not None:
                tracker.set_states(tracked)


@contextlib.contextmanager
def _eval_mode(model: List[torch.nn.Module]):
    """Every chunk in eval mode (no dropout) for the pass; each chunk's mode restored."""
    modes = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in zip(model, modes):
            chunk.train(mode)


def _file_dataset(config: Any, path: str) -> FileSFTDataset:
    return FileSFTDataset(
        path,
        config.tokenizer,
        config.seq_length,
        config.seed,
        eod_token=getattr(config, "eod_token", None),
    )


class _FileOrder:
    """The records of a file data set in file order, as documents (None past the end)."""

    def __init__(self, dataset: FileSFTDataset) -> None:
        self.dataset = dataset
        self.notes: List[str] = []

    def document(self, index: int) -> Optional[Batch]:
        return self.dataset.document_of_record(index)
