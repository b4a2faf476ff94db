"""Chat templates and assistant-only masks against HuggingFace ``transformers``.

The reference is ``transformers``' own ``apply_chat_template(..., tokenize=True,
return_dict=True, return_assistant_tokens_mask=True)`` on a tokenizer built here (a byte-level
BPE trained on a few sentences, wrapped as ``PreTrainedTokenizerFast`` and saved with
``save_pretrained``); our side reads the saved folder with ``load_hf_tokenizer`` only.
``transformers`` needs ``{% generation %}`` blocks to produce its mask; our incremental
rendering (templates without them) is compared with ``transformers``' mask of the same template
with the blocks added around exactly what the assistant writes.
"""

import json
import os

import pytest

from megatron.core.tokenizers.chat_template import ChatTemplateError, tokenize_conversation
from megatron.training.tokenizer import load_hf_tokenizer

pytestmark = pytest.mark.world(1)

transformers = pytest.importorskip(
    "transformers", reason="transformers (test-only, the dev extra) is not installed"
)
tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIAL += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>"]

# ChatML with {% generation %} around what the assistant writes (content + <|im_end|>).
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3 style, written for this test; GEN_OPEN/GEN_CLOSE become the generation tags or "".
LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}GEN_OPEN{{ m['content'] | trim + '<|eot_id|>' }}GEN_CLOSE"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_GEN = LLAMA3.replace("GEN_OPEN", "{% generation %}").replace(
    "GEN_CLOSE", "{% endgeneration %}"
)
LLAMA3_PLAIN = LLAMA3.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")

# Gemma style, written for this test: the system message folded into the first user turn, the
# assistant's role written "model", "<end_of_turn>\n" after every turn, roles alternating.
GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if m['role'] == 'assistant' %}GEN_OPEN{{ m['content'] | trim + '<end_of_turn>\n' }}"
    "GEN_CLOSE{% else %}{{ (prefix if loop.first else '') + m['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA_GEN = GEMMA.replace("GEN_OPEN", "{% generation %}").replace(
    "GEN_CLOSE", "{% endgeneration %}"
)
GEMMA_PLAIN = GEMMA.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "hello world, how are you?"},
        {"role": "assistant", "content": "the quick brown fox"},
        {"role": "user", "content": "and the dog?"},
        {"role": "assistant", "content": "lazy, today. Ünïcode ok"},
    ],
    [
        {"role": "user", "content": "jumps over"},
        {"role": "assistant", "content": "the lazy dog"},
    ],
]

TEXT = [
    "the quick brown fox jumps over the lazy dog.",
    "hello world, how are you today? You are brief.",
] * 10


