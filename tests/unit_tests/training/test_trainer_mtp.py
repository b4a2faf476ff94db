"""The trainer's multi-token prediction flags (megatron's ``--mtp-num-layers``,
``--mtp-loss-scaling-factor``): the MTP depths train, their losses are logged under megatron's
names ("mtp_1 loss", ...), the factor weighs them, and flags that would be ignored or ask for
what is not implemented are refused by name before anything runs. The gradients' exactness
is ``tests/unit_tests/models/test_multi_token_prediction.py``'s."""

import math

import pytest
import torch

from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.training import cli
from megatron.training.arguments import TrainingConfig, validate_config
from megatron.training.errors import UsageError
from megatron.training.loggers import log_line, scalars_of
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

SMALL = dict(
    num_layers=2,
    mtp_num_layers=2,
    train_iters=2,
    global_batch_size=2,
    micro_batch_size=2,
    progress=False,
)


def _records(**settings) -> list:
    with fresh_layout():
        return pretrain(TrainingConfig(**{**SMALL, **settings})).records


@pytest.mark.world(1)
def test_mtp_losses_are_logged_and_weighted():
    """Each record has mtp_1_loss and mtp_2_loss (about ln 64 for an untrained model), the
    console line and the scalars name them "mtp_1 loss", "mtp_2 loss"; a zero factor leaves
    the first step's losses unchanged and changes the second's (the MTP gradient is in the
    step). A loss left in the process-wide tracker before the run (another model's) is not
    counted: each step starts from an empty tracker."""
    MTPLossLoggingHelper.save_loss_to_tracker(torch.tensor(100.0), 0, 2)
    default, zero = _records(), _records(mtp_loss_scaling_factor=0.0)
    first = default[0]
    for key in ("mtp_1_loss", "mtp_2_loss"):
        assert abs(first[key] - math.log(64)) < 0.5, first
    assert "| mtp_1 loss: " in log_line(first, 2) and "| mtp_2 loss: " in log_line(first, 2)
    assert scalars_of(first)["mtp_2 loss"] == first["mtp_2_loss"]
    assert zero[0]["loss"] == pytest.approx(first["loss"], rel=1e-12)
    assert zero[0]["mtp_1_loss"] == pytest.approx(first["mtp_1_loss"], rel=1e-12)
    assert zero[1]["loss"] != pytest.approx(default[1]["loss"], rel=1e-9)


@pytest.mark.world(1)
def test_no_mtp_logs_no_mtp_loss_and_moe_mtp_trains():
    """Without --mtp-num-layers the record has no mtp key; a MoE model's MTP depths are MoE
    layers too (DeepSeek-V3's) and train; the router metrics are the decoder's layers' then
    the depths' (megatron-core's ``track_moe_metrics(mtp_num_layers=...)``)."""
    record = _records(mtp_num_layers=None, train_iters=1)[0]
    assert not [key for key in record if key.startswith("mtp")], record
    moe = _records(train_iters=1, num_experts=4, disable_bias_linear=True)[0]
    assert abs(moe["mtp_1_loss"] - math.log(64)) < 0.5, moe
    assert len(moe["moe_tokens_per_expert"]) == 4, moe  # 2 decoder MoE layers + 2 depths


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(mtp_num_layers=0), r"--mtp-num-layers must be an integer >= 1, got 0"),
        (dict(mtp_loss_scaling_factor=0.5), r"--mtp-loss-scaling-factor 0.5 needs --mtp-num"),
        (
            dict(mtp_num_layers=1, mtp_loss_scaling_factor=float("nan")),
            r"--mtp-loss-scaling-factor must be a finite number, got nan",
        ),
        (
            dict(mtp_num_layers=1, pipeline_model_parallel_size=2),
            r"--mtp-num-layers 1 with --position-embedding-type learned_absolute and --pp 2",
        ),
    ],
)
def test_bad_mtp_flags_are_refused_by_name(settings, message):
    """Refused before any process group, naming the flag, value and expectation."""
    with pytest.raises(UsageError, match=message):
        validate_config(TrainingConfig(**settings), 2)


