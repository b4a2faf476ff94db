"""Sampling from a trained model: ``python -m megatron.training.generate``.

    python -m megatron.training.generate --hf-model DIR --prompt "Hello"
    python -m megatron.training.generate --load CKPT --chat --prompt "What is 2 + 2?"
    torchrun --nproc-per-node 4 -m megatron.training.generate --load CKPT --tp 2 --pp 2 ...

The model comes from ``--load`` (one of our checkpoints, at any layout it was saved at: its
recorded settings build the model, a LoRA checkpoint's adapters included, the base from the
``--hf-model`` or ``--pretrained-checkpoint`` it recorded) or from ``--hf-model`` (with a
PEFT adapter from ``--hf-adapter``). Each prompt is tokenized as the tokenizer's own
``__call__`` would (its special tokens added), or rendered with the chat template
(``--chat``, a user turn and the generation prompt), then decoded token by token with a
key/value cache (``StaticInferenceContext``): the prompt in one forward, then one token per
forward. Greedy by default; ``--temperature``, ``--top-k`` or ``--top-p`` sample, with
``--seed``. The padded rows of a padded vocabulary are never chosen. The completion is
printed to stdout, one per prompt.

Layouts: ``--tp`` and ``--pp`` (the world is TP x PP; context and sequence parallelism do
not apply to a decode step of one token). Every rank computes the same logits and draws the
same token (the last stage picks it and hands it to the others), so greedy tokens are the
same at every layout up to the rounding of the layout's reductions.
"""

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.communication import broadcast_from_last_
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.arguments import TrainingConfig, validate_config
from megatron.training.checkpointing import load_checkpoint, resolve_checkpoint
from megatron.training.errors import UsageError
from megatron.training.initialize import (
    initialize_distributed,
    initialize_model_parallel_groups,
    initialize_single_gpu,
    is_rank_zero,
    launched_world_size,
    tear_down_distributed,
)
from megatron.training.model import build_model
from megatron.training.options import MODEL, fields_of_kind


@dataclasses.dataclass
class Sampling:
    """How the next token is chosen: greedy (argmax) unless ``temperature``, ``top_k`` or
    ``top_p`` is set; then softmax(logits / temperature) over the top-k tokens whose
    cumulative probability first reaches top-p, drawn from ``generator``."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 1234

    @property
    def greedy(self) -> bool:
        return self.temperature is None and self.top_k is None and self.top_p is None


def generate(
    model: List[torch.nn.Module],
    prompt: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    sampling: Optional[Sampling] = None,
    eos_id: Optional[int] = None,
    pg_collection=None,
) -> List[int]:
    """The new token ids after ``prompt`` (a list of ids): at most ``max_new_tokens``,
    stopping after ``eos_id``. ``model``: this rank's chunks (one; DDP or Float16Module
    wrappers allowed); ``vocab_size``: the tokenizer's vocabulary (padded rows never
    chosen). Collective over the model's TP x PP ranks."""
    sampling = sampling or Sampling()
    if len(model) != 1:
        raise ValueError(f"generate: one model chunk per rank (no VPP), got {len(model)}")
    chunk = model[0]
    device = next(chunk.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    context = StaticInferenceContext(1, len(prompt) + max_new_tokens)
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out: List[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            offset = context.sequence_len_offset
            positions = torch.arange(offset, offset + tokens.shape[1], device=device)[None]
            logits = _forward(chunk, tokens, positions, context, pg_collection)
            context.increment_sequence_len_offset(tokens.shape[1])
            context.enable_decode_mode()
            token = torch.zeros(1, dtype=torch.long, device=device)
            if logits is not None:
                token[0] = _choose(logits[0, -1, :vocab_size].float(), sampling, generator)
            token = _from_last_stage(token, pg_collection)
            out.append(int(token.item()))
            if eos_id is not None and out[-1] == eos_id:
                break
            tokens = token.view(1, 1)
    return out


def _forward(chunk, tokens, positions, context, pg_collection) -> Optional[torch.Tensor]:
    """One cached forward through the pipeline: logits [b, s, V] on the last stage (None
    elsewhere). Stage p receives the hidden states [s, b, h] from stage p - 1."""
    pp = None if pg_collection is None else pg_collection.pp
    stages = 1 if pp is None else pp.size()
    stage = 0 if pp is None else pp.rank()
    gpt = _unwrap(chunk)
    messages = None
    if stages > 1:
        messages = P2PCommunicator(pp, ModelParallelConfig(pipeline_dtype=_dtype(chunk)))
    if stage > 0:
        shape = (tokens.shape[1], tokens.shape[0], gpt.config.hidden_size)
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
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.cpu() / (sampling.temperature or 1.0)
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=0) - ordered  # mass of the tokens ranked above
        ordered = ordered.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())


