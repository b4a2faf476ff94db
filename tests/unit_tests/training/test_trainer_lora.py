"""The trainer with LoRA (``--lora-dim``): the same training at every layout, adapter-only
checkpoints that resume at another layout, a base model from a checkpoint of ours, and the
flags refused without ``--lora-dim``. (The adapters' gradients against an independent
reference: ``tests/unit_tests/models/test_lora_parity.py``.)"""

import dataclasses
import re
import shutil
import tempfile
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.checkpointing import checkpoint_dir
from megatron.training.errors import UsageError
from megatron.training.model import build_model
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

SMALL = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    global_batch_size=8,
    progress=False,
    lr=1e-2,
)
LORA = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal")
MOE = dict(num_experts=4, moe_router_topk=2, disable_bias_linear=True, num_layers=2, lora_dim=4)


def _run(**changes) -> List[float]:
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**SMALL, **changes}))
    assert result.passed
    return [r["loss"] for r in result.records]


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="lora-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


@pytest.mark.world(4)
@pytest.mark.slow  # two one-process comparison runs on rank 0 while the others wait
def test_a_lora_run_at_cp2_pp2_follows_the_one_process_run():
    """--compare-single-process with --lora-dim: the 4-rank run and the one-process run agree
    (the comparison raises the run's ``passed`` flag, asserted in ``_run``)."""
    losses = _run(context_parallel_size=2, pipeline_model_parallel_size=2, train_iters=3,
                  num_layers=2, hidden_size=16, compare_single_process=True,
                  **LORA)  # fmt: skip
    assert losses[-1] < losses[0]


@pytest.mark.world(2)
@pytest.mark.slow
def test_lora_with_the_distributed_optimizer_at_dp2_follows_the_one_process_run():
    """The adapters' Adam state sharded over two data-parallel ranks (the base has none): the
    losses follow the one-process run (``--compare-single-process``, asserted in ``_run``)."""
    losses = _run(use_distributed_optimizer=True, train_iters=3, num_layers=2, hidden_size=16,
                  compare_single_process=True, **LORA)  # fmt: skip
    assert losses[-1] < losses[0]


