"""Sampling from a trained model: ``python -m megatron.training.generate``.

    python -m megatron.training.generate --hf-model DIR --prompt "Hello"
    python -m megatron.training.generate --load CKPT --chat --prompt "What is 2 + 2?"
    torchrun --nproc-per-node 4 -m megatron.training.generate --load CKPT --tp 2 --pp 2 ...

The model comes from ``--load`` (one of our checkpoints, at any layout it was saved at: its
recorded model settings build the model, a LoRA checkpoint's adapters included, the base from
the ``--hf-model`` or ``--pretrained-checkpoint`` it recorded; the tokenizer is the one the
run trained with, byte-level for a ``--data-path`` run that named none) or from
``--hf-model`` (with a PEFT adapter from ``--hf-adapter``, whose adapter_config.json gives
the adapted modules). Each prompt is tokenized as the tokenizer's own ``__call__`` would
(its special tokens added), or rendered with the chat template (``--chat``, a user turn and
the generation prompt), then decoded token by token with a key/value cache
(``StaticInferenceContext``): the prompt in one forward, then one token per forward. Greedy
by default; ``--temperature`` (0: greedy), ``--top-k`` (0: off) or ``--top-p`` (1: off)
sample, with ``--seed``. The padded rows of a padded vocabulary are never chosen. A
completion ends at any stop id (``megatron.training.tokenizer.generation``: eos, the chat
template's turn end) and is printed by rank 0, one per prompt.

Layouts: ``--tp``, ``--pp`` and DP = world / (TP x PP) replicas; ``--ep`` / ``--etp`` for
MoE models, which at TP > 1 run with sequence parallelism (their token dispatcher needs it;
each step's tokens are padded to a multiple of TP). Every rank computes the same logits and
draws the same token (the last stage picks it and hands it to the others), so greedy tokens
are the same at every layout up to the rounding of the layout's reductions.

Everything that needs no model (flags, files, prompts) is checked first; a known error is
one line printed once, exit status 2 (``MEGATRON_DEBUG=1``: the traceback). torch and the
model are imported only once a model is built.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Collection, Iterator, List, Optional, Sequence, Tuple, Union

from megatron.training.errors import UsageError, debug_requested, is_usage_error, one_line

if TYPE_CHECKING:  # torch and the model are imported when a model is built (fast --help)
    import torch

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.arguments import TrainingConfig

PROG = "megatron.training.generate"
COMMAND_LINE_ERROR_STATUS = 2
# A rank whose collective fails because a peer stopped on its error waits this long for that
# rank's report (the trainer's rule, megatron.training.cli) and ends without a traceback.
PEER_FAILURE_WAIT_S = 30.0


@dataclasses.dataclass
class Sampling:
    """How the next token is chosen: greedy (argmax) unless ``temperature`` > 0, ``top_k``
    > 0 or ``top_p`` < 1 is set; then softmax(logits / temperature) over the top-k tokens
    whose cumulative probability first reaches top-p, drawn from a generator seeded with
    ``seed``. ``temperature`` 0 is greedy whatever else is set; ``top_k`` 0 and ``top_p`` 1
    mean off (megatron's convention). Out-of-range values are refused naming the flag."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 1234

    def __post_init__(self) -> None:
        checks = (
            ("--temperature", self.temperature, "a number >= 0 (0: greedy)", lambda v: v >= 0),
            ("--top-k", self.top_k, "an integer >= 0 (0: off)", lambda v: v >= 0),
            ("--top-p", self.top_p, "a number in (0, 1] (1: off)", lambda v: 0 < v <= 1),
        )
        for flag, value, expected, good in checks:
            if value is not None and not (value == value and good(value)):  # NaN fails too
                raise UsageError(f"{flag} {value}: expected {expected}")

    @property
    def greedy(self) -> bool:
        if self.temperature == 0:
            return True
        return self.temperature is None and not self.top_k and self.top_p in (None, 1)


def generate(
    model: List[torch.nn.Module],
    prompt: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    sampling: Optional[Sampling] = None,
    eos_id: Union[int, Collection[int], None] = None,
    pg_collection=None,
    cuda_graph: bool = False,
) -> List[int]:
    """The new token ids after ``prompt`` (a list of ids): at most ``max_new_tokens``,
    stopping after ``eos_id`` (an id, or a collection of ids any of which stops, as
    HuggingFace's ``eos_token_id`` list). ``model``: this rank's chunks (one; DDP or
    Float16Module wrappers allowed); ``vocab_size``: the tokenizer's vocabulary (padded rows
    never chosen). Collective over the model's TP x PP (x DP) ranks. Under sequence
    parallelism (a MoE model at TP > 1) each forward's tokens are padded to a multiple of TP
    after the real ones, which causal attention keeps from changing them. ``cuda_graph``
    (one CUDA GPU, TP = PP = 1, no routed experts):
    after the prompt, each decoding step replays one captured CUDA graph
    (``_GraphedDecoding``) instead of launching its kernels from Python."""
    import torch

    from megatron.core.inference.contexts import StaticInferenceContext

    sampling = sampling or Sampling()
    if len(model) != 1:
        raise ValueError(f"generate: one model chunk per rank (no VPP), got {len(model)}")
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    chunk = model[0]
    device = next(chunk.parameters()).device
    multiple = _sequence_multiple(chunk)
    generator = torch.Generator().manual_seed(sampling.seed)
    context = StaticInferenceContext(1, len(prompt) + max_new_tokens + multiple)
    if cuda_graph:
        _check_graphable(chunk, device, pg_collection)
    graphed = None
    step = list(prompt)
    out: List[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            if graphed is not None:
                logits = graphed(step[0])
            else:
                tokens, positions = _padded(step, context.sequence_len_offset, multiple, device)
                logits = _forward(chunk, tokens, positions, context, pg_collection)
            context.increment_sequence_len_offset(len(step))
            context.enable_decode_mode()
            token = torch.zeros(1, dtype=torch.long, device=device)
            if logits is not None:
                last = logits[0, len(step) - 1, :vocab_size].float()
                token[0] = _choose(last, sampling, generator)
            token = _from_last_stage(token, pg_collection)
            out.append(int(token.item()))
            if out[-1] in stops:
                break
            step = [out[-1]]
            if cuda_graph and graphed is None:
                graphed = _GraphedDecoding(chunk, context, device)
    return out


class _GraphedDecoding:
    """One decoding step (a token at the cache's offset) as a CUDA graph: the context keeps
    its offset on the device (``enable_static_decode``: static shapes); the first step runs
    eagerly on a side stream (the warm-up CUDA graphs need: allocations, kernel choices), the
    second is captured, and every step from then on replays it, its token and position
    copied into the graph's input tensors. Written here because ``torch.compile``'s CUDA
    graphs would need the model traced without a graph break; the capture needs none."""

    def __init__(self, chunk: torch.nn.Module, context, device) -> None:
        import torch

        context.enable_static_decode(device)
        self.chunk, self.context = chunk, context
        self.tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.graph = None
        self.logits = None
        self.warmed_up = False

    def __call__(self, token: int) -> torch.Tensor:
        import torch

        self.tokens.fill_(token)
        self.positions.copy_(self.context.static_offset.view(1, 1))
        if not self.warmed_up:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.warmed_up = True
            return logits
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        return self.logits

    def _forward(self) -> torch.Tensor:
        return self.chunk(
            self.tokens, self.positions, inference_context=self.context, runtime_gather_output=True
        )


def _check_graphable(chunk, device, pg_collection) -> None:
    """Refuse, naming the reason, a model or layout whose decoding step cannot be one
    captured CUDA graph: not on CUDA, TP or PP > 1 (collectives), routed experts (their
    token counts go to the host)."""
    config = _unwrap(chunk).config
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the model is on {device.type}, not a CUDA GPU")
    for name in ("tp", "pp"):
        group = None if pg_collection is None else getattr(pg_collection, name, None)
        if group is not None and group.size() > 1:
            reasons.append(f"{name.upper()} = {group.size()} (one GPU only)")
    if getattr(config, "num_moe_experts", None):
        reasons.append("routed experts (their token counts are read on the host)")
    if reasons:
        raise UsageError("--enable-cuda-graph: " + "; ".join(reasons))


def _sequence_multiple(chunk) -> int:
    """What each forward's token count must be a multiple of: TP under sequence parallelism
    (the sequence is split over TP), else 1."""
    config = _unwrap(chunk).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _padded(ids: List[int], offset: int, multiple: int, device) -> Tuple[Any, Any]:
    """tokens [1, s] and positions [1, s] of ``ids`` at cache ``offset``, padded to a
    multiple of ``multiple`` with copies of the last token at its position (after the real
    tokens: causal attention keeps them from changing the real ones; the cache slots they
    fill are overwritten by the next step)."""
    import torch

    pad = -len(ids) % multiple
    positions = list(range(offset, offset + len(ids)))
    tokens = torch.tensor([ids + ids[-1:] * pad], dtype=torch.long, device=device)
    return tokens, torch.tensor([positions + positions[-1:] * pad], device=device)


def _forward(chunk, tokens, positions, context, pg_collection) -> Optional[torch.Tensor]:
    """One cached forward through the pipeline (``context``: the KV cache): logits
    [b, s, V] on the last stage (None elsewhere). Stage p receives the hidden states
    [s, b, h] from stage p - 1."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pp = None if pg_collection is None else pg_collection.pp
    stages = 1 if pp is None else pp.size()
    stage = 0 if pp is None else pp.rank()
    gpt = _unwrap(chunk)
    messages = None
    if stages > 1:
        messages = P2PCommunicator(pp, ModelParallelConfig(pipeline_dtype=_dtype(chunk)))
    if stage > 0:
        seq = tokens.shape[1]
        if gpt.config.sequence_parallel:
            seq //= gpt.config.tensor_model_parallel_size
        shape = (seq, tokens.shape[0], gpt.config.hidden_size)
        gpt.set_input_tensor(messages.recv_forward(shape, is_first_stage=False))
    output = chunk(
        tokens if stage == 0 else None,
        positions,
        inference_context=context,
        runtime_gather_output=True,
    )
    if stage < stages - 1:
        messages.send_forward(output, is_last_stage=False)
        return None
    return output


def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from one position's logits [V] (see ``Sampling``)."""
    import torch

    if sampling.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.cpu() / (sampling.temperature or 1.0)
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=0) - ordered  # mass of the tokens ranked above
        ordered = ordered.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())