def _tokenizer_object(special=tuple(SPECIAL)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def _save(directory, template, eos="<|eot_id|>", special=tuple(SPECIAL), bos="<|begin_of_text|>"):
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object(special),
        bos_token=bos,
        eos_token=eos,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return fast


def _reference(fast, messages):
    out = fast.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_generation_blocks_give_transformers_ids_and_assistant_mask(tmp_path, conversation):
    messages = CONVERSATIONS[conversation]
    fast = _save(tmp_path, CHATML, eos="<|im_end|>")
    ours = load_hf_tokenizer(str(tmp_path))
    ids, mask = tokenize_conversation(ours, messages)
    ref_ids, ref_mask = _reference(fast, messages)
    assert ids == ref_ids
    assert mask == ref_mask
    assert 0 < sum(mask) < len(mask)
    # what the mask selects is exactly the assistant's words and end-of-turn markers
    chosen = ours.detokenize([i for i, m in zip(ids, mask) if m])
    expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert chosen == expected


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_incremental_rendering_equals_transformers_generation_mask(tmp_path, conversation):
    """Our folder's template has no generation tags (incremental rendering); the reference
    tokenizer has the same template with tags around the assistant's content + <|eot_id|>."""
    messages = CONVERSATIONS[conversation]
    fast = _save(tmp_path / "ref", LLAMA3_GEN)
    _save(tmp_path / "plain", LLAMA3_PLAIN)
    ours = load_hf_tokenizer(str(tmp_path / "plain"))
    assert ours.chat_template == LLAMA3_PLAIN and ours.eod == ours.vocab["<|eot_id|>"]
    ids, mask = tokenize_conversation(ours, messages)
    ref_ids, ref_mask = _reference(fast, messages)
    assert ids == ref_ids and ids[0] == ours.vocab["<|begin_of_text|>"]
    assert mask == ref_mask


# Phi-3 / Phi-3.5 (microsoft/Phi-3-mini-4k-instruct's tokenizer_config.json): no generation
# blocks, and the end of a conversation is eos_token where a generation prompt would be.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI3_GEN = PHI3.replace(
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
    "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>\n' }}"
    "{% endgeneration %}",
)
PHI3_SPECIAL = ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_phi3_template_trains_each_turn_without_the_closing_eos(tmp_path, conversation):
    """Phi-3's template writes eos_token after the last message only (instead of the
    generation prompt): an earlier turn renders with it on its own, so it is the
    conversation's closing, not part of a turn (it refused multi-turn conversations). Ids
    are transformers'; the mask is transformers' for the same template with generation
    blocks around each answer and its <|end|>\n (the final eos not trained)."""
    messages = CONVERSATIONS[conversation]
    kwargs = dict(eos="<|endoftext|>", special=PHI3_SPECIAL, bos="<s>")
    fast = _save(tmp_path / "ref", PHI3_GEN, **kwargs)
    _save(tmp_path / "plain", PHI3, **kwargs)
    ours = load_hf_tokenizer(str(tmp_path / "plain"))
    ids, mask = tokenize_conversation(ours, messages)
    ref_ids, ref_mask = _reference(fast, messages)
    assert ids == ref_ids and ids[-1] == ours.vocab["<|endoftext|>"]
    assert mask == ref_mask and mask[-1] == 0
    chosen = ours.detokenize([i for i, m in zip(ids, mask) if m])
    expected = "".join(m["content"] + "<|end|>\n" for m in messages if m["role"] == "assistant")
    assert chosen == expected


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_gemma_style_template_equals_transformers_generation_mask(tmp_path, conversation):
    """A Gemma-style template (system folded into the first user turn, role "model") by
    incremental rendering: the assistant's tokens are its content and "<end_of_turn>\n",
    as transformers' mask of the same template with generation tags around them."""
    messages = CONVERSATIONS[conversation]
    fast = _save(tmp_path / "ref", GEMMA_GEN, eos="<end_of_turn>")
    _save(tmp_path / "plain", GEMMA_PLAIN, eos="<end_of_turn>")
    ours = load_hf_tokenizer(str(tmp_path / "plain"))
    ids, mask = tokenize_conversation(ours, messages)
    ref_ids, ref_mask = _reference(fast, messages)
    assert ids == ref_ids and mask == ref_mask
    chosen = ours.detokenize([i for i, m in zip(ids, mask) if m])
    expected = "".join(
        m["content"].strip() + "<end_of_turn>\n" for m in messages if m["role"] == "assistant"
    )
    assert chosen == expected


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    """Incremental rendering needs each prefix of the conversation to render as a prefix of
    the whole; a template that marks the last message differently breaks that."""
    template = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
        "{% if loop.last %}[END]{% endif %}\n{% endfor %}"
    )
    _save(tmp_path, template)
    with pytest.raises(ChatTemplateError, match="generation"):
        tokenize_conversation(load_hf_tokenizer(str(tmp_path)), CONVERSATIONS[0])


