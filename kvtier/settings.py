"""Typed settings: a dataclass field per setting, each a flag, an environment variable and a TOML key.

Shared by ``kvtierd`` (``kvtier.daemon.config.Config``), ``kvtier route-server``
(``RouteServerConfig``, with ``RouterConfig`` and ``ScorerConfig`` of ``kvtier.client.routing``)
and ``kvtier gateway`` (``GatewayConfig``), so that every knob is declared once, where it is
used, with one name, one default and one doc line. README.md's configuration reference is
made from the same declarations (``scripts/config_reference.py``).

Declaring
    A setting is a dataclass field made by :func:`setting`: its default, its doc line, the
    function that parses it (from a flag's or variable's text, or a TOML value) and a metavar.
    Its *name* is the field's name unless ``name=`` says otherwise (a list field called
    ``daemons`` whose flag repeats as ``--daemon``). A field made by :func:`group` holds a
    nested settings dataclass, one subsystem's settings under a title (kvtierd's disk tier, the
    router's scorer); its settings keep their own names, flattened beside the others: grouping
    changes no flag, variable or key. :func:`flat_access` also makes each grouped setting an
    attribute of the outer class (``cfg.disk_dir`` for ``cfg.disk.disk_dir``).

Surfaces
    Setting ``host_capacity`` under the prefix ``KVTIER_`` is the flag ``--host-capacity``, the
    variable ``KVTIER_HOST_CAPACITY`` and the TOML key ``host_capacity`` in the file named by
    the setting ``config`` (itself a flag and a variable, not a key). A flag beats a variable
    beats the file beats the default. A list setting (``repeat=True``) repeats its flag; in a
    variable its items are separated by commas; in TOML it is an array (or a comma string).
    A boolean setting (parsed by :func:`parse_bool`) is a switch: ``--insecure-tcp`` sets it,
    ``--no-insecure-tcp`` clears it; its variable and key take ``true`` or ``false``. The
    form ``--insecure-tcp true|false`` (or ``=VALUE``) is still taken, with a warning on
    stderr naming the switch, and will be removed in the next release (:class:`Parser`).

Errors
    :class:`SettingsError` names the setting and where the bad value came from (the flag, the
    variable or the file and key).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import tomllib

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}

CONFIG = "config"
"""The name of the setting that names the TOML file."""


class SettingsError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


# -- parsers: text (a flag, a variable) or a TOML value -> the field's value ------------------

def parse_size(text: str | int) -> int:
    """``"64GiB"`` -> 68719476736; plain integers are bytes. Raises ValueError with the input."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 8GiB, 512MiB, 100MB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """68719476736 -> ``"64GiB"``: the largest binary unit that divides ``n``; bytes otherwise
    (the inverse of :func:`parse_size`)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_int(text: str | int) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_float(text: str | float) -> float:
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    try:
        return float(str(text).strip())
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def parse_list(value: str | Sequence[str]) -> tuple[str, ...]:
    """A comma-separated string (a variable) or a list (TOML, repeated flags) -> a tuple."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return tuple(x.strip() for x in items if x.strip())


# -- declaring ---------------------------------------------------------------------------------

def setting(default: Any, help: str, parse: Callable[[Any], Any] = str, metavar: str | None = None, *,
            name: str | None = None, repeat: bool = False) -> Any:
    """A settings dataclass field (see the module docstring). ``repeat``: a list setting (its
    default a tuple); ``name``: the flag, variable and TOML name when not the field's."""
    return field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar, "name": name,
                                            "repeat": repeat})


def group(cls: type, title: str = "") -> Any:
    """A field holding a nested settings dataclass (its default: ``cls()``), flattened;
    ``title`` names its subsystem in the configuration reference."""
    return field(default_factory=cls, metadata={"group": cls, "title": title})


