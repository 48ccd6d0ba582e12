"""The summary of a sweep (``osdpipe -m ...``): one row per job, as a table, ``sweep.json`` and ``sweep.png``.

A sweep's jobs each leave a ``report.json``, but one file per job answers
"which configurations work, and what do they cost?" only after a person opens
them all. This module gathers them once the sweep has ended.

The launcher process knows what a report cannot say: a job whose config is
bad writes no report at all (its directory is removed), so the CLI records,
for every job, its overrides, exit code, first error line and wall time
(:class:`JobRecord`; Hydra's basic launcher runs the jobs one after another
in that process). Everything from there on is pure -- rows from records and
report dicts (:func:`job_row`), the table (:func:`table_text`), the
``sweep.json`` dict (:func:`summary_dict`), the matrix the PNG shows
(:func:`matrix_cells`) -- so tests can hold each against the reports
directly. :func:`summarize_sweep` is the one entry point: it reads the
reports, prints the table and writes the files; only :func:`draw_matrix`
imports matplotlib (late, so that a plain run does not pay for it).
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osdpipe.io.store import is_url

#: How a job ended, from best to worst; the colors of the matrix.
OUTCOME_KINDS = ("ok", "check", "stage", "failed", "config")
KIND_LABELS = {
    "ok": "ok",
    "check": "check failed",
    "stage": "stage failed",
    "failed": "failed before the stages",
    "config": "config error",
}
KIND_COLORS = {"ok": "#a6d96a", "check": "#fdae61", "stage": "#d7191c", "failed": "#9e0142", "config": "#bababa"}

#: Override keys that say what is converted: the matrix's rows. Every other key that varies makes its columns.
SOURCE_SIDE = ("source.", "input.", "generate.")

#: What the table's and sweep.json's numbers are, said once in the table's header and in sweep.json.
UNITS = {
    "stage_seconds": "sum of report.json's stage seconds (the conversion itself)",
    "wall_seconds": "the job's wall time in the launcher (config, source generation, worlds, stages)",
    "bytes": "sum of report.json's stage bytes (what the stages read and wrote)",
    "peak_rss": "largest peak RSS among report.json's processes, in bytes",
}

OUTCOME_WIDTH = 72  # characters of an error kept in an outcome: enough to tell failures apart, short enough for a table


@dataclass(frozen=True)
class JobRecord:
    """One job of a sweep as the launcher saw it: what defines it and how it ended.

    ``error`` is the first ``osdpipe: error:`` line the job printed, without
    that prefix; ``output_dir`` is where its ``report.json`` is, if it wrote
    one; ``sweep_dir`` is the sweep's directory, where the summary goes.
    """

    num: int
    overrides: tuple[str, ...]
    exit_code: int
    error: str | None
    wall_seconds: float
    output_dir: str
    sweep_dir: str


# ------------------------------------------------------------------ rows


def split_override(override: str) -> tuple[str, str]:
    """``"+target.world_size=2"`` -> ``("target.world_size", "2")`` (Hydra's ``\\:`` escapes undone)."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value.replace("\\:", ":")


def shown_override(override: str) -> str:
    """An override as a person typed it (``model.factory=pkg:build``, not Hydra's ``pkg\\:build``)."""
    return "=".join(split_override(override))


def shorten(text: str, width: int = OUTCOME_WIDTH) -> str:
    """``text`` up to its first ``;`` or `` (`` (what follows is advice or detail),
    cut at a word to at most ``width`` characters."""
    text = text.split("; ", 1)[0].split(" (", 1)[0].strip()
    if len(text) <= width:
        return text
    cut = text[: width - 1].rsplit(" ", 1)[0]
    return cut.rstrip(" :,") + "…"


def outcome_of(exit_code: int, error: str | None, report: dict | None) -> tuple[str, str]:
    """How a job ended: its kind (one of :data:`OUTCOME_KINDS`) and a few words.

    A bad config (exit code 2) outranks whatever report the directory may
    hold from an earlier run: the job never ran. Otherwise the report says it:
    the stage that failed, or the checks that did not pass.
    """
    if exit_code == 2:
        line = error or "bad config"
        return "config", shorten(line if line.startswith("config:") else f"config: {line}")
    if report is not None and report.get("ok") and exit_code == 0:
        return "ok", "ok"
    if report is not None and report.get("error"):
        return _error_outcome(report["error"])
    if report is not None and not report.get("ok"):
        failed = [c for c in report.get("checks", []) if not c.get("ok")]
        if failed:
            names = ", ".join(c["name"] for c in failed)
            return "check", shorten(f"check {names}: {failed[0].get('detail', '')}")
    return "failed", shorten(f"failed: {error or 'no report.json'}")


def _error_outcome(error: str) -> tuple[str, str]:
    """``stage 'shard' failed on rank 0: the source holds NaN ...`` ->
    ``("stage", "stage shard: the source holds NaN ...")``."""
    if error.startswith("stage '"):
        stage, _, rest = error.removeprefix("stage '").partition("'")
        detail = rest.split(": ", 1)[1] if ": " in rest else rest.strip()
        return "stage", shorten(f"stage {stage}: {detail}")
    return "failed", shorten(f"failed: {error}")


def report_numbers(report: dict | None) -> dict[str, Any]:
    """The numbers a row takes from ``report.json``; ``None`` where it has none (no report, or no stage finished)."""
    stages = (report or {}).get("stages") or []
    memory = (report or {}).get("memory") or []
    return {
        "stage_seconds": round(sum(s["seconds"] for s in stages), 6) if stages else None,
        "bytes": sum(s["bytes"] for s in stages) if stages else None,
        "peak_rss": max(m["peak_rss"] for m in memory) if memory else None,
    }


def job_row(record: JobRecord, report: dict | None) -> dict[str, Any]:
    """One row of the summary: the job, its overrides, its outcome and its numbers."""
    kind, outcome = outcome_of(record.exit_code, record.error, report)
    return {
        "job": record.num,
        "overrides": list(record.overrides),
        "outcome": outcome,
        "kind": kind,
        "exit_code": record.exit_code,
        "error": record.error,
        **report_numbers(report if kind != "config" else None),
        "wall_seconds": round(record.wall_seconds, 3),
        "dir": record.output_dir,
    }


# ------------------------------------------------------------- overrides


def common_overrides(rows: list[dict]) -> list[str]:
    """The overrides every job has (the sweep's fixed settings): said once, not in every row."""
    if not rows:
        return []
    shared = set(rows[0]["overrides"]).intersection(*(r["overrides"] for r in rows[1:]))
    return [o for o in rows[0]["overrides"] if o in shared]


def varying(row: dict, common: list[str]) -> dict[str, str]:
    """The overrides that tell this job from the others, as ``{key: value}`` in command-line order."""
    return dict(split_override(o) for o in row["overrides"] if o not in common)


def varying_keys(rows: list[dict], common: list[str]) -> list[str]:
    """Every key some job sets to its own value, in the order the jobs name them."""
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(varying(row, common)))
    return list(keys)


