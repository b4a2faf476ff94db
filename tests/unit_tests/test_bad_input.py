"""Bad input fails with one clear error, before any collective (SPEC section 8).

Single-process tests: the parity harness (``tests/unit_tests/parity.py``) runs one step of
its token-wise model with no process group at all, and each test bends one input through
the harness's own seams (the loss callback, the schedule's keyword arguments, the DDP
config). Groups are stand-ins whose collectives are recorded, the pipeline communicator
one that refuses every message: the tests show that each check fires before either.
Every ``match`` names the argument and the bad value.
"""

import functools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests import parity
from tests.unit_tests.dist_utils import compare_tensors
from tests.unit_tests.parity import Case, TokenwiseChunk, initial_params, run_step

pytestmark = [pytest.mark.world(1), pytest.mark.timeout(60)]


# ----------------------------------------------------------------------------- stand-ins


class FakeGroup:
    """A process group of ``n`` ranks that only knows its size and rank."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r

    def __repr__(self) -> str:
        return f"FakeGroup({self.n})"


@pytest.fixture(autouse=True)
def fake_groups_are_distributed(monkeypatch):
    """The stand-in groups count as groups of a running torch.distributed for the size/rank
    helpers (``get_pg_size`` reads 1 for any group while torch.distributed is not
    initialized, megatron-core's convention); nothing else sees torch.distributed as up."""
    from types import SimpleNamespace

    from megatron.core import process_groups_config

    up = SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, ProcessGroup=dist.ProcessGroup
    )
    monkeypatch.setattr(process_groups_config, "dist", up)


class StrictP2P:
    """A pipeline communicator for stage ``pp_rank`` of ``pp_size`` that must not be used."""

    def __init__(self, pp_size: int = 2, pp_rank: int = 0):
        self.pp_size, self.pp_rank = pp_size, pp_rank

    def __getattr__(self, name):
        raise AssertionError(f"pipeline message {name} attempted before the argument check")


class PassThroughP2P:
    """The communicator of a one-stage pipeline: nothing to send, nothing received."""

    pp_size, pp_rank = 1, 0

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.fixture
def collectives(monkeypatch):
    """Record every all-reduce and broadcast (they leave tensors unchanged: a peer of 0)."""
    calls = []
    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    return calls


def with_schedule(monkeypatch, schedule=None, **transforms):
    """Make ``run_step`` call ``schedule`` (default: the one it picks) with each keyword
    argument named in ``transforms`` replaced by ``transform(original value)``."""
    real = parity.get_forward_backward_func

    def get(pp_size=None, vp_size=None):
        chosen = schedule or real(pp_size, vp_size)

        def run(**kwargs):
            for name, transform in transforms.items():
                kwargs[name] = transform(kwargs.get(name))
            return chosen(**kwargs)

        return run

    monkeypatch.setattr(parity, "get_forward_backward_func", get)


def with_loss_outputs(monkeypatch, edit):
    """Make the harness's loss callback return ``edit(what it would have returned)``."""
    real = parity._loss_function

    def patched(case, cp_group, result):
        inner = real(case, cp_group, result)
        return lambda mask, output, **kw: edit(inner(mask, output, **kw), output, mask)

    monkeypatch.setattr(parity, "_loss_function", patched)


def cp2_groups(_=None) -> ProcessGroupCollection:
    """C = 2 as far as the schedule can tell; a collective on it fails the test."""
    return ProcessGroupCollection(cp=FakeGroup(2), dp_cp=FakeGroup(1))


CP2 = Case(cp=2, microbatches=2, mask="uneven")


# ----------------------------------------------------------------------------- loss_func

