"""osdpipe from ``s3://`` to ``s3://`` against copying the same bytes down and up with fsspec alone, through one S3
server on this machine.

Run (from the repository root; about 8 GB of free disk: the source, moto's spilled objects, the local copies):

    python benchmarks/s3_reshard.py --repeats 3

``--width 2048`` (a quarter of the bytes, 0.4 GB) is a quick look while developing; the table in docs/speed.md is of
the default width. ``--store gs`` runs the same paths through ``gs://`` against gcp-storage-emulator (in memory, a
process of its own, found through ``STORAGE_EMULATOR_HOST``): a server that charges a ranged GET its range, where
moto charges it its whole object. ``--server s3rver`` keeps ``s3://`` but serves it with s3rver (Node.js, installed
once from the npm registry into the work directory, objects on its disk), which also reads a ranged GET's range
alone: what the paths cost where the server does not charge osdpipe's ranged reads the whole object (its log names
no request's method, so the requests table is left out).

The source is a 1.6 GB Adam state (exp_avg and exp_avg_sq of osdpipe's ``mlp``, width 4096, depth 12: the state of
benchmarks/checkpoint_scale.py's 1.6 GB row, synthesized without training) saved as a 4-rank FSDP2 DCP checkpoint
(``target.kind=fsdp2``, by osdpipe offline), uploaded to ``s3://osdpipe-bench/src/dcp`` on a moto server that this
script starts on 127.0.0.1 (``python -m moto.server``, a process of its own, so that its CPU time is measured apart).
Then, alternating in every repeat, each path a fresh process timed from start to end:

* ``osdpipe s3 -> s3``: the ``osdpipe`` command, 4 -> 2 FSDP2 ranks, DCP out, offline, ``pipeline.checks=[roundtrip]``,
  from ``input.path=s3://...`` to ``output.path=s3://...`` (an empty prefix: the previous repeat's output is deleted,
  untimed, first); the manifest's digests and the upload's commit included;
* ``fsspec get + put``: what moving the same bytes costs with no conversion: ``fs.get`` of the source prefix to the
  local disk, then ``fs.put`` of it to another prefix (s3fs, the same server and client options);
* ``osdpipe local -> local``: the same conversion from a local copy of the source to a local directory: the CPU and
  disk part of the first path, without the store;
* ``osdpipe s3 -> s3, no checks``: the first path with ``pipeline.checks=[]``: what the roundtrip check costs (it
  compares with digests the shard stage took as it read, and fetches nothing more from the store);
* ``osdpipe s3 -> s3, runtime.memory_budget=8GB``: the first path given the memory to make every request as large
  as the bytes it serves (:data:`WHOLE_REQUESTS_BUDGET`): each source object read in one GET, each output file sent
  in one PUT, the output made as save writes it. What a server that charges per request, not per byte, costs
  osdpipe at its fewest requests; the defaults keep request sizes made for S3 itself (64 MiB ranges, 50 MiB
  parts, several at once).

Under the table, the stages of the last ``osdpipe s3 -> s3`` run as the command reports them (the ranks' files go up
while later ranks convert; the rest of the upload and the commit come after the stages), the requests each path made
of the server (counted in moto's access log: ranged GETs, whole GETs, PUTs of objects and of parts), and what the
server charges for each kind, timed apart on the same objects (median of 5): a ranged GET of 1 KiB from a 400 MB
object and from a 1 MiB one, a GET of a whole 400 MB object, a PUT of one in parts and in one request: what bounds
each path.

The table gives median, min and max seconds of the repeats, the ratio to ``fsspec get + put`` (the issue's target:
osdpipe at most 1.3x), the CPU seconds each path took in the client (its process and children) and in the server
(moto's process), medians: where the time goes, and so what bounds the path (the network here is loopback), and the
command's peak RSS (its main process's ``VmHWM``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
BUCKET = "osdpipe-bench"
#: The built-in model and the source's size: benchmarks/checkpoint_scale.py's (width_for(1.6), depth 12).
WIDTH, DEPTH = 4096, 12


def conversion(width: int) -> list[str]:
    """The command's arguments but the paths, for the mlp of ``width``."""
    return [
        "model.factory=mlp", f"model.kwargs.width={width}", f"model.kwargs.depth={DEPTH}", "source.kind=fsdp2",
        "source.world_size=4", "target.kind=fsdp2", "target.world_size=2", "output.format=dcp", "runtime.mode=offline",
        "pipeline.checks=[roundtrip]", "runtime.progress=false", "output.overwrite=true",
    ]  # fmt: skip


#: Each store's server on this machine: the command that starts it on a port, and its name in the tables.
SERVERS = {
    "s3": (["-m", "moto.server", "-H", "127.0.0.1", "-p"], "moto"),
    "gs": (["-m", "gcp_storage_emulator", "start", "--in-memory", "--host", "127.0.0.1", "--port"],
           "gcp-storage-emulator"),
}  # fmt: skip


