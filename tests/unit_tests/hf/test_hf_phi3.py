"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) against ``transformers``, in float64.

A tiny random Phi-3 (GQA, fused ``qkv_proj`` / ``gate_up_proj``, a sliding window of 5
positions on 16-token sequences, ``partial_rotary_factor`` 0.75, untied, random norm weights)
loads through ``model_from_hf``; on prompt-masked data (valid tokens fall unevenly, one
microbatch's only on a quarter of the sequence) our per-token losses, the objective and the
gradient of every parameter equal transformers' (float64 model, its RMSNorm computed in
float64 instead of its float32 upcast; gradients mapped through the family's weight table).
One process and CP 2 in the default run; TP 2 with sequence parallelism, PP 2, TP 2 + SP x
PP 2 and CP 2 x PP 2 (the schedule, DDP and ``finalize_model_grads``) in the slow run.
Negative controls: the fused rows read as [q; v; k], a window one position wider, rotary
embeddings on the whole head. Import then export is bit for bit; LoRA exports as a PEFT
adapter on the fused modules; greedy generation equals transformers'; LongRoPE and what else
we cannot express are refused by name.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from megatron.training.hf import architecture_from_config, model_from_hf
from megatron.training.hf.families import phi3
from megatron.training.hf.weights import parameter_sources
from tests.unit_tests.dist_utils import Layout, assert_no_failures, rel_error, use_layout
from tests.unit_tests.hf.hf_models import HAVE_TRANSFORMERS, SKIP_REASON
from tests.unit_tests.models.naming import reference_names
from tests.unit_tests.models.test_gpt_parity import GLOBAL_MICROBATCHES, global_batch, shard_like

pytestmark = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=SKIP_REASON)

VOCAB, WINDOW = 32, 5
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
    partial_rotary_factor=0.75, max_position_embeddings=64, original_max_position_embeddings=64,
    rope_theta=500.0, rms_norm_eps=1e-5, initializer_range=0.2, pad_token_id=None, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
TOLERANCE = 1e-11  # float64 both sides; the measured differences are ~1e-15