BAD_LOSS_OUTPUTS = {
    "one value": (lambda out, o, m: out[:1], r"loss_func must return .*got a tuple of 1 values"),
    "four values": (
        lambda out, o, m: (*out, "extra"),
        r"loss_func must return .*got a tuple of 4 values",
    ),
    "bare tensor": (lambda out, o, m: out[0], r"loss_func must return .*got a tensor of shape"),
    "dict": (lambda out, o, m: out[-1], r"loss_func must return .*got dict \{"),
    "non-scalar loss": (
        lambda out, o, m: ((o * m), *out[1:]),
        r"loss_func returned a loss that is not a scalar tensor: got a tensor of shape \(2, 16\)",
    ),
    "non-scalar legacy loss": (
        lambda out, o, m: ((o * m), out[-1]),
        r"loss_func returned a loss that is not a scalar tensor: got a tensor of shape \(2, 16\)",
    ),
    "float loss": (
        lambda out, o, m: (1.5, *out[1:]),
        r"loss_func returned a loss that is not a scalar tensor: got float 1.5",
    ),
    "negative count": (
        lambda out, o, m: (out[0], -out[1] - 1, out[2]),
        r"loss_func returned num_tokens=-\d+; expected a .*>= 0",
    ),
    "negative float count": (
        lambda out, o, m: (out[0], torch.tensor(-2.5), out[2]),
        r"num_tokens=-2.5; expected a .*>= 0",
    ),
    "nan count": (
        lambda out, o, m: (out[0], torch.tensor(math.nan), out[2]),
        r"num_tokens=nan; expected a finite",
    ),
    "inf count": (
        lambda out, o, m: (out[0], torch.tensor(math.inf), out[2]),
        r"num_tokens=inf; expected a finite",
    ),
    "int count": (
        lambda out, o, m: (out[0], 7, out[2]),
        r"loss_func returned num_tokens=7 \(int\); expected a .*tensor",
    ),
    "string count": (
        lambda out, o, m: (out[0], "many", out[2]),
        r"loss_func returned num_tokens='many' \(str\); expected a .*tensor",
    ),
    "None count": (
        lambda out, o, m: (out[0], None, out[2]),
        r"loss_func returned num_tokens=None \(NoneType\); expected a .*tensor",
    ),
    "bool count": (
        lambda out, o, m: (out[0], out[1] > 0, out[2]),
        r"loss_func returned num_tokens of dtype torch.bool; expected",
    ),
    "vector count": (
        lambda out, o, m: (out[0], m.sum(dim=1), out[2]),
        r"loss_func returned num_tokens of shape \(2,\); expected a .*scalar",
    ),
}


def _loss_case(name: str) -> Case:
    return CP2.with_(mode="legacy") if "legacy" in name else CP2


@pytest.mark.parametrize("name", list(BAD_LOSS_OUTPUTS))
def test_bad_loss_func_output_raises_naming_it_before_the_count_all_reduce(
    monkeypatch, collectives, name
):
    edit, match = BAD_LOSS_OUTPUTS[name]
    with_loss_outputs(monkeypatch, edit)
    with_schedule(monkeypatch, pg_collection=cp2_groups)
    with pytest.raises((TypeError, ValueError), match=match):
        run_step(_loss_case(name))
    assert collectives == [], f"{collectives} ran before the error"


def test_valid_counts_do_reach_the_count_all_reduce(collectives, monkeypatch):
    """Positive control for the test above: with C = 2 the count is all-reduced once per
    microbatch, so a check placed after the all-reduce would be caught."""
    with_schedule(monkeypatch, pg_collection=cp2_groups)
    run_step(CP2)
    assert collectives == ["all_reduce"] * CP2.microbatches


def test_forward_step_func_returning_one_value_raises_naming_it(monkeypatch):
    def bad(func):
        return lambda data_iterator, model: func(data_iterator, model)[0]

    with_schedule(monkeypatch, forward_step_func=bad)
    with pytest.raises(TypeError, match=r"forward_step_func must return .*got a tensor of shape"):
        run_step(Case())


# ----------------------------------------------------------------------------- negative controls


def _reference_grads(case: Case):
    return parity.reference_step(case)[0]


def test_negative_control_unchecked_negative_count_gives_a_silently_wrong_gradient(monkeypatch):
    """Without ``_check_num_tokens`` a negative count runs to the end: max(N, 1) turns it
    into 1 and the gradient is N times too large, with no error anywhere."""
    case = Case(microbatches=2, mask="full")
    monkeypatch.setattr(schedules, "_check_num_tokens", lambda num_tokens: None)
    with_loss_outputs(monkeypatch, lambda out, o, m: (out[0], -out[1], out[2]))
    result = run_step(case)
    failures = compare_tensors(result.grads, _reference_grads(case), 1e-5, "main_grad")
    assert len(failures) == len(result.grads), failures
    assert all(torch.isfinite(g).all() for g in result.grads.values())


