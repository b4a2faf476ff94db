"""Chat conversations rendered with a tokenizer's Jinja chat template, and the exact set of
tokens that belong to the assistant (the tokens SFT trains on).

``tokenize_conversation(tokenizer, messages)`` returns the ids of the rendered conversation and
a 0/1 mask over them, 1 on assistant tokens. How the assistant's tokens are found:

1. The template is rendered to one string ``T`` (``bos_token``, ``eos_token``, ... from the
   tokenizer's config are template variables, as HuggingFace passes them), and ``T`` is
   tokenized once, without added special tokens (the template writes those itself), with
   each token's character span ``[a, b)`` in ``T``.
2. The assistant's character spans in ``T``:

   - templates with ``{% generation %}...{% endgeneration %}`` blocks (HuggingFace's marker
     for "the model writes this"): the text each block outputs. The block emits two private-use
     sentinel characters around its output; they are located and removed after rendering, so
     the spans are the blocks' exact output (a message containing a sentinel is refused).
   - other templates, by incremental rendering: for assistant message ``k``,
     ``P = render(messages[:k], add_generation_prompt=True)`` and
     ``Q = render(messages[:k + 1])``; the span is ``[len(P), len(Q))``, i.e. everything the
     assistant turn adds after its generation prompt (its content and the end-of-turn
     marker the template writes). This needs ``P`` to be a prefix of ``Q`` and ``Q`` of ``T``;
     a template that renders earlier turns differently once later turns exist is refused
     with an error asking for ``{% generation %}`` blocks. A closing the template writes only
     at the end of a conversation instead of the generation prompt (Phi-3's ``eos_token``:
     its rendering of no messages, when that does not begin its generation prompt) is not
     part of a turn: it is cut off ``Q`` before the checks, for every turn. A template that
     closes the last turn differently (GPT-OSS's ``<|return|>``, ``<|end|>`` on earlier turns)
     gives an earlier turn ``Q`` that ``T`` does not begin with; that turn is then taken as
     rendered when the conversation goes on: ``render(messages[:k + 1],
     add_generation_prompt=True)`` less the generation prompt (what ``P`` adds to
     ``render(messages[:k])``), under the same checks. A message field that ``Q`` writes
     and this rendering drops (leaving it out changes ``Q`` and not this rendering: an
     earlier turn's ``thinking``) is refused by name: it would not be trained.
3. Token ``i`` is an assistant token iff its span overlaps an assistant span
   (``a < span_end`` and ``b > span_start``).

Rendering uses jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks`` (as
HuggingFace renders templates), ``{% break %}`` / ``{% continue %}``, the ``tojson`` filter,
and ``raise_exception`` / ``strftime_now`` globals; ``strftime_now`` reads the clock once per
conversation, so every rendering of it has the same date.
"""

import datetime
import json
import re
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy

_OPEN, _CLOSE = "\ue000", "\ue001"  # sentinels around {% generation %} output
ROLES = ("system", "developer", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"{%[-+]?\s*generation\s*[-+]?%}")

Message = Dict[str, Any]


