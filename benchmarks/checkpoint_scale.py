"""osdpipe against the paths PyTorch users take today, side by side, at checkpoint scale.

Run (the default is the row the targets are set on; the full grid takes long):

    python benchmarks/checkpoint_scale.py --sizes 1.6 --pairs 4:2 --repeats 2
    python benchmarks/checkpoint_scale.py --sizes 0.4,1.6,6.4 --pairs 4:2,2:4,4:3
    python benchmarks/checkpoint_scale.py --sizes 25 --pairs 4:2,2:4 --paths osdpipe-offline-budget,limit --budget 1GB
    python benchmarks/checkpoint_scale.py --sizes 25 --pairs 4:2 --repeats 3 \
        --paths osdpipe-offline-budget,osdpipe-offline-budget-dcp,limit
    python benchmarks/checkpoint_scale.py --sizes 6.4 --pairs 4:8 --repeats 3 \
        --paths osdpipe-offline,osdpipe-offline-2,osdpipe-torchrun-2x1,limit
    python benchmarks/checkpoint_scale.py --sizes 25 --pairs 4:2 --repeats 3 --cold --paths \
        osdpipe-offline-budget,osdpipe-offline-budget-dcp,osdpipe-offline-budget-2,osdpipe-offline-budget-dcp-2,copy

(the last: a source larger than this machine's memory, which only an
offline conversion under a budget converts here; it needs about 60 GB of disk)

For each size of Adam state (GB: exp_avg and exp_avg_sq of osdpipe's ``mlp``,
width scaled, depth 12, FSDP1 units per Linear) it synthesizes the source
itself, without training: one ``fsdp_full`` file of random state, and from it
an N-rank ``dcp`` checkpoint. Then, for each N -> M and alternating the paths
in every repeat, each path writes every target rank's ``optim.state_dict()``
(FSDP1, ``use_orig_params``, per Linear) as a file:

* ``osdpipe``: the command, online, ``pipeline.checks=[roundtrip]``;
* ``osdpipe-offline``: the same with ``runtime.mode=offline``;
* ``osdpipe-scatter``: online, rank 0 reads and sends every other rank its
  ranges (``runtime.transfer=scatter``);
* ``osdpipe-offline-2``: offline, played by 2 local workers (``runtime.workers=2``);
* ``osdpipe-torchrun-2x1``: offline, played by a 2-node torchrun world on this
  machine (two agents, one process each, a c10d rendezvous on 127.0.0.1);
* ``osdpipe-offline-budget``: offline under ``runtime.memory_budget`` (``--budget``),
  so each rank's output is made as it is written: its ``save`` stage is the
  whole conversion (read, compare, write), and its "in flight" is ``-``;
* ``osdpipe-offline-budget-dcp``: the same, the output one DCP checkpoint;
* ``osdpipe-offline-budget-2``, ``osdpipe-offline-budget-dcp-2``: the two above
  played by 2 local workers (``runtime.workers=2``), each under the budget:
  two writers, as ``copy`` has;
* ``osdpipe-dcp``: online, the output one DCP checkpoint (``output.format=dcp``);
* ``fsdp1``: PyTorch's FSDP1 path on M ranks: rank 0 loads the file,
  ``FSDP.optim_state_dict_to_load`` with ``rank0_only``, each rank saves;
* ``dcp``: the DCP path on M ranks: ``get_optimizer_state_dict``,
  ``dcp.load`` of the N-rank DCP source, ``set_optimizer_state_dict``, save;
* ``limit``: what no conversion can beat on this machine: ``import
  torch.distributed``, then one ``dd ... conv=fdatasync`` per target rank,
  in parallel, each writing that rank's share of the output's bytes. Every
  path's ``x limit`` is its median over this one's. Its ``dd`` seconds alone
  give the disk's synced write throughput, which the osdpipe paths' own
  (output bytes over their ``save`` stage) is set against;
* ``copy``: the physical limit of a conversion that must read its source:
  one ``dd ... conv=fdatasync`` per target rank, in parallel, each copying
  that rank's share of the source file's bytes from its disk to the
  output's. Every path's ``x copy`` is its median over this one's.

Each timing is the whole command (a fresh process, imports and model
building included), median of the repeats. Memory is each rank's peak RSS
and peak anonymous memory (``osdpipe.core.memory``; memory-mapped input is RSS,
not anonymous), largest rank shown. ``cp`` copies the source file once per
size for the offline throughput ratio (output bytes per second over cp's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
#: osdpipe's paths: the command with these overrides (``{budget}``: the --budget option).
OSDPIPE_PATHS = {
    "osdpipe": (),
    "osdpipe-offline": ("runtime.mode=offline",),
    "osdpipe-scatter": ("runtime.transfer=scatter",),
    "osdpipe-offline-2": ("runtime.mode=offline", "runtime.workers=2"),
    "osdpipe-torchrun-2x1": ("runtime.mode=offline",),
    "osdpipe-offline-budget": ("runtime.mode=offline", "runtime.memory_budget={budget}"),
    "osdpipe-offline-budget-dcp": ("runtime.mode=offline", "runtime.memory_budget={budget}", "output.format=dcp"),
    "osdpipe-offline-budget-2": ("runtime.mode=offline", "runtime.memory_budget={budget}", "runtime.workers=2"),
    "osdpipe-offline-budget-dcp-2": (
        "runtime.mode=offline",
        "runtime.memory_budget={budget}",
        "runtime.workers=2",
        "output.format=dcp",
    ),
    "osdpipe-dcp": ("output.format=dcp",),
}
#: Paths whose command runs under torchrun agents, one per node (each node one process): the path -> how many nodes.
TORCHRUN_NODES = {"osdpipe-torchrun-2x1": 2}
PATHS = (*OSDPIPE_PATHS, "limit", "copy", "fsdp1", "dcp")
DEPTH = 12


def width_for(gigabytes: float) -> int:
    """The mlp width whose Adam state (8 bytes per parameter) is about ``gigabytes``, a multiple of 64."""
    params = gigabytes * 1e9 / 8 / DEPTH
    return max(64, round(math.sqrt(params) / 64) * 64)


# ---------------------------------------------------------------------------
# the source
# ---------------------------------------------------------------------------


def synthesize(width: int, directory: Path, source_ranks: int, with_dcp: bool) -> tuple[Path, Path]:
    """An fsdp_full file of random Adam state for the mlp, and (``with_dcp``) an N-rank dcp checkpoint of it
    (written by osdpipe offline).

    The file is streamed (:func:`write_random_state`), so a source larger than
    this machine's memory (the 25 GB case) can be made on it.
    """
    full = directory / "optim.pt"
    if not full.exists():
        write_random_state(width, full)
    read_once(full)
    dcp = directory / f"dcp_{source_ranks}"
    if with_dcp and not (dcp / "dcp" / ".metadata").exists():
        osdpipe_command(
            width,
            full,
            "fsdp_full",
            source_ranks,
            source_ranks,
            dcp,
            "runtime.mode=offline",
            "output.format=dcp",
            "pipeline.checks=[]",
        )
    return full, dcp / "dcp"


def read_once(path: Path) -> None:
    """Read the source through once, so that every path finds it in the page cache alike (as far as it fits).

    The source is written around the page cache, so without this the first
    path timed would alone read it from the disk; and a path that held much
    memory (offline: the mapped source and one rank's output), or ``dd``
    writing through the page cache, pushes part of it out for the next.
    """
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 26):
            pass


def drop_page_cache() -> None:
    """Write every dirty page out and drop the clean ones, so that the next run reads its source from the disk.

    Raises:
        SystemExit: the machine does not allow it (not root, or a container without the file): run without ``--cold``.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(
            f"--cold: cannot drop the page cache here ({exc}); run without --cold, and say the cache was warm"
        ) from None


def fits_in_memory(path: Path) -> bool:
    """Whether the file takes at most half of the memory available now: then it can be read into the page cache
    before each path."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():  # MemAvailable counts the page cache that can be reclaimed, the source's own pages among them
        available = next(
            int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")
        )
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return path.stat().st_size <= available // 2


def write_random_state(width: int, path: Path) -> None:
    """``torch.save`` of a full Adam state dict of random values, written without ever holding it.

    The state's tensors are ``torch.empty`` placeholders, never touched (so
    never given memory); the file is written by osdpipe's torch-file writer
    (:mod:`osdpipe.io.torchfile`), which here takes each placeholder's bytes
    from a filler (``filled_as_written``, as osdpipe's own output made as it is
    written does): fresh random values a piece at a time, ``exp_avg`` normal,
    ``exp_avg_sq`` uniform in [0, 1).
    Seeded: the same width gives the same file.
    """
    import torch

    from osdpipe.io import torchfile

    gen = torch.Generator().manual_seed(0)
    draws: dict[int, object] = {}  # each placeholder's storage: how its values are drawn
    state, names = {}, []
    for i in range(DEPTH):
        for name, shape in ((f"layers.{i}.weight", (width, width)), (f"layers.{i}.bias", (width,))):
            names.append(name)
            state[name] = {"step": torch.tensor(10.0), "exp_avg": torch.empty(shape), "exp_avg_sq": torch.empty(shape)}
            draws[state[name]["exp_avg"].untyped_storage()._cdata] = torch.randn
            draws[state[name]["exp_avg_sq"].untyped_storage()._cdata] = torch.rand
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
               "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": False, "params": names}]  # fmt: skip

    class RandomFiller:  # a torchfile.Filler: each placeholder's values, drawn 64 MB at a time as its record is written
        def fills(self, storage: torch.UntypedStorage) -> bool:
            return storage._cdata in draws

        def windows(self, storage: torch.UntypedStorage):
            draw, numel = draws[storage._cdata], storage.nbytes() // 4
            for start in range(0, numel, 1 << 24):
                yield memoryview(draw(min(1 << 24, numel - start), generator=gen).numpy())

    with torchfile.written(path, sync=True) as out, torchfile.filled_as_written(RandomFiller()):
        torchfile.write_archive({"state": state, "param_groups": groups}, out)


# ---------------------------------------------------------------------------
# the paths
# ---------------------------------------------------------------------------


def osdpipe_command(width: int, source: Path, fmt: str, n: int, m: int, out: Path, *extra: str, nodes: int = 0) -> dict:
    """The ``osdpipe`` command, or with ``nodes``, that many torchrun agents (one process each) running it as one
    world."""
    launcher = [sys.executable, "-m", "osdpipe"]
    if nodes:
        from osdpipe.run.launch import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    "--rdzv-id", f"bench{time.monotonic_ns()}", "-m", "osdpipe"]  # fmt: skip
    cmd = [
        *launcher, "model.factory=mlp", f"model.kwargs.width={width}", f"model.kwargs.depth={DEPTH}",
        f"input.path={source}", f"input.format={fmt}", f"source.world_size={n}", "source.wrap=[Linear]",
        f"target.world_size={m}", "target.wrap=[Linear]", "target.use_orig_params=true", "pipeline.checks=[roundtrip]",
        f"output.path={out}", "output.overwrite=true", "runtime.progress=false", *extra,
    ]  # fmt: skip
    logs = [
        tempfile.TemporaryFile("w+") for _ in range(max(1, nodes))
    ]  # files, not pipes: an agent never blocks on a full pipe the other waits behind
    agents = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True) for log in logs]
    codes = [a.wait() for a in agents]
    for code, log in zip(codes, logs):
        if code != 0:
            log.seek(0)
            raise RuntimeError(f"osdpipe failed: {log.read().strip()}")
    return json.loads((out / "report.json").read_text())


def _baseline_rank(rank: int, world: int, port: int, path: str, width: int, source: str, out: str) -> None:
    """One rank of PyTorch's own path (``fsdp1`` or ``dcp``); writes its file and its memory peaks."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from osdpipe.core.memory import MemoryWatch
    from osdpipe.layout.models import MLP

    warnings.simplefilter("ignore")
    watch = MemoryWatch(f"rank {rank}").start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        MLP(width, DEPTH),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    if path == "fsdp1":
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

        FSDP.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=True),
            FullOptimStateDictConfig(rank0_only=True),
        )
        full = torch.load(source, map_location="cpu", weights_only=True) if rank == 0 else {}
        osd = FSDP.optim_state_dict_to_load(model, optim, full)
        del full
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optim": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=source)
        set_optimizer_state_dict(model, optim, state["optim"])
        del state
        osd = optim.state_dict()
    torch.save(osd, Path(out) / f"rank_{rank}.pt")
    seconds = time.perf_counter() - start
    dist.barrier()
    peak = watch.stop()
    (Path(out) / f"memory_{rank}.json").write_text(json.dumps({**peak.__dict__, "seconds": seconds}))
    dist.destroy_process_group()