def test_negative_control_unchecked_nan_count_gives_nan_gradients(monkeypatch):
    case = Case(microbatches=2, mask="uneven")
    monkeypatch.setattr(schedules, "_check_num_tokens", lambda num_tokens: None)
    with_loss_outputs(monkeypatch, lambda out, o, m: (out[0], torch.tensor(math.nan), out[2]))
    result = run_step(case)
    assert all(torch.isnan(g).all() for g in result.grads.values())


def test_the_same_callback_with_a_valid_count_matches_the_reference(monkeypatch):
    """Control for the two negative controls: only the count was wrong."""
    case = Case(microbatches=2, mask="full")
    monkeypatch.setattr(schedules, "_check_num_tokens", lambda num_tokens: None)
    with_loss_outputs(monkeypatch, lambda out, o, m: out)
    result = run_step(case)
    assert compare_tensors(result.grads, _reference_grads(case), 1e-5, "main_grad") == []


# ----------------------------------------------------------------------------- arguments

SCHEDULES = {
    "no-pipelining": (schedules.forward_backward_no_pipelining, Case()),
    "1f1b": (schedules.forward_backward_pipelining_without_interleaving, Case(pp=2)),
    "interleaved": (schedules.forward_backward_pipelining_with_interleaving, Case(pp=2, vpp=2)),
}


def _pipelined(monkeypatch, name, p2p=None, **transforms):
    """Run ``SCHEDULES[name]`` as if on stage 0 of a 2-stage pipeline."""
    schedule, case = SCHEDULES[name]
    if name != "no-pipelining":
        transforms.setdefault("p2p_communicator", lambda _: p2p or StrictP2P())
        transforms.setdefault("pg_collection", lambda _: ProcessGroupCollection(pp=FakeGroup(2)))
    with_schedule(monkeypatch, schedule, **transforms)
    return case


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_num_microbatches_below_one_or_not_an_int_raises_naming_it(monkeypatch, name, bad):
    case = _pipelined(monkeypatch, name, num_microbatches=lambda _: bad)
    expected = re.escape(f"num_microbatches must be an int >= 1, got {bad!r}")
    with pytest.raises(ValueError, match=expected):
        run_step(case)


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_missing_pipeline_dtype_with_pp_2_raises_naming_it(monkeypatch, name):
    def drop_dtype(model):
        for chunk in model if isinstance(model, list) else [model]:
            chunk.config.pipeline_dtype = None
        return model

    case = _pipelined(monkeypatch, name, model=drop_dtype)
    with pytest.raises(
        ValueError, match=r"pipeline_dtype is None.*pipeline_model_parallel_size is 2"
    ):
        run_step(case)


@pytest.mark.parametrize(
    "groups, missing",
    [
        (dict(dp=FakeGroup(1)), "cp, dp_cp"),
        (dict(cp=FakeGroup(2)), "dp_cp"),
        (dict(dp_cp=FakeGroup(2)), "cp"),
    ],
)
def test_pg_collection_without_cp_or_dp_cp_when_c_is_2_raises_naming_it(
    monkeypatch, collectives, groups, missing
):
    with_schedule(monkeypatch, pg_collection=lambda _: ProcessGroupCollection(**groups))
    expected = rf"pg_collection is missing {missing} \(needed with context_parallel_size=2\); "
    with pytest.raises(ValueError, match=expected + r"got ProcessGroupCollection\(.*FakeGroup"):
        run_step(CP2)
    assert collectives == []


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_pipelined_schedule_without_a_pp_group_raises_naming_pg_collection(monkeypatch, name):
    case = _pipelined(monkeypatch, name, pg_collection=lambda _: ProcessGroupCollection())
    with pytest.raises(ValueError, match=r"pg_collection is missing pp .*pipeline parallelism"):
        run_step(case)
    case = _pipelined(monkeypatch, name, pg_collection=lambda _: None)
    with pytest.raises(RuntimeError, match=r"pass pg_collection \(with pp\)"):
        run_step(case)


def test_ddp_pg_collection_without_dp_cp_raises_naming_it():
    config = parity.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    chunk = TokenwiseChunk(config, [0], True, True, False, initial_params(False))
    with pytest.raises(ValueError, match=r"pg_collection has no dp_cp group.*got Process"):
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(),
            chunk,
            pg_collection=ProcessGroupCollection(cp=FakeGroup(2)),
        )