@pytest.mark.world(2)
def test_adapter_only_checkpoints_resume_at_another_layout_from_a_base_checkpoint():
    """A base trained and saved (full model); LoRA on it with --pretrained-checkpoint, saving
    adapters only (the checkpoint holds no base weight); resuming it at another layout
    continues the uninterrupted run's losses."""
    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        lora = dict(LORA, pretrained_checkpoint=str(root / "base"), train_iters=4)
        straight = _run(tensor_model_parallel_size=2, **lora)
        first = _run(context_parallel_size=2, **dict(lora, train_iters=2),
                     save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        resumed = _run(tensor_model_parallel_size=2, sequence_parallel=True, **lora,
                       load=str(root / "lora"), save=str(root / "lora"),
                       save_trainable_params_only=True)  # fmt: skip
        assert first == pytest.approx(straight[:2], rel=1e-6)
        assert resumed == pytest.approx(straight[2:], rel=1e-6)
        stored = dist_checkpointing.load_tensors_metadata(
            str(checkpoint_dir(str(root / "lora"), 4))
        )
        weights = [k for k in stored if not k.startswith(("optimizer", "rng_state"))]
        assert weights and all(".adapter." in k for k in weights), sorted(stored)
        base = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir(str(root / "base"), 2)))
        assert "embedding.word_embeddings.weight" in base  # positive control: a full one has it
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.world(4)
@pytest.mark.slow
def test_an_adapter_saved_at_tp2_pp2_gives_the_same_logits_in_one_process():
    """Adapters trained and saved at tp2-pp2 (adapter-only, on a base checkpoint): the model
    generate's loader builds at tp2-pp2 from that checkpoint gives the logits of a one-process
    model whose weights are the checkpoints' whole tensors (``load_plain_tensors``, another
    reading path), and that differ from the one-process model without the adapters."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.training.generate import _forward, build_parser, loaded_model
    from megatron.training.initialize import single_process_groups

    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        _run(**LORA, train_iters=3, pretrained_checkpoint=str(root / "base"),
             tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
             save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        tokens = torch.arange(3, 3 + SMALL["seq_length"])[None] % 64
        positions = torch.arange(SMALL["seq_length"])[None]
        args = build_parser().parse_args(["--load", str(root / "lora"), "--tp", "2", "--pp", "2"])
        with loaded_model(args) as (model, groups, config):
            context = StaticInferenceContext(1, SMALL["seq_length"])
            logits = _forward(model[0], tokens, positions, context, groups)
        shared = [None if logits is None else logits.detach()]
        dist.broadcast_object_list(shared, src=2)  # tp rank 0 of the last stage
        tp2_pp2 = shared[0]

        whole = {
            **dist_checkpointing.load_plain_tensors(str(checkpoint_dir(str(root / "base"), 2))),
            **dist_checkpointing.load_plain_tensors(str(checkpoint_dir(str(root / "lora"), 3))),
        }
        one_config = dataclasses.replace(config, tensor_model_parallel_size=1,
                                         pipeline_model_parallel_size=1)  # fmt: skip
        layout = validate_config(one_config, 1)
        groups = single_process_groups(rank=0)
        if dist.get_rank() == 0:
            with fresh_layout():
                gpt = build_model(one_config, layout, groups)[0].module
            state = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
            loaded = {k: _stored(whole, k) for k in state}
            missing = [k for k, v in loaded.items() if v is None]
            assert not missing and any(".adapter." in k for k in state), (missing, sorted(whole))
            gpt.load_state_dict(loaded, strict=False)
            one = _logits(gpt, tokens, positions)
            assert torch.allclose(one, tp2_pp2, rtol=0, atol=1e-5), (one - tp2_pp2).abs().max()
            with torch.no_grad():  # the same trained base with its adapters' outputs at zero
                outs = [p for n, p in gpt.named_parameters() if ".adapter.linear_out." in n]
                assert outs
                for weight in outs:
                    weight.zero_()
            without = _logits(gpt, tokens, positions)
            assert (without - tp2_pp2).abs().max() > 1e-3  # the adapters make a difference
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


LAYER_NORM_NAMES = {
    "input_layernorm": "self_attention.linear_qkv.layer_norm",
    "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm",
}


def _stored(whole: dict, key: str):
    """The model's ``key`` in the checkpoint's whole tensors, where a layer's weights are row
    ``i`` of one tensor stacked over the layers (``decoder.layers.<i>.x`` -> ``decoder.layers.x``)
    and the norms are named after the linear layer they precede (``LAYER_NORM_NAMES``)."""
    if key in whole:
        return whole[key]
    for norm, fused in LAYER_NORM_NAMES.items():  # megatron-core's checkpoint names
        key = key.replace(f".{norm}.", f".{fused}_")
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        stacked = whole.get(".".join(parts[:2] + parts[3:]))
        return None if stacked is None else stacked[int(parts[2])]
    return None


def _logits(gpt, tokens, positions) -> torch.Tensor:
    gpt.eval()
    with torch.no_grad():
        return gpt(tokens, positions, attention_mask=None)


@pytest.mark.world(2)
@pytest.mark.slow
def test_an_adapter_only_checkpoint_without_its_base_is_refused():
    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        _run(**LORA, train_iters=2, pretrained_checkpoint=str(root / "base"),
             save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        # the base it was trained on is named (the recorded --pretrained-checkpoint)
        with pytest.raises(ValueError, match="--pretrained-checkpoint"):
            _run(**LORA, train_iters=4, load=str(root / "lora"))
        with pytest.raises(ValueError, match="--lora-dim 4 when saved, not given now"):
            _run(train_iters=4, load=str(root / "lora"))
        # --finetune from the base: the adapters start fresh (positive control: it loads)
        _run(**LORA, train_iters=2, load=str(root / "base"), finetune=True)
        with pytest.raises(ValueError, match="pass --finetune"):
            _run(**LORA, train_iters=4, load=str(root / "base"))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(lora_alpha=4.0), "--lora-alpha 4.0 needs --lora-dim"),
        (dict(save_trainable_params_only=True, save="x"), "--save-trainable-params-only"),
        (dict(lora_target_modules=["linear_qkv"]), "--lora-target-modules linear_qkv needs"),
        (dict(lora_dim=3, tensor_model_parallel_size=2), "--lora-dim 3 is not divisible"),
        (dict(lora_dim=4, lora_target_modules=["qkv"]), "'qkv': expected one of"),
        (dict(lora_dim=4, save_trainable_params_only=True), "needs --save DIR"),
        (
            dict(
                MOE,
                lora_dim=3,
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=2,
                lora_target_modules=["*.experts.*"],
            ),
            r"--lora-dim 3 is not divisible by the expert-tensor-parallel size 2 \(--etp",
        ),
    ],
    ids=["alpha", "save-trainable", "targets", "dim-tp", "unknown-target", "no-save", "dim-etp"],
)
def test_lora_flags_are_refused_by_name(changes, message):
    config = TrainingConfig(**{**SMALL, **changes})
    world = (
        config.tensor_model_parallel_size
        * (config.expert_tensor_parallel_size or 1)
        * (config.expert_model_parallel_size)
    )
    with pytest.raises(UsageError, match=message):
        validate_config(config, world)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, shown",
    [
        (dict(lora_exclude_modules=["*.layers.9.*"]), "'*.layers.9.*'"),
        (dict(lora_exclude_modules=["linear_qkv", "*.mlp.linear_fc3"]), "'*.mlp.linear_fc3'"),
        (dict(lora_exclude_modules=["*.experts.*"]), "'*.experts.*'"),  # a dense model
    ],
    ids=["layer-9-of-2", "fc3", "experts-of-a-dense-model"],
)
def test_exclusions_that_match_no_layer_are_refused_naming_the_layers(changes, shown):
    """A --lora-exclude-modules pattern matching nothing (a typo) is refused before the run,
    naming the pattern and the model's adaptable layers."""
    config = TrainingConfig(**{**SMALL, "lora_dim": 4, **changes})
    layers = (  # SMALL: 4 layers
        "decoder.layers.<0..3>.{self_attention.linear_qkv, self_attention.linear_proj, "
        "mlp.linear_fc1, mlp.linear_fc2}"
    )
    message = f"--lora-exclude-modules {shown} matches no layer of the model; its adaptable "
    with pytest.raises(UsageError, match=re.escape(f"{message}layers are {layers}")):
        validate_config(config, 1)
    validate_config(dataclasses.replace(config, lora_exclude_modules=["*.layers.1.*"]), 1)


