"""Validation (``--eval-interval``, ``--eval-iters``, ``--valid-data-path``, ``--split``,
``--skip-train``; SPEC section 19): the validation loss of every layout equals an
independent float64 recomputation, and evaluating never changes training.

The reference: the model is exported to HuggingFace format (``--export-hf``) and
transformers' GPT-2 recomputes, in float64, every validation token's cross entropy; the
reference loss is ``sum(mask * CE) / sum(mask)`` over the whole pass, written here without
any of the trainer's code. The negative control is the mean of per-microbatch means (what
megatron's ``evaluate`` logs under ``--sft``): it differs from the reference by far more
than the tolerance, so a trainer that reported it would fail ``_check``.

Distributed cases run under ``torchrun --nproc-per-node 4 -m pytest``.
"""

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.data import SFTDataset
from megatron.training.datasets import split_ranges
from megatron.training.errors import UsageError
from megatron.training.evaluation import build_validation_set
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

TOLERANCE = 2e-5  # the trainer computes in fp32, the reference in float64


# ----------------------------------------------------------------------------- reference


def _hf_model(folder: str):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64)
    return model.eval()


def _token_losses(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[n, s] float64 cross entropies of ``labels`` given ``tokens`` (causal, positions 0..)."""
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.double()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).reshape(labels.shape)


def _reference(model, batches: List[dict], micro_batch_size: int):
    """(sum(mask * CE) / sum(mask) over all batches, mean of per-microbatch means)."""
    total, count, means = 0.0, 0.0, []
    for batch in batches:
        if "cu_seqlens_padded" in batch:  # packed rows: each document on its own
            losses, mask = _packed_losses(model, batch)
        else:
            losses = _token_losses(model, batch["tokens"], batch["labels"])
            mask = batch["loss_mask"].double()
        total += (losses * mask).sum().item()
        count += mask.sum().item()
        for start in range(0, mask.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            n = mask[rows].sum().item()
            if n:
                means.append((losses[rows] * mask[rows]).sum().item() / n)
    return total / count, sum(means) / len(means)


def _packed_losses(model, batch: dict):
    losses = torch.zeros(batch["tokens"].shape, dtype=torch.float64)
    for row in range(batch["tokens"].shape[0]):
        bounds = batch["cu_seqlens_padded"][row].tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                piece = slice(start, end)
                losses[row, piece] = _token_losses(
                    model,
                    batch["tokens"][row : row + 1, piece],
                    batch["labels"][row : row + 1, piece],
                )[0]
    return losses, batch["loss_mask"].double()


def _check(name: str, value: float, reference: float) -> List[str]:
    if abs(value - reference) <= TOLERANCE:
        return []
    return [f"{name}: validation loss {value!r}, float64 reference {reference!r}"]


# ----------------------------------------------------------------------------- distributed

BASE = dict(train_iters=1, eval_iters=2, progress=False, seed=7)
LAYOUTS = [
    pytest.param(dict(context_parallel_size=2, pipeline_model_parallel_size=2), id="cp2-pp2"),
    pytest.param(
        dict(context_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=1),
        marks=pytest.mark.slow,
        id="cp2-pp2-mbs1-masked-shard",
    ),
    pytest.param(
        dict(
            context_parallel_size=2,
            pipeline_model_parallel_size=2,
            micro_batch_size=1,
            pack_sequences=True,
        ),
        id="cp2-pp2-packed",
    ),
    pytest.param(
        dict(context_parallel_size=2, pipeline_model_parallel_size=2, from_hf=True),
        marks=pytest.mark.slow,
        id="cp2-pp2-hf-model",
    ),
    pytest.param(
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        marks=pytest.mark.slow,
        id="tp2-sp-dp2",
    ),
    pytest.param(dict(context_parallel_size=2), marks=pytest.mark.slow, id="cp2-dp2"),
    pytest.param(
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        marks=pytest.mark.slow,
        id="pp2-vpp2-dp2",
    ),
]


@pytest.fixture(scope="module")
def trained_model():
    """One iteration at cp2-pp2, saved and exported: (checkpoint dir, HuggingFace dir,
    the run's validation loss, the one-process run's)."""
    directory = _shared_temporary_directory()
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        eval_interval=1,
        save=f"{directory}/ckpt",
        export_hf=f"{directory}/hf",
        compare_single_process=True,
        **BASE,
    )
    with fresh_layout():
        result = pretrain(config)
    reference = result.reference[-1]["valid_loss"] if result.reference else None
    yield f"{directory}/ckpt", f"{directory}/hf", result.records[-1]["valid_loss"], reference
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.world(4)
@pytest.mark.parametrize("changes", LAYOUTS)
def test_validation_loss_equals_float64_reference(trained_model, changes):
    """``--skip-train --load`` (or ``--hf-model``) at each layout: the validation loss equals
    transformers' float64 recomputation (and the training run's own and the one-process run's); the
    mean of microbatch means does not (negative control)."""
    checkpoint, hf_folder, trained_value, one_process_value = trained_model
    changes = dict(changes)
    source = dict(hf_model=hf_folder) if changes.pop("from_hf", False) else dict(load=checkpoint)
    config = TrainingConfig(skip_train=True, **source, **{**BASE, **changes})
    with fresh_layout():
        result = pretrain(config)
    value = result.records[-1]["valid_loss"]
    everyone: List[float] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    failures = [] if len(set(everyone)) == 1 else [f"ranks report {everyone}"]
    if dist.get_rank() == 0:
        batches = build_validation_set(config).batches
        reference, mean_of_means = _reference(
            _hf_model(hf_folder), batches, config.micro_batch_size
        )
        failures += _check("this layout", value, reference)
        if not changes.get("pack_sequences"):
            failures += _check("the cp2-pp2 training run", trained_value, reference)
            failures += _check("the one-process run", one_process_value, reference)
        if not _check("negative control", mean_of_means, reference):
            failures.append(f"mean of microbatch means {mean_of_means} passes the check")
        if "masked-shard" in str(changes) or config.micro_batch_size == 1:
            failures += _masked_shard_present(batches)
    assert_no_failures(failures)


def _masked_shard_present(batches: List[dict]) -> List[str]:
    """At CP = 2 rank 1 holds positions [s/4, 3s/4): some one-sample microbatch trains
    nothing there (the 0-safe case is really exercised)."""
    for batch in batches:
        s = batch["loss_mask"].shape[1]
        middle = batch["loss_mask"][:, s // 4 : 3 * s // 4].sum(dim=1)
        if (middle == 0).any() and batch["loss_mask"].sum() > 0:
            return []
    return ["no validation sample leaves CP rank 1's shard without trained tokens"]


@pytest.mark.world(4)
def test_training_losses_bitwise_equal_with_and_without_evaluation():
    """cp2-pp2 with the distributed optimizer, overlapped parameter gather and full
    recomputation: the same 3 training losses and gradient norms with ``--eval-interval 1``
    as without."""
    common = dict(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=3,
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        progress=False,
    )
    runs = []
    for extra in ({}, dict(eval_interval=1, eval_iters=1)):
        with fresh_layout():
            runs.append(pretrain(TrainingConfig(**common, **extra)).records)
    plain, evaluated = runs
    failures = []
    for key in ("loss", "grad_norm"):
        if [r[key] for r in plain] != [r[key] for r in evaluated]:
            failures.append(
                f"{key} differs: {[r[key] for r in plain]} vs {[r[key] for r in evaluated]}"
            )
    if not all("valid_loss" in r for r in evaluated):
        failures.append("the evaluated run did not evaluate at every iteration")
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- one process


@pytest.mark.world(1)
def test_jsonl_validation_whole_set_matches_float64_reference(tmp_path):
    """``--valid-data-path`` (JSONL) with ``--eval-iters -1``: every record once, the last
    global batch filled with samples that train nothing; equals the float64 reference."""
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    _write_records(train, 24, seed=0)
    _write_records(valid, 11, seed=1)  # 11 = 8 + 3: the second batch is mostly filler
    config = TrainingConfig(
        data_path=str(train),
        valid_data_path=str(valid),
        eval_iters=-1,
        train_iters=1,
        eval_interval=1,
        seq_length=48,
        export_hf=str(tmp_path / "hf"),
        progress=False,
    )
    record = pretrain(config).records[-1]
    batches = build_validation_set(config).batches
    assert len(batches) == 2 and batches[1]["loss_mask"][3:].sum() == 0
    reference, mean_of_means = _reference(_hf_model(str(tmp_path / "hf")), batches, 2)
    assert not _check("one process", record["valid_loss"], reference)
    assert record["valid_ppl"] == pytest.approx(math.exp(record["valid_loss"]))
    assert _check("negative control", mean_of_means, reference)


def _write_records(path: Path, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with open(path, "w") as handle:
        for _ in range(count):
            length = int(torch.randint(1, 12, (1,), generator=generator))
            word = "".join(
                chr(97 + int(c)) for c in torch.randint(0, 26, (length,), generator=generator)
            )
            handle.write(json.dumps({"prompt": f"say {word}: ", "completion": word[::-1]}) + "\n")


@pytest.mark.world(1)
def test_split_is_contiguous_and_seed_and_layout_free():
    """``--split 969,30,1``: file-order ranges that depend on nothing but the record count;
    validation samples of the generated data are held out (not training samples)."""
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("8,2", 10) == [(0, 8), (8, 10), (10, 10)]
    assert split_ranges("1/1/0", 5) == [(0, 2), (2, 5), (5, 5)] or split_ranges("1/1/0", 5) == [
        (0, 3),
        (3, 5),
        (5, 5),
    ]
    held_out = build_validation_set(TrainingConfig(eval_interval=1, eval_iters=1)).batches[0]
    train = SFTDataset(32, 64, 1234).global_batch(0, 8)
    assert not torch.equal(held_out["tokens"], train["tokens"])


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(eval_iters=-1, eval_interval=2), "--eval-iters -1"),
        (dict(eval_iters=5), "--eval-iters 5 needs validation"),
        (dict(split="969,30,1"), "--split '969,30,1' splits --data-path"),
        (dict(data_path="x.jsonl", split="a,b"), "--split 'a,b'"),
        (dict(valid_data_path="v.jsonl"), "--valid-data-path 'v.jsonl' needs --data-path"),
        (dict(skip_train=True), "--skip-train evaluates a trained model"),
        (dict(eval_interval=0), "--eval-interval"),
        (dict(eval_iters=-2), "--eval-iters"),
    ],
    ids=[
        "whole-set-generated",
        "iters-unused",
        "split-no-data",
        "split-bad",
        "valid-no-data",
        "skip-train-nothing",
        "interval-zero",
        "iters-negative",
    ],
)
def test_validation_flags_refused_by_name(changes, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(TrainingConfig(**changes), 1)


def _shared_temporary_directory() -> str:
    path = [tempfile.mkdtemp(prefix="validation-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]
