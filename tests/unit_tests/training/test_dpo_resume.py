"""Resuming a DPO run (``--save`` / ``--load``, docs/dpo.md): the resumed run equals the
uninterrupted one bit for bit (the loss and every TRL metric), because the reference, the
run's starting weights, is rebuilt from the source its checkpoints record (the seeded
initialization, ``--load X --finetune``'s checkpoint) and not taken from the resumed weights
(the negative control); a recorded source that is gone is refused by name; LoRA's reference
(the base, adapters off) resumes too.
"""

import shutil
import tempfile

import pytest
import torch.distributed as dist

from megatron.training import TrainingConfig, dpo
from megatron.training.dpo_reference import HF_MODEL, REFERENCE_SOURCE_KEY, _source, check_source
from megatron.training.errors import UsageError
from megatron.training.preflight import check_input_paths
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout
from tests.unit_tests.training.test_trainer_dpo import SMALL as DPO_SMALL

SMALL = dict(DPO_SMALL, eval_interval=2, eval_iters=1)  # the DPO trainer tests' run
# what a resumed record must equal (the timings and memory are measured, not computed)
NO_VALIDATION = dict(eval_interval=None, eval_iters=TrainingConfig().eval_iters)
COMPARED = ("loss", "grad_norm", "lr", "valid_loss", "valid_rewards_margins")


def _run(**changes):
    with fresh_layout():
        return pretrain(TrainingConfig(**{**SMALL, **changes})).records


def _computed(records):
    from megatron.core.preference import METRIC_KEYS

    keys = COMPARED + tuple(METRIC_KEYS)
    return [{k: r[k] for k in keys if k in r} for r in records]


def _resumes_exactly(tmp_path, **changes):
    """(the straight 4 iterations, the first 2 saved then resumed for 2), computed fields."""
    straight = _run(train_iters=4, **changes)
    first = _run(train_iters=2, save=str(tmp_path), **changes)
    resumed = _run(train_iters=4, load=str(tmp_path), **changes)
    return _computed(straight), _computed(first + resumed)


