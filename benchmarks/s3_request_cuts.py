"""What the ``osdpipe s3 -> s3`` defaults pay over the fsspec copy on moto, request by request: the copy against the
defaults, against each of two what-ifs that take requests away, and against both at once, alternating.

Run (from the repository root, after ``python benchmarks/s3_reshard.py --workdir /tmp/s3bench`` made the source):

    python benchmarks/s3_request_cuts.py --repeats 3 --workdir /tmp/s3bench

moto reads a whole object to serve a ranged GET (0.2 to 0.27 s of its CPU for a 403 MB object, whatever the range),
and on this 2-core machine its CPU bounds both paths: the defaults make 60 ranged GETs where the copy makes 5 whole
GETs. The what-ifs say which of them make the difference. Neither is a change to osdpipe (docs/speed.md says why);
each is a ``sitecustomize`` module this script writes and puts on the command's ``PYTHONPATH``, patching the
installed osdpipe in the command's process alone:

* ``no small GETs``: a read of 64 KiB or less of a ``.distcp`` object (the ``step`` tensors and param-group items,
  one per parameter, scattered through the files) is served from the local copy of the source, as if those bytes
  came with requests the run makes anyway;
* ``whole-object GETs``: ``osdpipe.io.remote_input.DEFAULT_IN_FLIGHT`` is 4 GiB, so one request spans each source
  object a rank reads (as the copy's ``get`` does), where the default bound makes requests of 64 MiB;
* ``both``.

The copy is ``s3_reshard.py``'s ``fsspec get + put`` path, the conversion its first (4 -> 2 FSDP2 ranks, DCP out,
offline, ``pipeline.checks=[roundtrip]``). The table: median, min and max seconds, the ratio of medians to the
copy's, the client's and the server's CPU seconds (medians), the command's peak RSS, and the ranged and whole GETs
of the last repeat (moto's access log).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import s3_reshard as bench

#: The what-ifs: the environment that turns each on in the written ``sitecustomize``.
SMALL_FROM_DISK, WHOLE_OBJECTS = "OSDPIPE_BENCH_SMALL_FROM", "OSDPIPE_BENCH_WHOLE_OBJECTS"
#: The read size at or below which ``no small GETs`` serves a read from the local source (the snapshot's small read).
SMALL_READ = 64 << 10

SITECUSTOMIZE = f'''
import os

if os.environ.get("{SMALL_FROM_DISK}") or os.environ.get("{WHOLE_OBJECTS}"):
    import osdpipe.io.remote_input as remote_input

    if os.environ.get("{WHOLE_OBJECTS}"):
        remote_input.DEFAULT_IN_FLIGHT = 4 << 30
    if os.environ.get("{SMALL_FROM_DISK}"):
        fetched = remote_input.RemotePath.read_range
        local = os.environ["{SMALL_FROM_DISK}"]

        def read_range(self, start, length):
            if 0 < length <= {SMALL_READ} and self.key.endswith(".distcp"):
                with open(os.path.join(local, self.name), "rb") as f:
                    f.seek(start)
                    return f.read(length)
            return fetched(self, start, length)

        remote_input.RemotePath.read_range = read_range
'''


def variants(source: Path) -> dict[str, dict[str, str] | None]:
    """Each path's environment for the what-ifs (``None``: the copy)."""
    return {
        "fsspec get + put": None,
        "osdpipe s3 -> s3, defaults": {},
        "no small GETs": {SMALL_FROM_DISK: str(source)},
        "whole-object GETs": {WHOLE_OBJECTS: "1"},
        "both": {SMALL_FROM_DISK: str(source), WHOLE_OBJECTS: "1"},
    }


def command(work: Path, what_if: dict[str, str] | None, env: dict[str, str], site: Path) -> tuple[list[str], dict]:
    """The path's command and its environment: the copy (``what_if`` None), else the conversion with the what-ifs'
    ``sitecustomize`` (in ``site``) on its ``PYTHONPATH``, after this checkout."""
    if what_if is None:
        return [sys.executable, bench.__file__, "--copy", f"s3://{bench.BUCKET}/src/dcp",
                f"s3://{bench.BUCKET}/copy/dcp", str(work / "copy_local")], env  # fmt: skip
    repository = Path(bench.__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "osdpipe", *bench.conversion(bench.WIDTH), f"input.path=s3://{bench.BUCKET}/src/dcp",
           f"output.path=s3://{bench.BUCKET}/out"]  # fmt: skip
    return cmd, {**env, **what_if, "PYTHONPATH": os.pathsep.join([str(repository), str(site)])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/s3bench", help="where s3_reshard.py made the source")
    opts = parser.parse_args()
    work = Path(opts.workdir).resolve()
    source = work / "src" / "dcp"
    if not (source / ".metadata").exists():
        raise SystemExit(f"no source in {source}: run benchmarks/s3_reshard.py --workdir {work} first")
    site = Path(tempfile.mkdtemp(prefix="osdpipe-bench-site-"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = work / "moto-cuts.log"
    server, endpoint = bench.start_server(log)
    env = bench.environment(endpoint)
    os.environ.update(env)
    paths = variants(source)
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in paths}
    requests: dict[str, tuple[int, int]] = {}
    try:
        fs = bench.filesystem()
        fs.mkdir(bench.BUCKET)
        fs.put(f"{source}/", f"{bench.BUCKET}/src/dcp/", recursive=True)
        for repeat in range(opts.repeats):
            for name, what_if in paths.items():
                for prefix in ("out", "copy"):
                    if fs.exists(f"{bench.BUCKET}/{prefix}"):
                        fs.rm(f"{bench.BUCKET}/{prefix}", recursive=True)
                shutil.rmtree(work / "outputs", ignore_errors=True)
                shutil.rmtree(work / "copy_local", ignore_errors=True)
                cmd, run_env = command(work, what_if, env, site)
                logged = log.stat().st_size
                *measured, said = bench.timed(cmd, work, run_env, server)
                if what_if is not None and "check roundtrip  pass" not in said:
                    raise SystemExit(f"{name}: the roundtrip check did not pass:\n{said[-2000:]}")
                runs[name].append(tuple(measured))
                seen = bench.requests_in(log, logged)
                requests[name] = (seen["ranged GET"], seen["GET"])
                print(bench.said_repeat(repeat, name, runs[name][-1]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(site, ignore_errors=True)
    copy = statistics.median(w for w, *_ in runs["fsspec get + put"])
    print(f"\ns3 -> s3 on moto, {bench.WIDTH}-wide mlp (1.6 GB), median of {opts.repeats}, alternating")
    print("| path | median s | min s | max s | x fsspec copy | client CPU s | server CPU s | peak RSS GB "
          "| ranged GETs | GETs |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, got in runs.items():
        median, least, most, client, served, rss = bench.medians(got)
        print(f"| {name} | {median:.1f} | {least:.1f} | {most:.1f} | {median / copy:.2f} | {client:.1f} | "
              f"{served:.1f} | {rss:.2f} | {requests[name][0]} | {requests[name][1]} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
