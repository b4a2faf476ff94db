"""Options declared once: a dataclass field that carries its command line.

``option(default, "--flag", "--alias", kind=MODEL, help=..., check=...)`` is a
``dataclasses.field`` whose metadata holds the option (its flags, its kind, help text and the
check of its own value). The kind says what the setting is to the rest of the trainer, so no
side list restates it (``KINDS``; ``fields_of_kind``): a resume compares the model and data
kinds with the checkpoint's, the one-process comparison run resets the layout and output
kinds, and ``--load`` adopts the recorded model kind. From
a dataclass of such fields this module builds the ``argparse`` parser (``build_parser``),
parses a command line into an instance (``parse``), writes an instance back as flags
(``command_line``) and runs every field's own check (``check_fields``). Checks between
fields belong to the config's own validation (``arguments.validate_config``).

An option that configures the library declares the library field it sets
(``library="layernorm_epsilon"``, or ``Sets(...)`` with a target, a value rule or a
condition): ``library_values`` builds a library config's keywords from that table and
``library_names`` is its reverse (library field -> option), so neither is written again by
hand. No torch here.
"""

import argparse
import copy
import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import (
    Any,
    Callable,
    Collection,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
)

from megatron.training.errors import UsageError


@dataclass(frozen=True)
class Check:
    """A rule on one option's own value: ``test(value)`` is True when it is accepted;
    ``expected`` completes "--flag must be ..." in the error."""

    expected: str
    test: Callable[[Any], bool]


# What a setting is to the trainer (``option(..., kind=...)``).
MODEL = "model"  # what the weights mean: recorded, adopted by --load, another value refused
DATA = "data"  # the training data: another value on resume refused (unless --finetune)
PRECISION = "precision"  # the optimizer state's form: refused on resume with the optimizer state
OPTIMIZER = "optimizer"  # optimizer and schedule hyper-parameters: on resume, the new value wins
LAYOUT = "layout"  # how the run is split over processes: reset in the one-process comparison
OUTPUT = "output"  # what the run writes, loads or checks: reset in the one-process comparison
RUN = "run"  # the rest (batches, seed, kernels, recomputation): kept by the comparison run
KINDS = (MODEL, DATA, PRECISION, OPTIMIZER, LAYOUT, OUTPUT, RUN)


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool, and not inf or NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


FP32_MAX = 3.4028234663852886e38  # float32's largest finite value (no torch here)

positive = Check("an integer >= 1", lambda v: is_int(v) and v >= 1)
non_negative = Check("an integer >= 0", lambda v: is_int(v) and v >= 0)
positive_number = Check("a finite number > 0", lambda v: is_number(v) and v > 0)
non_negative_number = Check("a finite number >= 0", lambda v: is_number(v) and v >= 0)
# A loss scale is held in float32: inf (or a value float32 rounds to inf) never backs off.
loss_scale_number = Check(
    "a number > 0 that is finite in float32 (at most 3.4e38)",
    lambda v: is_number(v) and 0 < v <= FP32_MAX,
)
unit_interval = Check("in [0, 1)", lambda v: is_number(v) and 0 <= v < 1)


def one_of(choices: Sequence[str]) -> Check:
    """The value is one of ``choices`` ("A or B", "one of A, B, C")."""
    if len(choices) == 2:
        expected = f"{choices[0]} or {choices[1]}"
    else:
        expected = f"one of {', '.join(choices)}"
    return Check(expected, lambda v: v in choices)


# The library configs an option may set (``Sets.target``).
TRANSFORMER_CONFIG = "TransformerConfig"
GPT_MODEL = "GPTModel"
LORA_CONFIG = "LoRAConfig"
DDP_CONFIG = "DistributedDataParallelConfig"
SCHEDULER = "OptimizerParamScheduler"
TARGETS = (TRANSFORMER_CONFIG, GPT_MODEL, LORA_CONFIG, DDP_CONFIG, SCHEDULER)