def shared_directory(column: list[str]) -> str | None:
    """The directory that every value of ``column`` lies under, where all are local paths of one kind (absolute, or
    relative) and it is not one of them; else ``None``: the values are shown whole.

    A URL (``s3://bucket/out``) is not a local path (``os.path`` would fold its ``//``), and an absolute path has no
    directory in common with a relative one (``os.path.commonpath`` refuses the pair): a sweep over
    ``output.path=/local/out,s3://bucket/out`` ended in an internal error before its summary.
    """
    if len(column) < 2 or not all("/" in x and not is_url(x) for x in column):
        return None
    if len({os.path.isabs(x) for x in column}) > 1:
        return None
    prefix = os.path.commonpath(column)
    return prefix if prefix and prefix not in column else None


def shown_values(rows: list[dict], common: list[str]) -> list[dict[str, str]]:
    """Each row's varying overrides as a person reads them: paths without the directory all of them share."""
    values = [varying(r, common) for r in rows]
    for key in varying_keys(rows, common):
        prefix = shared_directory([v[key] for v in values if key in v])
        if prefix is not None:
            for v in values:
                if key in v:
                    v[key] = os.path.relpath(v[key], prefix)
    return values


# ----------------------------------------------------------------- table


def _cell(value: Any, digits: int | None = None, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if digits is not None:
        return f"{value / scale:.{digits}f}"
    return f"{value:,d}" if isinstance(value, int) else str(value)


def table_text(rows: list[dict], exit_code: int) -> str:
    """The console table: a header that says what every number is, then one line per job (columns two spaces apart)."""
    common = common_overrides(rows)
    keys = varying_keys(rows, common)
    values = shown_values(rows, common)
    header = ["job", *keys, "outcome", "stage s", "wall s", "bytes", "peak RSS MB"]
    lines = [
        [str(r["job"]), *(v.get(k, "-") for k in keys), r["outcome"],
         _cell(r["stage_seconds"], 3), _cell(r["wall_seconds"], 2), _cell(r["bytes"]), _cell(r["peak_rss"], 1, 1e6)]
        for r, v in zip(rows, values)
    ]  # fmt: skip
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    numeric = {0, *range(len(header) - 4, len(header))}

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join(
        [
            f"osdpipe: sweep summary: {counts_text(rows)}; exit code {exit_code}",
            f"  every job: {' '.join(map(shown_override, common)) if common else '(no common overrides)'}",
            f"  stage s: {UNITS['stage_seconds']}; wall s: {UNITS['wall_seconds']}",
            f"  bytes: {UNITS['bytes']}; peak RSS: the largest process's, from report.json",
            fmt(header),
            *(fmt(line) for line in lines),
        ]
    )


def counts(rows: list[dict]) -> dict[str, int]:
    return {kind: sum(r["kind"] == kind for r in rows) for kind in OUTCOME_KINDS}


def counts_text(rows: list[dict]) -> str:
    parts = [f"{n} {KIND_LABELS[kind]}" for kind, n in counts(rows).items() if n]
    return f"{len(rows)} job{'s' if len(rows) != 1 else ''}: " + ", ".join(parts)


# ---------------------------------------------------------------- matrix


@dataclass(frozen=True)
class Matrix:
    """What ``sweep.png`` shows: source configurations by target configurations, one cell per job.

    Rows are told apart by the varying overrides of :data:`SOURCE_SIDE` keys
    (what is converted), columns by every other varying override (what it
    becomes, and how). A label holds the values only, one per line, in the
    order of its axis's keys (``row_keys``, ``column_keys``), so that a wide
    sweep stays readable; ``subtitle`` is what every job shares.
    """

    rows: list[str]
    columns: list[str]
    row_keys: list[str] = field(default_factory=list)
    column_keys: list[str] = field(default_factory=list)
    cells: list[dict[str, Any]] = field(default_factory=list)  # {"row", "column", "job", "kind", "text", "seconds"}
    subtitle: str = ""


def _label(values: dict[str, str], keys: list[str]) -> str:
    """One axis label: the job's value of each of the axis's keys, one per line (``-``: the job does not set it)."""
    return "\n".join(values.get(k, "-") for k in keys) if keys else "(every job)"


def cell_text(row: dict) -> str:
    """A cell's words: the outcome in one or two words, then the stage seconds when the stages ran."""
    kind = row["kind"]
    if kind == "check":
        words = row["outcome"].split(":", 1)[0]
    elif kind == "stage":
        words = row["outcome"].split(":", 1)[0].removeprefix("stage ") + " failed"
    else:
        words = KIND_LABELS[kind] if kind != "failed" else "failed"
    seconds = row["stage_seconds"]
    return words if seconds is None else f"{words}\n{seconds_text(seconds)} s"


def seconds_text(seconds: float) -> str:
    """Seconds as a cell shows them: milliseconds of a small conversion stay visible,
    a long one needs no more than tenths."""
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.1f}"


