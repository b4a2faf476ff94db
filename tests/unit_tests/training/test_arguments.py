"""Trainer options are declared once: every ``TrainingConfig`` field carries its flag, help
and check; the parser is generated from the fields; the rules shared with
``TransformerConfig`` live in ``megatron.core.config_rules``."""

import subprocess
import sys
from dataclasses import fields

import pytest

from megatron.core import config_rules
from megatron.training import TrainingConfig, validate_config
from megatron.training.arguments import build_parser, command_line, option_of, parse_args

pytestmark = pytest.mark.world(1)

# A value other than the default for every field (the round trip must cover them all).
NON_DEFAULT = dict(
    make_vocab_size_divisible_by=128,
    nproc_per_node=8,
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    context_parallel_size=2,
    pipeline_model_parallel_size=2,
    virtual_pipeline_model_parallel_size=2,
    distributed_backend="gloo",
    cp_comm_type="a2a+p2p",
    hierarchical_context_parallel_sizes=[1, 2],
    micro_batch_size=1,
    global_batch_size=16,
    seq_length=64,
    vocab_size=128,
    data_path="data.jsonl",
    tokenizer="tok.json",
    eod_token="</s>",
    pack_sequences=True,
    num_layers=8,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=96,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    label_smoothing=0.1,
    init_method_std=0.01,
    untie_embeddings_and_output_weights=True,
    kv_channels=16,
    max_position_embeddings=64,
    norm_epsilon=1e-6,
    rotary_base=500000.0,
    use_rope_scaling=True,
    rope_scaling_factor=32.0,
    rotary_percent=0.5,
    add_qkv_bias=True,
    qk_layernorm=True,
    qk_layernorm_whole_projection=True,
    openai_gelu=True,
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    original_max_position_embeddings=16,
    beta_fast=8.0,
    beta_slow=2.0,
    mscale=0.9,
    mscale_all_dim=0.8,
    window_size=[3, 0],
    window_attn_skip_freq=[1, 0, 1, 0, 1, 0, 1, 0],
    quick_geglu=True,
    glu_linear_offset=1.0,
    activation_func_clamp_value=7.0,
    softmax_type="learnable",
    rotary_scaling_factor=32.0,
    yarn_original_max_position_embeddings=4096,
    yarn_beta_fast=16.0,
    yarn_beta_slow=2.0,
    no_yarn_correction_range_round_to_int=True,
    geglu=True,
    apply_layernorm_1p=True,
    sandwich_layernorm=True,
    embedding_scale_sqrt_hidden=True,
    softmax_scale=0.25,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    local_rotary_base=100.0,
    rotary_seq_len_interpolation_factor=4.0,
    attention_backend="unfused",
    hf_model="hf-model-dir",
    num_experts=8,
    mtp_num_layers=2,
    mtp_loss_scaling_factor=0.3,
    moe_router_topk=4,
    moe_ffn_hidden_size=48,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    moe_router_pre_softmax=True,
    moe_router_score_function="sigmoid",
    moe_router_dtype="fp32",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.01,
    moe_router_topk_scaling_factor=2.5,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_layer_freq=[1, 0, 1, 0, 1, 0, 1, 0],
    moe_grouped_gemm=True,
    moe_token_dispatcher_type="alltoall",
    expert_model_parallel_size=2,
    expert_tensor_parallel_size=1,
    train_iters=7,
    lr=0.01,
    adam_beta1=0.8,
    adam_beta2=0.95,
    adam_eps=1e-6,
    weight_decay=0.1,
    lr_warmup_iters=2,
    lr_decay_style="cosine",
    min_lr=1e-4,
    clip_grad=0.5,
    calculate_per_token_loss=True,
    per_shard_loss_normalization=True,
    overlap_grad_reduce=True,
    use_distributed_optimizer=True,
    overlap_param_gather=True,
    recompute_granularity="selective",
    recompute_method="block",
    recompute_num_layers=2,
    recompute_modules=["mlp", "layernorm"],
    gradient_accumulation_fusion=True,
    seed=5,
    compile=True,
    bf16=True,
    fp16=True,  # round trip only: validate_config refuses the pair
    fp8_format="hybrid",
    fp8_recipe="tensorwise",
    fp8_margin=1,
    fp8_amax_history_len=4,  # round trip only: the tensorwise recipe refuses it
    fp8_amax_compute_algo="max",
    fp8_wgrad=False,
    loss_scale=8.0,
    initial_loss_scale=1024.0,
    min_loss_scale=2.0,
    loss_scale_window=100.0,
    hysteresis=3,
    check_for_nan_in_loss_and_grad=False,
    eval_interval=5,
    eval_iters=-1,
    valid_data_path="valid.jsonl",
    split="90,10,0",
    skip_train=True,
    log_interval=7,
    tensorboard_log_interval=3,
    log_num_zeros_in_grad=True,
    tensorboard_dir="tb",
    wandb_project="proj",
    wandb_exp_name="run1",
    wandb_save_dir="wb",
    save_metrics="out",
    save="ck",
    load="ck",
    save_interval=3,
    export_hf="exported-dir",
    ckpt_step=4,
    finetune=True,
    no_load_optim=True,
    no_load_rng=True,
    exit_on_missing_checkpoint=True,
    override_opt_param_scheduler=True,
    use_checkpoint_opt_param_scheduler=True,  # round trip only: the pair is refused
    exit_signal_handler=True,
    exit_signal="SIGUSR1",
    exit_duration_in_mins=0.5,
    exit_interval=3,
    allow_truncation=True,
    compare_single_process=True,
    compare_tolerance=1e-3,
    progress=False,
    debug=True,
    lora_dim=8,
    lora_alpha=16.0,
    lora_target_modules=["linear_qkv", "*.layers.1.*.linear_fc2"],
    lora_exclude_modules=["*.layers.0.*"],
    lora_dropout=0.1,
    lora_dropout_position="post",
    lora_a_init_method="kaiming",
    lora_b_init_method="normal",
    save_trainable_params_only=True,
    pretrained_checkpoint="base-ckpt",
    merge_lora=True,
    hf_adapter="adapter-dir",
    optimizer="sgd",
    sgd_momentum=0.5,
    dpo=True,
    dpo_beta=0.5,
    dpo_loss_type="ipo",
    dpo_label_smoothing=0.1,
    dpo_sft_weight=1.0,
    dpo_reference_free=True,
    dpo_reference_hf_model="ref-dir",
)