def build_phi3(directory: Path, seed: int = 0) -> Path:
    """Save the tiny random Phi-3 (norm weights drawn around 1) under ``directory``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def phi3_path():
    directory = Path(tempfile.mkdtemp(prefix="phi3-"))
    yield build_phi3(directory / "phi3")
    shutil.rmtree(directory, ignore_errors=True)


def reference(path: Path, batch: Dict[str, torch.Tensor]):
    """transformers' float64 (per-token losses [G, b, s], objective, {HF key: gradient}) on
    ``batch``: J = mean over microbatches of masked loss sum / valid tokens (megatron's
    averaged objective)."""
    import transformers
    from transformers.models.phi3 import modeling_phi3

    def rms_norm_in_float64(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    model = transformers.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    saved = modeling_phi3.Phi3RMSNorm.forward
    modeling_phi3.Phi3RMSNorm.forward = rms_norm_in_float64
    for module in model.modules():
        if isinstance(module, modeling_phi3.Phi3RMSNorm):
            module.eps = module.variance_epsilon
    try:
        losses, terms = [], []
        for g in range(GLOBAL_MICROBATCHES):
            logits = model(batch["tokens"][g]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), batch["labels"][g], reduction="none"
            )
            mask = batch["loss_mask"][g].double()
            losses.append(loss)
            terms.append((loss * mask).sum() / mask.sum().clamp(min=1))
        objective = torch.stack(terms).mean()
        objective.backward()
    finally:
        modeling_phi3.Phi3RMSNorm.forward = saved
    grads = {name: p.grad for name, p in model.named_parameters()}
    return torch.stack(losses).detach(), objective.item(), grads


def our_gradients(hf_grads: Dict[str, torch.Tensor], arch) -> Dict[str, torch.Tensor]:
    """{our parameter name: transformers' gradient cut and stacked as the weight table
    reads the weight}."""
    return {
        name: torch.cat([hf_grads[seg.key][seg.start : seg.stop] for seg in source])
        for name, source in parameter_sources(arch).items()
    }


def one_process_run(path: Path, batch, **overrides):
    """Our float64 model on ``batch`` (one process): per-token losses, objective, grads."""
    model, config = model_from_hf(path, params_dtype=torch.float64, **overrides)
    losses, terms = [], []
    for g in range(GLOBAL_MICROBATCHES):
        loss = model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
        mask = batch["loss_mask"][g].double()
        losses.append(loss)
        terms.append((loss * mask).sum() / mask.sum().clamp(min=1))
    objective = torch.stack(terms).mean()
    objective.backward()
    grads = {name: p.grad for name, p in reference_names(model)}
    return torch.stack(losses).detach(), objective.item(), grads


@pytest.mark.world(1)
def test_float64_losses_and_every_gradient_equal_transformers(phi3_path):
    batch = global_batch(VOCAB)
    ref_losses, ref_objective, hf_grads = reference(phi3_path, batch)
    arch = architecture_from_config(json.loads((phi3_path / "config.json").read_text()))
    assert arch.window_size == (WINDOW - 1, 0) and arch.rotary_percent == 0.75
    losses, objective, grads = one_process_run(phi3_path, batch)
    expected = our_gradients(hf_grads, arch)
    assert sorted(grads) == sorted(expected)
    failures = [f"losses: {rel_error(losses, ref_losses):.2e}"] * (
        not rel_error(losses, ref_losses) <= TOLERANCE
    )
    if not abs(objective - ref_objective) <= TOLERANCE * abs(ref_objective):
        failures.append(f"objective {objective} != {ref_objective}")
    for name, grad in grads.items():
        err = rel_error(grad, expected[name])
        if not err <= TOLERANCE:
            failures.append(f"{name}: relative error {err:.2e}")
    assert not failures, failures


def _swapped_k_and_v(arch, key):
    """The negative control's table: the fused rows read as [q; v; k]."""
    d, groups, heads = arch.kv_channels, arch.num_query_groups, arch.num_attention_heads
    right = CORRECT_FUSED_QKV(arch, key)
    shift = groups * d
    out = []
    for seg in right:
        if seg.start >= heads * d:  # a k (or v) segment: read from the v (or k) block
            offset = shift if seg.start < (heads + groups) * d else -shift
            seg = type(seg)(seg.key, seg.start + offset, seg.stop + offset)
        out.append(seg)
    return tuple(out)


CORRECT_FUSED_QKV = phi3.fused_qkv


def _wider_window(read_extra):
    def read(self, c):
        extra = read_extra(self, c)
        return {**extra, "window_size": (extra["window_size"][0] + 1, 0)}

    return read


def _whole_head_rotary(read_rotary):
    def read(self, c):
        theta, scaling, _ = read_rotary(self, c)
        return theta, scaling, 1.0

    return read


@pytest.mark.world(1)
@pytest.mark.parametrize("control", ["k-v-swapped", "window-plus-one", "whole-head-rotary"])
def test_negative_controls_are_caught(phi3_path, control, monkeypatch):
    """The logits check above fails for a wrong fused layout, a window one position wider
    (transformers' W is the query and W - 1 earlier keys) and a full-head rotary."""
    if control == "k-v-swapped":
        monkeypatch.setattr(phi3, "fused_qkv", _swapped_k_and_v)
    elif control == "window-plus-one":
        monkeypatch.setattr(phi3.Phi3, "read_extra", _wider_window(phi3.Phi3.read_extra))
    else:
        monkeypatch.setattr(phi3.Phi3, "read_rotary", _whole_head_rotary(phi3.Phi3.read_rotary))
    batch = global_batch(VOCAB)
    ref_losses, _, _ = reference(phi3_path, batch)
    model, _ = model_from_hf(phi3_path, params_dtype=torch.float64)
    with torch.no_grad():
        losses = torch.stack(
            [
                model(batch["tokens"][g], batch["position_ids"][g], labels=batch["labels"][g])
                for g in range(GLOBAL_MICROBATCHES)
            ]
        )
    err = rel_error(losses, ref_losses)
    assert err > 1e-4, f"{control} went unnoticed (relative error {err:.2e})"


