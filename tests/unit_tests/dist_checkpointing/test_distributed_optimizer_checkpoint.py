"""The distributed optimizer's checkpoints reshard across DP sizes and to and from the plain
optimizer, bitwise.

As in ``test_gpt_resharding``, the reference needs no checkpoint: weights are drawn per
parameter from (seed, global name), each gradient is its slice of a full tensor drawn from
(GRAD_SEED, global name), and one Adam step is elementwise; so at the LOAD layout and with the
LOAD optimizer kind, building the model with the saving seed and taking the same step gives
exactly the state the checkpoint must deliver. It is compared in the optimizers' common
format (``optimizer.state_dict()``: whole per-parameter ``exp_avg``/``exp_avg_sq``, the step
and, in bf16, the fp32 main parameters, in parameter-group order) and as the model's
parameters. The loaded run starts from another seed and an empty optimizer.

Kinds: "dist" (``DistributedDataParallel`` + ``DistributedOptimizer``, state sharded over
dp x cp) and "plain" (DDP + the non-distributed optimizer).
"""

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import seeded_normal, tp_shard
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_checkpointing.test_gpt_resharding import (
    GRAD_SEED,
    LAYERS,
    LOAD_SEED,
    MODELS,
    ROPE,
    SAVE_SEED,
    SEQ,
    TIED,
    VOCAB,
    Layout,
)
from tests.unit_tests.dist_utils import assert_no_failures

pytestmark = pytest.mark.timeout(300)


def build(layout: Layout, model: str, seed: int, bf16: bool, kind: str):
    """This rank's DDP chunks and optimizer (``kind`` "dist" or "plain") at ``layout``."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        **MODELS[model],
    )
    distributed = kind == "dist"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=distributed,
        bucket_size=700,
    )
    last = layout.pp * (layout.vpp or 1) - 1
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage * layout.pp + groups.pp.rank()
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=stage == 0,
            post_process=stage == last,
            share_embeddings_and_output_weights=TIED[model],
            position_embedding_type="rope" if ROPE[model] else "learned_absolute",
            vp_stage=vp_stage if layout.vpp else None,
            pg_collection=groups,
            seed=seed,
        ).to(dtype)
        chunks.append(DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=0.01,
            weight_decay=0.1,
            clip_grad=0.0,
            bf16=bf16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
        ),
        chunks,
        pg_collection=groups,
    )
    return chunks, optimizer


def take_a_step(chunks, optimizer) -> None:
    """One Adam step on layout-free gradients (already reduced: the same on every replica)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            full_shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                full_shape[param.partition_dim] *= tp
            grad = seeded_normal(full_shape, GRAD_SEED, chunk.module._reference_name(name), 1.0)
            param.main_grad.copy_(tp_shard(grad, param, tp, tp_rank))
    optimizer.step()


def snapshot(chunks, optimizer) -> Dict[str, torch.Tensor]:
    """Parameters by name, and the optimizer state in the common (per-parameter) format."""
    out = {}
    for i, chunk in enumerate(chunks):
        chunk.finish_param_sync()
        for name, param in chunk.module.named_parameters():
            out[f"chunk{i}.{name}"] = param.detach().clone()
    state = optimizer.state_dict()
    optim = state["optimizer"] if "optimizer" in state else state
    for index, param_state in optim["state"].items():
        for key, value in param_state.items():
            out[f"state{index}:{key}"] = torch.as_tensor(value).clone()
    for g, group in enumerate(state.get("fp32_from_fp16_params", [])):
        for j, main in enumerate(group):
            out[f"fp32_param{g}.{j}"] = main.detach().clone()
    return out


def model_sharded_state_dict(chunks) -> dict:
    if len(chunks) == 1:
        return chunks[0].module.sharded_state_dict()
    return {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(chunks)}