def baseline_command(path: str, width: int, source: Path, m: int, out: Path) -> dict:
    """Run PyTorch's path as its own command (this script in worker mode); its ranks' memory and seconds."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        path,
        "--width",
        str(width),
        "--source",
        str(source),
        "--world",
        str(m),
        "--out",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{path} failed: {result.stderr.strip()[-2000:]}")
    ranks = [json.loads((out / f"memory_{r}.json").read_text()) for r in range(m)]
    return {"memory": ranks, "conversion_s": max(r["seconds"] for r in ranks)}


def worker_main(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from osdpipe.run.launch import free_port

    mp.start_processes(
        _baseline_rank,
        args=(args.world, free_port(), args.worker, args.width, args.source, args.out),
        nprocs=args.world,
        start_method="spawn",
    )


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------


def run_path(path: str, width: int, full: Path, dcp: Path, n: int, m: int, out: Path, budget: str) -> dict:
    start = time.perf_counter()
    if path in ("limit", "copy"):
        result = limit_command(full.stat().st_size, m, out, full if path == "copy" else None)
        result["seconds"] = time.perf_counter() - start
        result["bytes"] = output_bytes(out)
        return result
    if path in OSDPIPE_PATHS:
        extra = [arg.format(budget=budget) for arg in OSDPIPE_PATHS[path]]
        report = osdpipe_command(width, full, "fsdp_full", n, m, out, *extra, nodes=TORCHRUN_NODES.get(path, 0))
        result = {
            "memory": report["memory"], "conversion_s": sum(s["seconds"] for s in report["stages"]),
            "stages": {s["name"]: s["seconds"] for s in report["stages"]},
            "sent": sum(s["sent"] for s in report["stages"] if s["name"] == "shard"),
            "output_bytes": report["output_bytes"],
        }  # fmt: skip
    else:
        result = baseline_command(path, width, dcp if path == "dcp" else full, m, out)
    result["seconds"] = time.perf_counter() - start
    result["bytes"] = output_bytes(out)
    return result


def output_bytes(out: Path) -> int:
    """The bytes of a path's output data files: its rank files (``limit``: dd's), or a DCP checkpoint's."""
    return sum(p.stat().st_size for pattern in ("rank_*", "dcp/*.distcp") for p in out.glob(pattern))


