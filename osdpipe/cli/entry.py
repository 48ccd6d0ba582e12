"""The ``osdpipe`` console script: answer what needs no config at once, else run the command
(:mod:`osdpipe.cli.compose`).

Python alone starts in about 0.1 s here; Hydra's import and its two
compositions of the config take most of a second, torch two more. So:

* ``--version``, ``--help`` and the subcommands that start no ranks and
  compose no config (``check``, ``inspect``) are answered here, before Hydra
  is imported (:func:`version_line`, :func:`help_text`);
* the command line's plain overrides are checked against the schema
  alone (:func:`plain_overrides`, :func:`osdpipe.spec.config.check_overrides`):
  a mistyped value or an unknown key is said in a third of a second, where
  Hydra would take most of one to compose the config first;
* then the ranks' fork server starts, unless the command line says no local
  ranks will start (``--cfg``, offline with an input, torchrun: see
  :func:`osdpipe.core.rankserver.ranks_may_start`), so that its imports (torch among
  them) run while this process imports Hydra, composes the config and
  checks the model (see :mod:`osdpipe.core.rankserver`); :mod:`osdpipe.cli.compose`
  imports torch only once the composed config has passed its schema check;
* a command that imported torch ends without tearing the interpreter down
  (:func:`_end`): that takes about a second and does nothing for the user;
* a command stopped by SIGINT (Ctrl-C) or SIGTERM says so in one line, exits with 128 plus the signal's number (as
  a shell says a process the signal killed), and removes the job directories it made and had written nothing into
  (:func:`osdpipe.cli.new_dirs.discard_all`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import re
import signal
import sys
import threading
from string import Template
from typing import Any

from osdpipe.core.version import __version__

#: ``osdpipe <name> ...``: the function that runs it, given the remaining arguments, and returns the exit code.
SUBCOMMANDS = {"check": "osdpipe.cli.check:run_check", "inspect": "osdpipe.cli.inspect:run_inspect"}

#: The words that ask for help (Hydra's own spelling); alone on the command line they are answered here.
HELP = ("--help", "-h")
#: The exit code of a bad command line or config (as :data:`osdpipe.cli.compose.EXIT_CONFIG`).
EXIT_CONFIG = 2


def version_line() -> str:
    """``osdpipe X (torch Y, hydra Z)``, from the installed packages' metadata: importing torch and Hydra would take
    seconds."""
    from importlib.metadata import PackageNotFoundError, version  # about 20 ms: only --version reads package metadata

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return f"osdpipe {__version__} (torch {installed('torch')}, hydra {installed('hydra-core')})"


def help_text() -> str | None:
    """What ``osdpipe --help`` prints: the help template of ``conf/config.yaml`` with its config groups, read without
    Hydra.

    Hydra's own ``--help`` composes the config once per group and option to
    list them (about a second here); the groups are the directories of the
    config package and their options its YAML files, which is all this reads.
    ``None`` when the template asks for more than the groups (Hydra's
    ``$CONFIG``, ``$FLAGS_HELP``, an interpolation): then Hydra answers.
    ``tests/cli/test_startup.py`` holds this text against Hydra's.
    """
    from importlib.resources import files  # only --help reads the packaged config

    import yaml  # PyYAML: what OmegaConf reads YAML with, a fraction of Hydra's import

    conf = files("osdpipe.conf")
    template = (
        (yaml.safe_load(conf.joinpath("config.yaml").read_text()).get("hydra") or {}).get("help", {}).get("template")
    )
    if not isinstance(template, str) or "${" in template:
        return None
    groups = []
    for group in sorted(_config_groups(conf)):
        options = sorted(_options(conf, group))
        groups.append(f"{group}: {', '.join(options)}\n")
    try:
        return Template(template).substitute(APP_CONFIG_GROUPS="".join(groups))
    except (KeyError, ValueError):
        return None


def _config_groups(conf: Any, parent: str = "") -> list[str]:
    """The config groups under ``parent``, as Hydra names them (``model``, ``a/b``): directories that hold a YAML file,
    at any depth."""
    groups = []
    node = conf.joinpath(parent) if parent else conf
    for entry in node.iterdir():
        if not entry.is_dir() or entry.name in ("__pycache__", "hydra"):
            continue
        group = f"{parent}/{entry.name}" if parent else entry.name
        if _options(conf, group):
            groups.append(group)
        groups += _config_groups(conf, group)
    return groups


def _options(conf: Any, group: str) -> list[str]:
    return [
        f.name.removesuffix(".yaml")
        for f in conf.joinpath(group).iterdir()
        if f.is_file() and f.name.endswith(".yaml")
    ]


#: Values Hydra reads as a bool (in any case), an int, a float, or a plain string (a name, a path, ``module:function``).
_BOOL = ("true", "false")
_INT = re.compile(r"[+-]?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[+-]?[0-9]+\.[0-9]+")
_WORD = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:@-]*")


def plain_overrides(args: list[str]) -> dict[str, Any] | None:
    """The command line's ``key=value`` overrides whose values are plain, typed as Hydra types them; ``None`` for a
    sweep or a flag.

    Plain values are a bool, an int, a float or a string of name and path
    characters; anything else (a list, a sweep ``a,b``, ``null``, ``inf``,
    an interpolation, quotes, ``1_000``) is left to Hydra, as are ``+key``,
    ``~key`` and every flag (``-m`` runs each job apart, ``--cfg`` validates
    nothing). ``tests/cli/test_startup.py`` holds the typing against Hydra's parser.
    """
    if any(a.startswith("-") for a in args):
        return None
    values: dict[str, Any] = {}
    for arg in args:
        key, equals, text = arg.partition("=")
        if not equals or not key or key[0] in "+~":
            continue
        if text.lower() in _BOOL:
            values[key] = text.lower() == "true"
        elif _INT.fullmatch(text):
            values[key] = int(text)
        elif _FLOAT.fullmatch(text):
            values[key] = float(text)
        elif _WORD.fullmatch(text) and text.lower() not in ("null", "inf", "nan"):
            values[key] = text
    return values


def _check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse a command line whose overrides the schema refuses on their own
    (:func:`osdpipe.spec.config.check_overrides`), as the command would, before Hydra is imported."""
    # pydantic: not on --help's and --version's path
    from osdpipe.spec.config import ConfigError, UnknownKey, check_overrides

    try:
        check_overrides(overrides)
    except UnknownKey as exc:
        print(f"osdpipe: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"osdpipe: error: config: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


class Stopped(BaseException):
    """The command was sent SIGTERM (SIGINT raises :class:`KeyboardInterrupt`): like it, no ``Exception``, which the
    command's own handlers would say as a failure of the job."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def main() -> None:
    """The console script (see the module docstring); exits with the command's exit code."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if on_main_thread else None
    try:
        try:
            _dispatch(sys.argv[1:])
        except (KeyboardInterrupt, Stopped) as exc:
            sys.exit(_stopped(exc.signum if isinstance(exc, Stopped) else signal.SIGINT))
    except SystemExit as exc:
        if "torch" in sys.modules and _owns_the_process():
            _end(exc.code)
        raise
    finally:
        if previous is not None:  # a handler set outside Python reads as None and cannot be set again
            signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int) -> int:
    """Say that a signal stopped the command, remove the job directories it made that are still empty, and give the
    exit code: 128 plus the signal's number."""
    from osdpipe.cli import new_dirs  # os and pathlib alone

    new_dirs.discard_all()
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"osdpipe: error: stopped by {name}; run the command again to convert", file=sys.stderr, flush=True)
    return 128 + signum


