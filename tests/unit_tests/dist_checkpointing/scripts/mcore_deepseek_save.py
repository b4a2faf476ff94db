"""Run by megatron-core 0.16.1's interpreter (``MCORE_PYTHON``), never with this repository on
the path: build a small DeepSeek-V3-style ``GPTModel`` (MLA, MoE with a shared expert and
sigmoid routing with an expert bias, one MTP depth) from megatron-core's local spec, save it
with megatron-core's ``dist_checkpointing.save`` and write what it computes on a fixed batch.

    python mcore_deepseek_save.py CONFIG_JSON CKPT_DIR RESULT_PT [TP EP]

(under ``torchrun`` for TP / EP > 1). ``CONFIG_JSON``: the ``MLATransformerConfig`` fields
(the test's ``CONFIG``); the vocabulary and sequence length are ``vocab_size`` / ``seq_length``
in it. ``RESULT_PT``: the parameters' values by name (``model.state_dict()``), each decoder
layer's output, the logits, the per-token loss, the MTP loss and every parameter's gradient of
the loss sum. At TP or EP > 1 no forward (its MoE layer refuses TP without sequence
parallelism, which its local (torch) norms refuse): the checkpoint (at TP > 1 with the
one-process run's weights: ``use_cpu_initialization`` builds each whole weight from the seed),
and at EP > 1 ``RESULT_PT.rank<r>``, each rank's tensors by global name.

Without Transformer Engine, and on the CPU, megatron-core's local MLA needs shims
(``tests/benchmarks/mcore_shims.py``, shared with ``bench_mla.py``); the causal mask is passed
explicitly (its default is made on "cuda") and the allgather token dispatcher is used (its
alltoall one makes CUDA streams).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from nontrivial import nontrivial_norms_and_expert_biases  # noqa: E402

# tests/benchmarks (megatron-core and torch only), not the repository root: its megatron
# would be imported instead of megatron-core's
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from mcore_shims import apply_shims, local_core_attention  # noqa: E402


def swap_core_attention(spec, core):
    """``spec`` (a ModuleSpec tree) with every MLA core attention replaced by ``core``."""
    if isinstance(spec, (list, tuple)):
        return type(spec)(swap_core_attention(s, core) for s in spec)
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return spec
    changes = {}
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if field.name == "core_attention":
            changes[field.name] = core
        elif hasattr(value, "submodules") or isinstance(value, (list, tuple)):
            changes[field.name] = swap_core_attention(value, core)
    if not changes:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, **changes))


def build(fields: dict, tp: int, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = dict(fields)
    vocab, seq = fields.pop("vocab_size"), fields.pop("seq_length")
    fields["params_dtype"] = getattr(torch, fields["params_dtype"])
    config = MLATransformerConfig(
        **fields,
        activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=False,  # its local (torch) norms refuse sequence parallelism
        use_cpu_initialization=True,
        kv_channels=fields["v_head_dim"],  # the local core attention's context width (shim)
    )
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    core = local_core_attention()
    block = dataclasses.replace(block, layer_specs=swap_core_attention(block.layer_specs, core))
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    model = GPTModel(config, block, vocab, seq, position_embedding_type="rope", mtp_block_spec=mtp)
    return model.to(fields["params_dtype"]), vocab, seq


def global_state(model, ep: int) -> dict:
    """This rank's tensors by global name (local expert i is global expert
    ``ep_rank * num_local + i``)."""
    from megatron.core import parallel_state

    local = model.config.num_moe_experts // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    out = {}
    for name, value in model.state_dict().items():
        if torch.is_tensor(value):
            head, mark, tail = name.partition(".local_experts.")
            if mark:
                index, rest = tail.split(".", 1)
                name = f"{head}{mark}{first + int(index)}.{rest}"
            out[name] = value
    return out


def setup(tp: int = 1, ep: int = 1) -> None:
    """One gloo process group (or torchrun's), the shims, megatron-core's parallel state."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo")
    apply_shims(cpu=True)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp, expert_model_parallel_size=ep)


def compute(model, vocab: int, seq: int) -> dict:
    """What ``model`` computes on the fixed batch (the module docstring's ``RESULT_PT``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    calls, hidden = [], {}  # megatron-core's MTP needs labels: the main logits are the output
    # layer's last call; each decoder layer's output says where a difference starts. Copies:
    # its cross-entropy works in place on float32 logits.

    def keep(name):
        def hook(module, args, out):
            hidden[name] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        return hook

    model.output_layer.register_forward_hook(lambda m, i, o: calls.append(o[0].detach().clone()))
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(keep(f"decoder.{i}"))
    loss = model(tokens, positions, mask, labels=labels)
    logits = calls[-1].transpose(0, 1)  # [s, b, v] -> [b, s, v]
    loss.sum().backward()
    tracker = MTPLossLoggingHelper.tracker
    return {
        "tokens": tokens,
        "labels": labels,
        "logits": logits.detach(),
        "loss": loss.detach(),
        "mtp_loss": tracker["values"].detach().clone(),
        "hidden": hidden,
        "state": {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)},
        "state_keys": list(model.state_dict()),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "version": __import__("megatron.core.package_info").core.package_info.__version__,
    }


def main() -> None:
    fields = json.loads(sys.argv[1])
    ckpt, result = sys.argv[2], sys.argv[3]
    tp, ep = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (1, 1)
    setup(tp, ep)
    from megatron.core import dist_checkpointing

    torch.manual_seed(1234)
    model, vocab, seq = build(fields, tp, ep)
    nontrivial_norms_and_expert_biases(model)  # so that loading them matters
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    if tp * ep > 1:  # no forward: its MoE refuses TP without sequence parallelism, which its
        if tp == 1:  # local (torch) norms refuse; at EP > 1 each rank's weights, global names
            torch.save(global_state(model, ep), f"{result}.rank{dist.get_rank()}")
        dist.destroy_process_group()
        return
    out = compute(model, vocab, seq)
    if dist.get_rank() == 0:
        torch.save(out, result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