def test_per_token_finalize_without_dp_cp_raises_before_any_collective(collectives):
    config = parity.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    chunk = TokenwiseChunk(config, [0], True, True, False, initial_params(False))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), chunk)
    with pytest.raises(ValueError, match=r"finalize_model_grads: .*pg_collection has no dp_cp"):
        finalize_model_grads(
            [ddp], torch.tensor(5.0), pg_collection=ProcessGroupCollection(pp=FakeGroup(2))
        )
    assert collectives == []


# ----------------------------------------------------------------------------- interleaving


@pytest.mark.parametrize(
    "args, match",
    [
        ((1, 2, 2, 2), r"microbatch_group_size_per_vp_stage=2 must lie in .*num_microbatches=1"),
        ((4, 2, 1, 2), r"microbatch_group_size_per_vp_stage=1 must lie in \[pipeline_model"),
        ((4, 2, 5, 2), r"microbatch_group_size_per_vp_stage=5 must lie in .*num_microbatches=4"),
        ((5, 2, 2, 2), r"num_microbatches=5 leaves a last group of 1 microbatches"),
        ((7, 2, 3, 3), r"num_microbatches=7 leaves a last group of 1 .*at least .*size=3"),
    ],
)
def test_interleaved_table_rejects_microbatch_counts_it_cannot_schedule(args, match):
    with pytest.raises(ValueError, match=match):
        schedules.interleaved_schedule_table(*args)


def test_interleaved_table_accepts_a_remainder_of_at_least_pp():
    table = schedules.interleaved_schedule_table(5, 2, 3, 2)
    assert len(table) == 10 and table[6:] == [(3, 0), (4, 0), (3, 1), (4, 1)]


@pytest.mark.parametrize("microbatches, match", [(1, r"num_microbatches=1\]"), (3, r"=3 leaves")])
def test_interleaved_schedule_rejects_microbatch_counts_before_any_message(
    monkeypatch, microbatches, match
):
    case = _pipelined(monkeypatch, "interleaved").with_(microbatches=microbatches)
    with pytest.raises(ValueError, match=match):
        run_step(case)


@pytest.mark.parametrize("keep", [1, 3])
def test_model_list_whose_length_is_not_vpp_raises_naming_it(monkeypatch, keep):
    def chunks(model):
        return (model * 2)[:keep]

    def iterators(its):
        return (its * 2)[:keep]

    case = _pipelined(monkeypatch, "interleaved", model=chunks, data_iterator=iterators)
    expected = rf"model is a list of {keep} chunks but virtual_pipeline_model_parallel_size is 2"
    with pytest.raises(ValueError, match=expected):
        run_step(case)


def test_data_iterator_list_whose_length_is_not_the_chunk_count_raises_naming_it(monkeypatch):
    case = _pipelined(monkeypatch, "interleaved", data_iterator=lambda its: its[:1])
    with pytest.raises(ValueError, match=r"data_iterator is a list of 1 but the model has 2"):
        run_step(case)


def test_adjust_tensor_shapes_fn_with_interleaving_raises_naming_it(monkeypatch):
    def adjust(recv, send):
        return recv, send

    case = _pipelined(monkeypatch, "interleaved", adjust_tensor_shapes_fn=lambda _: adjust)
    with pytest.raises(
        ValueError, match=r"adjust_tensor_shapes_fn is not supported .*got <function"
    ):
        run_step(case)


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_seq_length_not_divisible_by_cp_raises_naming_it(monkeypatch, name):
    groups = ProcessGroupCollection(pp=FakeGroup(2), cp=FakeGroup(2), dp_cp=FakeGroup(2))
    case = _pipelined(
        monkeypatch, name, pg_collection=lambda _: groups, seq_length=lambda s: s + 1
    ).with_(cp=2, microbatches=2)
    with pytest.raises(ValueError, match=r"seq_length=17 is not divisible by .* size 2"):
        run_step(case)


# ----------------------------------------------------------------------------- data iterator


@pytest.mark.parametrize("name", ["no-pipelining", "1f1b"])
def test_data_iterator_running_out_raises_naming_it_and_the_microbatch(monkeypatch, name):
    def two_batches(iterator):
        return iter(list(iterator)[:2])

    case = _pipelined(monkeypatch, name, p2p=PassThroughP2P(), data_iterator=two_batches)
    if name == "1f1b":  # a one-stage pipeline through the 1F1B code
        case = case.with_(pp=1)
    with pytest.raises(
        RuntimeError, match=r"data_iterator ran out .* at microbatch 2 of num_microbatches=3"
    ):
        run_step(case.with_(microbatches=3))


