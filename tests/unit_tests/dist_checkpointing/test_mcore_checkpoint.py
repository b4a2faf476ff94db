"""A whole checkpoint written by megatron-core 0.16.1 itself loads here (issue 39): a small
DeepSeek-V3-style ``GPTModel`` (MLA with q LoRA and YaRN, a dense layer then a MoE layer with
a shared expert, sigmoid group-limited routing with an expert bias, one MoE MTP depth) built
from megatron-core's local spec and saved by its ``dist_checkpointing.save``
(``scripts/mcore_deepseek_save.py``, run by ``MCORE_PYTHON``). Our ``GPTModel`` of the same
config loads it with our ``dist_checkpointing.load`` and reproduces megatron-core's numbers on
a fixed batch. The mirror: megatron-core loads a checkpoint of ours of that model
(``scripts/mcore_deepseek_load.py``) and reproduces our logits.

Float64. What loading gives is exact: every tensor equals megatron-core's. The computation:
the first layer (MLA + dense MLP) equals megatron-core's within 3.5e-18; the MoE layer and the
logits within 1e-10, because megatron-core takes the sigmoid routing scores in float32
(``torch.sigmoid(logits.float())`` whatever ``moe_router_dtype``); its cross-entropy is float32
as well (``vocab_parallel_cross_entropy`` casts the logits), so its loss and MTP loss match
ours to float32 precision (1.1e-7 relative), our loss a float64 cross-entropy of its logits
within 4e-11, and the gradients (its float32 cross-entropy backward) within 1.7e-7 of each
gradient's largest entry. Measured values beside each check.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MTPLossLoggingHelper,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.training.checkpointing import _extra_state
from tests.unit_tests.dist_checkpointing.scripts.nontrivial import (
    nontrivial_norms_and_expert_biases,
)
from tests.unit_tests.dist_utils import fresh_layout
from tests.unit_tests.launch import free_port

pytestmark = [
    pytest.mark.world(1),
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("MCORE_PYTHON"),
        reason="MCORE_PYTHON (an interpreter with megatron-core 0.16.1) not set",
    ),
]
SCRIPT = Path(__file__).parent / "scripts" / "mcore_deepseek_save.py"
CONFIG = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=24,
    q_lora_rank=8,
    kv_lora_rank=6,
    qk_head_dim=4,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rotary_base=10000,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    mscale=1.0,
    mscale_all_dim=1.0,
    beta_fast=32,
    beta_slow=1,
    layernorm_epsilon=1e-6,
    normalization="RMSNorm",
    qk_layernorm=True,
    add_bias_linear=False,
    gated_linear_unit=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    params_dtype="float64",
    num_moe_experts=4,
    moe_layer_freq=[0, 1],
    moe_ffn_hidden_size=8,
    moe_shared_expert_intermediate_size=8,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_dtype="fp64",
    moe_token_dispatcher_type="allgather",  # its alltoall dispatcher needs CUDA streams
    mtp_num_layers=1,
    mtp_loss_scaling_factor=0.1,
    vocab_size=64,
    seq_length=8,
)


def _run_mcore(where: Path, *command: str) -> None:
    """Run ``MCORE_PYTHON command`` in ``where`` (this repository off its path); assert it
    succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run(
        [os.environ["MCORE_PYTHON"], *command],
        cwd=str(where), env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """megatron-core's checkpoint directory and what it computed."""
    where = tmp_path_factory.mktemp("mcore_deepseek")
    (where / "ckpt").mkdir()
    _run_mcore(where, str(SCRIPT), json.dumps(CONFIG), "ckpt", "result.pt")
    return where / "ckpt", torch.load(where / "result.pt", weights_only=True)


def ours() -> GPTModel:
    fields = dict(CONFIG)
    vocab, seq = fields.pop("vocab_size"), fields.pop("seq_length")
    fields["params_dtype"] = getattr(torch, fields["params_dtype"])
    config = MLATransformerConfig(**fields, activation_func=F.silu)
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    torch.manual_seed(0)
    return GPTModel(
        config, block, vocab, seq, position_embedding_type="rope", mtp_block_spec=mtp,
        pg_collection=ProcessGroupCollection(),
    )  # fmt: skip


def run_batch(model: GPTModel, theirs: dict) -> tuple:
    """Our forward on megatron-core's fixed batch: each decoder layer's output, the main
    logits [b, s, v] (the output layer's last call, after the MTP depth's, as megatron-core)
    and the per-token loss."""
    tokens, labels = theirs["tokens"], theirs["labels"]
    calls, hidden = [], {}
    model.output_layer.register_forward_hook(lambda m, i, o: calls.append(o[0].detach()))
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: hidden.__setitem__(i, o[0].detach()))
    MTPLossLoggingHelper.clean_loss_in_tracker()
    for scaler in (MTPLossAutoScaler, MoEAuxLossAutoScaler):  # megatron-core's default scale
        scaler.set_loss_scale(torch.tensor(1.0))  # (a test before may have left another)
    loss = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, labels=labels)
    return hidden, calls[-1].transpose(0, 1), loss