@pytest.mark.world(1)
def test_targets_that_match_no_layer_are_refused():
    with pytest.raises(ValueError, match="matches no layer"):
        _run(lora_dim=4, lora_target_modules=["*.layers.9.*"], train_iters=1)


@pytest.mark.world(2)
def test_targets_that_leave_a_pipeline_stage_without_adapters_are_refused_on_every_rank():
    """Layers 0-1 on stage 0, 2-3 on stage 1: adapters on layer 0 only leave stage 1 with
    nothing to train; every rank raises (no rank waits in the optimizer for the other)."""
    with pytest.raises(ValueError, match=r"no layer of pipeline stage\(s\) 1 of"):
        _run(lora_dim=4, lora_target_modules=["*.layers.0.*"], train_iters=1,
             pipeline_model_parallel_size=2)  # fmt: skip
    # positive control: a target on both stages trains
    _run(lora_dim=4, lora_target_modules=["*.layers.0.*", "*.layers.3.*"], train_iters=1,
         pipeline_model_parallel_size=2)  # fmt: skip


@pytest.mark.world(1)
def test_lora_on_a_moe_model_adapts_every_routed_expert_and_refuses_some_experts_by_name():
    """The default targets name linear_fc1/linear_fc2, which routed experts also have: every
    expert gets its own adapters and the run trains (before: refused, issue 42); adapting
    some experts of a layer only is refused by name before the run. (Excluding the experts,
    the attention and a shared expert train: ``test_hf_lora_paths``.)"""
    with pytest.raises(ValueError, match=r"routed experts \[1, 2, 3\] of decoder\.layers\.0"):
        _run(**MOE, train_iters=2, lora_exclude_modules=["*.local_experts.0.*"])
    losses = _run(**MOE, train_iters=2, moe_shared_expert_intermediate_size=16)
    assert len(losses) == 2


