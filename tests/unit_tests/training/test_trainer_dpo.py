"""The trainer with ``--dpo`` (SPEC section 21): the reference is the starting weights (LoRA:
the base with its adapters off), TRL's metrics per iteration, TRL's preference JSONL (the
completion-token rule), the layouts following the one-process run, the refusals by name.
(The objective's gradients against an independent float64 computation at every layout:
``tests/unit_tests/models/test_dpo_parity.py``.)

Independent checks of the reference: the starting model is rebuilt here (``build_model``,
the same seeded weights), its summed completion log-probs on the iteration's pairs computed
with plain torch, and ``rewards_chosen`` must be beta x (the policy's mean chosen log-prob -
that mean), which a reference that moves with the policy (rewards 0) or the LoRA policy used
as its own reference fails.
"""

import dataclasses
import json
import math

import pytest
import torch

from megatron.training import TrainingConfig
from megatron.training.arguments import validate_config
from megatron.training.dpo import build_preference_validation
from megatron.training.errors import UsageError
from megatron.training.model import build_model
from megatron.training.preference_data import (
    build_preference_dataset,
    packed_row,
    tokenize_pair,
)
from megatron.training.training import pretrain
from tests.unit_tests.dist_utils import fresh_layout

SMALL = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=32,
    global_batch_size=4,
    micro_batch_size=2,
    progress=False,
    lr=1e-2,
    dpo=True,
    dpo_beta=0.5,
)


def _run(**changes):
    return _result(**changes).records


def _result(**changes):
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**SMALL, **changes}))
    assert result.passed
    return result


def _mean_chosen_logp(config: TrainingConfig, iteration: int) -> float:
    """The starting model's (LoRA: the base's) mean summed log-prob of the chosen completions
    of iteration ``iteration``'s pairs: plain torch on the logits."""
    defaults = TrainingConfig()
    lora_fields = ("lora_dim", "lora_alpha", "lora_b_init_method")
    base = dataclasses.replace(config, **{f: getattr(defaults, f) for f in lora_fields})
    with fresh_layout():
        (chunk,) = build_model(base, validate_config(base, 1), None)
    batch = build_preference_dataset(config).global_batch(iteration - 1, config.global_batch_size)
    return _log_probs(base, batch, chunk.module)[0::2].mean().item()