def test_megatron_core_deepseek_checkpoint_loads_and_computes_the_same(saved):
    directory, theirs = saved
    assert theirs["version"] == "0.16.1"
    model = ours()
    request = model.sharded_state_dict()
    loaded, missing, unexpected = dist_checkpointing.load(
        request, str(directory), strict="return_all"
    )
    assert not unexpected
    # what ours has no module for: the extra states (None) of megatron-core's per-expert
    # linears and of the down projections (ours: one expert weight; ReplicatedLinear)
    assert missing and all(_extra_state(k) for k in missing), sorted(missing)
    assert any("linear_q_down_proj" in k for k in missing)
    model.load_state_dict(loaded)
    mine = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert set(mine) == set(theirs["state"])
    for name, value in theirs["state"].items():
        assert torch.equal(mine[name], value), name
    assert theirs["state"]["decoder.layers.1.mlp.router.expert_bias"].abs().min() > 0

    labels = theirs["labels"]
    hidden, logits, loss = run_batch(model, theirs)
    loss.sum().backward()

    assert (hidden[0] - theirs["hidden"]["decoder.0"]).abs().max() < 1e-15  # measured 3.5e-18
    assert (hidden[1] - theirs["hidden"]["decoder.1"]).abs().max() < 1e-9  # 3.0e-11
    assert (logits - theirs["logits"]).abs().max() < 1e-9  # 9.6e-11
    exact = F.cross_entropy(
        theirs["logits"].flatten(0, 1), labels.flatten(), reduction="none"
    ).view_as(loss)
    assert (loss.detach() - exact).abs().max() < 1e-9  # 3.9e-11
    assert torch.allclose(loss.detach().float(), theirs["loss"], rtol=5e-7, atol=0)  # 1.1e-7
    mtp = MTPLossLoggingHelper.tracker["values"]
    assert torch.allclose(mtp.float(), theirs["mtp_loss"], rtol=5e-7, atol=0)  # 1.1e-7
    MTPLossLoggingHelper.clean_loss_in_tracker()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(theirs["grads"])
    for name, grad in theirs["grads"].items():
        # worst 1.7e-7 of the gradient's largest entry (its float32 cross-entropy backward)
        assert (grads[name] - grad).abs().max() <= 2e-6 * grad.abs().max() + 1e-15, name


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_a_two_rank_megatron_core_checkpoint_loads_at_one_process(saved, tmp_path, tp, ep):
    """Saved by megatron-core on 2 ranks (TP 2: each weight split, fc1's gate and up halves
    split separately; EP 2: two experts per rank), loaded into one process: every tensor
    equals megatron-core's (TP 2: the one-process run's weights, which ``use_cpu_initialization``
    gives at any TP; EP 2: each rank's tensors, by global expert index)."""
    (tmp_path / "ckpt").mkdir()
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    args = [str(SCRIPT), json.dumps(CONFIG), "ckpt", "result.pt", str(tp), str(ep)]
    _run_mcore(tmp_path, *launch, *args)
    expected = saved[1]["state"]
    if ep > 1:  # rank 0's replicas are the stored ones
        ranks = [torch.load(tmp_path / f"result.pt.rank{r}", weights_only=True) for r in (1, 0)]
        expected = {**ranks[0], **ranks[1]}
    model = ours()
    loaded, missing, unexpected = dist_checkpointing.load(
        model.sharded_state_dict(), str(tmp_path / "ckpt"), strict="return_all"
    )
    assert not unexpected and all(_extra_state(k) for k in missing)
    model.load_state_dict(loaded)
    mine = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert set(mine) == set(expected)
    for name, value in expected.items():
        assert torch.equal(mine[name], value), name


def test_megatron_core_loads_a_checkpoint_of_ours_and_computes_the_same(tmp_path):
    """The mirror: our DeepSeek-style model saved by our ``dist_checkpointing.save`` loads
    into megatron-core's (its ``dist_checkpointing.load``, ``scripts/mcore_deepseek_load.py``):
    every tensor megatron-core asks for is stored under its key (before: the pre-MLP norms of
    the MLA dense layer, the MoE layer and the MTP depth were not), every weight equals ours
    and its logits and loss on a fixed batch equal ours (float64)."""
    torch.manual_seed(1)
    model = ours()
    nontrivial_norms_and_expert_biases(model)  # so that loading them matters
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"))
    script = SCRIPT.parent / "mcore_deepseek_load.py"
    _run_mcore(tmp_path, str(script), json.dumps(CONFIG), "ckpt", "result.pt")
    theirs = torch.load(tmp_path / "result.pt", weights_only=True)
    # megatron-core asks for the extra states (None) of modules ours has not; nothing else
    assert theirs["unexpected"] and all(_extra_state(k) for k in theirs["unexpected"])
    assert all(_extra_state(k) for k in theirs["missing"] + theirs["not_loaded"])
    mine = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert set(mine) == set(theirs["state"])
    for name, value in theirs["state"].items():  # its expert bias: float32 whatever the dtype
        assert torch.equal(mine[name].to(value.dtype), value), name
    assert mine["decoder.layers.1.mlp.router.expert_bias"].abs().min() > 0

    hidden, logits, loss = run_batch(model, theirs)
    assert (hidden[0] - theirs["hidden"]["decoder.0"]).abs().max() < 1e-15  # measured 3.5e-18
    assert (hidden[1] - theirs["hidden"]["decoder.1"]).abs().max() < 1e-9  # 2.6e-11
    assert (logits - theirs["logits"]).abs().max() < 1e-9  # 1.7e-10
    assert torch.allclose(loss.detach().float(), theirs["loss"], rtol=5e-7, atol=0)  # 1.2e-7
    MTPLossLoggingHelper.clean_loss_in_tracker()


