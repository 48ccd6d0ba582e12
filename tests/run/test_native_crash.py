"""A rank killed by native code is reported with the Python code it was in, and the last line it printed
(:mod:`osdpipe.run.native_crash`).

The end-to-end case (a rank of a world that aborts in ``save``) is in ``test_dead_rank.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import osdpipe
from osdpipe.run import native_crash
from osdpipe.run.launch import death

PACKAGE = Path(osdpipe.__file__).resolve().parent


def _dump_of_a_process_that_aborts(tmp_path: Path) -> str:
    """What a process armed by :func:`native_crash.arm` leaves when it aborts two calls deep, a thread beside it."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys, threading, time
        from pathlib import Path
        from osdpipe.run import native_crash

        def die():
            os.abort()

        def work():
            die()

        native_crash.arm(Path(sys.argv[1]))
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        work()
    """))
    dump = tmp_path / "rank-0.stacks"
    done = subprocess.run([sys.executable, str(job), str(dump)], capture_output=True, timeout=60, check=False)
    assert done.returncode < 0, done.stderr
    return native_crash.read(dump)


def test_the_dump_of_an_aborted_process_names_the_innermost_frame_of_the_dying_thread(tmp_path: Path) -> None:
    dump = _dump_of_a_process_that_aborts(tmp_path)
    assert "Thread 0x" in dump, dump  # the sleeping thread's stack is in the dump, and is not the one named
    job = tmp_path / "job.py"
    assert native_crash.innermost(dump) == f"{job}:7 in die"


def test_an_osdpipe_frame_under_the_innermost_one_is_named_too() -> None:
    dump = "\n".join([
        "Fatal Python error: Aborted",
        "",
        "Thread 0x00007f0000000001 (most recent call first):",
        f'  File "{PACKAGE}/core/memory.py", line 70 in _sample',
        "",
        "Current thread 0x00007f0000000002 (most recent call first):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 12 in broadcast',
        f'  File "{PACKAGE}/run/collective.py", line 40 in from_rank0',
        f'  File "{PACKAGE}/verify/checks/universal.py", line 45 in run',
        "",
        "Extension modules: torch._C (total: 1)",
    ])  # fmt: skip
    assert native_crash.innermost(dump) == (
        "torch/distributed/c10d.py:12 in broadcast, called from osdpipe/run/collective.py:40 in from_rank0"
    )


def test_no_dump_names_nothing(tmp_path: Path) -> None:
    assert native_crash.read(tmp_path / "never-written") == ""
    assert native_crash.innermost("") is None
    no_frame = "Fatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n"
    assert native_crash.innermost(no_frame) is None


def test_the_death_line_carries_the_code_it_was_in() -> None:
    said = death(-6, "verify", "osdpipe/verify/checks/universal.py:45 in run")
    assert said == (
        "process killed by SIGABRT in stage 'verify' without reporting an error "
        "(in osdpipe/verify/checks/universal.py:45 in run)"
    )


def test_what_a_process_prints_as_it_aborts_is_kept_from_the_terminal_and_its_last_line_named(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys
        from pathlib import Path
        from osdpipe.run import native_crash

        native_crash.capture_stderr(Path(sys.argv[1]))
        print("a warning from Python", file=sys.stderr)
        os.write(2, b"free(): invalid pointer\\n\\n")
        os.abort()
    """))
    printed = tmp_path / "rank-0.stderr"
    done = subprocess.run([sys.executable, str(job), str(printed)], capture_output=True, timeout=60, check=False)
    assert done.returncode < 0 and done.stderr == b""
    assert native_crash.read(printed) == "a warning from Python\nfree(): invalid pointer\n\n"
    assert native_crash.last_words(native_crash.read(printed)) == "free(): invalid pointer"


def test_last_words_are_the_last_line_cut_short() -> None:
    assert native_crash.last_words("") is None
    assert native_crash.last_words("\n  \n") is None
    long = native_crash.last_words("first\n" + "x" * 500)
    assert long is not None and len(long) == 200 and long.endswith("...")


def test_the_death_line_carries_what_the_process_printed_unless_sigkill_ended_it() -> None:
    assert death(-6, "save", "osdpipe/io/x.py:3 in f", "free(): invalid pointer") == (
        "process killed by SIGABRT in stage 'save' without reporting an error (in osdpipe/io/x.py:3 in f); "
        "it printed 'free(): invalid pointer'"
    )
    assert "printed" not in death(-9, "save", None, "an older warning")