@pytest.mark.world(1)
def test_a_full_fine_tuning_dpo_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Saved at iteration 2 and resumed: iterations 3 and 4 (loss, metrics, validation) equal
    the uninterrupted run's; the checkpoint records the seeded initialization. Negative
    control: the old rule (the reference copies the policy's present weights) gives the
    resumed run a reference that moved (rewards 0 at the first resumed step)."""
    straight, interrupted = _resumes_exactly(tmp_path)
    assert straight[2]["rewards_margins"] != 0.0 and "valid_loss" in straight[3]
    assert interrupted == straight
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(tmp_path / "iter_0000002"))
    assert common["run_settings"][REFERENCE_SOURCE_KEY] == {"flag": "--seed", "seed": 1234}
    original = dpo.build_reference
    monkeypatch.setattr(dpo, "build_reference", lambda *args: original(*args[:4]))
    copied = _computed(_run(train_iters=4, load=str(tmp_path / "iter_0000002")))
    assert copied[0]["rewards_chosen"] == 0.0 != straight[2]["rewards_chosen"]
    assert copied[0]["loss"] != straight[2]["loss"]


@pytest.mark.world(1)
def test_a_recorded_source_that_is_gone_or_changed_is_refused_by_name(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    source = _source(HF_MODEL, str(model), 1234)
    check_source(source, "--load run")  # unchanged: accepted
    (model / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(UsageError, match=f"--hf-model {model} .*now holds other weights"):
        check_source(source, "--load run")
    shutil.rmtree(model)
    with pytest.raises(UsageError, match=f"--load run resumes .*--hf-model {model}, which no"):
        check_source(source, "--load run")


@pytest.mark.world(1)
@pytest.mark.slow  # five short runs (the default run's budget; the refusal is tested above)
def test_a_finetune_source_is_rebuilt_on_resume_and_refused_by_name_when_gone(tmp_path):
    """A DPO run started with --load X --finetune records X's iteration (absolute): resumed,
    it equals the uninterrupted run; with X moved away the resume names X; an SFT checkpoint
    resumed as DPO (no recorded source) is refused naming --load."""
    sft = tmp_path / "sft"
    _run(train_iters=1, save=str(sft), dpo=False, dpo_beta=0.1, **NO_VALIDATION)
    start = dict(load=str(sft), finetune=True, **NO_VALIDATION)
    straight = _computed(_run(train_iters=2, **start))
    run = tmp_path / "run"
    first = _run(train_iters=1, save=str(run), **start)
    resumed = _run(train_iters=2, load=str(run), **NO_VALIDATION)
    assert _computed(first + resumed) == straight
    assert straight[0]["loss"] != straight[1]["loss"]
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(run / "iter_0000001"))
    recorded = common["run_settings"][REFERENCE_SOURCE_KEY]
    assert recorded["flag"] == "--load --finetune"
    assert recorded["path"] == str((sft / "iter_0000001").resolve())
    shutil.move(str(sft), str(tmp_path / "moved"))
    gone = f"came from --load --finetune {recorded['path']}, which no longer exists"
    with pytest.raises(UsageError, match=gone):
        _run(train_iters=2, load=str(run), **NO_VALIDATION)
    with pytest.raises(UsageError, match=gone):  # the command line, before workers start
        check_input_paths(TrainingConfig(**{**SMALL, **NO_VALIDATION, "load": str(run)}))
    with pytest.raises(UsageError, match="records no DPO reference"):
        _run(train_iters=2, load=str(tmp_path / "moved"), **NO_VALIDATION)


@pytest.mark.world(1)
@pytest.mark.slow  # writes a HuggingFace model
def test_an_hf_model_source_is_rebuilt_on_resume_and_refused_when_changed(tmp_path):
    """--hf-model DIR: the checkpoint records DIR; the resume equals the uninterrupted run;
    DIR's weights replaced by others, the resume is refused naming DIR."""
    from tests.unit_tests.hf.hf_models import LLAMA_CONFIG, write_random_hf_model

    model = write_random_hf_model(tmp_path / "policy", LLAMA_CONFIG, seed=0)
    base = {k: v for k, v in SMALL.items() if k not in ("num_layers", "hidden_size")}
    base.pop("num_attention_heads")
    base.update(NO_VALIDATION, hf_model=str(model), seq_length=16)

    def run(**changes):
        with fresh_layout():
            return _computed(pretrain(TrainingConfig(**{**base, **changes})).records)

    straight = run(train_iters=2)
    saved = tmp_path / "run"
    interrupted = run(train_iters=1, save=str(saved)) + run(train_iters=2, load=str(saved))
    assert interrupted == straight and straight[1]["rewards_chosen"] != 0.0
    write_random_hf_model(tmp_path / "policy", LLAMA_CONFIG, seed=1)
    with pytest.raises(UsageError, match=f"--hf-model {model.resolve()} .*now holds other"):
        run(train_iters=2, load=str(saved))


@pytest.mark.world(1)
@pytest.mark.slow  # the default run's budget
def test_a_lora_dpo_run_resumes_bit_for_bit(tmp_path):
    """LoRA's reference is the base with its adapters off: nothing to record."""
    lora = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal")
    straight, interrupted = _resumes_exactly(tmp_path, **lora)
    assert straight[0]["rewards_chosen"] != 0.0  # the adapters start non-zero
    assert interrupted == straight


@pytest.mark.world(2)
@pytest.mark.slow  # two ranks: saved at cp2, resumed at cp2 and at tp2-sp
def test_a_dpo_run_resumed_at_another_layout_follows_the_uninterrupted_run():
    path = [tempfile.mkdtemp(prefix="dpo-resume-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    directory = path[0]
    cp2 = dict(context_parallel_size=2)
    straight = _computed(_run(train_iters=4, **cp2))
    first = _computed(_run(train_iters=2, save=directory, **cp2))
    same = _computed(_run(train_iters=4, load=directory, **cp2))
    other = _computed(
        _run(train_iters=4, load=directory, tensor_model_parallel_size=2, sequence_parallel=True)
    )
    failures = []
    if first + same != straight:
        failures.append(f"resumed at cp2: {first + same} vs {straight} (bitwise)")
    # another split changes float32 rounding: the summed log-probs (~30) carry ~2e-6
    worst, key = max(
        (abs(a[k] - b[k]) / max(1.0, abs(b[k])), k) for a, b in zip(other, straight[2:]) for k in a
    )
    if len(other) != 2 or not worst <= 1e-5:
        failures.append(f"resumed at tp2-sp: {key} differs by {worst:.3e} > 1e-5")
    print(f"DPO resumed at tp2-sp: largest difference {worst:.2e} ({key})")
    assert_no_failures(failures)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.world(1)
def test_a_resume_keeps_the_seed_of_its_generated_pairs(tmp_path, capsys, no_training):
    """The generated pairs (and a file's per-epoch shuffle) come from --seed: the command
    line's --load adopts the recorded one, another --seed is refused naming both values (the
    command line, exit 2, and the trainer); --finetune starts new data, any seed."""
    from megatron.training import cli
    from megatron.training.resume_rules import compare_run_settings

    _run(train_iters=1, save=str(tmp_path), seed=7, **NO_VALIDATION)
    assert cli.main(["--load", str(tmp_path), "--train-iters", "2", "--lr", "0.01"]) == 0
    assert no_training[0].seed == 7 and no_training[0].dpo
    with pytest.raises(SystemExit) as refused:
        cli.main(["--load", str(tmp_path), "--train-iters", "2", "--lr", "0.01", "--seed", "8"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--seed 7 when saved, 8 now" in err, err
    with pytest.raises(ValueError, match="--seed 7 when saved, 1234 now"):
        _run(train_iters=2, load=str(tmp_path), **NO_VALIDATION)
    compare_run_settings({"dpo": True, "seed": 7}, {"dpo": True, "seed": 8}, tmp_path, True)
    with pytest.raises(ValueError, match="--seed 7 when saved, 8 now"):  # SFT too now
        compare_run_settings({"dpo": False, "seed": 7}, {"dpo": False, "seed": 8}, tmp_path)


@pytest.mark.world(1)
@pytest.mark.slow  # the default run's budget
def test_a_packed_dpo_run_resumes_bit_for_bit(tmp_path):
    """--pack-sequences: the resumed run packs the same rows (the pair stream from its
    start) and equals the uninterrupted one."""
    from tests.unit_tests.training.test_trainer_dpo import PACKED

    straight, interrupted = _resumes_exactly(tmp_path, **PACKED)
    assert interrupted == straight and straight[2]["rewards_margins"] != 0.0


@pytest.mark.world(1)
@pytest.mark.slow  # three short runs
def test_the_command_line_fingerprints_a_resumed_source_once(tmp_path, monkeypatch):
    """A resumed DPO run's recorded source is checked by the command line before training
    and handed to ``pretrain``: its files are fingerprinted once in the process, not again
    by the trainer."""
    from megatron.training import cli, lora_base
    from megatron.training.options import command_line

    sft, run = tmp_path / "sft", tmp_path / "run"
    _run(train_iters=1, save=str(sft), dpo=False, dpo_beta=0.1, **NO_VALIDATION)
    _run(train_iters=1, save=str(run), load=str(sft), finetune=True, **NO_VALIDATION)
    fingerprinted = []
    original = lora_base.base_fingerprint
    monkeypatch.setattr(
        lora_base, "base_fingerprint", lambda path: fingerprinted.append(path) or original(path)
    )
    resume = TrainingConfig(**{**SMALL, **NO_VALIDATION, "train_iters": 2, "load": str(run)})
    with fresh_layout():
        assert cli.main(command_line(resume)) == 0
    assert fingerprinted == [str((sft / "iter_0000001").resolve())]
