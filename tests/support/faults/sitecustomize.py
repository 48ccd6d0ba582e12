"""A rank that dies on cue: fault injection for the dead-rank tests (``tests/run/test_dead_rank.py``).

On ``PYTHONPATH``, Python imports this module at start-up in every process of
the command: the launcher, the fork server and so every rank forked from it.
``OSDPIPE_TEST_FAULT=<point>:<rank>:<how>`` makes rank ``<rank>`` die at
``<point>`` (``load``, ``send``, ``receive``, ``save``: see :func:`_install`):
``kill`` sends itself SIGKILL (nothing runs after it, not even a ``finally``),
``abort`` aborts as native code does (SIGABRT, as glibc's heap checks),
``glibc`` prints glibc's heap-check message to its standard error first,
``raise`` raises an exception in the stage.
``OSDPIPE_TEST_NOISY_TEARDOWN=1`` makes every rank write a line to its
standard error as it tears its process group down, as a survivor's glibc did
in CI when gloo's threads ended after a peer's death.
``OSDPIPE_TEST_FAULT=commit:<n>`` makes the process that commits the
conversion die in the middle of it (:func:`_kill_in_commit`).
``OSDPIPE_TEST_SHARE_SCALARS=1`` undoes the copy that gives every output
tensor scalar state of its own (``tests/verify/test_resume.py``).
``OSDPIPE_TEST_RECORD_SYNCS=<file>`` appends every ``os.fsync`` (the path
behind the descriptor) and ``os.replace`` of the process to ``<file>``, a
line each, in order (``tests/io/test_durability.py``).
``OSDPIPE_TEST_MISFILL=<fqn>:<state>`` copies one element wrong into the
output, as the shard stage fills it or as it is written: the first of each
batch of parameter ``<fqn>``'s state ``<state>`` is one more than the source's
(``tests/run/test_streamed.py``, ``tests/cloud/test_s3_input.py``).
``OSDPIPE_TEST_RECORD_FETCHES=<file>`` appends, as each command's snapshot of
its input ends (``osdpipe.io.remote_input.one_snapshot``: one per command, and
one per rank or worker process it starts), a JSON line: the process's
arguments, its ``RANK`` (``null`` in the command's own process) and every
ranged request it made (``tests/cloud/test_s3_input.py``); ``OSDPIPE_TEST_SMALL_READ=<bytes>``
lowers what a snapshot keeps (``remote_input.SMALL_READ``), so that a small
model's items count as a large model's do.
``OSDPIPE_TEST_RECORD_READS=<file>`` appends the key and range of every stored tensor a
DCP checkpoint reads (``DcpCheckpoint.read_parts``: a Megatron save's too), a
line each (``tests/io/test_megatron_memory.py``).
Without any of these variables this module does nothing, not even import torch.
"""

from __future__ import annotations

import os

FAULT = os.environ.get("OSDPIPE_TEST_FAULT")


def _die(how: str, where: str) -> None:
    import signal

    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "glibc":  # as glibc's heap checks die: a line on descriptor 2, then SIGABRT
        os.write(2, b"free(): invalid pointer\n")
        os.abort()
    if how == "abort":  # as native code dies: glibc's heap checks, a C++ terminate
        os.abort()
    raise RuntimeError(f"injected fault {where}")


def _install(point: str, rank: int, how: str) -> None:
    import torch.distributed as dist

    def here() -> bool:
        return dist.is_initialized() and dist.get_rank() == rank

    def on_call(n: int, fn, *, after: bool = False):
        """``fn``, but on the faulty rank its ``n``-th call dies: before it runs, or ``after`` it did its work."""
        calls = 0

        def wrapped(*args, **kwargs):
            nonlocal calls
            calls += here()
            if calls == n and not after:
                _die(how, f"{point} on rank {rank}")
            result = fn(*args, **kwargs)
            if calls == n and after:
                _die(how, f"{point} on rank {rank}")
            return result

        return wrapped

    if point == "load":  # as this rank opens the source (after the stage's first collective)
        from osdpipe.run.stages import load

        load.open_source = on_call(1, load.open_source)
    elif point == "send":  # the reading rank, between two tensors it sends (runtime.transfer=scatter)
        from osdpipe.run import transfer

        transfer.Server.send = on_call(2, transfer.Server.send)
    elif point == "receive":  # a receiving rank, between two tensors it receives (runtime.transfer=scatter)
        from osdpipe.run import transfer

        transfer.Receiver.receive = on_call(2, transfer.Receiver.receive)
    elif point == "save":  # after this rank's file is written to .staging, before the commit
        from osdpipe.io.formats import base  # the torch-file writer of every format but dcp

        base.save_hashed = on_call(1, base.save_hashed, after=True)
    else:
        raise ValueError(f"OSDPIPE_TEST_FAULT: unknown point {point!r}")


