"""The ranks' fork server: started only when the command will start ranks, and never outliving the command."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import clean_env, processes_marked, run_command


def _run(args: list[str], tmp_path: Path) -> tuple[int, str, list[int]]:
    mark = uuid.uuid4().hex
    env = {**clean_env(), "OSDPIPE_TEST_MARK": mark}
    result = run_command([sys.executable, "-m", "osdpipe", *args], cwd=tmp_path, timeout=120, env=env)
    deadline = time.monotonic() + 10
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result.returncode, result.stderr, processes_marked(mark)


def test_no_process_outlives_a_run_or_a_config_error(tmp_path: Path) -> None:
    assert os.path.isdir("/proc"), "Linux: the fork server is a Linux and macOS feature; this check reads /proc"
    code, err, left = _run([f"output.path={tmp_path / 'ok'}"], tmp_path)
    assert code == 0 and left == [], (code, err, left)
    code, err, left = _run(["target.world_size=0"], tmp_path)  # the server was started, and is stopped at exit
    assert code == 2 and left == [], (code, err, left)


def test_the_server_starts_only_where_ranks_will(monkeypatch) -> None:
    from osdpipe.core import rankserver

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert rankserver.ranks_may_start(["output.path=/tmp/x"])
    assert not rankserver.ranks_may_start(["--help"])
    given = "input.path=/ckpt/optim.pt"
    assert not rankserver.ranks_may_start(["runtime.mode=offline", "target.world_size=64", given])
    assert rankserver.ranks_may_start(["runtime.mode=offline", "runtime.workers=3", given]), "workers start as ranks"
    assert not rankserver.ranks_may_start(["runtime.mode=offline", "runtime.workers=1", given])
    assert rankserver.ranks_may_start(["runtime.mode=offline", "target.world_size=64"]), "a source is trained on ranks"
    assert not rankserver.ranks_may_start(["+runtime.launcher=torchrun"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not rankserver.ranks_may_start(["output.path=/tmp/x"]), "under torchrun the command is a rank itself"


@pytest.mark.parametrize(
    ("mode", "workers", "input_given", "launcher", "starts"),
    [
        ("online", 1, True, "auto", True),
        ("offline", 1, True, "auto", False),
        ("offline", 3, True, "auto", True),  # the workers start as ranks
        ("offline", 1, False, "auto", True),  # the source is trained on ranks first
        ("online", 1, False, "torchrun", False),  # the command is a rank itself
    ],
)
def test_a_run_starts_ranks_by_its_mode_workers_input_and_launcher(monkeypatch, mode, workers, input_given, launcher,
                                                                   starts) -> None:
    """The one rule both the command line (:func:`ranks_may_start`) and the composed run (a recipe's mode or input,
    the embedded default's) are judged by."""
    from osdpipe.core import rankserver

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert rankserver.starts_ranks(mode, workers, input_given, launcher) is starts


def _pid_and(value: int) -> tuple[int, bool]:
    import sys

    return os.getpid(), "torch" in sys.modules and value == 7


def _refuses(text: str) -> None:
    raise ValueError(f"{text}\nand a second line")


def _breaks() -> None:
    raise KeyError("nope")


def _dies() -> None:
    os._exit(3)


def _sleeps() -> None:
    time.sleep(60)


def test_call_apart_answers_from_a_process_of_its_own_with_torch_imported() -> None:
    from osdpipe.core.rankserver import call_apart

    pid, ready = call_apart(_pid_and, (7,), timeout_s=120)
    assert pid != os.getpid() and ready
    with pytest.raises(ValueError, match=r"^the plan's own words$"):
        call_apart(_refuses, ("the plan's own words",), timeout_s=60)
    with pytest.raises(ValueError, match=r"^KeyError: 'nope'$"):
        call_apart(_breaks, (), timeout_s=60)
    with pytest.raises(ValueError, match=r"died \(exit code 3\)"):
        call_apart(_dies, (), timeout_s=60)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="took over 1 s"):
        call_apart(_sleeps, (), timeout_s=1)
    assert time.monotonic() - start < 30, "the process past its time is killed, not waited for"


def _threads() -> tuple[int, str | None]:
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_each_local_rank_gets_its_share_of_the_cores() -> None:
    """Two ranks on this machine each run torch's intra-op work on half the cores (at least one), not on all of them
    each; where the environment says ``OMP_NUM_THREADS``, that rules, as torch reads it."""
    from osdpipe.run.launch import run_local_world

    cores = len(os.sched_getaffinity(0))
    for threads, said in run_local_world(_threads, 2, backend="gloo", timeout_s=60):
        assert threads == (int(said) if said else max(1, cores // 2)), (threads, said, cores)


def test_a_users_omp_num_threads_is_left_to_rule(tmp_path: Path) -> None:
    code = "import torch; from osdpipe.run.launch import share_cores; share_cores(8); print(torch.get_num_threads())"
    result = run_command(
        [sys.executable, "-c", code], cwd=tmp_path, timeout=60, env={**clean_env(), "OMP_NUM_THREADS": "2"}
    )
    assert result.returncode == 0 and result.stdout.strip() == "2", result
    result = run_command(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        timeout=60,
        env={k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"},
    )
    assert result.returncode == 0 and result.stdout.strip() == "1", result  # 8 ranks on this machine: one thread each


def test_a_temporary_folder_too_long_for_the_servers_socket_spawns_the_ranks(tmp_path: Path) -> None:
    """A ``TMPDIR`` under which the fork server's ``AF_UNIX`` socket would not fit (107 bytes): the command ran its
    ranks from spawned processes instead, and converts; before, it failed with a traceback ("AF_UNIX path too long")."""
    from osdpipe.core import rankserver

    long = tmp_path / ("d" * max(1, rankserver.SOCKET_PATH_MAX - len(os.fsencode(str(tmp_path)))))
    long.mkdir()
    assert not rankserver.socket_fits(str(long)) and rankserver.socket_fits("/tmp")
    mark = uuid.uuid4().hex
    env = {**clean_env(), "OSDPIPE_TEST_MARK": mark, "TMPDIR": str(long)}
    done = run_command([sys.executable, "-m", "osdpipe", f"output.path={tmp_path / 'out'}"], cwd=tmp_path,
                       timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check resume     pass" in done.stdout + done.stderr
