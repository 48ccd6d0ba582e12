"""How often a fresh process's first float32 ``sqrt`` over two threads comes back wrong, with and without
:func:`osdpipe.core.vector_math.settle` before it, side by side in one run.

Run:

    python benchmarks/vml_first_call.py --processes 150

Each of ``--processes`` fresh Python processes per arm (``--concurrent`` at a
time; one by default: the race needs a process's two threads to run at the
same moment, which more processes than cores make rarer) starts torch's
intra-op threads with a large op that does not use oneMKL's vector math, lets
them fall idle, then takes ``sqrt`` of a (500, 32) float32 tensor, which torch
splits over two threads and hands to oneMKL, and takes it again. A first call
that differs from the second is corrupted (pytorch/pytorch#188792): oneMKL chose
its kernel for ``vsSqrt`` on that call, on both threads at once. The ``settled``
arm calls ``settle()`` first. The arms alternate process by process, so load
falls on both alike.

Prints a table: arm, processes, corrupted first calls, and the elements wrong
in each corrupted one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ARMS = ("cold", "settled")


def child(arm: str) -> None:
    """One fresh process's first ``sqrt``: prints how many elements differ from the second call's."""
    import torch

    torch.set_num_threads(2)
    (torch.rand(1 << 22) + 1).sum()  # the intra-op threads start on an op that is not oneMKL's vector math
    time.sleep(0.5)  # and fall idle, as between a conversion's stages
    if arm == "settled":
        from osdpipe.core import vector_math

        vector_math.settle()
    values = torch.rand(500, 32, generator=torch.Generator().manual_seed(0)) + 0.01
    first, second = values.sqrt(), values.sqrt()
    print(int((first != second).sum()))


def one(arm: str) -> int:
    done = subprocess.run([sys.executable, __file__, "--child", arm], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=150, help="fresh processes per arm")
    parser.add_argument("--concurrent", type=int, default=1, help="processes running at once")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    order = [arm for _ in range(args.processes) for arm in ARMS]
    with ThreadPoolExecutor(args.concurrent) as pool:
        wrong = list(pool.map(one, order))
    print("| arm | processes | corrupted first calls | elements wrong in each |")
    print("| --- | --- | --- | --- |")
    for arm in ARMS:
        counts = [n for a, n in zip(order, wrong) if a == arm]
        bad = [n for n in counts if n]
        print(f"| {arm} | {len(counts)} | {len(bad)} | {', '.join(map(str, bad)) or '-'} |")


if __name__ == "__main__":
    main()