#: The S3 server ``--server s3rver`` installs (npm) and starts instead of moto's; its one access key and secret.
S3RVER, S3RVER_KEY = "s3rver@3.7.1", "S3RVER"


#: The budget at which each source object is one GET and each output file one PUT (a request fetches up to an eighth
#: of the budget, an upload part is an eighth: both at least this conversion's largest object, the 806 MB output).
WHOLE_REQUESTS_BUDGET = "8GB"


def paths(store: str) -> tuple[str, ...]:
    return (f"osdpipe {store} -> {store}", "fsspec get + put", "osdpipe local -> local",
            f"osdpipe {store} -> {store}, no checks",
            f"osdpipe {store} -> {store}, runtime.memory_budget={WHOLE_REQUESTS_BUDGET}")  # fmt: skip


def environment(endpoint: str, store: str = "s3", server: str = "moto") -> dict[str, str]:
    """The server as the endpoint, fake credentials (S3: s3rver takes its own) or none (the GCS emulator), nothing of
    the machine's own set-up for either store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_"))}
    env["CI"] = "true"
    if store == "gs":
        env["STORAGE_EMULATOR_HOST"] = endpoint
        return env
    key, secret = (S3RVER_KEY, S3RVER_KEY) if server == "s3rver" else ("AKIAOSDPIPEBENCH0001", "secret")
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)  # fmt: skip
    return env


def s3rver_command(work: Path, port: int) -> list[str]:
    """s3rver on ``port``, installed into ``work/s3rver`` the first time, its objects in a fresh folder there."""
    home = work / "s3rver"
    binary = home / "node_modules" / ".bin" / "s3rver"
    if not binary.exists():
        subprocess.run(["npm", "install", "--prefix", str(home), S3RVER], check=True, capture_output=True)
    data = home / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    return [str(binary), "-d", str(data), "-a", "127.0.0.1", "-p", str(port)]


def start_server(log: Path, store: str = "s3", server: str = "moto") -> tuple[subprocess.Popen, str]:
    """The store's server (for s3: moto's, or s3rver) on a free port of 127.0.0.1, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args, name = SERVERS[store]
    cmd, env = [sys.executable, *args, str(port)], None
    if server == "s3rver":  # it lists a bucket with a hash OpenSSL 3 keeps in its legacy provider
        name, cmd = "s3rver", s3rver_command(log.parent, port)
        env = {**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"}
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"{name} did not start; see {log}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def filesystem(store: str = "s3"):
    if store == "gs":
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True)
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def make_source(work: Path, env: dict[str, str], width: int = WIDTH) -> Path:
    """The 4-rank FSDP2 DCP checkpoint (local) of the mlp of ``width``, made once per work directory and width."""
    sys.path.insert(0, str(HERE.parent))
    from checkpoint_scale import DEPTH as SCALE_DEPTH
    from checkpoint_scale import width_for, write_random_state

    assert (width_for(1.6), SCALE_DEPTH) == (WIDTH, DEPTH)
    dcp = work / ("src" if width == WIDTH else f"src_{width}") / "dcp"
    if not (dcp / ".metadata").exists():
        full = work / ("optim.pt" if width == WIDTH else f"optim_{width}.pt")
        if not full.exists():
            write_random_state(width, full)
        subprocess.run([sys.executable, "-m", "osdpipe", "model.factory=mlp", f"model.kwargs.width={width}",
                        f"model.kwargs.depth={DEPTH}", f"input.path={full}", "input.format=fsdp_full",
                        "source.world_size=4", "target.kind=fsdp2", "target.world_size=4", "output.format=dcp",
                        "runtime.mode=offline", "pipeline.checks=[]", "runtime.progress=false",
                        f"output.path={dcp.parent}", "output.overwrite=true"],
                       check=True, cwd=work, env=env, capture_output=True)  # fmt: skip
        full.unlink()
    return dcp


def copy_main(source: str, target: str, local: str) -> None:
    """The baseline: the source prefix down to ``local``, then up to ``target``, with fsspec alone."""
    fs = filesystem(source.split("://", 1)[0])
    fs.get(source.rstrip("/") + "/", local.rstrip("/") + "/", recursive=True)
    fs.put(local.rstrip("/") + "/", target.rstrip("/") + "/", recursive=True)