def test_every_field_has_a_flag_and_a_help_text():
    """Each field declares an option: ``--field-name`` among its flags (``--no-field`` for
    a switch that is on by default), a help text, and no flag shared with another field."""
    seen = {}
    for config_field in fields(TrainingConfig):
        spec = option_of(config_field)
        dashed = config_field.name.replace("_", "-")
        expected = f"--no-{dashed}" if config_field.default is True else f"--{dashed}"
        assert expected in spec.flags or (
            # megatron's long name is an alias of the short --tp/--cp/--pp/--vpp
            spec.flags[0]
            in ("--tp", "--cp", "--pp", "--vpp")
        ), (config_field.name, spec.flags)
        assert len(spec.help.split()) >= 2, config_field.name
        for flag in spec.flags:
            assert flag not in seen, f"{flag} declared by {seen.get(flag)} and {config_field.name}"
            seen[flag] = config_field.name
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(seen) <= parser_flags


def test_the_generated_parser_round_trips_a_non_default_config():
    """parse(command_line(config)) == config with every field changed from its default."""
    assert set(NON_DEFAULT) == {f.name for f in fields(TrainingConfig)}
    config = TrainingConfig(**NON_DEFAULT)
    for config_field in fields(TrainingConfig):
        assert getattr(config, config_field.name) != config_field.default, config_field.name
    argv = command_line(config)
    assert parse_args(argv) == config
    assert command_line(TrainingConfig()) == [] and parse_args([]) == TrainingConfig()
    per_layer = TrainingConfig(cp_comm_type=["p2p", "a2a", "a2a+p2p", "all_gather"])
    assert parse_args(command_line(per_layer)) == per_layer


