"""Typed settings: a dataclass field per setting, each a flag, an environment variable and a TOML key.

Shared by ``kvtierd`` (``kvtier.daemon.config.Config``) and ``kvtier route-server``
(``RouterConfig`` and ``ScorerConfig`` of ``kvtier.client.routing``), so that every knob is
declared once, where it is used, with one name, one default and one doc line.

Declaring
    A setting is a dataclass field made by :func:`setting`: its default, its doc line, the
    function that parses it (from a flag's or variable's text, or a TOML value) and a metavar.
    Its *name* is the field's name unless ``name=`` says otherwise (a list field called
    ``daemons`` whose flag repeats as ``--daemon``). A field made by :func:`group` holds a
    nested settings dataclass whose settings appear flattened beside the others (the scorer's
    inside the router's).

Surfaces
    Setting ``host_capacity`` under the prefix ``KVTIER_`` is the flag ``--host-capacity``, the
    variable ``KVTIER_HOST_CAPACITY`` and the TOML key ``host_capacity`` in the file named by
    the setting ``config`` (itself a flag and a variable, not a key). A flag beats a variable
    beats the file beats the default. A list setting (``repeat=True``) repeats its flag; in a
    variable its items are separated by commas; in TOML it is an array (or a comma string).

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


def group(cls: type) -> Any:
    """A field holding a nested settings dataclass (its default: ``cls()``), flattened."""
    return field(default_factory=cls, metadata={"group": cls})


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

    @property
    def flag(self) -> str:
        return flag_name(self.name)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_of(cls: type, path: tuple[str, ...] = ()) -> list[Setting]:
    """Every setting of the dataclass ``cls``, groups flattened, in declaration order."""
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        md = f.metadata
        if "group" in md:
            out.extend(settings_of(md["group"], (*path, f.name)))
        elif "help" in md:
            out.append(Setting(md["name"] or f.name, (*path, f.name), f.default, md["help"], md["parse"],
                               md["metavar"], md["repeat"]))
    return out


def _build(cls: type, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if "group" in f.metadata:
            kwargs[f.name] = _build(f.metadata["group"], values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    return cls(**kwargs)


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
        if len(self.by_name) != len(self.settings):
            raise TypeError(f"{cls.__name__}: two settings share a name")

    def env_name(self, name: str) -> str:
        return self.env_prefix + name.upper()

    def parser(self) -> argparse.ArgumentParser:
        """Every setting a flag (default None: "not given"), its help ending in its variable
        and default."""
        ap = argparse.ArgumentParser(prog=self.prog, description=self.description, epilog=self.epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        for s in self.settings:
            if s.repeat:
                shown = ",".join(s.default) or "none"
                extra = f"env {self.env_name(s.name)}, comma-separated; default {shown}"
            else:
                extra = f"env {self.env_name(s.name)}; default {_shown_default(s)}"
            ap.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar,
                            action="append" if s.repeat else "store",
                            help=f"{s.help} [{extra}]".replace("%", "%%"))
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


def _shown_default(s: Setting) -> str:
    """A default as it is written on the command line: ``8GiB``, ``true``, ``unset``."""
    if s.default == "":
        return "unset"
    if isinstance(s.default, bool):
        return str(s.default).lower()
    if s.parse is parse_size:
        return format_size(s.default)
    return str(s.default)


def _parse(s: Setting, raw: Any, origin: str) -> Any:
    try:
        return s.parse(raw)
    except (ValueError, TypeError) as e:
        raise SettingsError(f"{origin}: {e}") from None