FLAGS = """--num-layers 2 --hidden-size 16 --num-attention-heads 2 --ffn-hidden-size 24
--multi-latent-attention --q-lora-rank 8 --kv-lora-rank 6 --qk-head-dim 4
--qk-pos-emb-head-dim 4 --v-head-dim 6 --rope-type yarn --rotary-base 10000
--rotary-scaling-factor 4 --original-max-position-embeddings 4 --mscale 1 --mscale-all-dim 1
--beta-fast 32 --beta-slow 1 --norm-epsilon 1e-6 --normalization RMSNorm --qk-layernorm
--disable-bias-linear --swiglu --num-experts 4 --moe-layer-freq [0,1] --moe-ffn-hidden-size 8
--moe-shared-expert-intermediate-size 8 --moe-router-topk 2 --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2
--moe-router-group-topk 1 --moe-token-dispatcher-type allgather --mtp-num-layers 1
--vocab-size 64 --seq-length 8 --untie-embeddings-and-output-weights
--position-embedding-type rope --global-batch-size 2 --micro-batch-size 2""".split()


def test_the_trainer_fine_tunes_from_it_in_megatrons_layout(saved, tmp_path, capsys):
    """``--load DIR --finetune`` with megatron's layout (``DIR/iter_0000010/`` and
    ``latest_checkpointed_iteration.txt``): the weights load (before: refused, the extra
    states of modules ours has not counted as dropped weights). A Megatron-LM training
    checkpoint holds more (docs/checkpoints.md)."""
    import shutil

    from megatron.training import cli

    shutil.copytree(saved[0], tmp_path / "iter_0000010")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with fresh_layout():
        code = cli.main(FLAGS + ["--load", str(tmp_path), "--finetune", "--train-iters", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert f"loaded checkpoint of iteration 0 from {tmp_path / 'iter_0000010'}" in out.out
    with fresh_layout():  # a resume: it has no optimizer state (before: a KeyError inside)
        code = cli.main(FLAGS + ["--load", str(tmp_path), "--train-iters", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "holds no optimizer state" in err and "pass --finetune" in err, err


# The common state Megatron-LM's trainer saves beside the model (``generate_state_dict``):
# its ``args`` (an argparse.Namespace holding megatron-core enums and torch dtypes), the
# checkpoint version, the iteration, the FLOPs so far and the scheduler's state.
MEGATRON_LM_COMMON = """
import argparse, sys, torch
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnBackend
args = argparse.Namespace(num_layers=2, hidden_size=16, params_dtype=torch.float64,
                          model_type=ModelType.encoder_or_decoder,
                          attention_backend=AttnBackend.auto, data_path=["corpus"])
torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10,
            "num_floating_point_operations_so_far": 1.5e12,
            "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 20}}, sys.argv[1])
"""


def test_the_trainer_fine_tunes_from_a_megatron_lm_training_checkpoint(saved, tmp_path, capsys):
    """megatron-core's checkpoint with the common state Megatron-LM's trainer writes (its
    ``args`` pickled by megatron-core's interpreter, enums included): ``--finetune`` loads
    its weights, the args read as a namespace with stand-ins for the enums (before: the whole
    checkpoint refused, common.pt "holds a pickled object ... argparse.Namespace"); a resume
    is refused naming Megatron-LM and ``--finetune``."""
    import argparse
    import shutil

    from megatron.core.dist_checkpointing.storage import SavedValue
    from megatron.training import cli

    checkpoint = tmp_path / "iter_0000010"
    shutil.copytree(saved[0], checkpoint)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    _run_mcore(tmp_path, "-c", MEGATRON_LM_COMMON, str(checkpoint / "common.pt"))
    common = dist_checkpointing.load_common_state_dict(str(checkpoint))
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and args.params_dtype == torch.float64
    assert isinstance(args.attention_backend, SavedValue)
    assert args.attention_backend.qualified_name == "megatron.core.transformer.enums.AttnBackend"
    with fresh_layout():
        code = cli.main(FLAGS + ["--load", str(tmp_path), "--finetune", "--train-iters", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert f"loaded checkpoint of iteration 10 from {checkpoint}" in out.out
    assert "model weights only; training starts at iteration 0" in out.out
    with fresh_layout():
        code = cli.main(FLAGS + ["--load", str(tmp_path), "--train-iters", "20"])
    err = capsys.readouterr().err
    assert code != 0 and "written by Megatron-LM's trainer" in err and "--finetune" in err, err