LAYOUTS = {
    "tp2-sp": Layout(tp=2, sp=True),
    "cp2": Layout(cp=2),
    "pp2": Layout(pp=2),
    "tp2-sp-pp2": Layout(tp=2, sp=True, pp=2),
    "cp2-pp2": Layout(cp=2, pp=2),
}
FOUR_RANKS = [pytest.mark.world(4), pytest.mark.slow]


@pytest.mark.parametrize(
    "layout",
    [  # CP 2 (uneven valid tokens, windows across the chunks) in the default run: 0.1 s
        pytest.param("tp2-sp", marks=[pytest.mark.world(2), pytest.mark.slow]),
        pytest.param("cp2", marks=pytest.mark.world(2)),
        pytest.param("pp2", marks=[pytest.mark.world(2), pytest.mark.slow]),
        pytest.param("tp2-sp-pp2", marks=FOUR_RANKS),
        pytest.param("cp2-pp2", marks=FOUR_RANKS),
    ],
)
def test_float64_gradients_at_a_layout_equal_transformers(layout):
    """This rank's shard of every gradient (the schedule, DDP, ``finalize_model_grads``) and
    the reported loss equal transformers' on the prompt-masked batch (the CP shards hold
    unequal numbers of valid tokens; the window crosses the CP chunk boundaries)."""
    from megatron.core.context_parallel import get_batch_on_this_cp_rank
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.loss_reporting import reduce_reported_losses
    from megatron.core.process_groups_config import ProcessGroupCollection
    from tests.unit_tests.models.test_gpt_parity import MICRO_BATCH, SEQ, forward_step

    box = [None]
    if dist.get_rank() == 0:  # transformers saves on rank 0 only
        box = [Path(tempfile.mkdtemp(prefix="phi3-"))]
        build_phi3(box[0] / "phi3")
    dist.broadcast_object_list(box, src=0)
    directory, path = box[0], box[0] / "phi3"
    batch = global_batch(VOCAB)
    ref_losses, _, hf_grads = reference(path, batch)
    mask = batch["loss_mask"].double()
    ref_logged = ((ref_losses * mask).sum() / mask.sum()).item()
    expected = our_gradients(hf_grads, architecture_from_config(CONFIG_JSON(path)))
    use_layout(LAYOUTS[layout])
    groups = ProcessGroupCollection.use_mpu_process_groups()
    extra = dict(sequence_parallel=True) if LAYOUTS[layout].sp else {}
    if LAYOUTS[layout].cp > 1:  # a sliding window at CP > 1 needs the a2a exchange
        extra["cp_comm_type"] = "a2a"
    model, config = model_from_hf(path, pg_collection=groups, params_dtype=torch.float64, **extra)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(), model, pg_collection=groups
    )
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    microbatches = [
        get_batch_on_this_cp_rank({k: v[g] for k, v in batch.items()}, groups.cp)
        for g in range(GLOBAL_MICROBATCHES)
    ]
    store = get_forward_backward_func(LAYOUTS[layout].pp, None)(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=ddp,
        num_microbatches=GLOBAL_MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        pg_collection=groups,
    )  # fmt: skip
    logged = reduce_reported_losses(store, groups.dp_cp).get("lm loss")
    failures = []
    if logged is not None and not abs(logged - ref_logged) <= TOLERANCE * ref_logged:
        failures.append(f"{layout}: reported loss {logged} != {ref_logged}")
    for name, param in reference_names(model):
        assert param.main_grad.dtype == torch.float64, name
        full = shard_like(expected[name], param, groups.tp.size(), groups.tp.rank())
        err = rel_error(param.main_grad, full)
        if not err <= TOLERANCE:
            failures.append(f"{layout} rank {dist.get_rank()}: {name}: relative error {err:.2e}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    assert_no_failures(failures)


def CONFIG_JSON(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.world(1)
def test_import_then_export_gives_back_the_original_tensors(phi3_path, tmp_path):
    """``import`` then ``export``: every tensor bit for bit (the fused rows cut per query
    group and put back), config.json's meaning kept, and transformers' logits of the export
    equal the original's exactly."""
    import transformers

    from megatron.training.hf.__main__ import main as hf_cli
    from megatron.training.hf.weights import SafetensorsReader

    assert hf_cli(["import", "--hf", str(phi3_path), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "hf"
    assert hf_cli(["export", "--load", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    original, exported = SafetensorsReader(phi3_path), SafetensorsReader(out)
    assert sorted(original.keys()) == sorted(exported.keys())
    assert any(key.endswith("self_attn.qkv_proj.weight") for key in exported.keys())
    for key in original.keys():
        everything = (slice(None),) * len(original.shape(key))
        a, b = original.read(key, everything), exported.read(key, everything)
        assert a.dtype == b.dtype and torch.equal(a, b), key
    assert architecture_from_config(CONFIG_JSON(out)) == architecture_from_config(
        CONFIG_JSON(phi3_path)
    )
    ids = global_batch(VOCAB)["tokens"][0]
    logits = [
        transformers.AutoModelForCausalLM.from_pretrained(p).eval()(ids).logits
        for p in (phi3_path, out)
    ]
    assert torch.equal(*logits)


PHI3_SHAPED = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
    seq_length=16, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    disable_bias_linear=True, untie_embeddings_and_output_weights=True, rotary_percent=0.75,
    window_size=[4, 0],
)  # fmt: skip


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(position_embedding_type="learned_absolute", window_size=None),
         "--rotary-percent need --position-embedding-type rope"),
        (dict(rotary_percent=0.1), r"--rotary-percent 0.1 rotates int\(8 x 0.1\) = 0 channels"),
        (dict(rotary_percent=1.5), r"--rotary-percent must be in \(0, 1\], got 1.5"),
    ],
    ids=["learned-positions", "no-channel", "above-one"],
)  # fmt: skip
def test_rotary_percent_is_checked_by_name(changes, message):
    from megatron.training import TrainingConfig
    from megatron.training.arguments import validate_config
    from megatron.training.errors import UsageError

    config = TrainingConfig(**{**PHI3_SHAPED, **changes})
    with pytest.raises((UsageError, ValueError), match=message):
        validate_config(config, 1)


@pytest.mark.world(1)
def test_the_trainer_builds_rotary_embeddings_on_the_given_fraction():
    """--rotary-percent reaches GPTModel: int(8 x 0.75) = 6 channels, 3 frequencies."""
    from megatron.training import TrainingConfig
    from megatron.training.arguments import validate_config
    from megatron.training.model import build_model
    from tests.unit_tests.dist_utils import fresh_layout

    config = TrainingConfig(**PHI3_SHAPED)
    with fresh_layout():
        (chunk,) = build_model(config, validate_config(config, 1), None)
    gpt = chunk.module if hasattr(chunk, "module") else chunk
    assert gpt.rotary_pos_emb.inv_freq.numel() == 3


@pytest.mark.world(1)
@pytest.mark.slow  # a trainer run and two transformers loads: ~5 s
def test_a_run_from_scratch_with_partial_rotary_exports_as_phi3(tmp_path):
    """--export-hf of a run with --rotary-percent 0.75 and a window: no other family writes
    a partial rotary, so it is Phi-3, and transformers computes what our model computes."""
    import transformers

    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout

    out = tmp_path / "exported"
    config = TrainingConfig(
        **PHI3_SHAPED, global_batch_size=4, train_iters=1, progress=False, export_hf=str(out)
    )
    with fresh_layout():
        pretrain(config)
    written = CONFIG_JSON(out)
    assert written["model_type"] == "phi3" and written["sliding_window"] == 5
    assert written["partial_rotary_factor"] == 0.75
    ids = global_batch(config.vocab_size)["tokens"][0]
    model, _ = model_from_hf(out)
    model.eval()
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    err = rel_error(ours, theirs)
    assert err <= 1e-5, f"relative error {err:.2e}"


PHI3_JSON = dict(
    CONFIG, model_type="phi3", architectures=["Phi3ForCausalLM"],
    rope_parameters=dict(rope_theta=500.0, rope_type="default", partial_rotary_factor=0.75),
)  # fmt: skip


@pytest.mark.world(1)
@pytest.mark.slow  # a LoRA run, a peft model and three transformers loads: ~6 s
def test_lora_exports_as_a_peft_adapter_on_the_fused_modules(tmp_path):
    """A LoRA run from a Phi-3: the PEFT adapter (on peft's ``qkv_proj`` / ``gate_up_proj``,
    one A and one B each: our fused adapter exactly, B's rows put in HuggingFace's [q; k; v]
    order) gives our logits through ``peft``, and so does the ``--merge-lora`` export.
    Negative control: B left in our per-group row order moves peft's logits off."""
    pytest.importorskip("peft", reason="peft is a test extra (pip install -e .[dev])")
    from safetensors.torch import load_file, save_file

    from megatron.training import TrainingConfig
    from megatron.training.hf.__main__ import main as hf_cli
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout
    from tests.unit_tests.hf.hf_models import transformers_logits, write_random_hf_model
    from tests.unit_tests.hf.test_hf_lora import LORA, RUN, _our_logits, _peft_logits

    config = {k: v for k, v in PHI3_JSON.items() if k != "rope_theta"}
    base = write_random_hf_model(tmp_path / "base", dict(config, vocab_size=128))
    ckpt, adapter, merged = tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "merged"
    with fresh_layout():
        run = TrainingConfig(hf_model=str(base), **LORA, **RUN, save=str(ckpt),
                             export_hf=str(adapter))  # fmt: skip
        assert pretrain(run).passed
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert {m.rsplit(".", 1)[-1] for m in written["target_modules"]} == {
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
    }  # fmt: skip
    ids = global_batch(128)["tokens"][0]
    ours = _our_logits(base, ckpt, ids)
    assert rel_error(_peft_logits(base, adapter, ids), ours) <= 1e-5
    assert hf_cli(["export", "--load", str(ckpt), "--out", str(merged), "--merge-lora"]) == 0
    assert rel_error(transformers_logits(merged, ids), ours) <= 1e-5
    assert rel_error(transformers_logits(base, ids), ours) > 1e-4  # the adapters matter

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    arch = architecture_from_config(config)
    rows = [tensors[key][s.start : s.stop] for s in phi3.fused_qkv(arch, "qkv")]
    tensors[key] = torch.cat(rows)  # our per-group order, not HuggingFace's
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    assert rel_error(_peft_logits(base, adapter, ids), ours) > 1e-3


@pytest.mark.world(1)
def test_greedy_generation_equals_transformers(tmp_path):
    """``megatron.training.generate`` (the key/value cache, the window and the partial rotary
    at each new position) chooses transformers' greedy tokens; the 6 + 8 tokens outrun the
    window of 5, and every chosen token leads the runner-up by a clear margin."""
    import transformers

    from megatron.training.generate import generate
    from tests.unit_tests.hf.hf_models import write_random_hf_model

    prompt, new = [3, 17, 42, 5, 99, 8], 8
    config = {k: v for k, v in PHI3_JSON.items() if k != "rope_theta"}
    path = write_random_hf_model(tmp_path / "m", dict(config, vocab_size=128), std=0.5)
    model, _ = model_from_hf(path)
    model.eval()
    ours = generate([model], prompt, new, vocab_size=128)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    assert min(margins) > 1e-4, f"a near tie makes the comparison meaningless: {margins}"
    assert ours == out.sequences[0, len(prompt) :].tolist()


# microsoft/Phi-3-mini-4k-instruct's config.json (transformers 4.40 format, remote-code
# auto_map) and the 128k model's LongRoPE
PHI3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0, "attention_bias": False,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
    "use_cache": True, "vocab_size": 32064,
}  # fmt: skip


@pytest.mark.world(1)
def test_the_published_phi3_mini_config_reads_and_the_128k_one_is_refused_by_name():
    from megatron.training.hf.config import training_settings

    arch = architecture_from_config(PHI3_MINI_4K)
    assert (arch.family, arch.window_size, arch.rotary_percent) == ("phi3", (2046, 0), 1.0)
    assert (arch.num_query_groups, arch.kv_channels, arch.tied) == (32, 96, False)
    assert training_settings(arch)["window_size"] == [2046, 0]
    long_rope = dict(
        PHI3_MINI_4K, max_position_embeddings=131072, sliding_window=262144,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r'rope_scaling.rope_type="longrope" .*LongRoPE'):
        architecture_from_config(long_rope)


@pytest.mark.world(1)
def test_hf_model_sets_the_trainer_options_and_refuses_a_contradicting_flag(phi3_path):
    """--hf-model DIR: config.json gives --rotary-percent 0.75 and --window-size 4 0; a
    --rotary-percent given with another value is refused naming both."""
    from megatron.training import TrainingConfig
    from megatron.training.hf_settings import resolve_hf_model

    config = resolve_hf_model(TrainingConfig(hf_model=str(phi3_path), seq_length=16))
    assert (config.rotary_percent, config.window_size) == (0.75, [WINDOW - 1, 0])
    assert (config.num_query_groups, config.untie_embeddings_and_output_weights) == (2, True)
    with pytest.raises(ValueError, match=r"--rotary-percent 0.5 \(config.json gives 0.75\)"):
        resolve_hf_model(TrainingConfig(hf_model=str(phi3_path), rotary_percent=0.5))


@pytest.mark.world(1)
@pytest.mark.slow  # a trainer run on a trained tokenizer: ~3 s
def test_sft_on_multi_turn_chats_with_phi3s_template(tmp_path):
    """--hf-model DIR --data-path chats.jsonl with Phi-3's own chat template (eos_token
    closing the conversation) in DIR: multi-turn conversations train (they were refused:
    the template renders an earlier turn's end differently once later turns follow)."""
    pytest.importorskip("jinja2", reason="jinja2 (the hf extra) is not installed")
    from megatron.training import TrainingConfig
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_utils import fresh_layout
    from tests.unit_tests.hf.hf_models import write_random_hf_model
    from tests.unit_tests.training.test_chat_template import (
        CONVERSATIONS,
        PHI3,
        PHI3_SPECIAL,
        _save,
    )

    hf = tmp_path / "hf"
    _save(hf, PHI3, eos="<|endoftext|>", special=PHI3_SPECIAL, bos="<s>")
    config = {k: v for k, v in PHI3_JSON.items() if k != "rope_theta"}
    write_random_hf_model(hf, dict(config, vocab_size=320))
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CONVERSATIONS * 4) + "\n")
    run = dict(seq_length=64, global_batch_size=4, micro_batch_size=2, progress=False)
    with fresh_layout():
        result = pretrain(TrainingConfig(hf_model=str(hf), data_path=str(data), train_iters=2,
                                         **run))  # fmt: skip
    assert result.passed and all(0 < r["loss"] < 100 for r in result.records)