@dataclass(frozen=True)
class Setting:
    """One setting as the command line, the environment and the TOML file see it."""

    name: str                   # host_capacity: --host-capacity, PREFIX + HOST_CAPACITY, host_capacity
    path: tuple[str, ...]       # attribute path from the outer dataclass: ("scorer", "queued_weight")
    default: Any
    help: str
    parse: Callable[[Any], Any]
    metavar: str | None
    repeat: bool
    section: str = ""           # the title of the group it is declared in ("": the outer dataclass)

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def switch(self) -> bool:
        """A boolean setting: the flags ``--NAME`` and ``--no-NAME``."""
        return self.parse is parse_bool and not self.repeat

    @property
    def shown_default(self) -> str:
        """The default as it is written on the command line: ``8GiB``, ``true``, ``unset``."""
        if self.repeat:
            return ",".join(str(v) for v in self.default) or "none"
        if self.default == "":
            return "unset"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if self.parse is parse_size:
            return format_size(self.default)
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_of(cls: type, path: tuple[str, ...] = (), section: str = "") -> list[Setting]:
    """Every setting of the dataclass ``cls``, groups flattened, in declaration order."""
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        md = f.metadata
        if "group" in md:
            out.extend(settings_of(md["group"], (*path, f.name), md["title"] or section))
        elif "help" in md:
            out.append(Setting(md["name"] or f.name, (*path, f.name), f.default, md["help"], md["parse"],
                               md["metavar"], md["repeat"], section))
    return out


def flat_access(cls: type) -> type:
    """Class decorator: every setting of a group of the settings dataclass ``cls`` is also a
    property of ``cls`` named as its field, read and written through the group
    (``cfg.host_capacity`` is ``cfg.host.host_capacity``). Raises TypeError when such a name
    is taken."""
    taken = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
    for s in settings_of(cls):
        if len(s.path) == 1:
            continue
        attr = s.path[-1]
        if attr in taken:
            raise TypeError(f"{cls.__name__}: {attr!r} of group {'.'.join(s.path[:-1])} is taken")
        taken.add(attr)
        setattr(cls, attr, _through(s.path))
    return cls


def _through(path: tuple[str, ...]) -> property:
    *groups, attr = path

    def owner(obj: Any) -> Any:
        for g in groups:
            obj = getattr(obj, g)
        return obj

    def get(self: Any) -> Any:
        return getattr(owner(self), attr)

    def put(self: Any, value: Any) -> None:
        setattr(owner(self), attr, value)

    return property(get, put, doc=f"``{'.'.join(path)}``")