@pytest.mark.world(2)
@pytest.mark.slow
def test_expert_adapters_resume_at_another_expert_layout():
    """Expert adapters saved adapter-only at EP 2 with SequentialMLP resume at TP 2 x ETP 2
    with GroupedMLP (--moe-grouped-gemm): the losses continue the uninterrupted run's, and
    the checkpoint stores them with the global expert axis."""
    root = Path(_shared_dir())
    try:
        _run(**dict(MOE, lora_dim=None), train_iters=2, save=str(root / "base"))
        lora = dict(MOE, lora_alpha=8.0, lora_b_init_method="normal", train_iters=4,
                    pretrained_checkpoint=str(root / "base"))  # fmt: skip
        straight = _run(**lora)
        first = _run(**dict(lora, train_iters=2), expert_model_parallel_size=2,
                     save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        resumed = _run(**lora, tensor_model_parallel_size=2, sequence_parallel=True,
                       expert_tensor_parallel_size=2, moe_grouped_gemm=True,
                       load=str(root / "lora"), save=str(root / "lora"),
                       save_trainable_params_only=True)  # fmt: skip
        assert first == pytest.approx(straight[:2], rel=1e-6)
        assert resumed == pytest.approx(straight[2:], rel=1e-6)
        stored = dist_checkpointing.load_tensors_metadata(
            str(checkpoint_dir(str(root / "lora"), 4))
        )
        key = "decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_out.weight"
        assert tuple(stored[key].global_shape)[:2] == (2, 4), sorted(stored)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.world(2)
@pytest.mark.slow
def test_adapters_on_some_layers_resume_at_another_layout():
    """Adapters on layers 0 and 3 only (stored one layer at a time; a stacked tensor would
    have gaps): saved adapter-only at pp2 (one adapted layer per stage), resumed at tp2-sp,
    the losses continue the uninterrupted run's."""
    root = Path(_shared_dir())
    try:
        _run(train_iters=2, save=str(root / "base"))
        lora = dict(LORA, pretrained_checkpoint=str(root / "base"), train_iters=4,
                    lora_target_modules=["*.layers.0.*", "*.layers.3.*"])  # fmt: skip
        straight = _run(tensor_model_parallel_size=2, **lora)
        first = _run(pipeline_model_parallel_size=2, **dict(lora, train_iters=2),
                     save=str(root / "lora"), save_trainable_params_only=True)  # fmt: skip
        resumed = _run(tensor_model_parallel_size=2, sequence_parallel=True, **lora,
                       load=str(root / "lora"))  # fmt: skip
        assert first == pytest.approx(straight[:2], rel=1e-6)
        assert resumed == pytest.approx(straight[2:], rel=1e-6)
        stored = dist_checkpointing.load_tensors_metadata(
            str(checkpoint_dir(str(root / "lora"), 2))
        )
        layers = {k.split(".")[2] for k in stored if k.startswith("decoder.layers.")}
        assert layers == {"0", "3"}, sorted(stored)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