class ChatTemplateError(ValueError):
    """A conversation or template problem (the caller adds the file and line)."""


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[Message], chat_template: Optional[str] = None
) -> Tuple[List[int], List[int]]:
    """``(ids, assistant_mask)`` of ``messages`` rendered with ``chat_template`` (default:
    ``tokenizer.chat_template``). ``tokenizer`` needs ``encode_with_offsets(text)`` and
    ``special_tokens`` (``HuggingFaceTokenizer`` has both). See the module docstring."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'path', tokenizer)!r} has no chat template "
            "(expected chat_template in tokenizer_config.json or a chat_template.jinja file)"
        )
    _check_messages(messages)
    variables = dict(getattr(tokenizer, "special_tokens", {}))
    text, spans = render_with_assistant_spans(template, messages, variables)
    ids, offsets = tokenizer.encode_with_offsets(text)
    bounds = numpy.asarray(offsets, dtype=numpy.int64).reshape(-1, 2)
    mask = numpy.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
    return list(ids), mask.astype(int).tolist()


def render_chat(
    template: str,
    messages: Sequence[Message],
    variables: Optional[Dict[str, Any]] = None,
    add_generation_prompt: bool = False,
) -> str:
    """``messages`` rendered with ``template`` (``variables``: ``bos_token`` etc.)."""
    _check_messages(messages, need_assistant=False)
    compiled = _compile(template)
    return _render(compiled, messages, add_generation_prompt, dict(variables or {}))


def render_with_assistant_spans(
    template: str, messages: Sequence[Message], variables: Dict[str, Any]
) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the assistant's ``(start, end)`` character spans in it
    (module docstring, step 2)."""
    compiled = _compile(template)
    variables = {"strftime_now": frozen_strftime_now(), **variables}  # one date for all
    if _GENERATION_TAG.search(template):
        return _strip_sentinels(_render(compiled, messages, False, variables, keep_marks=True))
    full = _render(compiled, messages, False, variables)
    closing = _closing(compiled, variables)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(compiled, messages[:k], True, variables)
        through = _render(compiled, messages[: k + 1], False, variables)
        if closing and through.endswith(closing) and full.startswith(through[: -len(closing)]):
            through = through[: -len(closing)]  # the conversation's end, not this turn's
        if k + 1 < len(messages) and not full.startswith(through):
            through = _continued_turn(compiled, messages, k, (before, through, full), variables)
        if not (through.startswith(before) and full.startswith(through)):
            raise ChatTemplateError(
                f"the chat template renders message {k} (assistant) differently once later "
                "turns follow, so the assistant's tokens cannot be found by incremental "
                "rendering; wrap the assistant's output in {% generation %}...{% endgeneration "
                "%} in the template"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return full, spans


def frozen_strftime_now() -> Callable[[str], str]:
    """``strftime_now`` (the template global transformers provides) on one instant, read
    now: passed as a variable to every rendering of one conversation, they agree on the
    date (GPT-OSS's ``Current date:``) even across midnight."""
    now = datetime.datetime.now()
    return lambda fmt: now.strftime(fmt)


def _continued_turn(
    compiled: Any,
    messages: Sequence[Message],
    k: int,
    texts: Tuple[str, str, str],
    variables: Dict[str, Any],
) -> str:
    """Assistant turn ``k`` (not the last message) as the template renders it when the
    conversation goes on, for templates that close the last turn differently (GPT-OSS's
    ``<|return|>`` instead of ``<|end|>``): ``render(messages[:k + 1],
    add_generation_prompt=True)`` less the generation prompt (what ``before`` adds to
    ``render(messages[:k])``). ``texts``: ``(before, last, full)``, ``last`` the turn rendered
    as the last message, returned when the continued turn does not fit ``full`` either."""
    before, last, full = texts
    head = _render(compiled, messages[:k], False, variables)
    if not before.startswith(head):
        return last
    prompt = before[len(head) :]
    continued = _render(compiled, messages[: k + 1], True, variables)
    if not continued.endswith(prompt):
        return last
    continued = continued[: len(continued) - len(prompt)]
    if not (continued.startswith(before) and full.startswith(continued)):
        return last
    for key in _dropped_fields(messages[k], last[len(before) :], continued[len(before) :]):
        if _writes_only_last(compiled, messages, k, key, variables):
            raise ChatTemplateError(
                f"messages[{k}] (assistant): the chat template writes its {key!r} only when "
                "it is the last message and drops it once later turns follow, so it would not "
                f"be trained; remove {key!r} from that message or split the conversation so "
                "that it ends there"
            )
    return continued


def _dropped_fields(message: Message, last: str, continued: str) -> List[str]:
    """The fields of ``message`` (a string value) found more often in ``last`` than in
    ``continued``: candidates for ``_writes_only_last``."""
    return [
        key
        for key, value in message.items()
        if key != "role"
        and isinstance(value, str)
        and value
        and last.count(value) > continued.count(value)
    ]


def _writes_only_last(
    compiled: Any, messages: Sequence[Message], k: int, key: str, variables: Dict[str, Any]
) -> bool:
    """Whether leaving ``key`` out of message ``k`` changes its rendering as the last message
    and not its rendering with the generation prompt (the continued turn): the template
    writes the field only on the last turn (GPT-OSS's ``thinking``)."""
    without = [dict(messages[k])]
    del without[0][key]
    texts = []
    for prompt in (False, True):
        try:
            texts.append(
                (
                    _render(compiled, messages[: k + 1], prompt, variables),
                    _render(compiled, list(messages[:k]) + without, prompt, variables),
                )
            )
        except ChatTemplateError:  # the template needs the field: not one it drops
            return False
    (last, last_without), (continued, continued_without) = texts
    return last != last_without and continued == continued_without


def _closing(compiled: Any, variables: Dict[str, Any]) -> str:
    """What the template writes at the end of a conversation only, in place of the
    generation prompt (Phi-3's ``{% else %}{{ eos_token }}``): its rendering of no messages
    when that is not the start of its rendering with the generation prompt; "" otherwise or
    when the template cannot render no messages."""
    try:
        empty = _render(compiled, [], False, variables)
        prompt = _render(compiled, [], True, variables)
    except ChatTemplateError:
        return ""
    return "" if prompt.startswith(empty) else empty


def _render(
    compiled: Any,
    messages: Sequence[Message],
    prompt: bool,
    variables: Dict[str, Any],
    keep_marks: bool = False,
) -> str:
    try:
        text = compiled.render(messages=list(messages), add_generation_prompt=prompt, **variables)
    except ChatTemplateError:
        raise
    except Exception as err:  # jinja2's undefined/sandbox errors, a template's TypeError
        raise ChatTemplateError(
            f"the chat template failed on this conversation ({type(err).__name__}: {err})"
        ) from None
    return text if keep_marks else text.replace(_OPEN, "").replace(_CLOSE, "")


def _strip_sentinels(marked: str) -> Tuple[str, List[Tuple[int, int]]]:
    out: List[str] = []
    spans: List[Tuple[int, int]] = []
    length, start = 0, None
    for piece in marked.replace(_CLOSE, _OPEN + _CLOSE).split(_OPEN):
        if piece.startswith(_CLOSE):
            if start is None:
                raise ChatTemplateError("unbalanced {% generation %} blocks in the chat template")
            spans.append((start, length))
            start, piece = None, piece[1:]
        elif out:  # every piece after the first follows an opening sentinel
            if start is not None:
                raise ChatTemplateError("nested {% generation %} blocks in the chat template")
            start = length
        out.append(piece)
        length += len(piece)
    if start is not None:
        raise ChatTemplateError("unbalanced {% generation %} blocks in the chat template")
    return "".join(out), [(a, b) for a, b in spans if b > a]


def _check_messages(messages: Any, need_assistant: bool = True) -> None:
    """Each field's type: ``messages`` a non-empty list of objects; ``role`` a string, one of
    ``ROLES``; ``content`` a string (None or absent only on an assistant message with
    ``tool_calls``); ``name`` / ``tool_call_id`` strings; ``tool_calls`` a list of objects.
    A wrong type would otherwise be rendered as Python text and trained on."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError(
            f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got "
            f"{_shown(messages)}"
        )
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(
                f"messages[{k}]: expected an object with 'role' and 'content', got "
                f"{_shown(message)}"
            )
        role = message["role"]
        if not isinstance(role, str) or role not in ROLES:
            shown = (
                repr(role) if isinstance(role, str) else f"is {type(role).__name__} {_shown(role)}"
            )
            raise ChatTemplateError(
                f"messages[{k}]: role {shown}; expected one of {', '.join(ROLES)}"
            )
        _check_fields(message, k)
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ChatTemplateError("no 'assistant' message: nothing to train on")


def _check_fields(message: Message, k: int) -> None:
    """The types of message ``k``'s fields (``_check_messages``)."""
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and not (message["role"] == "assistant" and tool_calls):
        raise ChatTemplateError(
            f"messages[{k}] ({message['role']}): 'content' is "
            f"{'missing' if 'content' not in message else 'null'}; expected a string (only an "
            "assistant message with 'tool_calls' may leave it out)"
        )
    if content is not None and not isinstance(content, str):
        raise ChatTemplateError(
            f"messages[{k}] ({message['role']}): 'content' is {type(content).__name__} "
            f"{_shown(content)}; expected a string"
        )
    if isinstance(content, str) and (_OPEN in content or _CLOSE in content):
        raise ChatTemplateError(
            f"messages[{k}]: content holds a private-use character U+E000/U+E001 that the "
            "renderer reserves"
        )
    for key in ("name", "tool_call_id"):
        if key in message and not isinstance(message[key], str):
            raise ChatTemplateError(
                f"messages[{k}] ({message['role']}): {key!r} is {type(message[key]).__name__} "
                f"{_shown(message[key])}; expected a string"
            )
    if tool_calls is not None and not (
        isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)
    ):
        raise ChatTemplateError(
            f"messages[{k}] ({message['role']}): 'tool_calls' is {_shown(tool_calls)}; "
            "expected a list of objects"
        )


def _shown(value: Any) -> str:
    """``value`` as JSON, cut to 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "chat templates need the 'jinja2' package (pip install -e '.[hf]')"
        ) from err

    class _Generation(Extension):
        """``{% generation %}body{% endgeneration %}`` outputs body between sentinels."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _OPEN + caller() + _CLOSE

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"the chat template is not valid Jinja (template line {err.lineno}: {err.message})"
        ) from None