@dataclass(frozen=True)
class Sets:
    """A library field an option sets: ``field`` of ``target`` (one of ``TARGETS``), whose
    value is ``value(config, layout)`` (None: the option's own value, or the layout's field
    of the option's name when ``from_layout``), set only where ``when(config)`` is True
    (None: always)."""

    field: str
    target: str = TRANSFORMER_CONFIG
    value: Optional[Callable[[Any, Any], Any]] = None
    when: Optional[Callable[[Any], bool]] = None
    from_layout: bool = False

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"Sets {self.field}: target must be one of {TARGETS}")


@dataclass(frozen=True)
class Option:
    """The command line of one config field (see ``option``)."""

    flags: Tuple[str, ...]
    help: str
    kind: str = RUN
    check: Optional[Check] = None
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[Sequence[str]] = None
    nargs: Union[None, int, str] = None
    metavar: Union[None, str, Tuple[str, ...]] = None
    one_or_list: bool = False  # nargs "+": one value is kept as the value, not a 1-list
    library: Tuple[Sets, ...] = ()  # the library fields it sets

    @property
    def flag(self) -> str:
        """The flag that names the option in errors."""
        return self.flags[0]


def option(
    default: Any,
    *flags: str,
    kind: str,
    help: str,
    check: Optional[Check] = None,
    type: Optional[Callable[[str], Any]] = None,
    choices: Optional[Sequence[str]] = None,
    nargs: Union[None, int, str] = None,
    metavar: Union[None, str, Tuple[str, ...]] = None,
    one_or_list: bool = False,
    library: Union[None, str, Sets, Sequence[Sets]] = None,
) -> Any:
    """A dataclass field with its command line: ``flags`` (the first names it in errors),
    its ``kind`` (one of ``KINDS``), ``help``, and ``check`` on its own value (skipped when
    the value is None and the default is None). A bool default makes a switch:
    ``store_true`` for False, ``store_false`` for True. The value type is ``type``, else the
    default's type. ``library``: the library field(s) it sets (a name: that
    ``TransformerConfig`` field, with the option's value)."""
    if not flags or not all(f.startswith("--") for f in flags):
        raise ValueError(f"option: flags must start with '--', got {flags!r}")
    if kind not in KINDS:
        raise ValueError(f"option {flags[0]}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if library is None:
        sets: Tuple[Sets, ...] = ()
    elif isinstance(library, (str, Sets)):
        sets = (Sets(library) if isinstance(library, str) else library,)
    else:
        sets = tuple(library)
    spec = Option(tuple(flags), help, kind, check, type, choices, nargs, metavar, one_or_list, sets)
    return field(default=default, metadata={"option": spec})


def option_of(config_field: Field) -> Option:
    """The ``Option`` a field was declared with."""
    return config_field.metadata["option"]


def fields_of_kind(config_class: Type, *kinds: str) -> Tuple[str, ...]:
    """The names of ``config_class``'s fields of any of ``kinds``, in declaration order."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"fields_of_kind: unknown kinds {unknown}; expected {', '.join(KINDS)}")
    return tuple(f.name for f in fields(config_class) if option_of(f).kind in kinds)


def library_table(config_class: Type, target: str) -> List[Tuple[str, Sets]]:
    """``(option field, Sets)`` of each library field of ``target`` the options set, in
    declaration order."""
    return [
        (f.name, sets)
        for f in fields(config_class)
        for sets in option_of(f).library
        if sets.target == target
    ]


def library_values(
    config: Any, layout: Any, target: str, only: Optional[Collection[str]] = None
) -> Dict[str, Any]:
    """The keywords of ``target`` that ``config``'s options (those named in ``only``, None:
    all) set (``Sets``), at ``layout``."""
    values: Dict[str, Any] = {}
    for name, sets in library_table(type(config), target):
        if only is not None and name not in only:
            continue
        if sets.when is not None and not sets.when(config):
            continue
        if sets.value is not None:
            values[sets.field] = sets.value(config, layout)
        else:
            values[sets.field] = getattr(layout if sets.from_layout else config, name)
    return values


def library_names(config_class: Type, targets: Sequence[str] = TARGETS) -> Dict[str, str]:
    """Library field -> the option field that sets it, for each field of ``targets`` set from
    an option of another name (the first option declaring it wins)."""
    names: Dict[str, str] = {}
    for config_field in fields(config_class):
        for sets in option_of(config_field).library:
            if sets.field != config_field.name and sets.target in targets:
                names.setdefault(sets.field, config_field.name)
    return names


def build_parser(
    config_class: Type, prog: str, description: str, sections: Mapping[str, str]
) -> argparse.ArgumentParser:
    """The parser of ``config_class``: one option per field (dest = the field name, default
    = the field's default), in ``--help`` sections opened by the fields named in
    ``sections`` (field name -> section title). A mistake raises ``UsageError``."""
    parser = _Parser(prog=prog, description=description, formatter_class=HelpFormatter)
    groups: Dict[str, argparse._ArgumentGroup] = {}
    section = None
    for config_field in fields(config_class):
        section = sections.get(config_field.name, section)
        if section not in groups:
            groups[section] = parser.add_argument_group(section)
        _add_option(groups[section], config_field)
    return parser


def parse(parser: argparse.ArgumentParser, config_class: Type, argv: Optional[Sequence[str]]):
    """``argv`` parsed by ``parser`` (from ``build_parser``) into a ``config_class``."""
    args = vars(parser.parse_args(argv))
    for config_field in fields(config_class):
        value = args[config_field.name]
        if option_of(config_field).one_or_list and isinstance(value, list) and len(value) == 1:
            args[config_field.name] = value[0]
    return config_class(**args)


def explicit_fields(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """The fields that ``argv`` gives explicitly (whatever their value), sorted."""
    parser = copy.deepcopy(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(parser.parse_args(argv)))


def command_line(config: Any) -> List[str]:
    """The flags that ``parse`` turns back into ``config`` (defaults left out)."""
    argv: List[str] = []
    for config_field in fields(config):
        value, default = getattr(config, config_field.name), config_field.default
        if value == default:
            continue
        flag = option_of(config_field).flag
        if isinstance(default, bool):
            argv.append(flag)
        elif value is None:
            raise ValueError(f"{flag}: None cannot be written as a flag (default {default!r})")
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def check_fields(config: Any) -> None:
    """Each field's own check, in declaration order (``UsageError`` naming the flag, what
    was expected and the value); switches must be True or False."""
    for config_field in fields(config):
        spec, value = option_of(config_field), getattr(config, config_field.name)
        if isinstance(config_field.default, bool):
            if not isinstance(value, bool):
                raise UsageError(f"{spec.flag} must be True or False, got {value!r}")
        elif spec.check is not None and not (value is None and config_field.default is None):
            if not spec.check.test(value):
                raise UsageError(f"{spec.flag} must be {spec.check.expected}, got {value!r}")


def _add_option(group: argparse._ArgumentGroup, config_field: Field) -> None:
    """Add the argparse option of one field."""
    spec, default = option_of(config_field), config_field.default
    if default is MISSING:
        raise TypeError(f"{config_field.name}: an option needs a default")
    if isinstance(default, bool):
        action = "store_false" if default else "store_true"
        group.add_argument(*spec.flags, dest=config_field.name, action=action, help=spec.help)
        return
    kind = spec.type or (None if default is None else type(default))
    extras: Dict[str, Any] = {}
    for name in ("choices", "nargs", "metavar"):
        if getattr(spec, name) is not None:
            extras[name] = getattr(spec, name)
    if kind is not None:
        extras["type"] = kind
    group.add_argument(
        *spec.flags, dest=config_field.name, default=default, help=spec.help, **extras
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line raised as ``UsageError`` (reported as
    one line, once per launch) instead of printing the usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{message} (--help lists the options)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show the default of options that take a value (not of switches, not of None)."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)