def _build(cls: type, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if "group" in f.metadata:
            kwargs[f.name] = _build(f.metadata["group"], values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    return cls(**kwargs)


# -- switches ---------------------------------------------------------------------------------

def is_bool_word(text: str) -> bool:
    """Whether :func:`parse_bool` takes ``text``."""
    try:
        parse_bool(text)
    except ValueError:
        return False
    return True


class Parser(argparse.ArgumentParser):
    """argparse's parser, with switches (:meth:`add_switch`): ``--NAME`` sets a boolean,
    ``--no-NAME`` clears it, neither takes a value. The older forms ``--NAME true|false`` and
    ``--NAME=VALUE`` are still taken for one release: each is read as the switch it means,
    with a warning on stderr naming it. Only a boolean word (true, false, yes, no, on, off, 1,
    0) after ``--NAME`` is taken as its value, so a switch never swallows a positional
    argument; after ``--`` nothing is read as a switch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._switches: dict[str, str] = {}  # --NAME -> --no-NAME

    def add_switch(self, flag: str, container: Any = None, **kwargs: Any) -> argparse.Action:
        """``--NAME`` and ``--no-NAME`` (``flag``: ``--NAME``), in ``container`` (an argument
        group of this parser; default the parser); ``kwargs`` as for :meth:`add_argument`
        (``dest``, ``default``, ``help``)."""
        action = (container or self).add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        self._switches[flag] = "--no-" + flag[2:]
        return action

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._switch_forms(args), namespace)

    def _switch_forms(self, args: list[str]) -> list[str]:
        """``args`` with each ``--NAME true|false`` and ``--NAME=VALUE`` of a switch written as
        ``--NAME`` or ``--no-NAME``, warning of each."""
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                out.extend(args[i:])
                break
            name, eq, value = arg.partition("=")
            flag, given = self._switch_of(name), arg
            if flag is not None and not eq and i + 1 < len(args) and is_bool_word(args[i + 1]):
                value, eq, given = args[i + 1], "=", f"{arg} {args[i + 1]}"
                i += 1
            if flag is None or not eq:
                out.append(arg)
                i += 1
                continue
            try:
                on = parse_bool(value)
            except ValueError as e:
                self.error(f"argument {flag}: {e}")
            new = flag if on else self._switches[flag]
            print(f"{self.prog}: warning: '{given}' is deprecated and will be removed in the next "
                  f"release: use {new}", file=sys.stderr)
            out.append(new)
            i += 1
        return out

    def _switch_of(self, name: str) -> str | None:
        """The switch ``--NAME`` that the option ``name`` is (or abbreviates, as argparse
        allows), else None."""
        if name in self._switches:
            return name
        if not self.allow_abbrev or not name.startswith("--") or len(name) < 3:
            return None
        matches = [o for o in self._option_string_actions if o.startswith(name)]
        return matches[0] if len(matches) == 1 and matches[0] in self._switches else None


# -- the command line, the environment and the file --------------------------------------------

class Settings:
    """The flags, variables and TOML keys of one settings dataclass ``cls`` (with a ``config``
    setting naming its TOML file), under the variable prefix ``env_prefix``."""

    def __init__(self, cls: type, env_prefix: str, prog: str, description: str = "",
                 epilog: str | None = None) -> None:
        self.cls, self.env_prefix, self.prog = cls, env_prefix, prog
        self.description, self.epilog = description, epilog
        self.settings = settings_of(cls)
        self.by_name = {s.name: s for s in self.settings}
        flags = [s.flag for s in self.settings] + ["--no-" + s.flag[2:] for s in self.settings if s.switch]
        if len(self.by_name) != len(self.settings) or len(set(flags)) != len(flags):
            raise TypeError(f"{cls.__name__}: two settings share a name or a flag")

    def env_name(self, name: str) -> str:
        return self.env_prefix + name.upper()

    def parser(self) -> Parser:
        """Every setting a flag, a boolean one a switch (default None: "not given"), its help
        ending in its variable and default; a group's settings under its title."""
        ap = Parser(prog=self.prog, description=self.description, epilog=self.epilog,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
        sections: dict[str, Any] = {}
        for s in self.settings:
            where = sections.setdefault(s.section, ap.add_argument_group(s.section) if s.section else ap)
            if s.repeat:
                extra = f"env {self.env_name(s.name)}, comma-separated; default {s.shown_default}"
            elif s.switch:
                extra = f"env {self.env_name(s.name)}=true|false; default {s.shown_default}"
            else:
                extra = f"env {self.env_name(s.name)}; default {s.shown_default}"
            text = f"{s.help} [{extra}]".replace("%", "%%")
            if s.switch:
                ap.add_switch(s.flag, where, dest=s.name, default=None, help=text)
            else:
                where.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar,
                                   action="append" if s.repeat else "store", help=text)
        return ap

    def load(self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Any:
        """Flags (``argv``), the variables (``env``) and the TOML file into an instance of the
        dataclass (flag > variable > file > default; ``env`` defaults to ``os.environ``). Raises :class:`SettingsError`; a flag
        argparse cannot parse exits as argparse does."""
        env = os.environ if env is None else env
        ns = self.parser().parse_args(argv)
        values: dict[tuple[str, ...], Any] = {}
        cfg_path = getattr(ns, CONFIG, None) or env.get(self.env_name(CONFIG), "")
        if cfg_path:
            self._load_file(cfg_path, values)
        for s in self.settings:
            raw = env.get(self.env_name(s.name))
            if raw is not None and s.name != CONFIG:
                values[s.path] = _parse(s, raw, self.env_name(s.name))
        for s in self.settings:
            raw = getattr(ns, s.name)
            if raw is not None:
                values[s.path] = _parse(s, raw, s.flag)
        if CONFIG in self.by_name:
            values[self.by_name[CONFIG].path] = cfg_path
        return _build(self.cls, values)

    def load_or_exit(self, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                     check: Callable[[Any], None] | None = None) -> Any:
        """:meth:`load`, then ``check(settings)`` (which raises :class:`SettingsError`); on an
        error, print it after the program's name and exit with status 2, as argparse does."""
        try:
            loaded = self.load(argv, env)
            if check is not None:
                check(loaded)
        except SettingsError as e:
            print(f"{self.prog}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return loaded

    def _load_file(self, path: str, values: dict[tuple[str, ...], Any]) -> None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise SettingsError(f"config file {path}: {e}") from None
        for key, raw in data.items():
            s = self.by_name.get(key)
            if s is None or key == CONFIG:
                raise SettingsError(f"config file {path}: unknown key {key!r}; known: "
                                    f"{', '.join(sorted(n for n in self.by_name if n != CONFIG))}")
            values[s.path] = _parse(s, raw, f"{path}: {key}")


def _parse(s: Setting, raw: Any, origin: str) -> Any:
    try:
        return s.parse(raw)
    except (ValueError, TypeError) as e:
        raise SettingsError(f"{origin}: {e}") from None