def _kill_in_commit(after: int) -> None:
    """SIGKILL this process in the middle of committing a conversion: right after the ``after``-th rename of the commit
    (the first is ``.staging`` -> ``.incoming``), or, for ``0``, once everything staged is synced but before any
    rename."""
    import signal

    from osdpipe.io import output

    real_replace, real_commit = os.replace, output.commit
    renames = -1  # counting from the commit's first rename

    def replace(src, dst, *args, **kwargs):
        nonlocal renames
        if renames < 0 and os.path.basename(os.fspath(src)) == output.STAGING:
            renames = 0
        real_replace(src, dst, *args, **kwargs)
        if renames >= 0:
            renames += 1
            if renames == after:
                os.kill(os.getpid(), signal.SIGKILL)

    def commit(directory, durable=True):
        if after == 0:
            if durable:
                output.sync_tree(directory / output.STAGING)
            os.kill(os.getpid(), signal.SIGKILL)
        real_commit(directory, durable)

    os.replace = replace
    output.commit = commit


if FAULT and FAULT.startswith("commit:"):  # the process that commits (offline: the command itself) dies in the commit
    _kill_in_commit(int(FAULT.split(":")[1]))
elif FAULT:
    _point, _rank, _how = FAULT.split(":")
    _install(_point, int(_rank), _how)

if os.environ.get("OSDPIPE_TEST_NOISY_TEARDOWN"):

    def _noisy_teardown() -> None:
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def noisy(*args, **kwargs):
            os.write(2, b"tcache_thread_shutdown(): unaligned tcache chunk detected\n")
            return destroy(*args, **kwargs)

        dist.destroy_process_group = noisy

    _noisy_teardown()

if os.environ.get("OSDPIPE_TEST_SHARE_SCALARS"):
    # Put back what osdpipe fixes: every output tensor holds the source's scalar state object itself, so a
    # source that shares one step across parameters (FSDP1's FULL state) shares it in the output too.
    from osdpipe.run import transfer

    transfer.own_copy = lambda value: value


def _record_syncs(log: str) -> None:
    """Append each ``fsync`` and ``replace`` of this process to ``log`` as it happens: ``fsync<TAB>path`` or
    ``replace<TAB>src<TAB>dst``."""
    real_fsync, real_replace = os.fsync, os.replace

    def record(*fields: str) -> None:
        with open(log, "a") as f:
            f.write("\t".join(fields) + "\n")

    def fsync(fd):
        record("fsync", os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        record("replace", os.fspath(src), os.fspath(dst))
        real_replace(src, dst, *args, **kwargs)

    os.fsync = fsync
    os.replace = replace


if os.environ.get("OSDPIPE_TEST_RECORD_SYNCS"):
    _record_syncs(os.environ["OSDPIPE_TEST_RECORD_SYNCS"])


def _misfill(fqn: str, name: str) -> None:
    """Every batch the shard stage (:func:`osdpipe.run.transfer.fill`) or :mod:`osdpipe.run.streamed_output` fills of
    ``fqn``'s state ``name`` gets its first element wrong, after the copy."""
    from osdpipe.run import streamed_output as streamed
    from osdpipe.run import transfer

    real_place = transfer.place

    def place(flat, batch, pieces):
        real_place(flat, batch, pieces)
        first = batch.segments[0]
        if first.fqn == fqn and batch.name == name:
            flat[first.dest] += 1

    streamed.place = transfer.place = place


if os.environ.get("OSDPIPE_TEST_MISFILL"):
    _misfill(*os.environ["OSDPIPE_TEST_MISFILL"].split(":"))


def _record_fetches(log: str) -> None:
    """Each command's requests to object storage, a JSON line per command: ``{"argv": [...], "ranges": [[url, start,
    end], ...]}``."""
    import json
    import sys
    from contextlib import contextmanager

    from osdpipe.io import remote_input

    real_snapshot = remote_input.one_snapshot

    @contextmanager
    def recorded(taken_over=None):
        first = len(remote_input.METER.ranges)
        try:
            with real_snapshot(taken_over):
                yield
        finally:
            with open(log, "a") as f:
                ranges = remote_input.METER.ranges[first:]
                said = {"argv": sys.argv[1:], "rank": os.environ.get("RANK"), "ranges": ranges}
                f.write(json.dumps(said) + "\n")

    remote_input.one_snapshot = recorded


if os.environ.get("OSDPIPE_TEST_RECORD_FETCHES"):
    _record_fetches(os.environ["OSDPIPE_TEST_RECORD_FETCHES"])

if os.environ.get("OSDPIPE_TEST_SMALL_READ"):
    from osdpipe.io import remote_input

    remote_input.SMALL_READ = int(os.environ["OSDPIPE_TEST_SMALL_READ"])


def _record_reads(log: str) -> None:
    from osdpipe.io.formats.dcp_reader import DcpCheckpoint

    def recorded(real):
        def read(self, flat, start, stop):
            with open(log, "a") as f:
                f.write(f"{flat} {start} {stop}\n")
            return real(self, flat, start, stop)

        return read

    DcpCheckpoint.read_parts = recorded(DcpCheckpoint.read_parts)  # read_range reads through it


if os.environ.get("OSDPIPE_TEST_RECORD_READS"):
    _record_reads(os.environ["OSDPIPE_TEST_RECORD_READS"])