def round_trip(save, load, model: str, bf16: bool, directory) -> List[str]:
    (save_layout, save_kind), (load_layout, load_kind) = save, load
    chunks, optimizer = build(save_layout, model, SAVE_SEED, bf16, save_kind)
    take_a_step(chunks, optimizer)
    sharded = model_sharded_state_dict(chunks)
    state = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded)}
    dist_checkpointing.save(state, str(directory))

    chunks, optimizer = build(load_layout, model, SAVE_SEED, bf16, load_kind)
    take_a_step(chunks, optimizer)
    reference = snapshot(chunks, optimizer)

    chunks, optimizer = build(load_layout, model, LOAD_SEED, bf16, load_kind)
    fresh = snapshot(chunks, optimizer)
    sharded = model_sharded_state_dict(chunks)
    request = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded, True)}
    loaded = dist_checkpointing.load(request, str(directory))
    if len(chunks) == 1:
        chunks[0].module.load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded["model"][f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])
    got = snapshot(chunks, optimizer)
    tag = f"{save_layout.id}:{save_kind}->{load_layout.id}:{load_kind}"
    failures = []
    if set(got) != set(reference):
        failures.append(f"{tag}: state names differ: {sorted(set(got) ^ set(reference))[:6]}")
    for name in sorted(set(got) & set(reference)):
        a, b = got[name], reference[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            failures.append(f"{tag} {name}: loaded value differs from the reference")
    if all(torch.equal(fresh[n], reference[n]) for n in fresh if n.startswith("chunk")):
        failures.append(f"{tag}: the fresh model equals the reference before loading")
    return failures


def _pair(save, load, model: str, bf16: bool = False, slow: bool = False):
    marks = [pytest.mark.world(save[0].world)] + ([pytest.mark.slow] if slow else [])
    tag = f"{save[0].id}-{save[1]}-to-{load[0].id}-{load[1]}-{model}" + ("-bf16" if bf16 else "")
    return pytest.param(save, load, model, bf16, marks=marks, id=tag)


PAIRS = [
    # world 2
    _pair((Layout(dp=2), "dist"), (Layout(tp=2), "dist"), "gpt2"),
    _pair((Layout(dp=2), "plain"), (Layout(dp=2), "dist"), "llama"),
    _pair((Layout(cp=2), "dist"), (Layout(dp=2), "plain"), "gpt2", bf16=True),
    # world 4: DP = 4 to DP = 2, to DP = 1, to the plain optimizer, and back
    _pair((Layout(dp=4), "dist"), (Layout(tp=2, dp=2), "dist"), "gpt2"),
    _pair((Layout(dp=4), "dist"), (Layout(pp=2, vpp=2, tp=2), "dist"), "llama", slow=True),
    _pair((Layout(dp=4), "dist"), (Layout(dp=4), "plain"), "llama"),
    _pair((Layout(pp=2, dp=2), "plain"), (Layout(dp=4), "dist"), "gpt2"),
    _pair((Layout(dp=4), "dist"), (Layout(pp=2, dp=2), "dist"), "gpt2", bf16=True, slow=True),
    _pair((Layout(cp=2, dp=2), "dist"), (Layout(tp=4), "plain"), "llama", bf16=True, slow=True),
    _pair((Layout(tp=4), "plain"), (Layout(cp=2, dp=2), "dist"), "gpt2", bf16=True, slow=True),
]


@pytest.mark.parametrize("save, load, model, bf16", PAIRS)
def test_distributed_optimizer_checkpoint_reshards_bitwise(save, load, model, bf16, shared_dir):
    try:
        assert_no_failures(round_trip(save, load, model, bf16, shared_dir))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.world(2, 4)
def test_negative_control_shards_written_one_element_off_are_caught(shared_dir, monkeypatch):
    """Each rank's flat shards written one element off (every state shard rolled by one before
    it is saved) must not load as the reference."""
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer._flat_pieces
    monkeypatch.setattr(
        distrib_optimizer,
        "_flat_pieces",
        lambda piece, shard, value, prefix: original(piece, shard, value.roll(1), prefix),
    )
    layout = Layout(dp=dist.get_world_size())
    try:
        failures = round_trip((layout, "dist"), (layout, "dist"), "gpt2", False, shared_dir)
    finally:
        parallel_state.destroy_model_parallel()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, len(failures))
    assert sum(everyone) > 0, "state written one element off went unnoticed"


@pytest.mark.world(2)
def test_sharded_save_and_load_never_assemble_whole_tensors(shared_dir, monkeypatch):
    """While the distributed optimizer builds its sharded state dict, saves, loads and takes
    the loaded state, no gather may run (each rank writes and reads its own shards); the
    loaded state still equals the saved one. Negative control: the same guard does trip on
    ``state_dict()``, which does assemble whole tensors."""
    from megatron.core.optimizer import distrib_optimizer

    layout = Layout(dp=dist.get_world_size())
    try:
        chunks, optimizer = build(layout, "gpt2", SAVE_SEED, False, "dist")
        take_a_step(chunks, optimizer)
        saved = snapshot(chunks, optimizer)

        def refuse(*args, **kwargs):
            raise AssertionError("a gather ran during a sharded save or load")

        with monkeypatch.context() as patch:
            patch.setattr(distrib_optimizer, "all_gather_along_first_dim", refuse)
            sharded = model_sharded_state_dict(chunks)
            state = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded)}
            dist_checkpointing.save(state, str(shared_dir))
            chunks, optimizer = build(layout, "gpt2", LOAD_SEED, False, "dist")
            sharded = model_sharded_state_dict(chunks)
            request = {"model": sharded, "optimizer": optimizer.sharded_state_dict(sharded, True)}
            loaded = dist_checkpointing.load(request, str(shared_dir))
            chunks[0].module.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            with pytest.raises(AssertionError, match="a gather ran"):
                optimizer.state_dict()
        got = snapshot(chunks, optimizer)
    finally:
        parallel_state.destroy_model_parallel()
    assert set(got) == set(saved)
    assert_no_failures([n for n in saved if not torch.equal(got[n], saved[n])])
