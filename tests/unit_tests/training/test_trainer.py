"""The main job (``megatron.training``): generated SFT data, layout checks, the command
line, and training runs that follow the one-process run.

Distributed cases run in-process under ``torchrun --nproc-per-node 4 -m pytest
tests/unit_tests/training``: CP = 2, PP = 2 on the four ranks, then the one-process run on
rank 0 with groups of its own (``--compare-single-process``). Single-process cases run under
plain pytest.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import pytest
import torch
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import parse_args, single_process_config
from megatron.training.cli import launch_command, main
from megatron.training.data import BOS, EOS, PAD, SEP, SFTDataset, microbatches_for_rank
from megatron.training.metrics import read_jsonl
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

ROOT = Path(__file__).resolve().parents[3]
RECORD_KEYS = {"iteration", "loss", "grad_norm", "tokens_per_s"}


# ----------------------------------------------------------------------------- distributed


@pytest.mark.world(4)
def test_cp2_pp2_training_follows_the_one_process_run():
    """4 iterations at CP = 2, PP = 2: the loss falls, every rank logs the same loss, it
    equals the one-process run's within 1e-5, and rank 0 writes the metrics and picture."""
    directory = _shared_temporary_directory()
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=4,
        save_metrics=directory,
        compare_single_process=True,
        compare_tolerance=1e-5,
        progress=False,
    )
    with fresh_layout():
        result = pretrain(config)

    failures = []
    losses = [r["loss"] for r in result.records]
    if not result.passed:
        failures.append("the comparison with the one-process run failed")
    if not losses[-1] < losses[0]:
        failures.append(f"loss does not fall: {losses}")
    everyone: List[Optional[List[float]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    if any(other != everyone[0] for other in everyone):
        failures.append(f"ranks log different losses: {everyone}")
    if dist.get_rank() == 0:
        failures += _check_rank_zero_outputs(result, Path(directory), config.train_iters)
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)


@pytest.mark.world(4)
def test_per_shard_normalization_drifts_from_the_one_process_run():
    """Negative control: megatron-core 0.16.1's per-shard objective on the same prompt-masked
    data does not follow the one-process run, and the comparison says so."""
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        train_iters=2,
        compare_single_process=True,
        per_shard_loss_normalization=True,
        progress=False,
    )
    with fresh_layout():
        result = pretrain(config)
    failures = [] if not result.passed else ["the per-shard run passed the comparison"]
    if dist.get_rank() == 0 and not result.comparison.max_difference > 1e-3:
        failures.append(f"drift only {result.comparison.max_difference:.2e}")
    assert_no_failures(failures)


TP_RUNS = [
    # GPT-2 style with sequence parallelism on 4 ranks; Llama style (RMSNorm, SwiGLU, RoPE,
    # grouped-query attention, no biases, untied, label smoothing) on 8 ranks with PP = 2
    pytest.param(
        dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True),
        marks=pytest.mark.world(4),
        id="tp2-sp-cp2-gpt2",
    ),
    pytest.param(
        dict(
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            pipeline_model_parallel_size=2,
            sequence_parallel=True,
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            num_query_groups=2,
            disable_bias_linear=True,
            untie_embeddings_and_output_weights=True,
            label_smoothing=0.1,
        ),
        marks=pytest.mark.world(8),
        id="tp2-sp-cp2-pp2-llama",
    ),
]


