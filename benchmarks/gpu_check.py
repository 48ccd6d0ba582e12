"""The checks a GPU machine runs that a CPU machine cannot: NCCL, CUDA tensors, FSDP1 and FSDP2 on a GPU.

Run on a machine with one CUDA GPU (under 5 minutes; ``benchmarks/gpu_check.sh`` runs this and the 1.6 GB row):

    python benchmarks/gpu_check.py [--workdir DIR]

Each case is the ``osdpipe`` command on a world of one GPU (several ranks cannot share one GPU under NCCL):
the source job trains on the GPU with NCCL (CUDA tensors), saves, osdpipe converts it, and every check runs
(``load_step`` and ``resume`` load the output into the target job on the GPU and step). One more case asks
whether FSDP1's ``FSD.optim_state_dict`` with ``offload_to_cpu=True`` gives ``exp_avg == exp_avg_sq`` on a GPU,
as it does on CPU with gloo (docs/usage.md's loading section). It prints one table, and exits 1 when a case fails.
``tests/gpu/test_gpu.py`` runs the same cases, marked ``gpu``, and skips them without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: case -> the osdpipe overrides of its conversion (each on one GPU, NCCL, every check).
CASES: dict[str, list[str]] = {
    "default on NCCL (fsdp1 -> fsdp1, rank files)": [],
    "fsdp1 use_orig_params full file -> fsdp2 dcp": [
        "source.use_orig_params=true", "target.kind=fsdp2", "output.format=dcp",
    ],
    "fsdp2 sharded (dcp) -> fsdp1 full file": [
        "source.kind=fsdp2", "source.state_dict_type=sharded", "target.kind=fsdp1", "output.format=fsdp_full",
    ],
}
ONE_GPU = ["source.world_size=1", "target.world_size=1", "runtime.backend=nccl", "runtime.progress=false"]

#: Run as ``python gpu_check.py --moments``: FSDP1 use_orig_params on the GPU, gathered with the default offload.
MOMENTS = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda(), use_orig_params=True)
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(2):
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    optim.step()
    optim.zero_grad()
state = FSDP.optim_state_dict(model, optim)["state"]
print("ALIKE" if all(torch.equal(s["exp_avg"], s["exp_avg_sq"]) for s in state.values()) else "DISTINCT")
dist.destroy_process_group()
"""


def run_case(name: str, overrides: list[str], work: Path) -> dict:
    """One conversion through the command; its outcome, seconds and each check's result from report.json."""
    out = work / re.sub(r"\W+", "_", name).strip("_")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "osdpipe", *ONE_GPU, *overrides, f"output.path={out}"],
        capture_output=True, text=True, timeout=240, cwd=work,
    )
    seconds = time.perf_counter() - start
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    checks = {c["name"]: c["ok"] for c in report.get("checks", [])}
    ok = done.returncode == 0 and report.get("ok") is True
    detail = ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in checks.items()) or done.stderr.strip()[-300:]
    return {"case": name, "ok": ok, "seconds": seconds, "detail": detail}


def run_moments(work: Path) -> dict:
    """Whether the FSDP1 gather trap of CPU happens on a GPU (a finding either way; the case fails only on an error)."""
    start = time.perf_counter()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    done = subprocess.run(
        [sys.executable, "-c", MOMENTS], capture_output=True, text=True, timeout=120, env=env, cwd=work
    )
    said = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-300:]
    found = {"ALIKE": "exp_avg == exp_avg_sq on the GPU too", "DISTINCT": "distinct moments on the GPU"}
    detail = found.get(said, said)
    return {"case": "FSDP1 use_orig_params FSD.optim_state_dict on the GPU", "ok": done.returncode == 0,
            "seconds": time.perf_counter() - start, "detail": detail}


def table(rows: list[dict]) -> str:
    lines = ["| case | result | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {'ok' if r['ok'] else 'FAILED'} | {r['seconds']:.1f} | {r['detail']} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_case(name, overrides, work) for name, overrides in CASES.items()] + [run_moments(work)]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