def _from_last_stage(token: torch.Tensor, pg_collection) -> torch.Tensor:
    """The last pipeline stage's token on every stage."""
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
        "model (--hf-model), greedy by default, with a key/value cache, at any TP x PP layout",
    )
    source = parser.add_argument_group("model")
    source.add_argument("--load", metavar="CKPT", help="a checkpoint of ours (--save DIR)")
    source.add_argument("--hf-model", metavar="DIR", help="a HuggingFace model folder")
    source.add_argument("--hf-adapter", metavar="DIR", help="a PEFT LoRA adapter on --hf-model")
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
    decoding.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    decoding.add_argument("--temperature", type=float, help="sample with this temperature")
    decoding.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    decoding.add_argument("--top-p", type=float, help="sample from the top-p nucleus")
    decoding.add_argument("--seed", type=int, default=1234, help="the sampling seed")
    layout = parser.add_argument_group("layout")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    layout.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    layout.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; 0 on success, 2 with a one-line error (from rank 0)."""
    args = build_parser().parse_args(argv)
    try:
        completions = run(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, NotImplementedError) as err:
        if is_rank_zero():
            print(f"megatron.training.generate: error: {err}", file=sys.stderr)
        return 2
    if is_rank_zero():
        for text in completions:
            print(text)
    return 0


def run(args: argparse.Namespace) -> List[str]:
    """Build the model on this rank, generate for every prompt, return the completions."""
    with loaded_model(args) as (model, groups, config):
        tokenizer_file = _tokenizer_file(args, config)
        tokenizer = None
        if tokenizer_file is not None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(tokenizer_file)
        prompts = _prompts(args, tokenizer, tokenizer_file)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        vocab = config.vocab_size if tokenizer is None else tokenizer.get_vocab_size()
        eos = None if tokenizer is None else _eos_id(tokenizer, tokenizer_file)
        completions = []
        for ids in prompts:
            new = generate(model, ids, args.max_new_tokens, vocab, sampling, eos, groups)
            if tokenizer is None:
                completions.append(" ".join(str(i) for i in new))
            else:
                completions.append(tokenizer.decode(new, skip_special_tokens=True))
        return completions


@contextlib.contextmanager
def loaded_model(
    args: argparse.Namespace,
) -> Iterator[Tuple[List[torch.nn.Module], Optional[ProcessGroupCollection], TrainingConfig]]:
    """(this rank's model chunks in eval mode, the layout's groups, the model's settings)
    for the command line ``args`` (``--load`` or ``--hf-model``, ``--tp``, ``--pp``):
    torch.distributed and the groups are set up on entering (unless already there) and
    torn down on leaving."""
    config = _model_config(args)
    world = launched_world_size() or 1
    layout = validate_config(config, world)
    if world == 1 and launched_world_size() is None:
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


def _model_config(args) -> TrainingConfig:
    """The model's settings: those recorded in ``--load``'s checkpoint, or ``--hf-model``'s
    config.json; the layout of this command (TP x PP, no CP, no SP)."""
    if bool(args.load) == bool(args.hf_model):
        raise UsageError("pass exactly one of --load CKPT and --hf-model DIR")
    layout = dict(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        global_batch_size=1,
        micro_batch_size=1,
        bf16=args.bf16,
        distributed_backend=args.distributed_backend,
        progress=False,
    )
    if args.hf_model:
        from megatron.training.hf_settings import resolve_hf_model

        config = TrainingConfig(hf_model=args.hf_model, hf_adapter=args.hf_adapter, **layout)
        if args.hf_adapter:
            from megatron.training.hf.peft import read_peft_config

            raw = read_peft_config(Path(args.hf_adapter))
            config = dataclasses.replace(
                config, lora_dim=int(raw["r"]), lora_alpha=float(raw["lora_alpha"])
            )
        return resolve_hf_model(config)
    directory, _ = resolve_checkpoint(args.load)
    settings = dist_checkpointing.load_common_state_dict(str(directory)).get("run_settings")
    if not settings:
        raise ValueError(f"--load {args.load}: checkpoint {directory} records no run settings")
    names = set(fields_of_kind(TrainingConfig, MODEL)) | {"data_path", "hf_model"}
    known = {f.name for f in dataclasses.fields(TrainingConfig)}
    recorded = {k: v for k, v in settings.items() if k in names and k in known}
    for key in ("lora_target_modules", "lora_exclude_modules"):
        if key in recorded:
            recorded[key] = tuple(recorded[key])
    if args.tokenizer:
        recorded["tokenizer"] = args.tokenizer
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if not common.get("trainable_params_only"):  # the checkpoint holds every weight
        recorded.update(hf_model=None, pretrained_checkpoint=None)
    elif recorded.get("hf_model") and args.tokenizer is None:
        recorded.setdefault("tokenizer", recorded["hf_model"])
    return TrainingConfig(**{**recorded, **layout})


def _tokenizer_file(args, config: TrainingConfig) -> Optional[str]:
    """The model's ``tokenizer.json``: ``--tokenizer``, the one the run recorded, the
    ``--hf-model`` folder's; None for a model without one when the prompts are token ids."""
    from megatron.core.tokenizers.hf_folder import resolve_tokenizer_file

    if args.tokenizer:
        return resolve_tokenizer_file(args.tokenizer)
    path = config.tokenizer or config.hf_model or _recorded_tokenizer(args)
    texts = bool(args.prompt or args.prompts_file)
    if path is not None and (texts or Path(path, "tokenizer.json").is_file()):
        return resolve_tokenizer_file(str(path))
    if texts:
        raise UsageError(
            "this model has no tokenizer: give prompts as --prompt-ids, or a tokenizer with "
            "--tokenizer"
        )
    return None


def _recorded_tokenizer(args) -> Optional[str]:
    """The ``--hf-model`` a full checkpoint was trained from (its tokenizer folder)."""
    if not args.load:
        return None
    directory, _ = resolve_checkpoint(args.load)
    settings = dist_checkpointing.load_common_state_dict(str(directory)).get("run_settings")
    path = (settings or {}).get("tokenizer") or (settings or {}).get("hf_model")
    return path if path and Path(path).exists() else None


def _prompts(args, tokenizer, tokenizer_file) -> List[List[int]]:
    """Every prompt as token ids."""
    texts = list(args.prompt)
    if args.prompts_file:
        texts += [line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines()]
    ids = [[int(t) for t in p.replace(",", " ").split()] for p in args.prompt_ids]
    if not texts and not ids:
        raise UsageError("no prompt: pass --prompt TEXT, --prompts-file FILE or --prompt-ids")
    for text in texts:
        if args.chat:
            ids.append(_chat_ids(tokenizer, tokenizer_file, text))
        else:
            ids.append(tokenizer.encode(text, add_special_tokens=True).ids)
    return ids


def _chat_ids(tokenizer, tokenizer_file: str, text: str) -> List[int]:
    """The user turn rendered with the tokenizer folder's chat template and the generation
    prompt, tokenized without adding special tokens (as ``apply_chat_template`` does)."""
    from megatron.core.tokenizers.chat_template import render_chat
    from megatron.core.tokenizers.hf_folder import read_tokenizer_config

    _, template, special = read_tokenizer_config(tokenizer_file)
    if template is None:
        raise UsageError(f"--chat: {tokenizer_file}'s folder has no chat template")
    rendered = render_chat(template, [{"role": "user", "content": text}], special, True)
    return tokenizer.encode(rendered, add_special_tokens=False).ids


def _eos_id(tokenizer, tokenizer_file: str) -> Optional[int]:
    """The tokenizer folder's ``eos_token`` id, if it names one."""
    from megatron.core.tokenizers.hf_folder import read_tokenizer_config

    _, _, special = read_tokenizer_config(tokenizer_file)
    eos = special.get("eos_token")
    return None if eos is None else tokenizer.token_to_id(eos)


if __name__ == "__main__":
    sys.exit(main())