def test_bad_conversations_name_what_is_wrong(tmp_path):
    _save(tmp_path, CHATML)
    tok = load_hf_tokenizer(str(tmp_path))
    for messages, match in [
        ([], "non-empty list"),
        ([{"content": "x"}], r"messages\[0\]"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user", "content": "x"}], "no 'assistant' message"),
    ]:
        with pytest.raises(ChatTemplateError, match=match):
            tokenize_conversation(tok, messages)


def test_load_hf_tokenizer_names_the_file_on_every_problem(tmp_path):
    _save(tmp_path / "ok", CHATML)
    assert load_hf_tokenizer(str(tmp_path / "ok" / "tokenizer.json")).chat_template == CHATML
    with pytest.raises(FileNotFoundError, match="missing"):
        load_hf_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_hf_tokenizer(str(tmp_path / "empty"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="bad.json: not a valid"):
        load_hf_tokenizer(str(bad))
    config = tmp_path / "ok" / "tokenizer_config.json"
    config.write_text('{\n  "eos_token": "<|eot_id|>",\n  oops\n}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json:3: not valid JSON"):
        load_hf_tokenizer(str(tmp_path / "ok"))
    config.write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    tok = load_hf_tokenizer(str(tmp_path / "ok"))
    assert tok.eod == tok.vocab["<|eot_id|>"]
    assert load_hf_tokenizer(str(tmp_path / "ok"), eod_token="<|im_end|>").eod == (
        tok.vocab["<|im_end|>"]
    )
    with pytest.raises(ValueError, match="--eod-token '<nope>'"):
        load_hf_tokenizer(str(tmp_path / "ok"), eod_token="<nope>")
    os.remove(tmp_path / "ok" / "chat_template.jinja")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenize_conversation(load_hf_tokenizer(str(tmp_path / "ok")), CONVERSATIONS[1])


def test_megatron_tokenizer_apply_chat_template_matches_transformers(tmp_path):
    """megatron-core's API: MegatronTokenizer.from_pretrained(folder, library huggingface)
    reads the folder's template; apply_chat_template gives transformers' text and ids."""
    from megatron.core.tokenizers import MegatronTokenizer

    fast = _save(tmp_path, LLAMA3_PLAIN)
    tok = MegatronTokenizer.from_pretrained(str(tmp_path), metadata_path={"library": "huggingface"})
    assert tok.chat_template == LLAMA3_PLAIN and tok.eod == fast.convert_tokens_to_ids("<|eot_id|>")
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            want = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert (
                tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                == want
            )
            ids = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == list(ids)
    bare = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=8)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[1])


# GPT-OSS's "harmony" format, written for this test from its published properties: a system
# block with today's date (strftime_now), a developer block from a leading system/developer
# message, the last assistant turn closed by <|return|> (with its "thinking" as an analysis
# message before it) and earlier ones by <|end|> (their thinking dropped); the generation
# prompt is <|start|>assistant. GEN_OPEN/GEN_CLOSE: around what the model writes after it.
HARMONY = (
    "{{ '<|start|>system<|message|>You are a test model.\nCurrent date: ' }}"
    "{{ strftime_now('%Y-%m-%d') + '\n\nReasoning: medium<|end|>' }}"
    "{% set turns = messages %}"
    "{% if messages and messages[0]['role'] in ['system', 'developer'] %}"
    "{{ '<|start|>developer<|message|># Instructions\n\n' + messages[0]['content'] }}"
    "{{ '\n\n<|end|>' }}{% set turns = messages[1:] %}{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] != 'assistant' %}"
    "{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
    "{% elif loop.last and not add_generation_prompt %}{{ '<|start|>assistant' }}GEN_OPEN"
    "{% if m['thinking'] %}"
    "{{ '<|channel|>analysis<|message|>' + m['thinking'] + '<|end|><|start|>assistant' }}"
    "{% endif %}{{ '<|channel|>final<|message|>' + m['content'] + '<|return|>' }}GEN_CLOSE"
    "{% else %}{{ '<|start|>assistant' }}GEN_OPEN"
    "{{ '<|channel|>final<|message|>' + m['content'] + '<|end|>' }}GEN_CLOSE{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
HARMONY_GEN = HARMONY.replace("GEN_OPEN", "{% generation %}").replace(
    "GEN_CLOSE", "{% endgeneration %}"
)
HARMONY_PLAIN = HARMONY.replace("GEN_OPEN", "").replace("GEN_CLOSE", "")
HARMONY_SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>")
HARMONY_SPECIAL += ("<|channel|>", "<|end|>", "<|return|>")


def _harmony(tmp_path, messages):
    """Our ids and mask (plain template) and transformers' (generation-tagged template)."""
    kwargs = dict(eos="<|return|>", special=HARMONY_SPECIAL, bos="<|startoftext|>")
    fast = _save(tmp_path / "ref", HARMONY_GEN, **kwargs)
    _save(tmp_path / "plain", HARMONY_PLAIN, **kwargs)
    ours = load_hf_tokenizer(str(tmp_path / "plain"))
    ids, mask = tokenize_conversation(ours, messages)
    return ours, ids, mask, _reference(fast, messages)


def _trained(tok, ids, mask):
    return tok.detokenize([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_harmony_trains_earlier_turns_to_end_and_the_last_to_return(tmp_path, conversation):
    """The last assistant turn closes with <|return|>, earlier ones (as rendered once later
    turns follow) with <|end|>: each turn is trained as the conversation renders it, from
    after the generation prompt <|start|>assistant through its own closing token; equal to
    transformers' mask of the generation-tagged template. The leading system message is the
    developer block, never trained (it refused multi-turn conversations)."""
    messages = CONVERSATIONS[conversation]
    ours, ids, mask, (ref_ids, ref_mask) = _harmony(tmp_path, messages)
    assert ids == ref_ids and mask == ref_mask
    assert ids[-1] == ours.vocab["<|return|>"] and mask[-1] == 1
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    expected = "".join(f"<|channel|>final<|message|>{a}<|end|>" for a in answers[:-1])
    assert _trained(ours, ids, mask) == expected + (
        f"<|channel|>final<|message|>{answers[-1]}<|return|>"
    )
    text = ours.detokenize(ids)
    if messages[0]["role"] == "system":
        assert f"<|start|>developer<|message|># Instructions\n\n{messages[0]['content']}" in text


def test_harmony_last_turn_trains_its_thinking_and_developer_role_is_accepted(tmp_path):
    """The last turn's "thinking" (an analysis message before the final one) is trained with
    the <|start|>assistant between them, which the model writes too; a leading "developer"
    message (harmony's name for the system prompt) is accepted and rendered as the
    developer block."""
    messages = [{"role": "developer", "content": "You are brief."}] + CONVERSATIONS[0][1:-1]
    messages.append({"role": "assistant", "thinking": "the dog is lazy", "content": "lazy."})
    ours, ids, mask, (ref_ids, ref_mask) = _harmony(tmp_path, messages)
    assert ids == ref_ids and mask == ref_mask
    trained = _trained(ours, ids, mask)
    assert trained.endswith(
        "<|channel|>analysis<|message|>the dog is lazy<|end|><|start|>assistant"
        "<|channel|>final<|message|>lazy.<|return|>"
    )
    assert "<|start|>developer<|message|># Instructions\n\nYou are brief." in ours.detokenize(ids)


def test_harmony_thinking_on_an_earlier_turn_is_refused_by_name(tmp_path):
    """The template drops an earlier turn's thinking once later turns follow: training that
    turn would silently lose it, so the conversation is refused, naming the message and
    the field."""
    _save(tmp_path, HARMONY_PLAIN, eos="<|return|>", special=HARMONY_SPECIAL)
    tok = load_hf_tokenizer(str(tmp_path))
    for thinking in ("a fox, quick and brown", "fox"):  # the second also in the content
        messages = [dict(m) for m in CONVERSATIONS[0]]
        messages[2]["thinking"] = thinking
        with pytest.raises(ChatTemplateError, match=r"messages\[2\].*'thinking'.*last"):
            tokenize_conversation(tok, messages)


def test_harmony_field_the_template_never_writes_is_not_refused(tmp_path):
    """Only a field the template writes on the last turn and drops on earlier ones is
    refused: an unrendered field whose text happens to occur in the last turn's closing
    ("return" in <|return|>) is accepted, with transformers' ids and mask."""
    messages = [dict(m) for m in CONVERSATIONS[0]]
    messages[2]["finish"] = "return"
    ours, ids, mask, (ref_ids, ref_mask) = _harmony(tmp_path, messages)
    assert ids == ref_ids and mask == ref_mask


def _tick_a_day_per_read(monkeypatch) -> None:
    """A clock that moves a day each time the template reads it (midnight during a run)."""
    import datetime as real

    from megatron.core.tokenizers import chat_template

    days = iter(range(1, 28))

    class _Ticking(real.datetime):
        @classmethod
        def now(cls, tz=None):
            return real.datetime(2026, 2, next(days), 23, 59)

    monkeypatch.setattr(chat_template.datetime, "datetime", _Ticking)


def test_harmony_date_is_the_same_in_every_render_of_a_conversation(tmp_path, monkeypatch):
    """strftime_now is read once per conversation: a clock that moves between the renders
    (midnight during a run) gives the first date everywhere, not a refusal or a wrong mask."""

    _save(tmp_path, HARMONY_PLAIN, eos="<|return|>", special=HARMONY_SPECIAL)
    tok = load_hf_tokenizer(str(tmp_path))
    _tick_a_day_per_read(monkeypatch)
    ids, mask = tokenize_conversation(tok, CONVERSATIONS[1])
    assert "Current date: 2026-02-01\n" in tok.detokenize(ids)
    assert _trained(tok, ids, mask) == "<|channel|>final<|message|>the lazy dog<|return|>"


def test_loop_controls_render_as_in_transformers(tmp_path):
    """{% break %} / {% continue %} (jinja2's loopcontrols, which transformers' renderer
    enables and chat templates use) render here too (before: "not valid Jinja"); the mask
    by incremental rendering equals transformers' of the generation-tagged variant."""
    template = LLAMA3.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}",
    ).replace("{% endfor %}", "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}")
    fast = _save(
        tmp_path / "ref",
        template.replace("GEN_OPEN", "{% generation %}").replace(
            "GEN_CLOSE", "{% endgeneration %}"
        ),
    )
    _save(tmp_path / "plain", template.replace("GEN_OPEN", "").replace("GEN_CLOSE", ""))
    ours = load_hf_tokenizer(str(tmp_path / "plain"))
    ids, mask = tokenize_conversation(ours, CONVERSATIONS[0])
    ref_ids, ref_mask = _reference(fast, CONVERSATIONS[0])
    assert (ids, mask) == (ref_ids, ref_mask) and "system" not in ours.detokenize(ids)


def test_dpo_conversational_pair_with_harmony_reads_one_date(tmp_path, monkeypatch):
    """DPO's conversational pairs render the prompt and prompt + completion separately and
    train from where they differ: a clock that moves between the two renders (midnight)
    trained the whole conversation from the date on; now both have one date."""
    from megatron.training.preference_data import tokenize_pair

    _save(tmp_path, HARMONY_PLAIN, eos="<|return|>", special=HARMONY_SPECIAL)
    tok = load_hf_tokenizer(str(tmp_path))
    _tick_a_day_per_read(monkeypatch)
    record = {
        "prompt": CONVERSATIONS[1][:1],
        "chosen": [{"role": "assistant", "content": "the lazy dog"}],
        "rejected": [{"role": "assistant", "content": "a fox"}],
    }
    for (ids, mask), side in zip(tokenize_pair(record, tok, "x:1"), ("the lazy dog", "a fox")):
        assert tok.detokenize(ids[mask == 1].tolist()) == (
            f"<|channel|>final<|message|>{side}<|return|>"
        )
