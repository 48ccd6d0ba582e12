"""Every ``osdpipe`` command the README and ``docs/`` show is one the command line accepts, so the docs cannot drift
from the CLI.

Each command in a fenced code block is composed and validated as the
command does it (Hydra's composition of ``osdpipe.conf``, then
:func:`osdpipe.spec.config.check_schema`: unknown keys, bad values, groups,
rules between keys), without running a conversion. What a command leaves to
the reader is filled in first: ``inspect``'s placeholders (``target.world_size=M``, ``OUT_DIR``,
``PACKAGE.MODULE:FUNCTION``), and each path it names,
which stands for the reader's own files, by one that exists here. A sweep
(``-m``, ``a,b``) is checked with its first value. ``inspect`` and
``check`` must be subcommands, and ``check``'s overrides keys of the config.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from osdpipe.cli.compose import job_config, open_dict_overrides
from osdpipe.spec.config import ConfigError, check_schema

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: The subcommands and the options they take, as ``osdpipe/cli/entry.py`` dispatches them.
SUBCOMMANDS = {"inspect": {"--json", "--key", "--help"}, "check": {"--load", "--help"}}
#: Keys whose value is a path the reader supplies.
PATH_KEYS = ("input.path", "output.path")


def shown_commands(text: str) -> list[str]:
    """The ``osdpipe`` commands in ``text``'s fenced code blocks: continuation lines joined, comments dropped, each
    command of a ``&&`` chain."""
    commands, in_block, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        for part in re.split(r"&&|\|\|", pending):
            words = part.strip().removeprefix("$ ")
            if words == "osdpipe" or words.startswith("osdpipe "):
                commands.append(words.split(" #", 1)[0].strip())
        pending = ""
    return commands


def _composed(overrides: list[str]) -> object:
    with initialize_config_module(version_base="1.3", config_module="osdpipe.conf"):
        return compose("config", overrides=open_dict_overrides(overrides))


def _filled(args: list[str], here: Path) -> list[str]:
    out = []
    for arg in args:
        key, equals, value = arg.partition("=")
        if equals and key.lstrip("+") in PATH_KEYS:
            value = str(here / "path")
        value = "2" if (key, value) == ("target.world_size", "M") else value.replace("OUT_DIR", str(here / "out"))
        value = value.replace("PACKAGE.MODULE:FUNCTION", "userlm:build")
        if equals and "," in value and not value.startswith(("[", "{", "'", '"')):
            value = value.split(",", 1)[0]  # a sweep's first value
        out.append(f"{key}{equals}{value}" if equals else arg)
    return out


def command_problems(command: str, here: Path) -> list[str]:
    """What the command line would refuse in ``command`` (empty: it composes and validates)."""
    try:
        args = shlex.split(command)[1:]
    except ValueError as exc:
        return [f"{command}: {exc}"]
    if args[:1] and args[0] in SUBCOMMANDS:
        options = {a for a in args[1:] if a.startswith("-")}
        problems = [f"{command}: osdpipe {args[0]} takes no {o}" for o in sorted(options - SUBCOMMANDS[args[0]])]
        if args[0] == "check":  # its overrides name keys of the conversion's config
            default = _composed([])
            keys = [a.split("=", 1)[0] for a in args[1:] if "=" in a]
            problems += [
                f"{command}: {key} is no key of the config"
                for key in keys
                if OmegaConf.select(default, key, default=KeyError) is KeyError
            ]
        return problems
    args = [a for a in _filled(args, here) if a not in ("-m", "--multirun")]
    if any(a.startswith("-") for a in args):
        return [f"{command}: options other than -m are not conversions ({[a for a in args if a.startswith('-')]})"]
    try:
        check_schema(job_config(_composed(args), str(here / "run"), args))
    except (HydraException, OmegaConfBaseException, ConfigError) as exc:
        return [f"{command}: {' '.join(str(exc).split())[:300]}"]
    return []


def test_the_pages_show_commands_at_all() -> None:
    shown = {page.name: len(shown_commands(page.read_text())) for page in PAGES}
    # a floor: an extraction that finds none would prove nothing
    assert shown["README.md"] >= 6 and sum(shown.values()) >= 30, shown


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_command_shown_is_one_the_command_line_accepts(page: Path, tmp_path: Path) -> None:
    (tmp_path / "path").mkdir()
    problems = [p for command in shown_commands(page.read_text()) for p in command_problems(command, tmp_path)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("planted", [
    "osdpipe target.world_sise=2 output.path=/ckpt/out",  # a misspelt key
    "osdpipe output.format=zip target.world_size=2",  # a value no format has
    "osdpipe runtime.mode=offline runtime.transfer=scatter",  # a rule between keys
    "osdpipe recipe=no_such_recipe",  # a group option that does not exist
    "osdpipe inspect --jsn /ckpt",  # an option inspect does not take
    "osdpipe check /ckpt input.pth=/x",  # a key check cannot override
])
def test_a_planted_bad_command_is_found(planted: str, tmp_path: Path) -> None:
    (tmp_path / "path").mkdir()
    page = f"Some text.\n\n```bash\n# a comment\n{planted} \\\n        runtime.progress=false\n```\n"
    assert [c.split() for c in shown_commands(page)] == [[*planted.split(), "runtime.progress=false"]]
    assert command_problems(shown_commands(page)[0], tmp_path) != []


def _schema_keys(model: type, prefix: str = "") -> list[str]:
    """Every key of the schema (:class:`osdpipe.spec.config.RunSpec`), as a command line names it: the sections'
    fields, recursively."""
    import typing

    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        sections = [
            a
            for a in (typing.get_args(field.annotation) or (field.annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if sections and typing.get_origin(field.annotation) is not list:
            keys += _schema_keys(sections[0], f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_every_key_of_the_schema_is_one_the_command_line_takes_and_docs_config_lists() -> None:
    """A key the schema has but ``conf/config.yaml`` lacks is refused by the command line as unknown
    (``output.model_keys`` was)."""
    from osdpipe.spec.config import RunSpec

    keys = _schema_keys(RunSpec)
    assert len(keys) > 50 and "output.checkpoint" in keys and "source.mixed_precision.param_dtype" in keys
    default = _composed([])
    assert [k for k in keys if OmegaConf.select(default, k, default=KeyError) is KeyError] == [], (
        "keys conf/config.yaml does not have"
    )
    reference = (REPO / "docs" / "config.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", reference, flags=re.M)
    named = {key for cell in first_cells for key in re.findall(r"`([^`]+)`", cell)}
    # a layout's keys are listed once for source and target (`.kind`); a dict's as `key.*`
    listed = [k for k in keys if k in named or f"{k}.*" in named or "." + k.split(".", 1)[1] in named]
    assert sorted(set(keys) - set(listed)) == [], "keys docs/config.md does not list"


#: A ``pip install`` and its arguments, to the end of the command (``&&``, ``;``, a closing backtick, the line's end).
_PIP_INSTALL = re.compile(r"pip install((?:(?!&&|;|`)[^\n])*)")
#: osdpipe named as a package to fetch (``osdpipe``, ``'osdpipe[cloud]'``, ``osdpipe==1.0``): no index holds it.
_BY_NAME = re.compile(r"osdpipe(?:\[[^\]]*\])?(?:[<>=!~].*)?")


def install_problems(text: str, extras: set[str]) -> list[str]:
    """The ``pip install`` commands of ``text`` that would not install osdpipe from its checkout: one that names the
    package ``osdpipe`` (it is installed from the checkout, ``pip install '.[cloud]'``), or an extra of the checkout
    that ``pyproject.toml`` does not define."""
    problems = []
    for match in _PIP_INSTALL.finditer(text):
        args = match.group(1)
        if any(_BY_NAME.fullmatch(word.strip("'\"")) for word in args.split()):
            problems.append(f"pip install{args}: osdpipe installs from its checkout (pip install '.[extra]')")
        for named in re.findall(r"(?:^|[\s'\"])\.\[([^\]]*)\]", args):
            unknown = sorted({e.strip() for e in named.split(",")} - extras)
            if unknown:
                problems.append(f"pip install{args}: pyproject.toml has no extra {', '.join(unknown)}")
    return problems


def test_every_install_command_shown_installs_from_the_checkout() -> None:
    """osdpipe is not on a package index: ``pip install 'osdpipe[cloud]'`` (docs/running.md's, and the store's error
    line) fails where a user runs it. The pages and the package's own messages say ``pip install '.[cloud]'``."""
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert {"cloud", "test", "frameworks"} <= extras
    sources = [*PAGES, *sorted((REPO / "osdpipe").rglob("*.py"))]
    problems = [f"{p.relative_to(REPO)}: {q}" for p in sources for q in install_problems(p.read_text(), extras)]
    assert problems == [], "\n".join(problems)
    # the check finds what it is for
    assert install_problems("with the `cloud` extra (`pip install 'osdpipe[cloud]'`: s3fs)", extras) != []
    assert install_problems('pip install "osdpipe" && osdpipe', extras) != []
    assert install_problems("pip install -e '.[test,cloudy]'", extras) != []
    assert install_problems("pip install . && cd x && osdpipe; pip install -e '.[test,cloud]'", extras) == []
    assert install_problems("pip install '.[cloud]' in osdpipe's checkout", extras) == []