@pytest.mark.parametrize("changes", TP_RUNS)
def test_tensor_parallel_training_follows_the_one_process_run(changes):
    """3 iterations with tensor (and sequence) parallelism: the comparison with the
    one-process run PASSes within 1e-5 and every rank logs the same loss."""
    config = TrainingConfig(
        train_iters=3, compare_single_process=True, compare_tolerance=1e-5, progress=False,
        **changes,
    )  # fmt: skip
    with fresh_layout():
        result = pretrain(config)
    failures = [] if result.passed else ["the comparison with the one-process run failed"]
    losses = [r["loss"] for r in result.records]
    everyone: List[Optional[List[float]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    if any(other != everyone[0] for other in everyone):
        failures.append(f"ranks log different losses: {everyone}")
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- one process


@pytest.mark.world(1)
def test_one_process_training_is_bitwise_reproducible_and_learns():
    """Without torch.distributed: the loss falls, and the comparison run (the same training
    again) gives bit-identical losses and gradient norms."""
    result = pretrain(TrainingConfig(train_iters=3, compare_single_process=True, progress=False))
    assert result.passed and result.comparison.max_difference == 0.0
    assert [r["grad_norm"] for r in result.records] == [r["grad_norm"] for r in result.reference]
    assert result.records[-1]["loss"] < result.records[0]["loss"]
    assert all(RECORD_KEYS <= set(r) for r in result.records)


@pytest.mark.world(1)
def test_gradient_accumulation_fusion_trains_the_same_model():
    """--gradient-accumulation-fusion: the same losses and gradient norms as without it, to
    fp32 rounding (the GEMM accumulates into main_grad instead of a separate add)."""
    runs = [
        pretrain(TrainingConfig(train_iters=3, progress=False, gradient_accumulation_fusion=f))
        for f in (False, True)
    ]
    for key in ("loss", "grad_norm"):
        plain, fused = ([r[key] for r in run.records] for run in runs)
        assert fused == pytest.approx(plain, rel=1e-5), key


# Slow: four interpreters of its own. The default run covers the self-launch
# (test_launch_errors.py, a self-launch on 2 ranks) and the comparison, metrics and picture
# in-process (test_cp2_pp2_training_follows_the_one_process_run, 4 ranks).
@pytest.mark.slow
@pytest.mark.world(1)
@pytest.mark.timeout(180)
def test_command_line_self_launches_and_prints_the_verdict(tmp_path):
    """``python -m megatron.training --nproc-per-node 2 --cp 2 --compare-single-process``
    launches two processes, prints the per-iteration table and PASS, writes the metrics."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    command = [sys.executable, "-m", "megatron.training", "--nproc-per-node", "2", "--cp", "2"]
    command += ["--train-iters", "2", "--compare-single-process", "--no-progress"]
    command += ["--save-metrics", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "cp2-pp1-dp1 (2 processes)" in output and ": PASS" in output, output[-4000:]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- data


@pytest.mark.world(1)
def test_generated_samples_are_deterministic_prompt_masked_reversals():
    """Sample i depends only on (seed, i); the mask covers exactly the reversed prompt and
    EOS; prompts have varied lengths."""
    dataset = SFTDataset(seq_length=32, vocab_size=64, seed=3)
    again = SFTDataset(seq_length=32, vocab_size=64, seed=3)
    other = SFTDataset(seq_length=32, vocab_size=64, seed=4)
    assert all(torch.equal(dataset[5][k], again[5][k]) for k in dataset[5])
    assert not torch.equal(dataset[5]["tokens"], other[5]["tokens"])

    lengths = set()
    for index in range(40):
        sample = dataset[index]
        sequence = torch.cat([sample["tokens"][:1], sample["labels"]])
        assert sequence[0] == BOS
        length = int((sequence == SEP).nonzero()[0]) - 1
        lengths.add(length)
        prompt = sequence[1 : 1 + length]
        response = sequence[length + 2 : 2 * length + 2]
        assert torch.equal(response, prompt.flip(0))
        assert sequence[2 * length + 2] == EOS and (sequence[2 * length + 3 :] == PAD).all()
        expected_mask = torch.zeros(32)
        expected_mask[length + 1 : 2 * length + 2] = 1.0
        assert torch.equal(sample["loss_mask"], expected_mask)
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(32))
    assert len(lengths) > 5


@pytest.mark.world(1)
def test_global_batches_and_microbatches_do_not_depend_on_the_layout():
    """Global batch i holds samples [i * GBS, (i + 1) * GBS); microbatch (d, m) holds
    samples (d * M + m) * b onwards, so any D x M split regroups the same microbatches."""
    dataset = SFTDataset(seq_length=16, vocab_size=32, seed=0)
    batch = dataset.global_batch(iteration=2, global_batch_size=8)
    assert torch.equal(batch["tokens"][3], dataset[19]["tokens"])
    one_replica = microbatches_for_rank(batch, 2, num_microbatches=4, dp_rank=0)
    two_replicas = [
        mb
        for d in range(2)
        for mb in microbatches_for_rank(batch, 2, num_microbatches=2, dp_rank=d)
    ]
    for a, b in zip(one_replica, two_replicas):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(torch.cat([mb["tokens"] for mb in one_replica]), batch["tokens"])


# ----------------------------------------------------------------------------- layouts


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, world, message",
    [
        (dict(context_parallel_size=2), 3, r"world size 3 is not divisible by --cp 2 x --pp 1"),
        (dict(pipeline_model_parallel_size=4), 6, r"world size 6 .* --pp 4 = 4"),
        (dict(context_parallel_size=2, seq_length=30), 2, r"--seq-length 30 .* 2 x --cp = 4"),
        (dict(context_parallel_size=4, seq_length=12), 4, r"--seq-length 12 .* = 8"),
        (
            dict(
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=6
            ),
            2,
            r"--num-layers 6 is not divisible among 4 pipeline chunks",
        ),
        (dict(pipeline_model_parallel_size=4, num_layers=6), 4, r"--num-layers 6 .* 4 pipeline"),
        (dict(virtual_pipeline_model_parallel_size=2), 1, r"--vpp 2 needs .* --pp must be >= 2"),
        (dict(global_batch_size=6), 4, r"--global-batch-size 6 .* data-parallel size 4 = 8"),
        (
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                global_batch_size=4,
            ),
            4,
            r"--vpp 2: 1 microbatches .* cannot be interleaved",
        ),
        (dict(hidden_size=30), 1, r"--hidden-size 30 is not divisible by --num-attention-heads 4"),
        (dict(micro_batch_size=0), 1, r"--micro-batch-size must be an integer >= 1, got 0"),
        (dict(tensor_model_parallel_size=2), 3, r"world size 3 .* --tp 2 x --cp 1 x --pp 1 = 2"),
        (
            dict(tensor_model_parallel_size=8),
            8,
            r"--num-attention-heads 4 is not divisible by --tp 8",
        ),
        (
            dict(tensor_model_parallel_size=2, num_attention_heads=8, num_query_groups=1),
            2,
            r"--num-query-groups 1 is not divisible by --tp 2",
        ),
        (dict(num_query_groups=3), 1, r"--num-query-groups 3 must .* dividing"),
        (
            dict(tensor_model_parallel_size=2, ffn_hidden_size=33),
            2,
            r"--ffn-hidden-size 33 .* divisible by --tp 2",
        ),
        (dict(sequence_parallel=True), 1, r"--sequence-parallel needs .* --tp must be > 1, got 1"),
        (
            dict(
                tensor_model_parallel_size=4,
                context_parallel_size=2,
                sequence_parallel=True,
                seq_length=24,
            ),
            8,
            r"--seq-length 24 is not divisible by --tp 4 x 2 x --cp 2 = 16",
        ),
        (dict(label_smoothing=1.0), 1, r"--label-smoothing must be in \[0, 1\), got 1.0"),
        (dict(normalization="L2Norm"), 1, r"--normalization must be LayerNorm or RMSNorm"),
        (
            dict(calculate_per_token_loss=True, per_shard_loss_normalization=True),
            1,
            "cannot be combined",
        ),
    ],
)
def test_impossible_layouts_are_rejected_with_the_flag_and_value(changes, world, message):
    """validate_config names the flag, the value received and what was expected."""
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**changes), world)


@pytest.mark.world(1)
def test_layouts_share_the_objective():
    """DP = world / (CP * PP) and M = GBS / (b * DP): every layout runs G = D * M = GBS / b
    microbatches; the one-process config drops only the layout."""
    for changes, world, dp, microbatches in [
        (dict(), 1, 1, 4),
        (dict(context_parallel_size=2, pipeline_model_parallel_size=2), 4, 1, 4),
        (
            dict(
                context_parallel_size=2,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
            ),
            8,
            2,
            2,
        ),
        (dict(context_parallel_size=4), 8, 2, 2),
        (dict(tensor_model_parallel_size=2, context_parallel_size=2), 8, 2, 2),
    ]:
        layout = validate_config(TrainingConfig(**changes), world)
        assert (layout.data_parallel_size, layout.num_microbatches) == (dp, microbatches)
    config = TrainingConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        seed=9,
        compare_single_process=True,
        save_metrics="out",
    )
    single = single_process_config(config)
    assert (single.context_parallel_size, single.pipeline_model_parallel_size) == (1, 1)
    tp_single = single_process_config(
        TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    )
    assert (tp_single.tensor_model_parallel_size, tp_single.sequence_parallel) == (1, False)
    assert single.seed == 9 and not single.compare_single_process and single.save_metrics is None


# ----------------------------------------------------------------------------- command line


@pytest.mark.world(1)
def test_command_line_flags_map_to_the_config():
    """Short and megatron-style flag names, defaults, booleans."""
    config = parse_args(
        "--nproc-per-node 4 --cp 2 --pp 2 --vpp 2 --micro-batch-size 1 --global-batch-size 16 "
        "--seq-length 64 --train-iters 7 --lr 0.01 --seed 5 --calculate-per-token-loss "
        "--save-metrics out --compare-single-process --no-progress "
        "--gradient-accumulation-fusion".split()
    )
    assert (config.nproc_per_node, config.context_parallel_size) == (4, 2)
    assert (config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size) == (
        2,
        2,
    )
    assert (config.micro_batch_size, config.global_batch_size, config.seq_length) == (1, 16, 64)
    assert (config.train_iters, config.lr, config.seed) == (7, 0.01, 5)
    assert config.calculate_per_token_loss and config.compare_single_process
    assert config.save_metrics == "out" and not config.progress
    assert config.gradient_accumulation_fusion
    long_names = parse_args(["--context-parallel-size", "4", "--pipeline-model-parallel-size", "2"])
    assert (long_names.context_parallel_size, long_names.pipeline_model_parallel_size) == (4, 2)
    assert parse_args([]) == TrainingConfig()
    tp = parse_args(
        "--tp 2 --sequence-parallel --normalization RMSNorm --swiglu --position-embedding-type "
        "rope --num-query-groups 2 --ffn-hidden-size 48 --disable-bias-linear "
        "--label-smoothing 0.1".split()
    )
    assert (tp.tensor_model_parallel_size, tp.sequence_parallel) == (2, True)
    assert (tp.normalization, tp.swiglu, tp.position_embedding_type) == ("RMSNorm", True, "rope")
    assert (tp.num_query_groups, tp.ffn_hidden_size, tp.disable_bias_linear) == (2, 48, True)
    assert tp.label_smoothing == 0.1
    assert parse_args(["--tensor-model-parallel-size", "4"]).tensor_model_parallel_size == 4


@pytest.mark.world(1)
def test_command_line_rejects_an_impossible_layout_before_launching(capsys):
    """A bad layout ends with argparse's status 2 and the reason, without starting anyone."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc-per-node", "3", "--cp", "2"])
    assert exit_info.value.code == 2
    assert "world size 3 is not divisible by --cp 2" in capsys.readouterr().err


@pytest.mark.world(1)
def test_command_line_under_torchrun_checks_nproc(monkeypatch, capsys):
    """Under torchrun an explicit --nproc-per-node must match the launch."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        main(["--nproc-per-node", "2"])
    assert "--nproc-per-node 2 but torchrun started 4" in capsys.readouterr().err


@pytest.mark.world(1)
def test_self_launch_command():
    """The self-launch re-runs the same arguments under torch.distributed.run."""
    command = launch_command(["--cp", "2"], 4)
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "megatron.training",
        "--cp",
        "2",
    ]


# ----------------------------------------------------------------------------- helpers


def _shared_temporary_directory() -> str:
    """A directory made by rank 0, its path given to every rank."""
    path = [tempfile.mkdtemp(prefix="trainer-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _check_rank_zero_outputs(result, directory: Path, iterations: int) -> List[str]:
    """Rank 0's comparison, metrics.jsonl and loss.png."""
    failures = []
    comparison = result.comparison
    if comparison is None or not comparison.max_difference <= 1e-5:
        failures.append(f"losses differ from the one-process run: {comparison}")
    elif [row[2] for row in comparison.rows] != [r["loss"] for r in result.reference]:
        failures.append("comparison rows do not hold the one-process losses")
    records = read_jsonl(directory / "metrics.jsonl")
    if [r["iteration"] for r in records] != list(range(1, iterations + 1)):
        failures.append(f"metrics.jsonl iterations: {[r.get('iteration') for r in records]}")
    if not all(RECORD_KEYS <= set(r) for r in records):
        failures.append(f"metrics.jsonl lacks keys: {records[:1]}")
    if [r["loss"] for r in records] != [r["loss"] for r in result.records]:
        failures.append("metrics.jsonl losses differ from the logged ones")
    if len(read_jsonl(directory / "metrics_single_process.jsonl")) != iterations:
        failures.append("metrics_single_process.jsonl missing or short")
    png = directory / "loss.png"
    if not png.exists() or png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        failures.append("loss.png missing or not a PNG")
    return failures