def matrix_cells(rows: list[dict]) -> Matrix:
    """The matrix of :class:`Matrix` from the rows, in sweep order along both axes."""
    common = common_overrides(rows)
    keys = varying_keys(rows, common)
    source_keys = [k for k in keys if k.startswith(SOURCE_SIDE)]
    target_keys = [k for k in keys if not k.startswith(SOURCE_SIDE)]
    row_labels: dict[str, None] = {}
    column_labels: dict[str, None] = {}
    placed = []
    for row, values in zip(rows, shown_values(rows, common)):
        r, c = _label(values, source_keys), _label(values, target_keys)
        row_labels.setdefault(r)
        column_labels.setdefault(c)
        placed.append((r, c, row))
    row_list, column_list = list(row_labels), list(column_labels)
    cells = [
        {
            "row": row_list.index(r),
            "column": column_list.index(c),
            "job": row["job"],
            "kind": row["kind"],
            "text": cell_text(row),
            "seconds": row["stage_seconds"],
        }
        for r, c, row in placed
    ]
    subtitle = " ".join(map(shown_override, common))
    return Matrix(
        rows=row_list,
        columns=column_list,
        row_keys=source_keys,
        column_keys=target_keys,
        cells=cells,
        subtitle=subtitle,
    )


def axis_title(side: str, keys: list[str]) -> str:
    """``"target: world_size / sharding_strategy"``: what the labels along an axis are values of."""
    prefix = f"{side}."
    return f"{side}: " + " / ".join(k.removeprefix(prefix) for k in keys) if keys else side