def test_megatron_long_names_and_short_aliases():
    """--tp/--cp/--pp/--vpp and megatron's long names set the same field."""
    short = parse_args("--tp 2 --cp 4 --pp 2 --vpp 3".split())
    long = parse_args(
        "--tensor-model-parallel-size 2 --context-parallel-size 4 "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3".split()
    )
    assert short == long
    assert (short.tensor_model_parallel_size, short.context_parallel_size) == (2, 4)
    assert short.virtual_pipeline_model_parallel_size == 3


def _rejected_value(check):
    """A value ``check`` refuses."""
    for candidate in (0, -1, -1.0, 0.0, 1.0, 4, "not-a-choice"):
        if not check.test(candidate):
            return candidate
    raise AssertionError(f"no candidate refused by {check}")


@pytest.mark.parametrize(
    "name", [f.name for f in fields(TrainingConfig) if option_of(f).check is not None]
)
def test_each_field_check_names_its_flag_and_value(name):
    """A value the field's own check refuses fails validate_config naming the flag, what was
    expected and the value."""
    spec = option_of({f.name: f for f in fields(TrainingConfig)}[name])
    bad = _rejected_value(spec.check)
    with pytest.raises(ValueError) as error:
        validate_config(TrainingConfig(**{name: bad}), 1)
    assert str(error.value) == f"{spec.flag} must be {spec.check.expected}, got {bad!r}"


@pytest.mark.parametrize(
    "name",
    [
        f.name
        for f in fields(TrainingConfig)
        if "finite" in getattr(option_of(f).check, "expected", "")
    ],
)
def test_number_checks_refuse_inf_and_nan(name):
    """Every check that asks for a finite number refuses inf and NaN naming the flag (an
    infinite loss scale or learning rate was accepted before)."""
    spec = option_of({f.name: f for f in fields(TrainingConfig)}[name])
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"^{spec.flag} must be .*finite.*, got {bad}$"):
            validate_config(TrainingConfig(**{name: bad}), 1)


def test_switches_must_be_booleans():
    with pytest.raises(ValueError, match=r"--swiglu must be True or False, got 'yes'"):
        validate_config(TrainingConfig(swiglu="yes"), 1)