def _log_probs(config: TrainingConfig, batch: dict, gpt=None) -> torch.Tensor:
    """Each row's summed completion log-prob under ``gpt`` (default: the starting model of
    ``config``), from the logits with plain torch."""
    if gpt is None:
        with fresh_layout():
            (chunk,) = build_model(config, validate_config(config, 1), None)
        gpt = chunk.module
    with torch.no_grad():
        logits = gpt(batch["tokens"], batch["position_ids"]).double()  # [b, s, V]
    logp = logits.log_softmax(-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    return (logp * batch["loss_mask"]).sum(-1)


@pytest.mark.world(1)
def test_the_reference_is_the_starting_weights():
    """Iteration 1: policy = reference, so the sigmoid loss is log 2 and every reward 0;
    iteration 2: rewards_chosen = beta (logps_chosen - the starting model's)."""
    config = TrainingConfig(**{**SMALL, "train_iters": 2})
    records = _run(train_iters=2)
    first, second = records
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards_chosen"] == first["rewards_margins"] == 0.0
    assert first["rewards_accuracies"] == 0.0  # strict: equal rewards are not a win
    expected = 0.5 * (second["logps_chosen"] - _mean_chosen_logp(config, 2))
    assert second["rewards_chosen"] != 0.0
    assert abs(second["rewards_chosen"] - expected) < 1e-5 * max(1.0, abs(expected))
    margin = second["rewards_chosen"] - second["rewards_rejected"]
    assert abs(second["rewards_margins"] - margin) < 1e-6


@pytest.mark.world(1)
def test_validation_gives_the_objective_and_metrics_of_the_held_out_pairs():
    """Reference-free sigmoid after one step of a vanishing learning rate (the policy is the
    starting model): valid_loss = mean -logsigmoid(beta (logp_w - logp_l)) and the log-prob
    metrics over the held-out generated pairs, recomputed here; training is not perturbed."""
    run = dict(train_iters=1, lr=1e-30, dpo_reference_free=True)
    (record,) = _run(eval_interval=1, eval_iters=2, **run)
    (plain,) = _run(**run)
    assert record["loss"] == plain["loss"] and record["grad_norm"] == plain["grad_norm"]
    config = TrainingConfig(**{**SMALL, **run, "eval_interval": 1, "eval_iters": 2})
    validation = build_preference_validation(config)
    assert len(validation.batches) == 2 and validation.num_pairs == 8
    sums = torch.cat([_log_probs(config, batch) for batch in validation.batches])
    chosen, rejected = sums[0::2], sums[1::2]
    expected = {
        "valid_loss": -torch.nn.functional.logsigmoid(0.5 * (chosen - rejected)).mean(),
        "valid_logps_chosen": chosen.mean(),
        "valid_logps_rejected": rejected.mean(),
        "valid_rewards_accuracies": (chosen > rejected).double().mean(),
    }
    for key, value in expected.items():
        assert abs(record[key] - value.item()) < 1e-5 * max(1.0, abs(value.item())), key


@pytest.mark.world(1)
@pytest.mark.slow  # the default run's budget; the starting-weights case above stays
def test_with_lora_the_reference_is_the_base_with_its_adapters_off():
    """Adapters that start non-zero (B drawn normal): at iteration 1 the policy already
    differs from the base, and rewards_chosen = beta (logps_chosen - the base's)."""
    lora = dict(lora_dim=4, lora_alpha=8.0, lora_b_init_method="normal")
    config = TrainingConfig(**{**SMALL, **lora, "train_iters": 1})
    (record,) = _run(train_iters=1, **lora)
    expected = 0.5 * (record["logps_chosen"] - _mean_chosen_logp(config, 1))
    assert abs(expected) > 1e-3  # the adapters change the log-probs
    assert abs(record["rewards_chosen"] - expected) < 1e-5 * max(1.0, abs(expected))


@pytest.mark.world(1)
@pytest.mark.slow
def test_reference_free_rewards_are_the_policy_log_probs():
    (record,) = _run(train_iters=1, dpo_reference_free=True, dpo_loss_type="hinge")
    assert abs(record["rewards_chosen"] - 0.5 * record["logps_chosen"]) < 1e-6
    assert abs(record["rewards_rejected"] - 0.5 * record["logps_rejected"]) < 1e-6


@pytest.mark.world(1)
def test_standard_pairs_split_where_the_completion_diverges_from_the_prompt():
    """Byte-level: prompt + completion + EOD, the completion's bytes and EOD trained."""
    from megatron.training.datasets import build_training_tokenizer

    tok = build_training_tokenizer(None)
    chosen, rejected = tokenize_pair(
        {"prompt": "2+2=", "chosen": "4", "rejected": "five"}, tok, "x:1"
    )
    for (ids, mask), text in ((chosen, "4"), (rejected, "five")):
        assert tok.detokenize(ids[mask == 1][:-1].tolist()) == text
        assert ids[-1] == tok.eod and mask[-1] == 1 and mask.sum() == len(text) + 1


@pytest.mark.world(1)
@pytest.mark.slow  # trains a tokenizer and imports transformers
def test_conversational_pairs_train_every_token_after_the_templated_prompt(tmp_path):
    """TRL's rule, against transformers' own rendering: the trained labels decode to
    template(prompt + completion)[len(template(prompt, generation prompt)):] (with ChatML:
    the content, <|im_end|> and the newline)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    from megatron.training.tokenizer import load_hf_tokenizer
    from megatron.training.tokenizer.train_tokenizer import main as tokenizer_main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog hello world\n" * 20)
    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer_main(
        ["train", "--input", str(corpus), "--output-dir", str(folder), "--vocab-size", "300"]
    )
    tok = load_hf_tokenizer(str(folder))
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    record = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "the quick fox"}],
        "rejected": [{"role": "assistant", "content": "dog"}],
    }
    before = fast.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    for side, (ids, mask) in zip(("chosen", "rejected"), tokenize_pair(record, tok, "x:1")):
        full = fast.apply_chat_template(prompt + record[side], tokenize=False)
        expected = full[len(before) :]
        assert expected.endswith("<|im_end|>\n")
        assert tok.detokenize(ids[mask == 1].tolist()) == expected
        assert tok.detokenize(ids[mask == 0].tolist()) == before


@pytest.mark.world(1)
@pytest.mark.slow
def test_a_jsonl_file_of_pairs_trains_and_validates_on_its_split(tmp_path):
    """12 standard pairs, --split 2,1,0: 8 train, the last 4 (file order) validate."""
    path = tmp_path / "pairs.jsonl"
    lines = [
        {"prompt": f"q{i}:", "chosen": " yes" * (1 + i % 3), "rejected": " no"} for i in range(12)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = _run(train_iters=2, data_path=str(path), split="2,1,0", eval_interval=2)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6 and math.isfinite(records[1]["loss"])
    config = TrainingConfig(**{**SMALL, "data_path": str(path), "split": "2,1,0"})
    validation = build_preference_validation(config)
    assert validation.num_pairs == 4 and "records 8..11" in validation.source
    assert math.isfinite(records[1]["valid_loss"]) and "valid_loss" not in records[0]


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dpo=False, dpo_beta=0.5), "--dpo-beta 0.5 needs --dpo"),
        (dict(calculate_per_token_loss=True), "--calculate-per-token-loss with --dpo"),
        (dict(label_smoothing=0.1), "--label-smoothing 0.1 with --dpo"),
        (dict(skip_train=True, load="c", finetune=True), "--skip-train with --dpo"),
        (dict(dpo_loss_type="hinge", dpo_label_smoothing=0.1), "--dpo-label-smoothing 0.1 with"),
        (dict(dpo_label_smoothing=0.5), "--dpo-label-smoothing"),
        (dict(dpo_loss_type="kto"), "--dpo-loss-type"),
        (dict(dpo_reference_free=True, dpo_reference_hf_model="x"), "--dpo-reference-free and"),
        (
            dict(
                lora_dim=4,
                lora_target_modules=("linear_qkv",),
                num_experts=4,
                moe_router_enable_expert_bias=True,
                moe_router_score_function="sigmoid",
                disable_bias_linear=True,
            ),
            "--moe-router-enable-expert-bias with --dpo and --lora-dim",
        ),
    ],
)
def test_dpo_flags_are_refused_by_name(changes, message):
    with pytest.raises(UsageError, match=message.replace("+", r"\+")):
        validate_config(TrainingConfig(**{**SMALL, **changes}), 1)


@pytest.mark.world(1)
def test_a_pair_without_its_keys_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    config = TrainingConfig(**{**SMALL, "data_path": str(path)})
    with pytest.raises(ValueError, match=f"{path}:1: got \\['chosen', 'prompt'\\]; expected"):
        build_preference_dataset(config)


@pytest.mark.world(1)
@pytest.mark.slow  # three runs, ~4 s
def test_recompute_and_bf16_train_the_same_objective():
    """Full activation recomputation gives the same iterations (the reference pass has no
    graph to recompute, the policy's backward recomputes); bf16 follows the fp32 run at bf16's
    precision (the log-probs summed in fp32)."""
    keys = ("loss", "grad_norm", "rewards_margins", "logps_chosen")
    plain = _run(train_iters=2)
    recompute = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    again = _run(train_iters=2, **recompute)
    for mine, reference in zip(again, plain):
        for key in keys:
            assert abs(mine[key] - reference[key]) <= 1e-6 * max(1.0, abs(reference[key])), key
    half = _run(train_iters=2, bf16=True)
    for mine, reference in zip(half, plain):
        for key in keys:
            assert abs(mine[key] - reference[key]) <= 3e-2 * max(1.0, abs(reference[key])), key


PACKED = dict(seq_length=48, micro_batch_size=2, dpo_sft_weight=0.5, pack_sequences=True)


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "loss_type", ["sigmoid", pytest.param("ipo", marks=pytest.mark.slow)]  # ipo: per-token means
)
def test_packed_pairs_train_the_unpacked_objective(loss_type):
    """--pack-sequences: the batch sizes count pairs as unpacked, a micro-batch's 2 pairs in
    one row as long as their data; iteration 1's objective, TRL's metrics and gradient norm
    equal the unpacked run's on the same pairs (the reference's packed sums equal the
    policy's: rewards 0), with less padding; and so do the validation pass's."""
    packed = TrainingConfig(**{**SMALL, **PACKED, "dpo_loss_type": loss_type})
    batch = build_preference_dataset(packed).global_batch(0, packed.global_batch_size)
    assert batch["tokens"].shape[0] == packed.global_batch_size // packed.micro_batch_size
    assert [int(row.max()) + 1 for row in batch["sequence_index"]] == [4, 4]  # 2 pairs a row
    evaluate = dict(eval_interval=1, eval_iters=2, dpo_loss_type=loss_type)
    (mine,) = _run(train_iters=1, **PACKED, **evaluate)
    (unpacked,) = _run(train_iters=1, **{**PACKED, "pack_sequences": False}, **evaluate)
    keys = ("loss", "grad_norm", "logps_chosen", "logps_rejected", "rewards_margins")
    for key in keys + ("valid_loss", "valid_rewards_margins", "valid_logps_rejected"):
        assert abs(mine[key] - unpacked[key]) <= 1e-5 * max(1.0, abs(unpacked[key])), key
    assert mine["rewards_chosen"] == 0.0 and mine["data_tokens"] == unpacked["data_tokens"]
    assert mine["padding_tokens"] == 0 < unpacked["padding_tokens"]  # one process: no padding


@pytest.mark.world(1)
def test_packed_rows_are_their_pairs_padded_for_the_layout():
    """A row holds --micro-batch-size pairs as documents of their own data length, each
    padded to 2 x --cp, the row to 2 x --cp x --tp under sequence parallelism (the last
    document longer); ``packed_row`` cuts a micro-batch back to its row."""
    layout = dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    config = TrainingConfig(**{**SMALL, **PACKED, **layout, "micro_batch_size": 1})
    unpacked = build_preference_dataset(dataclasses.replace(config, pack_sequences=False))
    pairs = unpacked.global_batch(0, config.global_batch_size)
    batch = build_preference_dataset(config).global_batch(0, config.global_batch_size)
    real = (~pairs["padding_mask"]).sum(-1).reshape(-1, 2)  # [row, side]
    for r in range(config.global_batch_size):
        row = packed_row({k: v[r : r + 1] for k, v in batch.items()})
        spans = row["cu_seqlens_padded"][0].diff()
        assert row["cu_seqlens"][0].diff().tolist() == real[r].tolist()
        assert all(s % 4 == 0 for s in spans) and int(spans.sum()) % 8 == 0
        fitted = sum(-(-int(n) // 4) * 4 for n in real[r])
        assert int(spans.sum()) == -(-fitted // 8) * 8  # no more padding than needed
        assert row["tokens"].shape[1] == int(spans.sum()) and int(row["sequence_index"].min()) == 0
        assert torch.equal(row["loss_mask"][0].sum(), pairs["loss_mask"][2 * r : 2 * r + 2].sum())


@pytest.mark.world(1)
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(pipeline_model_parallel_size=2), "allgather with --dpo --pack-sequences and --pp 2"),
        (dict(expert_model_parallel_size=2), "allgather .* --expert-model-parallel-size 2"),
        (
            dict(expert_tensor_parallel_size=2, moe_token_dispatcher_type="alltoall"),
            "--expert-tensor-parallel-size 2 > --tp 1 with --dpo --pack-sequences",
        ),
    ],
)
def test_packed_pairs_refuse_expert_groups_of_unequal_rows(changes, message):
    """Rows of packed pairs differ in length between data-parallel ranks and micro-batches:
    the dispatchers that need equal token counts are refused by name (alltoall over
    --expert-model-parallel-size follows the one-process run)."""
    moe = dict(num_experts=4, disable_bias_linear=True, **changes)
    config = TrainingConfig(**{**SMALL, **PACKED, **moe})
    with pytest.raises(UsageError, match=message):
        validate_config(config, 2)
    if "expert_tensor_parallel_size" not in changes:
        validate_config(dataclasses.replace(config, moe_token_dispatcher_type="alltoall"), 2)


@pytest.mark.world(1)
def test_packed_validation_holds_whole_batches_of_rows(tmp_path):
    """The validation pairs packed as the training pairs, in file order: whole global
    batches of pairs (--micro-batch-size pairs a row), the pairs of a partial last batch
    left out and counted."""
    path = tmp_path / "prefs.jsonl"
    words = ["a b", "c d e f g h", "i", "j k l m n o p q r s t", "u v"]
    lines = [dict(prompt=w, chosen=" yes " + w, rejected=" no") for w in words * 3]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    files = dict(data_path=str(path), valid_data_path=str(path), eval_interval=1)
    config = TrainingConfig(**{**SMALL, **PACKED, **files})
    validation = build_preference_validation(config)
    rows = [row for batch in validation.batches for row in batch["sequence_index"]]
    assert [(int(r.max()) + 1) // 2 for r in rows] == [config.micro_batch_size] * len(rows)
    assert validation.num_pairs == 12 == config.micro_batch_size * len(rows)
    assert validation.num_pairs + validation.left_out == len(lines)
    # (the packed validation pass itself: the packed layouts' --compare-single-process below)


# --------------------------------------------------------------- layouts (torchrun, slow)

LAYOUTS = [
    pytest.param(
        dict(context_parallel_size=2, pipeline_model_parallel_size=2,
             virtual_pipeline_model_parallel_size=2, num_layers=4, micro_batch_size=1,
             dpo_sft_weight=0.5),
        marks=[pytest.mark.world(4), pytest.mark.slow], id="cp2-pp2-vpp2-sft",
    ),
    pytest.param(
        dict(context_parallel_size=2, use_distributed_optimizer=True, dpo_loss_type="ipo"),
        marks=[pytest.mark.world(4), pytest.mark.slow], id="dp2-cp2-distopt-ipo",
    ),
    pytest.param(
        dict(tensor_model_parallel_size=2, sequence_parallel=True, lora_dim=4, lora_alpha=8.0,
             lora_b_init_method="normal"),
        marks=[pytest.mark.world(2), pytest.mark.slow], id="tp2-sp-lora",
    ),
    pytest.param(
        dict(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
             moe_aux_loss_coeff=0.01, disable_bias_linear=True, dpo_loss_type="hinge"),
        marks=[pytest.mark.world(2), pytest.mark.slow], id="ep2-moe-hinge",
    ),
    pytest.param(
        dict(PACKED, context_parallel_size=2), marks=[pytest.mark.world(2), pytest.mark.slow],
        id="cp2-packed",
    ),
    pytest.param(
        dict(PACKED, tensor_model_parallel_size=2, sequence_parallel=True,
             pipeline_model_parallel_size=2, dpo_loss_type="ipo"),
        marks=[pytest.mark.world(4), pytest.mark.slow], id="tp2-sp-pp2-packed-ipo",
    ),
    pytest.param(
        dict(PACKED, context_parallel_size=2, use_distributed_optimizer=True,
             dpo_loss_type="hinge"),
        marks=[pytest.mark.world(4), pytest.mark.slow], id="dp2-cp2-distopt-packed-hinge",
    ),
    pytest.param(
        dict(PACKED, num_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
             moe_aux_loss_coeff=0.01, disable_bias_linear=True,
             moe_token_dispatcher_type="alltoall"),
        marks=[pytest.mark.world(2), pytest.mark.slow], id="ep2-moe-alltoall-packed",
    ),
    pytest.param(
        dict(PACKED, context_parallel_size=2, pipeline_model_parallel_size=2,
             virtual_pipeline_model_parallel_size=2, num_layers=4, global_batch_size=8),
        marks=[pytest.mark.world(4), pytest.mark.slow], id="cp2-pp2-vpp2-packed",
    ),
]  # fmt: skip


@pytest.mark.parametrize("changes", LAYOUTS)
def test_dpo_at_a_layout_follows_the_one_process_run(changes):
    """--compare-single-process with --dpo: the layout's objective follows the one-process
    run's (the comparison sets ``passed``, asserted in ``_run``); every rank records the same
    metrics."""
    import torch.distributed as dist

    result = _result(train_iters=3, compare_single_process=True, eval_interval=3, **changes)
    records = result.records
    if result.reference is not None:  # rank 0: the one-process run's validation
        for key in ("valid_loss", "valid_rewards_margins", "valid_logps_chosen"):
            mine, single = records[-1][key], result.reference[-1][key]
            assert abs(mine - single) < 1e-5 * max(1.0, abs(single)), key
    mine = [[r[k] for k in ("loss", "rewards_chosen", "logps_rejected")] for r in records]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(other == mine for other in everyone)


@pytest.mark.world(1)
@pytest.mark.slow  # writes three HuggingFace models, imports transformers
def test_a_reference_hf_model_gives_the_reference_log_probs(tmp_path):
    """--dpo-reference-hf-model: the rewards at iteration 1 are beta (the policy's log-probs -
    transformers' log-probs of the reference on the same pairs); the policy's own folder as
    the reference gives log 2; another architecture is refused by name."""
    transformers = pytest.importorskip("transformers")
    from tests.unit_tests.hf.hf_models import GPT2_CONFIG, LLAMA_CONFIG, write_random_hf_model

    policy = write_random_hf_model(tmp_path / "policy", LLAMA_CONFIG, seed=0)
    reference = write_random_hf_model(tmp_path / "reference", LLAMA_CONFIG, seed=1)
    other = write_random_hf_model(tmp_path / "gpt2", GPT2_CONFIG, seed=0)
    run = dict(train_iters=1)
    changes = dict(SMALL, hf_model=str(policy), seq_length=16)
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        changes.pop(name)
    same = _run_with(changes, dpo_reference_hf_model=str(policy), **run)
    assert abs(same[0]["loss"] - math.log(2)) < 1e-6
    (record,) = _run_with(changes, dpo_reference_hf_model=str(reference), **run)
    config = TrainingConfig(**changes)
    batch = build_preference_dataset(config).global_batch(0, config.global_batch_size)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(reference)).double()
    with torch.no_grad():
        logits = model(batch["tokens"], position_ids=batch["position_ids"]).logits
    logp = logits.log_softmax(-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    ref_chosen = (logp * batch["loss_mask"]).sum(-1)[0::2].mean().item()
    expected = 0.5 * (record["logps_chosen"] - ref_chosen)
    assert abs(expected) > 1e-3
    assert abs(record["rewards_chosen"] - expected) < 1e-5 * max(1.0, abs(expected))
    with pytest.raises(ValueError, match="is not the policy's architecture"):
        _run_with(changes, dpo_reference_hf_model=str(other), **run)


@pytest.mark.world(1)
@pytest.mark.slow  # writes two HuggingFace models, imports transformers
def test_the_dpo_step_equals_transformers_float64_gradient(tmp_path):
    """One plain-SGD step (lr 1, no clipping, decay or momentum) from an --hf-model policy
    against an --dpo-reference-hf-model reference: the exported weights' update equals -lr x
    the gradient transformers gives (float64) for the issue's objective on the same pairs
    (sigmoid + the pooled SFT term), every tensor by its HuggingFace name; the loss and the
    gradient norm too. Control: the per-token MEAN log-probs (not the sums) give another
    gradient."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.unit_tests.dist_utils import rel_error
    from tests.unit_tests.hf.hf_models import LLAMA_CONFIG, write_random_hf_model

    policy = write_random_hf_model(tmp_path / "policy", LLAMA_CONFIG, seed=0)
    reference = write_random_hf_model(tmp_path / "reference", LLAMA_CONFIG, seed=1)
    beta, weight = 0.5, 0.7
    changes = {k: v for k, v in SMALL.items() if k not in ("num_layers", "hidden_size")}
    changes.pop("num_attention_heads")
    changes.update(
        hf_model=str(policy), dpo_reference_hf_model=str(reference), seq_length=16,
        dpo_beta=beta, dpo_sft_weight=weight, optimizer="sgd", sgd_momentum=0.0, lr=1.0,
        clip_grad=0.0, weight_decay=0.0, export_hf=str(tmp_path / "out"),
    )  # fmt: skip
    (record,) = _run_with(changes, train_iters=1)
    config = TrainingConfig(**changes)
    batch = build_preference_dataset(config).global_batch(0, config.global_batch_size)
    mask = batch["loss_mask"].double()

    def logps(model, mean=False):
        logits = model(batch["tokens"], position_ids=batch["position_ids"]).logits
        logp = logits.log_softmax(-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        summed = (logp * mask).sum(-1)
        return summed / mask.sum(-1) if mean else summed

    def gradient(mean=False):
        load = transformers.AutoModelForCausalLM.from_pretrained
        model = load(str(policy), dtype=torch.float64)
        with torch.no_grad():
            ref = logps(load(str(reference), dtype=torch.float64), mean)
        mine = logps(model, mean)
        h = (mine[0::2] - ref[0::2]) - (mine[1::2] - ref[1::2])
        sft = -logps(model)[0::2].sum() / mask[0::2].sum()
        objective = -torch.nn.functional.logsigmoid(beta * h).mean() + weight * sft
        objective.backward()
        return objective.item(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = gradient()
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    assert (
        abs(record["loss"] - loss) < 1e-6 * loss and abs(record["grad_norm"] - norm) < 1e-5 * norm
    )
    start = load_file(str(policy / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(grads)
    update = {n: exported[n].double() - start[n].double() for n in grads}
    errors = {n: rel_error(update[n], -grads[n]) for n in grads}
    assert max(errors.values()) < 1e-5, errors
    _, mean_grads = gradient(mean=True)
    assert min(rel_error(update[n], -mean_grads[n]) for n in grads) > 1e-2


def _run_with(base: dict, **changes):
    with fresh_layout():
        result = pretrain(TrainingConfig(**{**base, **changes}))
    return result.records


@pytest.mark.world(1)
def test_the_loggers_know_every_dpo_metric():
    from megatron.core.preference import METRIC_KEYS
    from megatron.training.loggers import DPO_METRICS, scalars_of

    assert DPO_METRICS == METRIC_KEYS
    record = {key: 1.0 for key in METRIC_KEYS} | {f"valid_{key}": 2.0 for key in METRIC_KEYS}
    scalars = scalars_of(record)
    assert scalars["rewards/accuracies"] == 1.0 and scalars["logps/rejected validation"] == 2.0
    assert len(scalars) == 2 * len(METRIC_KEYS)


@pytest.mark.world(1)
@pytest.mark.slow
def test_tensorboard_holds_the_dpo_metrics(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    records = _run(train_iters=2, tensorboard_dir=str(tmp_path), log_interval=1, eval_interval=2)
    (path,) = tmp_path.rglob("events.out.tfevents.*")
    reader = accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0})
    reader.Reload()
    for key, tag in (("rewards_margins", "rewards/margins"), ("logps_chosen", "logps/chosen")):
        logged = {e.step: e.value for e in reader.Scalars(tag)}
        assert logged == pytest.approx({r["iteration"]: r[key] for r in records}, rel=1e-6)
    (event,) = reader.Scalars("rewards/accuracies validation")
    assert event.step == 2 and event.value == pytest.approx(records[-1]["valid_rewards_accuracies"])