def matrix_dict(matrix: Matrix) -> dict[str, Any]:
    return {
        "rows": matrix.rows, "columns": matrix.columns, "row_keys": matrix.row_keys, "column_keys": matrix.column_keys,
        "cells": matrix.cells, "subtitle": matrix.subtitle,
    }  # fmt: skip


# ------------------------------------------------------------ sweep.json


def summary_dict(rows: list[dict], sweep_dir: str, exit_code: int) -> dict[str, Any]:
    """What ``sweep.json`` holds: the rows, what their numbers are, and the matrix the PNG draws."""
    matrix = matrix_cells(rows)
    return {
        "sweep_dir": str(sweep_dir),
        "exit_code": exit_code,
        "jobs": len(rows),
        "counts": counts(rows),
        "common_overrides": common_overrides(rows),
        "units": UNITS,
        "rows": rows,
        "matrix": matrix_dict(matrix),
    }


# ------------------------------------------------------------------ files


def read_report(directory: str) -> dict | None:
    """A job's ``report.json``, or ``None`` where it wrote none (a bad config) or it cannot be read."""
    try:
        return json.loads((Path(directory) / "report.json").read_text())
    except (OSError, ValueError):
        return None


def draw_matrix(matrix: Matrix, path: Path, title: str) -> None:
    """Draw the matrix as a PNG: one colored cell per job, its outcome and seconds written in it.

    Drawn on a bare Agg figure (no pyplot: nothing global is touched in the
    command's process). The cells, as JSON, also go into the PNG's
    ``Description``, so that the picture carries the data it shows.
    """
    # matplotlib is heavy: only a sweep's summary draws (cli imports this module on every command)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width, height = figure_inches(matrix)
    fig = Figure(figsize=(width, height), dpi=min(110, MAX_PIXELS / width), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_cells(ax, matrix)
    _label_axes(ax, matrix)
    _add_legend(fig, matrix)
    subtitle = [f"every job: {matrix.subtitle}"] if matrix.subtitle else []
    _fit_title(fig, [title, *subtitle, "cells: outcome, and seconds in the stages (report.json)"])
    fig.savefig(path, metadata={"Description": json.dumps(matrix_dict(matrix)), "Software": "osdpipe"})


#: The share of the figure's width a title line may take: a margin on each side.
TITLE_ROOM = 0.96
#: The fewest characters a title line is wrapped to (a figure narrower than that cuts it).
TITLE_MIN_CHARS = 12
#: The height of one more title line at 10 pt, with its spacing.
TITLE_LINE_INCHES = 0.17


def _fit_title(fig: Any, paragraphs: list[str]) -> None:
    """Give ``fig`` the title ``paragraphs``, each wrapped into lines that fit the figure's width, and the figure the
    height the extra lines take.

    A centered line wider than the figure is cut on both sides, and how many characters fit an inch depends on the
    letters (capitals, ``=``, ``_`` of a sweep's overrides are wide), so each paragraph is measured as drawn, not
    guessed, and wrapped narrower until it fits.
    """
    renderer = fig.canvas.get_renderer()
    room = fig.bbox.width * TITLE_ROOM
    lines: list[str] = []
    for paragraph in paragraphs:
        chars = len(paragraph)
        while True:
            wrapped = textwrap.wrap(paragraph, width=chars) or [""]
            wide = fig.suptitle("\n".join(wrapped), fontsize=10).get_window_extent(renderer).width
            if wide <= room or chars <= TITLE_MIN_CHARS:
                break
            chars = max(TITLE_MIN_CHARS, min(chars - 1, int(chars * room / wide)))
        lines.extend(wrapped)
    fig.suptitle("\n".join(lines), fontsize=10)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + TITLE_LINE_INCHES * max(0, len(lines) - 3))


# the widest sweep.png: a sweep of hundreds of columns gets smaller type, not a picture no viewer opens
MAX_PIXELS = 8000


