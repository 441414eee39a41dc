"""One typed schema per pipeline stage: the CLI flags, the YAML loader, the help text and the checks, from one place.

A stage declares its settings once, as a dataclass whose fields carry a `Spec` (help, group, bounds, flag names)
through `setting(...)`. From it this module generates:

- the typer options of the stage's command (`command_for`): kebab-case `--field-name` unless the spec names the
  flags (existing flags and short aliases are contracts, so a spec can pin them), one rich help panel per group,
  the default and the bounds appended to each help line;
- `--config FILE.yaml` loading (`load_yaml`, through `yaml.safe_load`): keys are field names (snake or kebab case),
  flat or nested under their group (`optim: {lr: 3e-4}`); an unknown key, a key in the wrong group or a value of
  the wrong type is one line naming the file and the field;
- validation: every value, from a flag or from YAML, is converted and checked where it enters, so the error names
  its source: `--steps: must be >= 1, got 0` or `train.yaml: field 'optim.steps': must be >= 1, got 0`. The
  dataclass's `__post_init__` (`check_fields`) runs the same bounds for Python callers.

Why stdlib dataclasses and not pydantic: the trainer and the capture job run on GPU machines whose images carry
typer and PyYAML but not pydantic, and a config is constructed on every run there, so a pydantic schema would mean
shipping its compiled core as wheels to every such machine; the checks needed here (types, bounds, choices) are a
page of code. The configs stay flat (`TrainConfig(lr=...)`, `cfg.lr`) because the trainer, the evaluator, the
benches and the tests construct and read them that way; groups live in each field's spec (help panels, YAML
nesting) instead of nested dataclasses. pydantic stays a declared dependency only for the server's FastAPI models;
nothing here imports it. Values from the command line are parsed here too (typer sees plain strings) so the
conversion and its errors are the same for a flag and for YAML whatever typer version is installed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from draftsmith.common.errors import DraftsmithError


# ------------------------------------------------------------------------------------------------ checks
@dataclass(frozen=True)
class Check:
    """A rule on a value: `holds(value)` is true when the value is acceptable; `says` is the rule in words."""

    says: str
    holds: Callable[[Any], bool]
    choices: tuple[str, ...] = ()  # the accepted values, when they are a list (shown as the option's metavar)
    in_help: bool = True  # append `says` to the option's help line (choices and patterns say it elsewhere)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def at_least(lo: float) -> Check:
    return Check(f">= {_num(lo)}", lambda v: v >= lo)


def above(lo: float) -> Check:
    return Check(f"> {_num(lo)}", lambda v: v > lo)


def at_most(hi: float) -> Check:
    return Check(f"<= {_num(hi)}", lambda v: v <= hi)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """lo <= v <= hi, with either end open: between(0, 1, lo_open=True) is (0, 1]."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"

    def holds(v) -> bool:
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Check(f"in {left}{_num(lo)}, {_num(hi)}{right}", holds)


def one_of(*choices: str) -> Check:
    return Check("one of " + ", ".join(choices), lambda v: v in choices, choices=choices, in_help=False)


def matches(pattern: str, says: str) -> Check:
    """The whole text matches the regular expression `pattern`; `says` names the accepted forms."""
    rx = re.compile(pattern)
    return Check(says, lambda v: isinstance(v, str) and rx.fullmatch(v) is not None, in_help=False)


POSITIVE = above(0)
NON_NEGATIVE = at_least(0)
AT_LEAST_ONE = at_least(1)