def _dispatch(args: list[str]) -> None:
    if args[:1] and args[0] in SUBCOMMANDS:
        module, _, function = SUBCOMMANDS[args[0]].partition(":")
        sys.exit(getattr(importlib.import_module(module), function)(args[1:]))
    if "--version" in args:
        print(version_line())
        return
    if args and all(a in HELP for a in args):
        text = help_text()
        if text is not None:
            print(text)
            return
    overrides = plain_overrides(args)
    if overrides:
        _check_overrides(overrides)
    from osdpipe.core.rankserver import start_early  # multiprocessing: only a command that may start ranks

    start_early(args)
    from osdpipe.cli.compose import main as command  # Hydra: most of a second, past every early answer

    command()


def _owns_the_process() -> bool:
    """Whether this call is the whole process: the ``osdpipe`` script or ``python -m osdpipe``, not a caller that goes
    on (a test driver)."""
    return getattr(sys.modules.get("__main__"), "main", None) is main


def _end(code: Any) -> None:
    """End the process now, as ``sys.exit(code)`` would, but without tearing down the interpreter.

    Everything the command wrote is closed by now; the exit handlers still run
    (they stop the fork server and flush the logs). What is skipped is
    unloading every module: about a second with torch loaded, on a
    conversion that itself takes a few.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away, or a stream a caller closed
            stream.flush()
    os._exit(status)