def limit_command(total: int, m: int, out: Path, source: Path | None = None) -> dict:
    """``import torch.distributed``, then ``m`` synced ``dd`` writes of ``total / m`` bytes each, in parallel;
    ``dd_s``: the writes alone.

    From ``/dev/zero``, or with ``source``, each its share of the source's bytes (a copy: read and written).
    """
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True)
    out.mkdir(parents=True, exist_ok=True)
    share = -(-total // m)
    start = time.perf_counter()
    writers = [
        subprocess.Popen(["dd", f"if={source or '/dev/zero'}", f"of={out / f'rank_{r}.bin'}", "bs=16M",
                          f"count={share}", f"skip={r * share if source else 0}", "iflag=count_bytes,skip_bytes",
                          "conv=fdatasync"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(m)
    ]  # fmt: skip
    if any(w.wait() for w in writers):
        raise RuntimeError("dd failed")
    return {"dd_s": time.perf_counter() - start, "memory": [], "conversion_s": 0.0}


def in_flight(run: dict) -> str:
    """The most anonymous memory a process held beyond its baseline and the output it holds (offline: one target
    rank's at a time).

    ``-`` where a process held less than its output: its output was made as it was written
    (``osdpipe.run.streamed_output``), never held whole.
    """
    if "output_bytes" not in run:
        return "-"
    memory, outputs = run["memory"], run["output_bytes"]
    held = (
        outputs if len(memory) == len(outputs) else [max(outputs)] * len(memory)
    )  # online: its own; offline workers: one rank's at a time
    beyond = [(m["peak_anonymous"] or 0) - (m["baseline_anonymous"] or 0) - out for m, out in zip(memory, held)]
    return "-" if min(beyond) < 0 else f"{max(beyond) / 1e9:.2f}"


def write_throughput(runs: list[dict]) -> str:
    """Output bytes over the save stage's seconds (median): how fast a path writes (``limit``: dd's own)."""
    seconds = [r["stages"]["save"] for r in runs if r.get("stages")] or [r["dd_s"] for r in runs if "dd_s" in r]
    return f"{runs[-1]['bytes'] / 1e9 / statistics.median(seconds):.2f}" if seconds else "-"


def write_ratio(runs: list[dict], limit: list[dict]) -> str:
    """A path's write throughput over dd's, for the same bytes."""
    ours = runs[-1]["bytes"] / statistics.median(r["stages"]["save"] for r in runs)
    theirs = limit[-1]["bytes"] / statistics.median(r["dd_s"] for r in limit)
    return f"{ours / theirs:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.6", help="GB of Adam state, comma-separated")
    parser.add_argument("--pairs", default="4:2", help="N:M source:target ranks, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--workdir", default=None, help="where sources and outputs go (default: a temporary directory)")
    parser.add_argument("--budget", default="1GB", help="runtime.memory_budget of the osdpipe-offline-budget path")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before every run (needs root: /proc/sys/vm/drop_caches); "
        "else the source is read into it first where it fits",
    )
    parser.add_argument("--worker", choices=("fsdp1", "dcp"), help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    paths = args.paths.split(",")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="osdpipe-bench-"))
    rows = []
    print(
        "| state GB | N -> M | path | median s | x fsdp1 | x dcp | x limit | conversion s | write GB/s (save) "
        "| peak RSS GB | peak anon GB (beyond baseline) "
        "| in flight GB (anon beyond baseline and output) | sent GB / receivers' GB | output GB/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (float(s) for s in args.sizes.split(",")):
        width = width_for(size)
        for pair in args.pairs.split(","):
            n, m = (int(x) for x in pair.split(":"))
            directory = root / f"{size}GB"
            directory.mkdir(parents=True, exist_ok=True)
            full, dcp = synthesize(width, directory, n, with_dcp="dcp" in paths)
            runs: dict[str, list[dict]] = {p: [] for p in paths}
            failed: dict[str, str] = {}
            for _ in range(args.repeats):
                for path in paths:  # alternating: the machine's drift falls on every path alike
                    if path in failed:
                        continue
                    out = directory / f"out_{path}"
                    try:
                        if args.cold:
                            # every path reads its source from the disk, as a first conversion after a job would
                            drop_page_cache()
                        elif fits_in_memory(full):
                            read_once(full)  # the paths before this one may have pushed some of it out
                        runs[path].append(run_path(path, width, full, dcp, n, m, out, args.budget))
                    except (
                        RuntimeError
                    ) as exc:  # a path that cannot run here (PyTorch's own, out of memory) is a finding, not the end
                        failed[path] = (
                            "killed (out of memory?)"
                            if "SIGKILL" in str(exc)
                            else str(exc).strip().splitlines()[-1][:100]
                        )
                    shutil.rmtree(out, ignore_errors=True)
            for path, why in failed.items():
                print(f"| {size} | {n} -> {m} | {path} | failed: {why} |  |  |  |  |  |  |  |  |  |  |", flush=True)
                rows.append({"size_gb": size, "n": n, "m": m, "path": path, "failed": why})
            paths_run = [p for p in paths if p not in failed]
            medians = {p: statistics.median(r["seconds"] for r in runs[p]) for p in paths_run}
            for path in paths_run:
                last = runs[path][-1]
                rss = max((x["peak_rss"] for x in last["memory"]), default=0) / 1e9
                anon = (
                    max(
                        ((x["peak_anonymous"] or 0) - (x["baseline_anonymous"] or 0) for x in last["memory"]), default=0
                    )
                    / 1e9
                )
                ratio = lambda base: f"{medians[base] / medians[path]:.2f}" if base in medians else "-"  # noqa: E731
                times = f"{medians[path] / medians['limit']:.2f}" if "limit" in medians else "-"
                conv = statistics.median(r["conversion_s"] for r in runs[path])
                flight, sent = in_flight(last), "-"
                if last.get("sent"):
                    # rank 0 reads for the others
                    sent = f"{last['sent'] / 1e9:.2f} / {sum(last['output_bytes'][1:]) / 1e9:.2f}"
                write = write_throughput(runs[path])
                row = (
                    f"| {size} | {n} -> {m} | {path} | {medians[path]:.1f} | {ratio('fsdp1')} | {ratio('dcp')} "
                    f"| {times} | {conv:.1f} | {write} | {rss:.2f} "
                    f"| {anon:.2f} | {flight} | {sent} | {last['bytes'] / 1e9 / medians[path]:.2f} |"
                )
                print(row, flush=True)
                rows.append({"size_gb": size, "n": n, "m": m, "path": path, "runs": runs[path]})
            if "limit" in medians:
                for path in (p for p in paths_run if p in OSDPIPE_PATHS):
                    ratio = write_ratio(runs[path], runs["limit"])
                    print(
                        f"|  |  | {path}: write throughput / dd's (fdatasync, same bytes) | {ratio} "
                        "|  |  |  |  |  |  |  |  |  |  |  |"
                    )
            if "copy" in medians:
                for path in (p for p in paths_run if p in OSDPIPE_PATHS):
                    print(
                        f"|  |  | {path}: median / copy's (dd from the source's disk to the output's, fdatasync) "
                        f"| {medians[path] / medians['copy']:.2f} |  |  |  |  |  |  |  |  |  |  |  |"
                    )
    (root / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nraw results: {root / 'results.json'}")


if __name__ == "__main__":
    main()