def _from_last_stage(token: torch.Tensor, pg_collection) -> torch.Tensor:
    """The last pipeline stage's token on every stage."""
    from megatron.core.communication import broadcast_from_last_

    return broadcast_from_last_(token, None if pg_collection is None else pg_collection.pp)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _dtype(chunk: torch.nn.Module) -> torch.dtype:
    return next(_unwrap(chunk).parameters()).dtype


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.training.generate",
        description="Sample completions from a checkpoint of ours (--load) or a HuggingFace "
        "model (--hf-model), greedy by default, with a key/value cache, at any TP x PP (x EP) "
        "layout. MEGATRON_DEBUG=1 shows the traceback of an error.",
    )
    source = parser.add_argument_group("model")
    source.add_argument("--load", metavar="CKPT", help="a checkpoint of ours (--save DIR)")
    source.add_argument("--hf-model", metavar="DIR", help="a HuggingFace model folder")
    source.add_argument(
        "--hf-adapter",
        metavar="DIR",
        help="a PEFT LoRA adapter on --hf-model (its adapter_config.json gives r, alpha and "
        "the adapted modules)",
    )
    source.add_argument(
        "--tokenizer", metavar="DIR_OR_JSON", help="tokenizer (default: the model's own)"
    )
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    prompts.add_argument("--prompts-file", metavar="FILE", help="one prompt per line")
    prompts.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="a prompt as token ids, e.g. '5 17 3' (models without a tokenizer)",
    )
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="render each prompt as a user turn with the chat template",
    )
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="at most N tokens (>= 1)"
    )
    decoding.add_argument(
        "--temperature", type=float, help="sample with this temperature (0: greedy)"
    )
    decoding.add_argument(
        "--top-k", type=int, help="sample among the k most likely tokens (0: off)"
    )
    decoding.add_argument(
        "--top-p", type=float, help="sample from the top-p nucleus, in (0, 1] (1: off)"
    )
    decoding.add_argument("--seed", type=int, default=1234, help="the sampling seed")
    layout = parser.add_argument_group("layout (the world is TP x PP x DP; DP replicas agree)")
    layout.add_argument(
        "--tp", "--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel size"
    )
    layout.add_argument(
        "--pp", "--pipeline-model-parallel-size", type=int, default=1, help="pipeline size"
    )
    layout.add_argument(
        "--ep",
        "--expert-model-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="expert-parallel size (MoE models; the experts split over TP x DP ranks)",
    )
    layout.add_argument(
        "--etp",
        "--expert-tensor-parallel-size",
        dest="etp",
        type=int,
        help="tensor-parallel size inside each expert (default: --tp)",
    )
    layout.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    decoding.add_argument(
        "--enable-cuda-graph",
        action="store_true",
        help="replay each decoding step as one captured CUDA graph (one GPU, TP = PP = 1, "
        "no routed experts)",
    )
    layout.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; 0 on success, 2 with a one-line error printed once (rank 0;
    under torchrun the lowest local rank that failed). ``MEGATRON_DEBUG=1`` raises instead,
    with the traceback, as the trainer does."""
    from megatron.training.errors import another_rank_reported, lost_peer, report_error

    args = build_parser().parse_args(argv)
    rank = _rank()  # fixed before the groups come and go
    try:
        completions = run(args)
    except Exception as exc:
        if not debug_requested() and is_usage_error(exc):
            report_error(one_line(exc), prog=PROG)
            return COMMAND_LINE_ERROR_STATUS
        if lost_peer(exc) and another_rank_reported(PEER_FAILURE_WAIT_S):
            return 1  # the consequence of another rank's error, which is the one reported
        raise
    if rank == 0:
        for text in completions:
            print(text, flush=True)
    return 0


def _rank() -> int:
    """This process's global rank: torch.distributed's when it is up (an in-process
    caller's group), else torchrun's RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def run(args: argparse.Namespace) -> List[str]:
    """Check the command line, build the model on this rank, generate for every prompt and
    return the completions. Every check that needs no model runs first."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.prompts_file and not os.path.isfile(args.prompts_file):
        raise FileNotFoundError(
            f"--prompts-file {args.prompts_file}: no such file (expected a text file, one "
            "prompt per line)"
        )
    config = _model_config(args)
    codec = _codec(args)
    prompts = _prompts(args, codec)
    _check_prompts(prompts, args.max_new_tokens, config)
    vocab = config.vocab_size if codec is None else min(codec.vocab_size, config.vocab_size)
    stops = set() if codec is None else codec.stop_ids
    completions = []
    with loaded_model(args, config) as (model, groups, config):
        for ids in prompts:
            new = generate(
                model, ids, args.max_new_tokens, vocab, sampling, stops, groups,
                cuda_graph=args.enable_cuda_graph,
            )  # fmt: skip
            if codec is None:
                completions.append(" ".join(str(i) for i in new))
            else:
                completions.append(codec.decode(new[:-1] if new[-1] in stops else new))
    return completions


@contextlib.contextmanager
def loaded_model(
    args: argparse.Namespace, config: Optional[TrainingConfig] = None
) -> Iterator[Tuple[List[torch.nn.Module], Optional[ProcessGroupCollection], TrainingConfig]]:
    """(this rank's model chunks in eval mode, the layout's groups, the model's settings)
    for the command line ``args`` (``--load`` or ``--hf-model``, the layout flags;
    ``config``: ``_model_config(args)`` when already made): torch.distributed and the
    groups are set up on entering (unless already there) and torn down on leaving."""
    import torch.distributed as dist

    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import (
        initialize_distributed,
        initialize_model_parallel_groups,
        initialize_single_gpu,
        launched_world_size,
        tear_down_distributed,
    )
    from megatron.training.model import build_model

    config = config or _model_config(args)
    layout = _layout(config)
    if launched_world_size() is None:
        created = initialize_single_gpu(config)
    else:
        created = initialize_distributed(config, layout)
    try:
        groups = initialize_model_parallel_groups(layout) if dist.is_initialized() else None
        model = build_model(config, layout, groups)
        if config.pretrained_checkpoint:  # the base of a LoRA checkpoint
            load_checkpoint(config.pretrained_checkpoint, model, None, finetune=True)
        if args.load:
            load_checkpoint(
                args.load,
                model,
                None,
                finetune=True,
                run_settings=None,
                base_source=config.hf_model or config.pretrained_checkpoint,
            )
        for chunk in model:
            chunk.eval()
        yield model, groups, config
    finally:
        tear_down_distributed(created)


def _layout(config: TrainingConfig):
    """The layout of ``config`` on this launch's world (errors name generate's flags)."""
    from megatron.training.arguments import validate_config
    from megatron.training.initialize import launched_world_size

    return validate_config(config, launched_world_size() or 1)


def _model_config(args) -> TrainingConfig:
    """The model's settings: those recorded in ``--load``'s checkpoint, or ``--hf-model``'s
    config.json (and ``--hf-adapter``'s adapter_config.json); the layout of this command
    (TP x PP x DP, EP; sequence parallelism for a MoE model at TP > 1, which its token
    dispatcher needs)."""
    from megatron.training.arguments import TrainingConfig

    if bool(args.load) == bool(args.hf_model):
        raise UsageError("pass exactly one of --load CKPT and --hf-model DIR")
    if args.hf_adapter and not args.hf_model:
        raise UsageError(
            f"--hf-adapter {args.hf_adapter} applies to --hf-model BASE; a --load checkpoint "
            "brings its own adapters (pass --hf-model BASE --hf-adapter DIR instead)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    dp = max(1, world // max(1, args.tp * args.pp))
    layout = dict(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        global_batch_size=dp,
        micro_batch_size=1,
        bf16=args.bf16,
        distributed_backend=args.distributed_backend,
        progress=False,
    )
    model = _hf_model_settings(args) if args.hf_model else _recorded_model_settings(args)
    config = TrainingConfig(**{**model, **layout})
    if config.num_experts and args.tp > 1:
        config = dataclasses.replace(config, sequence_parallel=True)
    return config


def _hf_model_settings(args) -> dict:
    """``--hf-model``'s model settings (and ``--hf-adapter``'s LoRA settings); the sequence
    length within a learned position table (generation checks its own lengths)."""
    from megatron.training.arguments import TrainingConfig
    from megatron.training.hf_settings import resolve_hf_model
    from megatron.training.options import MODEL, fields_of_kind

    config = resolve_hf_model(TrainingConfig(hf_model=args.hf_model))
    if args.hf_adapter:
        from megatron.training.hf import read_hf_config
        from megatron.training.hf.peft import lora_settings_of_peft

        if not os.path.isdir(args.hf_adapter):
            raise FileNotFoundError(
                f"--hf-adapter {args.hf_adapter}: no such folder (expected a PEFT adapter "
                "folder: adapter_config.json + adapter_model.safetensors)"
            )
        arch, _ = read_hf_config(args.hf_model)
        lora = lora_settings_of_peft(args.hf_adapter, arch)
        config = dataclasses.replace(config, hf_adapter=args.hf_adapter, **lora)
    table = config.max_position_embeddings
    if config.position_embedding_type == "learned_absolute" and table and table < config.seq_length:
        config = dataclasses.replace(config, seq_length=max(4, table - table % 2))
    names = set(fields_of_kind(TrainingConfig, MODEL)) - {"tokenizer"}
    kept = {"hf_model": config.hf_model, "hf_adapter": config.hf_adapter}
    return {n: getattr(config, n) for n in names} | kept


def _recorded_model_settings(args) -> dict:
    """The model settings ``--load``'s checkpoint records (not its data: the tokenizer is
    ``_codec``'s business). A full checkpoint holds every weight; an adapter-only one
    names its base (``--hf-model`` or ``--pretrained-checkpoint``)."""
    from megatron.training.arguments import TrainingConfig
    from megatron.training.options import MODEL, fields_of_kind

    settings, common = _checkpoint_settings(args.load)
    names = set(fields_of_kind(TrainingConfig, MODEL)) - {"tokenizer"}
    names |= {"hf_model", "make_vocab_size_divisible_by"}
    known = {f.name for f in dataclasses.fields(TrainingConfig)}
    recorded = {k: v for k, v in settings.items() if k in names and k in known}
    for key in ("lora_target_modules", "lora_exclude_modules"):
        if key in recorded:
            recorded[key] = tuple(recorded[key])
    if not common.get("trainable_params_only"):  # the checkpoint holds every weight
        recorded.update(hf_model=None, pretrained_checkpoint=None)
        return recorded
    from megatron.training.lora_base import LORA_BASE_KEY

    base = common.get(LORA_BASE_KEY) or {}  # the absolute path of the base
    field = {"--hf-model": "hf_model", "--pretrained-checkpoint": "pretrained_checkpoint"}
    if base.get("flag") in field and base.get("path"):  # works from any directory
        recorded[field[base["flag"]]] = base["path"]
    return recorded


def _checkpoint_settings(load: str) -> Tuple[dict, dict]:
    """(run settings, common state) of checkpoint ``load``."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import resolve_checkpoint

    directory, _ = resolve_checkpoint(load)
    common = dist_checkpointing.load_common_state_dict(str(directory))
    settings = common.get("run_settings")
    if not settings:
        raise UsageError(f"--load {load}: checkpoint {directory} records no run settings")
    return settings, common


def _tokenizer_spec(args) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(the tokenizer: ``--tokenizer``, the one the run trained with, ``byte-level`` for a
    ``--data-path`` run without one, the ``--hf-model`` folder's, or None; the run's
    ``--eod-token``; model folders that may hold a generation_config.json)."""
    from megatron.training.tokenizer.generation import BYTE_LEVEL

    if args.hf_model:
        found = os.path.isfile(os.path.join(args.hf_model, "tokenizer.json"))
        return args.tokenizer or (args.hf_model if found else None), None, [args.hf_model]
    settings, _ = _checkpoint_settings(args.load)
    hf_model = settings.get("hf_model")
    folders = [hf_model] if hf_model and os.path.isdir(hf_model) else []
    spec = args.tokenizer or settings.get("tokenizer")
    if spec is None and folders and os.path.isfile(os.path.join(hf_model, "tokenizer.json")):
        spec = hf_model
    if spec is None and settings.get("data_path"):
        spec = BYTE_LEVEL
    return spec, settings.get("eod_token"), folders


def _codec(args):
    """The tokenizer's codec (``megatron.training.tokenizer.generation``), or None for a
    model without one when the prompts are token ids."""
    from megatron.training.tokenizer.generation import BYTE_LEVEL, generation_codec

    spec, eod_token, folders = _tokenizer_spec(args)
    texts = bool(args.prompt or args.prompts_file)
    if spec is None or (not texts and spec != BYTE_LEVEL and not os.path.exists(spec)):
        if texts:
            raise UsageError(
                "this model has no tokenizer: give prompts as --prompt-ids, or a tokenizer "
                "with --tokenizer"
            )
        return None
    if spec != BYTE_LEVEL and not os.path.exists(spec):
        flag = "--tokenizer" if args.tokenizer else f"the tokenizer {args.load} was trained with:"
        raise FileNotFoundError(
            f"{flag} {spec}: no such file or folder (pass --tokenizer DIR_OR_tokenizer.json)"
        )
    return generation_codec(spec, eod_token, folders)


def _prompts(args, codec) -> List[List[int]]:
    """Every prompt as token ids."""
    texts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f.read().splitlines()]
    ids = [_ids_of(p) for p in args.prompt_ids]
    if not texts and not ids:
        raise UsageError("no prompt: pass --prompt TEXT, --prompts-file FILE or --prompt-ids")
    if args.chat and codec is None:
        raise UsageError("--chat needs a tokenizer with a chat template (--tokenizer DIR)")
    return ids + [codec.encode(text, chat=args.chat) for text in texts]


def _ids_of(text: str) -> List[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(
            f"--prompt-ids {text!r}: expected token ids (integers) separated by spaces or commas"
        ) from None


def _check_prompts(prompts: List[List[int]], max_new_tokens: int, config) -> None:
    """Each prompt is non-empty, its ids are in the vocabulary, and with learned positions
    the prompt and ``--max-new-tokens`` fit the position table."""
    table = None
    if config.position_embedding_type == "learned_absolute":
        table = config.max_position_embeddings or config.seq_length
    for k, ids in enumerate(prompts):
        if not ids:
            raise UsageError(f"prompt {k + 1} has no tokens; expected at least one")
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise UsageError(
                f"prompt {k + 1}: token id {bad[0]} is outside the model's vocabulary (ids 0 "
                f"to {config.vocab_size - 1})"
            )
        if table is not None and len(ids) + max_new_tokens > table:
            raise UsageError(
                f"prompt {k + 1} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} = "
                f"{len(ids) + max_new_tokens} positions, but the model's learned position "
                f"table has {table}; shorten the prompt or lower --max-new-tokens"
            )


if __name__ == "__main__":
    sys.exit(main())
