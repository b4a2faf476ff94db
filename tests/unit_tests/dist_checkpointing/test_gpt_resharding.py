"""A GPT and its Adam state saved at one (TP, CP, PP, VPP, DP) layout load bitwise at another.

The reference needs no checkpoint: every state here is a layout-free function of global
tensors. Weights are drawn per parameter from (seed, global name) as full tensors and sliced
(``GPTModel``), each gradient likewise (``seeded_normal`` of the full shape, this rank's TP
slice), and one Adam step without clipping is elementwise. So at the LOAD layout, building
the model with the saving seed and taking the same step gives, on every rank, exactly the
tensors the checkpoint must deliver there: parameters, ``exp_avg``, ``exp_avg_sq``, the step
and (bf16) the fp32 main parameters. The loaded run starts from a different seed and an empty
optimizer, loads with ``dist_checkpointing.load`` and ``load_state_dict`` (the model through
``model.load_state_dict`` as megatron's example script does), and must match bit for bit.

Configurations: "gpt2" (LayerNorm, learned positions, tied embeddings, biases) and "llama"
(RMSNorm, SwiGLU, GQA, RoPE, untied, no biases), and "llama-qknorm-whole" (OLMoE's q/k norms
over the whole projections, their weights split over TP). A negative control numbers layers by their
local index (a key that depends on PP) and must fail when PP changes.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import seeded_normal, tp_shard
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import assert_no_failures

SAVE_SEED, LOAD_SEED, GRAD_SEED = 5, 77, 9
LAYERS, VOCAB, SEQ = 4, 32, 16


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def id(self) -> str:
        parts = [f"{n}{v}" for n, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp)) if v > 1]
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"dp{self.dp}"] if self.dp > 1 else []
        return "-".join(parts) or "dp1"


MODELS = {
    "gpt2": dict(hidden_size=16, num_attention_heads=4, normalization="LayerNorm"),
    "llama": dict(
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
    ),
}
# OLMoE's attention: q/k norms over the whole projections, their weights split over TP
MODELS["llama-qknorm-whole"] = dict(
    MODELS["llama"], qk_layernorm=True, qk_layernorm_whole_projection=True
)
TIED = {"gpt2": True, "llama": False, "llama-qknorm-whole": False}
ROPE = {"gpt2": False, "llama": True, "llama-qknorm-whole": True}


def build(layout: Layout, model: str, seed: int, bf16: bool):
    """This rank's chunks and optimizer at ``layout`` (parallel_state set up for it)."""
    if _current_layout() != layout:
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
    pp_rank = groups.pp.rank()
    last = layout.pp * (layout.vpp or 1) - 1
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage * layout.pp + pp_rank
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                qk_layernorm=MODELS[model].get("qk_layernorm", False)
            ),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=stage == 0,
            post_process=stage == last,
            share_embeddings_and_output_weights=TIED[model],
            position_embedding_type="rope" if ROPE[model] else "learned_absolute",
            vp_stage=vp_stage if layout.vpp else None,
            pg_collection=groups,
            seed=seed,
        )
        chunks.append(chunk.to(dtype))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=0.0, bf16=bf16, params_dtype=dtype),
        chunks,
        pg_collection=groups,
    )
    return chunks, optimizer


def _current_layout() -> Optional[Layout]:
    if not parallel_state.model_parallel_is_initialized():
        return None
    return Layout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
    )


def take_a_step(chunks: List[GPTModel], optimizer) -> None:
    """One Adam step on layout-free gradients: each parameter's gradient is its slice of a
    full tensor drawn from (GRAD_SEED, global name)."""
    for chunk in chunks:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for name, param in chunk.named_parameters():
            full_shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                full_shape[param.partition_dim] *= tp
            grad = seeded_normal(full_shape, GRAD_SEED, chunk._reference_name(name), 1.0)
            param.main_grad = tp_shard(grad, param, tp, tp_rank).to(param.dtype)
    optimizer.step()


def snapshot(chunks: List[GPTModel], optimizer) -> Dict[str, torch.Tensor]:
    """Every model parameter and every optimizer state tensor of this rank, by name."""
    out = {}
    for i, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            out[f"chunk{i}.{name}"] = param.detach().clone()
            main = getattr(param, "main_param", param)
            for key, value in optimizer.optimizer.state[main].items():
                out[f"chunk{i}.{name}:{key}"] = torch.as_tensor(value).clone()
            if main is not param:
                out[f"chunk{i}.{name}:fp32_param"] = main.detach().clone()
    return out


def model_sharded_state_dict(chunks: List[GPTModel]) -> dict:
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save(chunks, optimizer, directory) -> None:
    model = model_sharded_state_dict(chunks)
    state = {"model": model, "optimizer": optimizer.sharded_state_dict(model), "iteration": 1}
    dist_checkpointing.save(state, str(directory))


