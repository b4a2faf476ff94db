"""Schedule helpers of megatron-core 0.16.1 that scripts call directly, checked against
facts recorded from megatron-core itself: ``get_pp_rank_microbatches``,
``get_schedule_table``, ``pipeline_parallel.utils``; and the legacy ``loss_func`` that
returns a Python number (accepted with ``forward_only=True``, rejected in training).
"""

import inspect

import pytest
import torch
import torch.distributed as dist

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel import utils as pp_utils
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import WORLD_SIZE, assert_no_failures, reset_layout
from tests.unit_tests.mcore_facts import facts_section

HELPERS = facts_section("schedule_helpers")


class _Group:
    """Size and rank of a pipeline group, as ``get_pp_rank_microbatches`` reads them."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _P2P:
    def __init__(self, pp_size: int, pp_rank: int, vp_size) -> None:
        self.pp_group = _Group(pp_size, pp_rank)
        self.virtual_pipeline_model_parallel_size = vp_size


@pytest.mark.world(1)
def test_get_pp_rank_microbatches_equals_megatron_core():
    failures = []
    for fact in HELPERS["get_pp_rank_microbatches"]:
        m, chunks, g, forward_only, overlap, pp_size, rank, vp_size = fact["args"]
        got = schedules.get_pp_rank_microbatches(
            m, chunks, g, forward_only, overlap, p2p_communicator=_P2P(pp_size, rank, vp_size)
        )
        if list(got) != fact["result"]:
            failures.append(f"{fact['args']}: {list(got)} != megatron-core {fact['result']}")
    assert len(HELPERS["get_pp_rank_microbatches"]) > 100
    assert not failures, "\n".join(failures[:20])


@pytest.mark.world(1)
def test_get_schedule_table_equals_megatron_core():
    failures = []
    for fact in HELPERS["get_schedule_table"]:
        got = [list(x) for x in schedules.get_schedule_table(*fact["args"])]
        if got != fact["table"]:
            failures.append(f"{fact['args']}: {got} != megatron-core {fact['table']}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.world(1)
def test_pp_utils_without_a_group_is_one_stage():
    assert pp_utils.is_pp_first_stage(None) and pp_utils.is_pp_last_stage(None)
    assert pp_utils.is_vp_first_stage(None, None) and pp_utils.is_vp_last_stage(0, 1)
    assert pp_utils.is_vp_first_stage(0, 3) and not pp_utils.is_vp_first_stage(2, 3)
    assert pp_utils.is_vp_last_stage(2, 3) and not pp_utils.is_vp_last_stage(1, 3)
    with pytest.raises(AssertionError, match="vp_stage=1"):
        pp_utils.is_vp_first_stage(1, None)


@pytest.mark.world(2, 4)
def test_pp_utils_follow_the_pipeline_group():
    reset_layout()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        group = parallel_state.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        stage = ranks.index(dist.get_rank())
        checks = {
            "first": (pp_utils.is_pp_first_stage(group), stage == 0),
            "last": (pp_utils.is_pp_last_stage(group), stage == 1),
            "first rank": (pp_utils.get_pp_first_rank(group), ranks[0]),
            "last rank": (pp_utils.get_pp_last_rank(group), ranks[1]),
            "next": (pp_utils.get_pp_next_rank(group), ranks[1] if stage == 0 else None),
            "prev": (pp_utils.get_pp_prev_rank(group), ranks[0] if stage == 1 else None),
        }
        failures = [f"{k}: {got} != {want}" for k, (got, want) in checks.items() if got != want]
    finally:
        reset_layout()
    assert_no_failures(failures)


# ----------------------------------------------------------------------------- number loss

HIDDEN, SEQ, MBS, M = 3, 4, 2, 3


class _Stage(torch.nn.Module):
    """y = x * w (elementwise); the first stage reads the batch, later ones their input."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.full((HIDDEN,), 2.0))
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch if self.input_tensor is None else self.input_tensor
        return x * self.weight


def _batches():
    return [
        torch.arange(SEQ * MBS * HIDDEN, dtype=torch.float32).view(SEQ, MBS, HIDDEN) + m
        for m in range(M)
    ]


def _number_loss_step(pp: int, forward_only: bool, config_kind: str = "transformer"):
    if config_kind == "transformer":
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32
        )
    else:  # megatron-core's schedule tests: a bare ModelParallelConfig plus hidden_size
        config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
        config.hidden_size = HIDDEN
    model = _Stage(config)

    def forward_step(data_iterator, chunk):
        output = chunk(next(data_iterator))

        def loss_func(out):
            value = out.detach().sum().item()  # a Python number, as legacy scripts return
            return value, {"lm loss": value}

        return output, loss_func

    func = schedules.get_forward_backward_func(pp_size=pp)
    return func(
        forward_step_func=forward_step,
        data_iterator=iter(_batches()),
        model=[model],
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )


@pytest.mark.world(1, 2)
@pytest.mark.parametrize("config_kind", ["transformer", "model-parallel"])
def test_legacy_number_loss_is_reported_with_forward_only(config_kind):
    """Each microbatch's reported number is sum(x) * 2**PP, as a dense computation gives;
    a plain ModelParallelConfig (no calculate_per_token_loss field) works too."""
    pp = WORLD_SIZE
    reset_layout()
    if pp > 1:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    try:
        reported = _number_loss_step(pp, forward_only=True, config_kind=config_kind)
        last = not parallel_state.model_parallel_is_initialized() or (
            parallel_state.is_pipeline_last_stage()
        )
    finally:
        reset_layout()
    expected = [{"lm loss": float(b.double().sum()) * 2.0**pp} for b in _batches()] if last else []
    assert_no_failures([] if reported == expected else [f"reported {reported} != {expected}"])


@pytest.mark.world(1)
def test_legacy_number_loss_in_training_raises_naming_it():
    with pytest.raises(ValueError, match="Python number.*forward_only=True"):
        _number_loss_step(1, forward_only=False)


@pytest.mark.world(1)
def test_interleaved_remainder_error_is_also_megatron_cores_runtime_error():
    """M = 7 with g = PP = 4 leaves a last group of 3: megatron-core raises RuntimeError."""
    with pytest.raises(RuntimeError, match="last group of 3") as info:
        schedules.interleaved_schedule_table(7, 2, 4, 4)
    assert isinstance(info.value, ValueError)


@pytest.mark.world(1)
def test_misuse_megatron_core_asserts_on_is_an_assertion_error():
    """Code written for megatron-core catches these as AssertionError; they stay ValueError /
    TypeError with our messages."""
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1)
    chunk = _Stage(config)
    kwargs = dict(
        data_iterator=iter(_batches()),
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=True,
    )

    def step(data_iterator, model):
        return model(next(data_iterator)), lambda out: (out.sum(),)  # one value: bad

    with pytest.raises(AssertionError, match="model must be one module") as info:
        schedules.forward_backward_no_pipelining(
            forward_step_func=step, model=[chunk, chunk], **kwargs
        )
    assert isinstance(info.value, ValueError)
    with pytest.raises(AssertionError, match="loss_func must return") as info:
        schedules.forward_backward_no_pipelining(forward_step_func=step, model=[chunk], **kwargs)
    assert isinstance(info.value, ValueError)
    with pytest.raises(AssertionError, match="expected a Tensor") as info:
        schedules.deallocate_output_tensor([1.0], deallocate_pipeline_outputs=True)
    assert isinstance(info.value, TypeError)


@pytest.mark.world(1)
def test_schedules_keep_their_names_and_docs_around_the_shared_signature():
    """The three schedules are loops given one signature by ``_schedule``: each still
    introspects as itself (name, module, docstring) with megatron-core's keyword-only
    parameters, and ``get_forward_backward_func`` returns them."""
    funcs = [
        schedules.forward_backward_no_pipelining,
        schedules.forward_backward_pipelining_without_interleaving,
        schedules.forward_backward_pipelining_with_interleaving,
    ]
    for func in funcs:
        assert func.__module__ == schedules.__name__ and func.__qualname__ == func.__name__
        assert getattr(schedules, func.__name__) is func and func.__doc__
        params = inspect.signature(func).parameters.values()
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), func
    assert len({str(inspect.signature(func)) for func in funcs}) == 1
    assert len({func.__doc__ for func in funcs}) == 3
    assert schedules.get_forward_backward_func(pp_size=2, vp_size=2) is funcs[2]


@pytest.mark.world(1)
def test_set_is_first_microbatch_follows_the_module_chain():
    """megatron-core's ``set_is_first_microbatch`` is found through ``.module`` wrappers
    (DDP); a model without it anywhere on the chain is left alone."""
    calls = []

    class Inner(torch.nn.Module):
        def set_is_first_microbatch(self):
            calls.append(self)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = Inner()
    schedules._set_is_first_microbatch(Wrapper(Wrapper(inner)))
    schedules._set_is_first_microbatch(Wrapper(torch.nn.Linear(1, 1)))
    assert calls == [inner]
