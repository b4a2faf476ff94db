"""What the run is, as its header says it: the layout label with expert parallelism, the
experts and the LoRA adapters, and the parameter count (total and trainable), each element
of the model counted once whatever the layout (issue 38 item 10)."""

import dataclasses

import pytest
import torch.distributed as dist

from megatron.training import TrainingConfig, validate_config
from megatron.training.initialize import initialize_model_parallel_groups, single_process_groups
from megatron.training.model import build_model
from megatron.training.training import _print_header, parameter_counts
from tests.unit_tests.dist_utils import assert_no_failures, fresh_layout

MOE = dict(num_experts=4, disable_bias_linear=True)
LORA = dict(lora_dim=4, lora_target_modules=["linear_qkv", "linear_proj"])  # not experts
EP2 = dict(expert_model_parallel_size=2)
ETP1 = dict(expert_tensor_parallel_size=1)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "settings, world, name",
    [
        (dict(MOE, expert_model_parallel_size=2, context_parallel_size=2), 4, "cp2-pp1-dp2-ep2"),
        (
            dict(MOE, tensor_model_parallel_size=2, sequence_parallel=True, **EP2),
            4,
            "tp2-sp-cp1-pp1-dp2-ep2",
        ),
        (
            dict(MOE, tensor_model_parallel_size=2, sequence_parallel=True, **ETP1),
            2,
            "tp2-sp-cp1-pp1-dp1-etp1",
        ),
        (dict(context_parallel_size=2), 2, "cp2-pp1-dp1"),
    ],
)
def test_the_layout_label_names_expert_parallelism(settings, world, name):
    """``--ep 2 --cp 2`` printed ``cp2-pp1-dp2``: the label now ends with ``-ep2`` (and
    ``-etpN`` when the experts' TP is not the TP); a dense layout's label is unchanged."""
    assert validate_config(TrainingConfig(**settings), world).name == name


@pytest.mark.world(1)
def test_the_header_names_the_experts_and_the_adapters(capsys):
    """The header says the model has experts (how many, top-k, where) and LoRA adapters
    (rank, alpha, targets); a dense run's header mentions neither."""
    config = TrainingConfig(**MOE, moe_router_topk=2, moe_layer_freq=[1, 0, 1, 0], **LORA)
    _print_header(config, validate_config(config, 1))
    header = capsys.readouterr().out
    assert "MoE: 4 experts, top-2, --moe-layer-freq [1, 0, 1, 0]" in header, header
    assert "LoRA: rank 4, alpha 32 on linear_qkv, linear_proj (base weights frozen)" in header
    _print_header(TrainingConfig(), validate_config(TrainingConfig(), 1))
    dense = capsys.readouterr().out
    assert "MoE" not in dense and "LoRA" not in dense, dense


@pytest.mark.world(1)
def test_one_process_parameter_count_is_every_element_once():
    """One process: every element once (the tied output layer is the embedding), the
    trainable ones being the LoRA adapters' alone."""
    config = TrainingConfig(**MOE, **LORA)
    model = build_model(config, validate_config(config, 1), None)
    params = dict(model[0].named_parameters())
    total, trainable = parameter_counts(model, None)
    assert total == sum(p.numel() for p in params.values())
    adapters = sum(p.numel() for n, p in params.items() if ".adapter." in n)
    assert trainable == adapters == sum(p.numel() for p in params.values() if p.requires_grad)
    assert 0 < trainable < total


@pytest.mark.world(2)
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(dict(tensor_model_parallel_size=2, sequence_parallel=True), id="tp2-sp"),
        pytest.param(dict(pipeline_model_parallel_size=2), id="pp2"),
        pytest.param(dict(expert_model_parallel_size=2), id="dp2-ep2"),
    ],
)
def test_parameter_count_is_the_same_for_every_layout(settings):
    """The counts of a 2-rank MoE + LoRA model (TP shards, pipeline stages with the tied
    embedding copy, expert shards) equal the one-process model's."""
    config = TrainingConfig(**MOE, **LORA, **settings)
    one_config = dataclasses.replace(
        config, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, sequence_parallel=False,
    )  # fmt: skip
    with fresh_layout():
        groups = single_process_groups(rank=0)
        one = [None]
        if dist.get_rank() == 0:
            one = [
                parameter_counts(
                    build_model(one_config, validate_config(one_config, 1), groups), groups
                )
            ]
        dist.broadcast_object_list(one, src=0)
        layout = validate_config(config, 2)
        groups = initialize_model_parallel_groups(layout)
        counts = parameter_counts(build_model(config, layout, groups), groups)
    failures = [] if counts == one[0] else [f"{layout.name}: {counts} != one process {one[0]}"]
    assert_no_failures(failures)