def test_shared_rules_agree_with_transformer_config():
    """The tensor-parallel split rule is the same for TransformerConfig and the trainer: for
    each case both accept or both refuse (naming the same size)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cases = [(2, 4, 2, 64), (2, 6, 3, 64), (4, 8, 2, 64), (2, 4, 4, 66), (1, 4, 1, 33)]
    for tp, heads, groups, ffn in cases:
        trainer, library = None, None
        try:
            validate_config(
                TrainingConfig(
                    tensor_model_parallel_size=tp,
                    num_attention_heads=heads,
                    num_query_groups=groups,
                    hidden_size=8 * heads,
                    ffn_hidden_size=ffn,
                ),
                tp,
            )
        except ValueError as exc:
            trainer = str(exc).split()[0].lstrip("-").replace("-", "_")
        try:
            TransformerConfig(
                num_layers=2,
                hidden_size=8 * heads,
                num_attention_heads=heads,
                num_query_groups=groups,
                ffn_hidden_size=ffn,
                tensor_model_parallel_size=tp,
            )
        except ValueError as exc:
            library = str(exc).split()[0]
        assert trainer == library, (tp, heads, groups, ffn, trainer, library)
    assert config_rules.tensor_parallel_misfits(2, {"a": 4, "b": 3, "c": 0}) == [("b", 3), ("c", 0)]


def test_hierarchical_sizes_need_a2a_p2p():
    """--hierarchical-context-parallel-sizes is refused by name when no layer uses a2a+p2p
    (it would be ignored)."""
    fields_ = dict(context_parallel_size=4, seq_length=64, global_batch_size=2)
    for kind in ("p2p", "all_gather", "a2a"):
        with pytest.raises(ValueError, match=r"--hierarchical-context-parallel-sizes 2 2 is used"):
            validate_config(
                TrainingConfig(
                    cp_comm_type=kind, hierarchical_context_parallel_sizes=[2, 2], **fields_
                ),
                4,
            )
    mixed = ["a2a+p2p", "p2p", "p2p", "p2p"]
    layout = validate_config(
        TrainingConfig(cp_comm_type=mixed, hierarchical_context_parallel_sizes=[2, 2], **fields_),
        4,
    )
    assert layout.hierarchical_sizes == [2, 2]


def test_options_and_rules_load_without_torch():
    """The launcher parses and checks a command line without importing torch."""
    code = (
        "import sys; import megatron.training.arguments as a; "
        "a.validate_config(a.parse_args(['--cp', '2']), 2); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(cp_comm_type="p2p"), r"--cp-comm-type p2p chooses .* but --cp is 1"),
        (dict(compare_tolerance=0.5), r"--compare-tolerance 0.5 needs --compare-single-process"),
        (dict(min_lr=1e-4), r"--min-lr 0.0001 is the end of a decay, but --lr-decay-style const"),
        (dict(data_path="d.jsonl", vocab_size=100), r"--vocab-size 100 is not used with --data"),
        (dict(save_interval=2), r"--save-interval 2 needs --save DIR"),
        (
            dict(position_embedding_type="rope", rope_scaling_factor=4.0),
            r"--rope-scaling-factor 4.0 needs --use-rope-scaling",
        ),
        (
            dict(qk_layernorm_whole_projection=True, normalization="RMSNorm"),
            r"--qk-layernorm-whole-projection needs --qk-layernorm .*--qk-layernorm False",
        ),
        (
            dict(qk_layernorm_whole_projection=True, qk_layernorm=True),
            r"--qk-layernorm-whole-projection needs .*--normalization LayerNorm",
        ),
        (dict(geglu=True, swiglu=True), r"--geglu and --swiglu exclude each other"),
        (
            dict(
                apply_layernorm_1p=True,
                qk_layernorm=True,
                normalization="RMSNorm",
                qk_layernorm_whole_projection=True,
            ),
            r"--apply-layernorm-1p and --qk-layernorm-whole-projection exclude each other",
        ),
        (
            dict(rotary_seq_len_interpolation_factor=8.0),
            r"--rotary-seq-len-interpolation-factor 8.0 needs --position-embedding-type rope",
        ),
        (dict(window_attn_skip_freq=2), r"--window-attn-skip-freq 2 needs --window-size"),
        (
            dict(position_embedding_type="rope", local_rotary_base=1e4),
            r"--local-rotary-base 10000.0 needs --window-size",
        ),
        (
            dict(window_size=[3, 0], local_rotary_base=1e4),
            r"--local-rotary-base 10000.0 needs --position-embedding-type rope",
        ),
        (
            dict(attn_logit_softcapping=50.0, attention_backend="flash"),
            r"--attn-logit-softcapping 50.0 .* expected --attention-backend auto, unfused or "
            r"local, got flash",
        ),
        (dict(ckpt_step=0), r"--ckpt-step 0 needs --load DIR"),
        (dict(finetune=True), r"--finetune needs --load DIR"),
        (dict(no_load_optim=True), r"--no-load-optim needs --load DIR"),
        (dict(no_load_rng=True), r"--no-load-rng needs --load DIR"),
        (dict(exit_on_missing_checkpoint=True), r"--exit-on-missing-checkpoint needs --load"),
        (dict(override_opt_param_scheduler=True), r"--override-opt_param-scheduler needs --load"),
        (dict(exit_signal_handler=True), r"--exit-signal-handler save a checkpoint .*--save DIR"),
        (dict(exit_interval=2), r"--exit-interval 2 save a checkpoint .*add --save DIR"),
        (dict(exit_signal="SIGUSR1"), r"--exit-signal SIGUSR1 needs --exit-signal-handler"),
    ],
)
def test_options_that_would_be_ignored_are_refused(changes, message):
    """A setting that changes nothing in this combination is refused by name."""
    with pytest.raises(ValueError, match=message):
        validate_config(TrainingConfig(**changes), 1)


def test_the_one_process_config_drops_the_layout_only_options():
    """The comparison run is valid: no CP exchange kind, no tolerance, no checkpoints."""
    from megatron.training.arguments import single_process_config

    config = TrainingConfig(
        context_parallel_size=4,
        cp_comm_type="a2a+p2p",
        hierarchical_context_parallel_sizes=[2, 2],
        seq_length=64,
        compare_single_process=True,
        compare_tolerance=1e-6,
        lr_decay_style="cosine",
        min_lr=1e-4,
    )
    validate_config(config, 4)
    single = single_process_config(config)
    validate_config(single, 1)
    assert (single.cp_comm_type, single.compare_tolerance) == ("all_gather", None)
    assert (single.min_lr, single.lr_decay_style) == (1e-4, "cosine")


def test_pretrain_refuses_a_process_count_it_does_not_have(monkeypatch):
    """pretrain() launches nothing: --nproc-per-node 4 on one process is an error."""
    from megatron.training import pretrain

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"--nproc-per-node 4, but this run has 1 process"):
        pretrain(TrainingConfig(nproc_per_node=4, train_iters=1))


def test_attention_backend_reaches_the_transformer_config():
    """--attention-backend (megatron's flag) becomes TransformerConfig.attention_backend; the
    names are megatron-core's AttnBackend's."""
    from megatron.core.config_rules import ATTENTION_BACKENDS
    from megatron.core.transformer.enums import AttnBackend
    from megatron.training.model import transformer_config_from

    assert tuple(AttnBackend.__members__) == ATTENTION_BACKENDS
    for name in ATTENTION_BACKENDS:
        config = parse_args(["--attention-backend", name])
        library = transformer_config_from(config, validate_config(config, 1))
        assert library.attention_backend is AttnBackend[name]
    with pytest.raises(ValueError, match="--attention-backend: invalid choice: 'sdpa'"):
        parse_args(["--attention-backend", "sdpa"])


def test_the_resume_checks_name_existing_fields():
    """The settings a resume compares are TrainingConfig fields (a renamed field fails here,
    not silently at resume)."""
    from megatron.training.checkpointing import DATA_SETTINGS, MODEL_SETTINGS, OPTIMIZER_SETTINGS

    names = {f.name for f in fields(TrainingConfig)}
    assert set(MODEL_SETTINGS + DATA_SETTINGS + OPTIMIZER_SETTINGS) <= names


def test_every_option_declares_its_kind():
    """A flag's kind is part of its declaration: left out it is a TypeError, an unknown one
    a ValueError naming the flag."""
    from megatron.training.options import KINDS, option

    assert {option_of(f).kind for f in fields(TrainingConfig)} <= set(KINDS)
    with pytest.raises(TypeError, match="kind"):
        option(1, "--new-flag", help="a new flag")
    with pytest.raises(ValueError, match=r"--new-flag: kind must be one of .*got 'modle'"):
        option(1, "--new-flag", kind="modle", help="a new flag")


def test_the_kinds_give_the_resume_and_comparison_lists():
    """The resume compares the model, data and precision kinds; the comparison run resets the
    layout and output kinds (written out here: a field moved to another kind fails)."""
    from megatron.training.arguments import single_process_config
    from megatron.training.checkpointing import DATA_SETTINGS, MODEL_SETTINGS, OPTIMIZER_SETTINGS

    assert set(MODEL_SETTINGS) == {
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
        "ffn_hidden_size", "normalization", "position_embedding_type", "swiglu",
        "disable_bias_linear", "untie_embeddings_and_output_weights", "vocab_size",
        "kv_channels", "norm_epsilon", "rotary_base", "use_rope_scaling",
        "rope_scaling_factor", "add_qkv_bias", "qk_layernorm", "openai_gelu", "window_size",
        "tokenizer", "qk_layernorm_whole_projection",
        "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type",
        "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
        "yarn_beta_slow", "no_yarn_correction_range_round_to_int", "window_attn_skip_freq",
        "rotary_percent",
        "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
        "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim",
        "geglu", "apply_layernorm_1p",
        "sandwich_layernorm", "embedding_scale_sqrt_hidden", "softmax_scale",
        "attn_logit_softcapping", "final_logit_softcapping",
        "local_rotary_base", "rotary_seq_len_interpolation_factor",
        "seq_length", "max_position_embeddings", "num_experts", "moe_router_topk",
        "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
        "moe_router_pre_softmax", "moe_router_score_function", "moe_router_enable_expert_bias",
        "moe_router_dtype",
        "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
        "moe_layer_freq", "mtp_num_layers", "lora_dim", "lora_alpha",
        "lora_target_modules", "lora_exclude_modules", "pretrained_checkpoint",
    }  # fmt: skip
    assert (set(DATA_SETTINGS), set(OPTIMIZER_SETTINGS)) == (
        {"data_path", "eod_token", "split", "dpo"},
        {"bf16", "fp16", "optimizer"},
    )
    single = single_process_config(TrainingConfig(**NON_DEFAULT))
    reset = {
        f.name for f in fields(TrainingConfig) if getattr(single, f.name) != NON_DEFAULT[f.name]
    }
    assert reset == {
        "nproc_per_node", "tensor_model_parallel_size", "sequence_parallel",
        "context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes",
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "compare_single_process", "compare_tolerance", "save_metrics", "save", "load",
        "save_interval", "ckpt_step", "finetune", "no_load_optim", "no_load_rng",
        "exit_on_missing_checkpoint", "export_hf", "override_opt_param_scheduler",
        "use_checkpoint_opt_param_scheduler", "exit_signal_handler", "exit_signal",
        "exit_duration_in_mins", "exit_interval", "log_interval", "tensorboard_dir",
        "wandb_project", "wandb_exp_name", "wandb_save_dir", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "save_trainable_params_only",
        "merge_lora", "tensorboard_log_interval",
    }  # fmt: skip
    assert single.nproc_per_node == 1


def test_resolved_model_derives_the_defaults_once():
    """Query groups = heads, FFN = 4 x hidden, head size = hidden / heads, position table =
    sequence length; given values kept; recorded settings lacking a source left alone."""
    from megatron.training.arguments import resolved_model

    model = resolved_model(TrainingConfig(hidden_size=48, num_attention_heads=6, seq_length=40))
    assert [model[k] for k in ("num_query_groups", "ffn_hidden_size", "kv_channels")] == [6, 192, 8]
    assert model["max_position_embeddings"] == 40
    given = dict(hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=100)
    given.update(kv_channels=16, max_position_embeddings=64, seq_length=40)
    assert resolved_model(given) == given
    old = resolved_model({"hidden_size": 48, "num_query_groups": None})
    assert old == {"hidden_size": 48, "num_query_groups": None, "ffn_hidden_size": 192}


def test_moe_router_dtype_reaches_the_transformer_config():
    """--moe-router-dtype fp32 is megatron's router precision flag: it reaches the
    TransformerConfig; another value, or the flag without --num-experts, is refused."""
    from megatron.training.model import transformer_config_from

    config = TrainingConfig(num_experts=4, disable_bias_linear=True, moe_router_dtype="fp32")
    assert transformer_config_from(config, validate_config(config, 1)).moe_router_dtype == "fp32"
    with pytest.raises(ValueError, match="--moe-router-dtype must be fp32 or fp64, got .bf16."):
        validate_config(
            TrainingConfig(num_experts=4, disable_bias_linear=True, moe_router_dtype="bf16"), 1
        )
    with pytest.raises(ValueError, match="--moe-router-dtype fp32 needs --num-experts"):
        validate_config(TrainingConfig(moe_router_dtype="fp32"), 1)