# Sampling options (used by `draftsmith generate`/`eval` as well as here): temperature 0 is greedy; top-p is a
# probability mass, so 0 would keep nothing; top-k 0 means no top-k cut.
TEMPERATURE = (NON_NEGATIVE,)
TOP_P = (between(0, 1, lo_open=True),)
TOP_K = (NON_NEGATIVE,)
MAX_NEW_TOKENS = (AT_LEAST_ONE,)
# torch.device names the commands run on ("cuda" alone: this rank's GPU); anything else fails deep inside torch.
DEVICE = matches(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", "auto, cpu, cuda, cuda:N, mps or xpu[:N]")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else (_num(value) if isinstance(value, (int, float)) else str(value))


def check_value(where: str, value: Any, checks: Sequence[Check] = ()) -> None:
    """Raise one line `WHERE: must be RULE, got VALUE` unless every check holds (a None value passes).

    Floats must also be finite: nan passes no bound honestly, and no setting here means anything at inf."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise DraftsmithError(f"{where}: must be a finite number, got {_show(value)}")
    for c in checks:
        try:
            ok = c.holds(value)
        except TypeError:
            ok = False
        if not ok:
            raise DraftsmithError(f"{where}: must be {c.says}, got {_show(value)}")


def check_temperature(where: str, value: float | None) -> None:
    check_value(where, value, TEMPERATURE)


def check_top_p(where: str, value: float | None) -> None:
    check_value(where, value, TOP_P)


def check_top_k(where: str, value: int | None) -> None:
    check_value(where, value, TOP_K)


def check_max_new_tokens(where: str, value: int | None) -> None:
    check_value(where, value, MAX_NEW_TOKENS)


# ------------------------------------------------------------------------------------------------ fields
@dataclass(frozen=True)
class Spec:
    """What the schema knows about one setting beyond its type and default."""

    help: str
    group: str
    checks: tuple[Check, ...] = ()
    flags: tuple[str, ...] = ()  # CLI names (long first); () = --field-name
    negate: bool = False  # a flag that sets a boolean field to False (--no-final, --quiet)
    required: bool = False  # the command needs a value (flag or YAML) although the dataclass has a default
    default_help: str | None = None  # the default in words, where the value alone does not say it
    aliases: tuple[str, ...] = ()  # further YAML keys accepted for this field (older names)
    metavar: str | None = None


def setting(
    default: Any = MISSING,
    *,
    help: str,
    group: str,
    checks: Sequence[Check] = (),
    flags: Sequence[str] = (),
    negate: bool = False,
    required: bool = False,
    default_help: str | None = None,
    aliases: Sequence[str] = (),
    metavar: str | None = None,
) -> Any:
    """A dataclass field with its `Spec`; without a default the field is a required constructor argument."""
    spec = Spec(
        help=help,
        group=group,
        checks=tuple(checks),
        flags=tuple(flags),
        negate=negate,
        required=required,
        default_help=default_help,
        aliases=tuple(aliases),
        metavar=metavar,
    )
    return dataclasses.field(default=default, metadata={"spec": spec})


# A field's type reduced to what the parser needs: one of these kinds, and whether None is allowed.
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list of integers"}


@dataclass(frozen=True)
class FieldInfo:
    name: str
    kind: type  # int | float | str | bool | list (of int)
    optional: bool
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        return self.spec.flags[0] if self.spec.flags else "--" + self.name.replace("_", "-")

    @property
    def has_default(self) -> bool:
        return self.default is not MISSING


def _kind(tp: Any, where: str) -> tuple[type, bool]:
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if len(args) != 1:
            raise TypeError(f"{where}: unsupported type {tp}")
        tp = args[0]
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return list, optional
    if tp in (int, float, str, bool):
        return tp, optional
    raise TypeError(f"{where}: unsupported type {tp}")


def fields_of(schema: type) -> dict[str, FieldInfo]:
    """The schema's settings by name, in declaration order (fields without a Spec are not settings)."""
    cached = schema.__dict__.get("_schema_fields")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        spec = f.metadata.get("spec")
        if spec is None:
            continue
        kind, optional = _kind(hints[f.name], f"{schema.__name__}.{f.name}")
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else MISSING)
        )
        out[f.name] = FieldInfo(f.name, kind, optional, default, spec)
    schema._schema_fields = out
    return out


def groups_of(schema: type) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for info in fields_of(schema).values():
        groups.setdefault(info.spec.group, []).append(info.name)
    return groups