def requests_in(log: Path, start: int) -> Counter:
    """The requests the server's access log holds past byte ``start``, by kind (moto's S3 API, or the emulator's
    GCS JSON API: an object's bytes are ``GET .../o/<name>?alt=media``; an upload in parts is resumable, its parts
    ``PUT ...&upload_id=``)."""
    kinds: Counter = Counter()
    with log.open("rb") as f:
        f.seek(start)
        for line in f.read().decode(errors="replace").splitlines():
            if line.count('"') < 2 or " HTTP/" not in line:
                continue
            request, status = line.split('"')[1], line.rsplit('"', 1)[1].split()[0]
            method, target = request.split()[:2]
            if method == "GET" and ("?" not in target or "alt=media" in target):
                kinds["ranged GET" if status == "206" else "GET"] += 1
            elif method == "PUT":
                kinds["PUT part" if "partNumber=" in target or "upload_id=" in target else "PUT"] += 1
            elif method == "POST" and "uploadType=multipart" in target:
                kinds["PUT"] += 1  # one request, the whole object
            else:
                kinds["other"] += 1
    return kinds


def server_costs(fs, source: Path) -> dict[str, float]:
    """Seconds the server takes for one request of each kind (median of 5), timed from this process."""
    big = max(source.iterdir(), key=lambda p: p.stat().st_size)
    fs.put_file(str(big), f"{BUCKET}/costs/big")
    fs.pipe_file(f"{BUCKET}/costs/small", b"x" * (1 << 20))

    def median_of(action) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    size = big.stat().st_size
    costs = {
        f"ranged GET of 1 KiB, {size / 1e6:.0f} MB object": median_of(
            lambda: fs.cat_file(f"{BUCKET}/costs/big", start=size // 2, end=size // 2 + 1024)
        ),
        "ranged GET of 1 KiB, 1 MiB object": median_of(
            lambda: fs.cat_file(f"{BUCKET}/costs/small", start=4096, end=4096 + 1024)
        ),
        f"GET of a whole {size / 1e6:.0f} MB object": median_of(lambda: fs.cat_file(f"{BUCKET}/costs/big")),
        f"PUT of a {size / 1e6:.0f} MB object (in parts)": median_of(
            lambda: fs.put_file(str(big), f"{BUCKET}/costs/up")
        ),
        f"PUT of a {size / 1e6:.0f} MB object (one request)": median_of(  # s3fs: one PUT below 2 chunks
            lambda: fs.put_file(str(big), f"{BUCKET}/costs/up", chunksize=size)
        ),
    }
    fs.rm(f"{BUCKET}/costs", recursive=True)
    return costs


def peak_rss_gb(pid: int, seen: float) -> float:
    """The larger of ``seen`` and the process's own high-water RSS now (``VmHWM``, GB); ``seen`` once it is gone.

    Read while it runs: the ``ru_maxrss`` that ``wait4`` gives counts the forking parent's RSS too (Linux keeps the
    high-water mark across ``fork`` and ``exec``), and this script holds more than the commands it times.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return seen
    kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return max(seen, kb * 1024 / 1e9)


def timed(
    cmd: list[str], cwd: Path, env: dict[str, str], server: subprocess.Popen
) -> tuple[float, float, float, float, str]:
    """Wall seconds of ``cmd``, the CPU seconds of it and its children, the server's CPU seconds meanwhile, the
    command's peak RSS in GB (its own process's, sampled every 20 ms), and what it said on stdout."""
    before_client = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_server = cpu_seconds(server.pid)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        rss = 0.0
        while proc.poll() is None:
            rss = peak_rss_gb(proc.pid, rss)
            time.sleep(0.02)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        said, complained = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{complained}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client = (after.ru_utime - before_client.ru_utime) + (after.ru_stime - before_client.ru_stime)
    return wall, client, cpu_seconds(server.pid) - before_server, rss, said


def said_repeat(repeat: int, path: str, measured: tuple[float, float, float, float]) -> str:
    """One repeat of a path (what :func:`timed` measured), as the scripts print it while they run."""
    wall, client, served, rss = measured
    return (f"  repeat {repeat + 1}: {path}: {wall:.1f} s (CPU: client {client:.1f} s, server {served:.1f} s; "
            f"peak RSS {rss:.2f} GB)")  # fmt: skip


def medians(got: list[tuple[float, float, float, float]]) -> tuple[float, float, float, float, float, float]:
    """A path's repeats as its table row's numbers: the median, min and max seconds, and the medians of the client's
    and the server's CPU seconds and of the peak RSS."""
    walls = [wall for wall, *_ in got]
    client, served, rss = (statistics.median(run[i] for run in got) for i in (1, 2, 3))
    return statistics.median(walls), min(walls), max(walls), client, served, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="keeps the synthesized source between invocations")
    parser.add_argument("--width", type=int, default=WIDTH,
                        help=f"the mlp's width (default {WIDTH}: 1.6 GB); smaller for a quick look")  # fmt: skip
    parser.add_argument("--store", choices=sorted(SERVERS), default="s3",
                        help="s3: moto's server (default); gs: gcp-storage-emulator, in memory")  # fmt: skip
    parser.add_argument("--server", choices=("moto", "s3rver"), default="moto",
                        help="with --store s3: moto's server (default), or s3rver (npm)")  # fmt: skip
    parser.add_argument("--copy", nargs=3, metavar=("SOURCE", "TARGET", "LOCAL"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.copy:
        copy_main(*opts.copy)
        return 0
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="s3_bench_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    store, server_name = opts.store, SERVERS[opts.store][1]
    if opts.server == "s3rver":
        if store != "s3":
            raise SystemExit("--server s3rver serves s3://; leave --store out")
        server_name = "s3rver"
    log = work / f"{server_name}.log"
    server, endpoint = start_server(log, store, opts.server)
    env = environment(endpoint, store, opts.server)
    os.environ.update(env)
    try:
        source = make_source(work, env, opts.width)
        size = sum(p.stat().st_size for p in source.iterdir())
        fs = filesystem(store)
        fs.mkdir(BUCKET)
        fs.put(f"{source}/", f"{BUCKET}/src/dcp/", recursive=True)
        print(f"source: {size / 1e9:.2f} GB (width {opts.width}), FSDP2 DCP at 4 ranks, {store}://{BUCKET}/src/dcp, "
              f"{server_name} {endpoint}", flush=True)  # fmt: skip
        runs: dict[str, list[tuple[float, float, float, float]]] = {path: [] for path in paths(store)}
        asked: dict[str, Counter] = {}
        stages = ""
        for repeat in range(opts.repeats):
            for path in runs:
                for prefix in ("out", "copy"):
                    if fs.exists(f"{BUCKET}/{prefix}"):
                        fs.rm(f"{BUCKET}/{prefix}", recursive=True)
                for local in ("local_out", "copy_local", "outputs"):
                    shutil.rmtree(work / local, ignore_errors=True)
                if path.startswith(f"osdpipe {store} -> {store}"):
                    cmd = [sys.executable, "-m", "osdpipe", *conversion(opts.width),
                           f"input.path={store}://{BUCKET}/src/dcp", f"output.path={store}://{BUCKET}/out"]  # fmt: skip
                    cmd += ["pipeline.checks=[]"] if path.endswith("no checks") else []
                    cmd += [f"runtime.memory_budget={WHOLE_REQUESTS_BUDGET}"] if "memory_budget" in path else []
                elif path == "fsspec get + put":
                    cmd = [sys.executable, str(HERE), "--copy", f"{store}://{BUCKET}/src/dcp",
                           f"{store}://{BUCKET}/copy/dcp", str(work / "copy_local")]  # fmt: skip
                else:
                    cmd = [sys.executable, "-m", "osdpipe", *conversion(opts.width), f"input.path={source}",
                           f"output.path={work / 'local_out'}"]  # fmt: skip
                logged = log.stat().st_size
                *measured, said = timed(cmd, work, env, server)
                runs[path].append(tuple(measured))
                asked[path] = requests_in(log, logged)
                if path == f"osdpipe {store} -> {store}":
                    stages = said
                print(said_repeat(repeat, path, runs[path][-1]), flush=True)
        costs = server_costs(fs, source)
    finally:
        server.terminate()
        server.wait(timeout=30)
    copy = statistics.median(w for w, *_ in runs["fsspec get + put"])
    print(f"\nmedian of {opts.repeats}, alternating; {size / 1e9:.2f} GB FSDP2 DCP, 4 -> 2 ranks; {server_name} on "
          "127.0.0.1")  # fmt: skip
    print("| path | median s | min s | max s | x fsspec copy | client CPU s | server CPU s | peak RSS GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path, got in runs.items():
        median, least, most, client, moto, rss = medians(got)
        print(f"| {path} | {median:.1f} | {least:.1f} | {most:.1f} | {median / copy:.2f} | {client:.1f} | "
              f"{moto:.1f} | {rss:.2f} |")  # fmt: skip
    print(f"\nthe last osdpipe {store} -> {store} run's stages:")
    print("\n".join(line for line in stages.splitlines() if line.startswith("  ") and " s " in line))
    kinds = ("ranged GET", "GET", "PUT", "PUT part", "other")
    if server_name != "s3rver":  # its log names no request's method
        print(f"\nrequests of the server, the last repeat of each path ({server_name}'s access log)")
        print("| path | " + " | ".join(kinds) + " |")
        print("| --- | " + " | ".join("---" for _ in kinds) + " |")
        for path, counted in asked.items():
            print(f"| {path} | " + " | ".join(str(counted[k]) for k in kinds) + " |")
    print("\nwhat the server takes per request, timed apart (median of 5)")
    print("| request | s |")
    print("| --- | --- |")
    for request, seconds in costs.items():
        print(f"| {request} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