def load(chunks, optimizer, directory) -> None:
    model = model_sharded_state_dict(chunks)
    request = {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=True)}
    loaded = dist_checkpointing.load(request, str(directory))
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model"][f"model{i}"])
    optimizer.load_state_dict(loaded["optimizer"])


def compare(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tag: str) -> List[str]:
    failures = []
    if set(got) != set(want):
        failures.append(f"{tag}: state names differ: {sorted(set(got) ^ set(want))[:6]}")
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            failures.append(f"{tag} {name}: loaded value differs from the reference")
    return failures


def round_trip(save_layout: Layout, load_layout: Layout, model: str, bf16: bool, directory):
    chunks, optimizer = build(save_layout, model, SAVE_SEED, bf16)
    take_a_step(chunks, optimizer)
    save(chunks, optimizer, directory)

    chunks, optimizer = build(load_layout, model, SAVE_SEED, bf16)
    take_a_step(chunks, optimizer)
    reference = snapshot(chunks, optimizer)

    chunks, optimizer = build(load_layout, model, LOAD_SEED, bf16)
    fresh = snapshot(chunks, optimizer)
    load(chunks, optimizer, directory)
    loaded = snapshot(chunks, optimizer)
    # the test can fail: before loading, the weights differ from the reference
    changed = [n for n in fresh if ":" not in n and not torch.equal(fresh[n], reference[n])]
    return compare(loaded, reference, f"{save_layout.id}->{load_layout.id}"), changed


def _pair(save: Layout, load: Layout, model: str, bf16: bool = False, slow: bool = False):
    assert save.world == load.world
    marks = [pytest.mark.world(save.world)] + ([pytest.mark.slow] if slow else [])
    tag = f"{save.id}-to-{load.id}-{model}" + ("-bf16" if bf16 else "")
    return pytest.param(save, load, model, bf16, marks=marks, id=tag)


PAIRS = [
    _pair(Layout(tp=2, pp=2), Layout(cp=2, dp=2), "gpt2"),
    _pair(Layout(pp=2, vpp=2, dp=2), Layout(tp=4), "llama"),
    _pair(Layout(tp=4), Layout(pp=4), "llama", bf16=True),
    _pair(Layout(cp=4), Layout(pp=2, vpp=2, dp=2), "gpt2"),
    _pair(Layout(tp=2, cp=2), Layout(tp=2, pp=2), "llama"),
    _pair(Layout(dp=4), Layout(tp=2, pp=2), "gpt2", bf16=True),
    _pair(Layout(tp=2, cp=2, pp=2), Layout(pp=2, vpp=2, dp=4), "gpt2"),
    # more pairs, in the slow run
    _pair(Layout(tp=2, pp=2, dp=2), Layout(tp=4, cp=2), "llama", slow=True),
    _pair(Layout(pp=4), Layout(tp=2, dp=2), "gpt2", slow=True),
    _pair(Layout(tp=4), Layout(pp=2, vpp=2, tp=2), "gpt2", slow=True),
    _pair(Layout(pp=2, vpp=2, cp=2), Layout(dp=4), "llama", bf16=True, slow=True),
    _pair(Layout(tp=2, dp=2), Layout(tp=4), "llama", slow=True),
    _pair(Layout(tp=4, dp=2), Layout(pp=4, dp=2), "llama", slow=True),
    _pair(Layout(cp=2, pp=4), Layout(tp=2, cp=4), "gpt2", bf16=True, slow=True),
    _pair(Layout(tp=4), Layout(tp=2, pp=2), "llama-qknorm-whole", slow=True),
]


@pytest.mark.parametrize("save_layout, load_layout, model, bf16", PAIRS)
def test_gpt_and_optimizer_reshard_bitwise(save_layout, load_layout, model, bf16, shared_dir):
    try:
        failures, changed = round_trip(save_layout, load_layout, model, bf16, shared_dir)
        if not changed:
            failures.append("the fresh model equals the reference before loading")
        assert_no_failures(failures)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.world(4)
def test_negative_control_layer_keys_by_local_index_are_caught(shared_dir, monkeypatch):
    """Number layers by their index within the chunk (a key that depends on PP): loading a
    PP=2 checkpoint at PP=1 then puts stage 1's layers in place of layers 0 and 1."""
    original = GPTModel.sharded_state_dict

    def local_numbering(self, *args, **kwargs):
        saved = [layer.layer_number for layer in self.decoder.layers]
        for index, layer in enumerate(self.decoder.layers):
            layer.layer_number = index + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            for layer, number in zip(self.decoder.layers, saved):
                layer.layer_number = number

    monkeypatch.setattr(GPTModel, "sharded_state_dict", local_numbering)
    try:
        failures, _ = round_trip(Layout(pp=2, dp=2), Layout(dp=4), "gpt2", False, shared_dir)
    except dist_checkpointing.CheckpointingException as err:
        failures = [f"refused: {err}"]  # also a catch: the save sees the overlap
    finally:
        parallel_state.destroy_model_parallel()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, len(failures))
    assert sum(everyone) > 0, "layer keys that depend on PP went unnoticed"