# ------------------------------------------------------------------------------------------------ parsing
def convert(info: FieldInfo, value: Any, where: str) -> Any:
    """`value` (a flag's text or a YAML value) as the field's type, checked; one line naming `where` if not."""
    if value is None:
        if info.optional:
            return None
        raise DraftsmithError(f"{where}: expected {_KIND_WORDS[info.kind]}, got null")
    kind, text = info.kind, isinstance(value, str)
    wrong = DraftsmithError(
        f"{where}: expected {_KIND_WORDS[kind]}, got {_show(value)}" + ("" if text else f" ({type(value).__name__})")
    )
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
    elif kind is int:
        if isinstance(value, bool):
            raise wrong
        if text:
            try:
                value = int(value.strip())
            except ValueError:
                raise wrong from None
        elif not isinstance(value, int):
            raise wrong
    elif kind is float:
        if isinstance(value, bool):
            raise wrong
        if text:  # YAML 1.1 reads `1e-4` (no dot) as a string: it still means the number
            try:
                value = float(value.strip())
            except ValueError:
                raise wrong from None
        elif not isinstance(value, (int, float)):
            raise wrong
        value = float(value)
    elif kind is str:
        if not text:
            raise wrong
    elif kind is list:
        if text:
            items = value.strip().strip("[]").replace(",", " ").split()  # '1,4,7', '1 4 7' or '[1, 4, 7]'
            try:
                value = [int(x) for x in items]
            except ValueError:
                raise DraftsmithError(f"{where}: expected comma-separated integers, got {value!r}") from None
        elif not isinstance(value, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
            raise wrong
        value = list(value)
        if not value:
            raise DraftsmithError(f"{where}: expected at least one integer, got none")
        for x in value:
            check_value(where, x, info.spec.checks)
        return value
    check_value(where, value, info.spec.checks)
    return value


def check_fields(cfg: Any) -> None:
    """Every setting's bounds on a constructed config (Python callers); errors name the flag."""
    for info in fields_of(type(cfg)).values():
        value = getattr(cfg, info.name)
        if value is None or isinstance(value, str) and not info.spec.checks:
            continue
        if info.kind is list:
            for x in value:
                check_value(info.flag, x, info.spec.checks)
        elif info.kind in (int, float) and not isinstance(value, (int, float)):
            try:  # numpy scalars and the like: compare as numbers
                check_value(info.flag, float(value), info.spec.checks)
            except (TypeError, ValueError):
                raise DraftsmithError(f"{info.flag}: expected {_KIND_WORDS[info.kind]}, got {value!r}") from None
        else:
            check_value(info.flag, value, info.spec.checks)


def _norm(key: Any) -> str:
    return str(key).strip().replace("-", "_")


def _lookup(schema: type, key: str) -> str | None:
    fields = fields_of(schema)
    if key in fields:
        return key
    for info in fields.values():
        if key in (_norm(a) for a in info.spec.aliases):
            return info.name
    return None


def _unknown(path: str, dotted: str, key: str, candidates: Sequence[str]) -> DraftsmithError:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "`--help` lists the fields"
    return DraftsmithError(f"{path}: field '{dotted}': unknown ({hint})")


def load_yaml(schema: type, path: str) -> dict[str, Any]:
    """The settings in a YAML file, converted and checked: {field name: value}."""
    p = Path(path)
    if not p.is_file():
        raise DraftsmithError(f"{path}: --config file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DraftsmithError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise DraftsmithError(f"{where}: invalid YAML ({reason})") from None
    if data is None:
        return {}
    groups = groups_of(schema)
    if not isinstance(data, dict):
        raise DraftsmithError(
            f"{path}: expected a mapping of field: value (flat, or nested under the groups {', '.join(groups)})"
        )
    fields = fields_of(schema)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def take(name: str, dotted: str, value: Any) -> None:
        if name in out:
            raise DraftsmithError(f"{path}: field '{dotted}': given twice (also as '{origin[name]}')")
        out[name] = convert(fields[name], value, f"{path}: field '{dotted}'")
        origin[name] = dotted

    for key, value in data.items():
        k = _norm(key)
        name = _lookup(schema, k)
        if k in groups and (isinstance(value, dict) or name is None):
            if not isinstance(value, dict):
                raise DraftsmithError(
                    f"{path}: field '{key}': a group, expected a mapping of its fields, got {_show(value)}"
                )
            for sub, v in value.items():
                s = _norm(sub)
                dotted = f"{key}.{sub}"
                sub_name = _lookup(schema, s)
                if sub_name is None:
                    raise _unknown(path, dotted, s, groups[k])
                if fields[sub_name].spec.group != k:
                    raise DraftsmithError(
                        f"{path}: field '{dotted}': belongs to group '{fields[sub_name].spec.group}', not '{key}'"
                    )
                take(sub_name, dotted, v)
        elif name is None:
            raise _unknown(path, str(key), k, list(fields) + list(groups))
        else:
            take(name, str(key), value)
    return out


# ------------------------------------------------------------------------------------------------ the CLI
def _help(info: FieldInfo) -> str:
    parts = []
    if info.spec.required or not info.has_default:
        parts.append("required")
    elif info.kind is bool and not info.optional and not info.spec.negate and info.default is False:
        pass  # a plain switch: off unless given
    elif info.spec.default_help is not None:
        parts.append(f"default: {info.spec.default_help}")
    elif info.has_default and info.default is not None and info.kind is not bool:
        parts.append(f"default: {_show(info.default) if info.kind is not str else info.default}")
    rules = [c.says for c in info.spec.checks if c.in_help]
    if rules:
        parts.append(("each " if info.kind is list else "") + ", ".join(rules))
    return info.spec.help + (f" ({'; '.join(parts)})" if parts else "")


def _metavar(info: FieldInfo) -> str:
    if info.spec.metavar:
        return info.spec.metavar
    for c in info.spec.checks:
        if c.choices:
            return "[" + "|".join(c.choices) + "]"
    return {int: "INTEGER", float: "FLOAT", str: "TEXT", list: "IDS"}[info.kind]


def _panel(group: str) -> str:
    return {"ttt": "TTT"}.get(group, group.capitalize())


def cli_parameter(info: FieldInfo) -> inspect.Parameter:
    """The typer option of one setting (a value option takes text, converted and checked by `convert`); it
    defaults to None, meaning "not given", so YAML values and the dataclass defaults apply beneath the flag."""
    flags = list(info.spec.flags) or [info.flag]
    kw: dict[str, Any] = {"help": _help(info), "rich_help_panel": _panel(info.spec.group)}
    if info.kind is bool:
        if not info.spec.negate and (info.optional or info.default is not False):
            flags[0] = f"{flags[0]}/--no-{flags[0][2:]}"
        annotation = Optional[bool]
    else:
        annotation = Optional[str]
        kw["metavar"] = _metavar(info)
    return inspect.Parameter(
        info.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=typer.Option(None, *flags, **kw)
    )


def cli_parameters(schema: type) -> list[inspect.Parameter]:
    """One typer option per setting (`cli_parameter`)."""
    return [cli_parameter(info) for info in fields_of(schema).values()]


def config_parameter(stage: str) -> inspect.Parameter:
    return inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Optional[str],
        default=typer.Option(
            None,
            "--config",
            "-c",
            metavar="FILE.yaml",
            rich_help_panel="Config file",
            help=f"YAML file of {stage} settings: field names (as the options below, - or _), "
            "flat or nested under their group (e.g. optim: {lr: 3e-4}); flags override it.",
        ),
    )


def values_from_flags(schema: type, given: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line (None = not given), converted and checked."""
    out = {}
    for name, raw in given.items():
        if raw is None:
            continue
        info = fields_of(schema)[name]
        if info.kind is bool:
            out[name] = (not raw) if info.spec.negate else raw
        else:
            out[name] = convert(info, raw, info.flag)
    return out


def build(schema: type, values: dict[str, Any]) -> Any:
    """The config from settings given (flags over YAML), the required ones checked, then its `check_together`."""
    for info in fields_of(schema).values():
        if (info.spec.required or not info.has_default) and values.get(info.name) in (None, ""):
            raise DraftsmithError(f"{info.flag}: required")
    cfg = schema(**values)
    together = getattr(cfg, "check_together", None)
    if together is not None:
        together()
    return cfg


def command_for(
    schema: type,
    run: Callable[..., None],
    *,
    stage: str,
    doc: str,
    extra: Sequence[inspect.Parameter] = (),
    adjust: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
) -> Callable[..., None]:
    """A typer command whose options are the schema's settings plus `--config` and `extra`.

    It loads `--config`, lets `adjust(flag_values, extras)` map stage-specific extra options into settings given
    by flags, lays those over the file's, builds the config and calls `run(cfg)`."""
    extra_names = [p.name for p in extra]

    def command(**kw: Any) -> None:
        extras = {n: kw.pop(n) for n in extra_names}
        config = kw.pop("config")
        values = load_yaml(schema, config) if config else {}
        flags = values_from_flags(schema, kw)
        if adjust is not None:
            adjust(flags, extras)
        values.update(flags)
        run(build(schema, values))

    command.__signature__ = inspect.Signature([config_parameter(stage), *cli_parameters(schema), *extra])
    command.__doc__ = doc
    command.__name__ = f"{stage}_command"
    return command
