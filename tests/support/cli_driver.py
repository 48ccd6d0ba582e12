"""Run the ``osdpipe`` command's entry point once per case, in one process, for tests with many cases.

Starting Python and importing torch takes 2 s, so a test with hundreds of
command lines runs them here: each case is ``osdpipe.cli.entry.main()`` with its own
``sys.argv``, exactly what the ``osdpipe`` script calls, with stdout and
stderr captured and an alarm that turns a hang into a failed case. Reads a
JSON list of argument lists on stdin; writes one JSON object per case
(``code``, ``stdout``, ``stderr``, ``seconds``) as a list on stdout.

Usage: ``python cli_driver.py SECONDS_PER_CASE < cases.json``
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import time


class Hung(Exception):
    pass


def _alarm(signum, frame):  # noqa: ANN001
    raise Hung


def main() -> None:
    from osdpipe.cli import entry

    limit = int(sys.argv[1])
    cases = json.load(sys.stdin)
    real_stdout = sys.stdout
    signal.signal(signal.SIGALRM, _alarm)
    results = []
    for args in cases:
        out, err = io.StringIO(), io.StringIO()
        start = time.monotonic()
        sys.argv = ["osdpipe", *args]
        code: int | str
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            signal.alarm(limit)
            try:
                entry.main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except Hung:
                code = "hung"
            finally:
                signal.alarm(0)
        results.append(
            {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "seconds": time.monotonic() - start}
        )
    json.dump(results, real_stdout)


if __name__ == "__main__":
    main()