def figure_inches(matrix: Matrix) -> tuple[float, float]:
    """A figure that grows with the matrix:
    every column as wide as its longest label line at 9 pt, so labels never overlap."""
    col_lines = max(label.count("\n") + 1 for label in matrix.columns)
    row_label_chars = max(len(line) for label in matrix.rows for line in label.split("\n"))
    col_label_chars = max(len(line) for label in matrix.columns for line in label.split("\n"))
    cell_width = max(1.0, 0.075 * col_label_chars + 0.2)
    width = max(7.0, cell_width * len(matrix.columns) + 0.075 * row_label_chars + 1.2)
    height = max(3.5, 0.75 * len(matrix.rows) + 0.16 * col_lines + 2.2)
    return width, height


def _draw_cells(ax: Any, matrix: Matrix) -> None:
    """Color each job's cell by its outcome (white where no job is) and write its text in it."""
    from matplotlib.colors import ListedColormap  # matplotlib: only a sweep's summary draws

    grid = [[0] * len(matrix.columns) for _ in matrix.rows]
    for cell in matrix.cells:
        grid[cell["row"]][cell["column"]] = OUTCOME_KINDS.index(cell["kind"]) + 1
    colors = ListedColormap(["white", *(KIND_COLORS[k] for k in OUTCOME_KINDS)])
    ax.imshow(grid, cmap=colors, vmin=0, vmax=len(OUTCOME_KINDS), aspect="auto")
    for cell in matrix.cells:
        dark = cell["kind"] in ("stage", "failed")
        ax.text(
            cell["column"],
            cell["row"],
            cell["text"],
            ha="center",
            va="center",
            fontsize=9,
            color="white" if dark else "black",
        )
    ax.set_xticks([x - 0.5 for x in range(1, len(matrix.columns))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(matrix.rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)


def _label_axes(ax: Any, matrix: Matrix) -> None:
    """Target configurations along the top, source configurations down the side, each axis titled with its keys."""
    ax.set_xticks(range(len(matrix.columns)), matrix.columns, fontsize=9)
    ax.set_yticks(range(len(matrix.rows)), matrix.rows, fontsize=9)
    ax.xaxis.tick_top()
    ax.set_xlabel(axis_title("target", matrix.column_keys), fontsize=10)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel(axis_title("source", matrix.row_keys), fontsize=10)


def _add_legend(fig: Any, matrix: Matrix) -> None:
    """One swatch per outcome the sweep had, below the matrix."""
    from matplotlib.patches import Patch  # matplotlib: only a sweep's summary draws

    present = [k for k in OUTCOME_KINDS if any(c["kind"] == k for c in matrix.cells)]
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in present]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False, fontsize=9)


def gather_rows(records: list[JobRecord]) -> list[dict[str, Any]]:
    """Every job's row, in job order, each from its record and (unless its config was bad) its ``report.json``."""
    return [
        job_row(r, read_report(r.output_dir) if r.exit_code != 2 else None)
        for r in sorted(records, key=lambda r: r.num)
    ]


def write_files(rows: list[dict], directory: Path, exit_code: int) -> None:
    """Write ``sweep.json``, then draw ``sweep.png``: a drawing failure costs only the picture."""
    directory.mkdir(parents=True, exist_ok=True)  # a sweep of bad configs only may have left none
    (directory / "sweep.json").write_text(json.dumps(summary_dict(rows, str(directory), exit_code), indent=2) + "\n")
    draw_matrix(matrix_cells(rows), directory / "sweep.png", f"osdpipe sweep, {counts_text(rows)}")


def summarize_sweep(records: list[JobRecord], exit_code: int) -> str | None:
    """Print the table of a finished sweep and write ``sweep.json`` and ``sweep.png`` into its directory.

    Returns ``None``, or one line for a person saying what could not be
    written (the sweep's jobs ran all the same: their reports are in place).
    """
    rows = gather_rows(records)
    print(table_text(rows, exit_code), flush=True)
    directory = Path(records[0].sweep_dir)
    try:
        write_files(rows, directory, exit_code)
    except ImportError as exc:
        return (
            f"sweep summary: cannot draw sweep.png without matplotlib ({exc}); "
            "pip install matplotlib (sweep.json is written)"
        )
    except OSError as exc:
        return (
            f"sweep summary: cannot write {exc.filename or directory} ({exc.strerror or exc}); "
            "the jobs' report.json files are in place"
        )
    print(f"  summary: {directory / 'sweep.json'}, {directory / 'sweep.png'}", flush=True)
    return None