@pytest.mark.world(1)
def test_the_run_header_names_the_mtp_depths():
    """The header line says how many depths and their loss weight."""
    from megatron.training.training import _model_description

    config = TrainingConfig(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    assert "; MTP: 2 depth(s), loss weight 0.3" in _model_description(config)
    assert "MTP" not in _model_description(TrainingConfig())


@pytest.mark.world(1)
def test_mtp_flags_on_the_command_line(no_training):
    """megatron's spellings reach the config (and TransformerConfig through its library
    field)."""
    argv = ["--mtp-num-layers", "3", "--mtp-loss-scaling-factor", "0.25", "--train-iters", "1"]
    assert cli.main(argv) == 0
    assert no_training[0].mtp_num_layers == 3 and no_training[0].mtp_loss_scaling_factor == 0.25


@pytest.mark.slow
@pytest.mark.world(4)
def test_cp2_pp2_logs_the_one_process_mtp_losses():
    """At CP = 2 x PP = 2 every rank logs the same mtp_k losses (summed over CP, broadcast
    from the last stage), equal to the one-process run's (float32: within 1e-4), and the
    LM loss follows the one-process run's."""
    import torch.distributed as dist

    config = TrainingConfig(
        **{**SMALL, "train_iters": 3},
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        position_embedding_type="rope",
        compare_single_process=True,
        compare_tolerance=1e-4,
    )
    with fresh_layout():
        result = pretrain(config)
    ours = [[r["mtp_1_loss"], r["mtp_2_loss"]] for r in result.records]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours)
    failures = [] if result.passed else ["the LM loss left the one-process run's"]
    if any(other != everyone[0] for other in everyone):
        failures.append(f"ranks log different MTP losses: {everyone}")
    if dist.get_rank() == 0:
        reference = [[r["mtp_1_loss"], r["mtp_2_loss"]] for r in result.reference]
        for got, want in zip(ours, reference):
            if any(abs(g - w) > 1e-4 * abs(w) for g, w in zip(got, want)):
                failures.append(f"MTP losses {got} differ from the one-process run's {want}")
    from tests.unit_tests.dist_utils import assert_no_failures

    assert_no_failures(failures)


@pytest.mark.world(1)
def test_forward_step_hands_the_loss_mask_to_the_mtp_chunk_only():
    """The chunk with MTP depths (through its wrappers) gets ``loss_mask``; others do not."""
    from megatron.training import loop
    from megatron.training.data import SFTDataset

    calls = []

    class Chunk(torch.nn.Module):
        def __init__(self, mtp_process: bool):
            super().__init__()
            self.mtp_process = mtp_process

        def forward(self, tokens, positions, **kwargs):
            calls.append(kwargs)
            return torch.zeros(tokens.shape)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    batch = SFTDataset(seq_length=16, vocab_size=64, seed=0).global_batch(0, 2)
    batch = loop.without_padding_mask(batch)
    loop.forward_step(iter([batch]), Wrapper(Chunk(True)))
    assert torch.equal(calls[-1]["loss_mask"], batch["loss_mask"])
    loop.forward_step(iter([batch]), Wrapper(Chunk(False)))
    assert set(calls[-1]) == {"labels"}


@pytest.mark.slow
@pytest.mark.world(1)
def test_resume_restores_the_mtp_depths(tmp_path):
    """2 iterations, save, resume for 2 more: every loss, the MTP losses too, equals the
    4-iteration run's bit for bit (the checkpoint holds the MTP depths and their optimizer
    state)."""
    keys = ("loss", "mtp_1_loss", "mtp_2_loss")
    straight = [[r[k] for k in keys] for r in _records(train_iters=4)]
    _records(train_iters=2, save=str(tmp_path))
    resumed = [[r[k] for k in keys] for r in _records(train_iters=4, load=str(tmp_path))]
    assert resumed == straight[2:], (resumed, straight)


@pytest.mark.world(1)
def test_export_hf_of_mtp_depths_needs_a_family_that_carries_them():
    """--export-hf of a flags-built model with MTP depths is refused up front unless it is
    a DeepSeek-V3 model (the only family whose HuggingFace format carries them)."""
    from megatron.training.preflight import check_export_family

    llama = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    config = TrainingConfig(mtp_num_layers=1, export_hf="out", disable_bias_linear=True, **llama)
    with pytest.raises(UsageError, match=r"mtp_num_layers=1 .*llama.*expected a deepseek_v3"):
        check_export_family(config)
    check_export_family(TrainingConfig(export_hf="out", disable_bias_linear=True, **llama))


@pytest.mark.world(1)
def test_hf_export_refuses_a_model_with_mtp_depths():
    """A checkpoint's settings with MTP depths match no family we write: refused by name
    (they would be left out of the export silently)."""
    from megatron.training.checkpointing import MODEL_SETTINGS
    from megatron.training.hf.config import architecture_from_model_settings

    llama = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    config = TrainingConfig(mtp_num_layers=2, disable_bias_linear=True, **llama)
    settings = {name: getattr(config, name) for name in MODEL_SETTINGS}
    with pytest.raises(ValueError, match=r"export: this model has mtp_num_layers=2"):
        architecture_from_model_settings(settings)
    assert architecture_from_model_settings({**settings, "mtp_num_layers": None}).family == "llama"