# ----------------------------------------------------------------------------- DDP


@pytest.mark.parametrize(
    "options, error, match",
    [
        (
            dict(overlap_param_gather=True),
            ValueError,
            r"overlap_param_gather=True needs use_distributed_optimizer=True",
        ),
        (dict(num_distributed_optimizer_instances=2), NotImplementedError, r"_instances=2 .*1"),
    ],
)
def test_ddp_options_this_core_lacks_raise_naming_them(options, error, match):
    config = parity.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    chunk = TokenwiseChunk(config, [0], True, True, False, initial_params(False))
    with pytest.raises(error, match=match):
        DistributedDataParallel(config, DistributedDataParallelConfig(**options), chunk)


def test_average_in_collective_with_per_token_loss_raises_naming_both():
    config = parity.TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True
    )
    chunk = TokenwiseChunk(config, [0], True, True, False, initial_params(False))
    with pytest.raises(ValueError, match=r"average_in_collective=True .*per_token_loss=True"):
        DistributedDataParallel(
            config, DistributedDataParallelConfig(average_in_collective=True), chunk
        )


def _poison(name: str, value: float):
    """A model transform adding ``value`` to the gradient of chunk parameter ``name``."""

    def transform(model):
        dict(model.module.named_parameters())[name].register_hook(lambda g: g + value)
        return model

    return transform


@pytest.mark.parametrize("overlap", [False, True], ids=["finish_grad_sync", "overlap"])
@pytest.mark.parametrize("value, kind", [(math.nan, "NaN"), (math.inf, "inf"), (-math.inf, "inf")])
def test_check_for_nan_in_grad_raises_naming_the_parameter(
    monkeypatch, collectives, overlap, value, kind
):
    checked = functools.partial(DistributedDataParallelConfig, check_for_nan_in_grad=True)
    monkeypatch.setattr(parity, "DistributedDataParallelConfig", checked)
    with_schedule(monkeypatch, model=_poison("weights.1", value))
    case = Case(microbatches=2, overlap=overlap, bucket_size=1 if overlap else None)
    with pytest.raises(
        RuntimeError, match=rf"found {kind} in the local gradient of parameter 'weights\.1'"
    ):
        run_step(case)
    assert collectives == []


def test_negative_control_without_check_for_nan_in_grad_nan_passes_silently(monkeypatch):
    with_schedule(monkeypatch, model=_poison("weights.1", math.nan))
    result = run_step(Case(microbatches=2))
    assert torch.isnan(result.grads["layer1.weight"]).all()
    assert torch.isfinite(result.grads["layer0.weight"]).all()


# ----------------------------------------------------------------------------- the docs

DOCUMENTED = [
    "loss_func must return (loss_sum, num_tokens, reported) or (loss, reported)",
    "loss_func returned a loss that is not a scalar tensor",
    "loss_func returned num_tokens of shape",
    "loss_func returned num_tokens of dtype torch.bool",
    "expected a finite scalar tensor (integer or float) >= 0",
    "forward_step_func must return (output_tensor, loss_func)",
    "num_microbatches must be an int >= 1, got",
    "data_iterator ran out (StopIteration in forward_step_func) at microbatch",
    "pipeline_dtype is None; set it",
    "pg_collection is missing",
    "pipeline schedules need groups: pass pg_collection (with pp)",
    "pg_collection has no dp_cp group",
    "model is a list of",
    "must lie in [pipeline_model_parallel_size=",
    "leaves a last group of",
    "adjust_tensor_shapes_fn is not supported by the interleaved schedule",
    "overlap_param_gather=True needs use_distributed_optimizer=True",
    "is not supported by this core; expected 1",
    "average_in_collective=True cannot be combined with calculate_per_token_loss=True",
    "found NaN in the local gradient of parameter",
    "accelerator counts are checked when the schedule finishes",
    "config.gradient_accumulation_fusion=True adds weight gradients into param.main_grad",
]


def test_troubleshooting_page_lists_every_error_tested_here():
    """docs/troubleshooting.md (the README's "Troubleshooting") names each message."""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "troubleshooting.md").read_text()
    assert [m for m in DOCUMENTED if m not in page] == []
