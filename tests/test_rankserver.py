"""The ranks' fork server: started only when the command will start ranks, and never outliving the command."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

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


def test_the_server_starts_only_where_ranks_will() -> None:
    from osdpipe import rankserver

    rankserver.start_early(["--help"])
    rankserver.start_early(["runtime.mode=offline", "target.world_size=64"])
    assert not rankserver._started
