"""The built wheel is the product: it carries its Hydra config and recipes and runs outside the checkout.

The wheel is built from a clean copy of the source tree (the files git
does not ignore, symlinks kept as symlinks), so a stale build/ directory in the
checkout cannot hide a file the wheel would miss, and installed into a fresh
venv that sees the machine's torch, hydra and pydantic (no downloads) but
imports osdpipe from the wheel, not from the editable checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import run_command

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

pytestmark = pytest.mark.slow


def run(
    cmd: list[str | Path], cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))}: exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result


def source_tree(dest: Path) -> Path:
    """Copy the checkout as git sees it (tracked plus untracked, not ignored; without git: the tree minus build
    products) to ``dest``, symlinks as symlinks."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        files = [f for f in listed.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        ignore = shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", "outputs", "multirun", ".venv", ".pytest_cache"
        )
        shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
        return dest
    for rel in files:
        src, dst = REPO / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # tracked but deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = source_tree(root / "src")
    assert (src / "conf" / "recipe").is_symlink(), "conf/recipe should be a symlink to ../recipes"
    dist = root / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "--no-index", "-w", dist],
        cwd=root,
    )
    wheels = list(dist.glob("osdpipe-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "osdpipe/conf/config.yaml" in names
    assert "osdpipe/conf/__init__.py" in names
    # Recipes reach the wheel through the symlink conf/recipe -> ../recipes.
    assert "osdpipe/conf/recipe/quickstart.yaml" in names
    recipes = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    assert sorted(
        n.removeprefix("osdpipe/conf/recipe/") for n in names if n.startswith("osdpipe/conf/recipe/")
    ) == recipes
    # Every config group file ships.
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        rel = path.relative_to(REPO / "conf").as_posix()
        assert f"osdpipe/conf/{rel}" in names, rel
    for module in sorted(REPO.glob("osdpipe/**/*.py")):
        assert module.relative_to(REPO).as_posix() in names
    assert "osdpipe = osdpipe.cli.entry:main" in entry_points


def test_wheel_installs_and_runs_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path, timeout=120)
    python, script = venv / "bin" / "python", venv / "bin" / "osdpipe"
    # The dependencies (torch, hydra, ...) come from the environment running the
    # tests, whether a venv or the system's: a plain path entry adds its
    # site-packages after the venv's own, without running its .pth hooks, so
    # the editable checkout installed there stays out of sight.
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
    ).stdout.strip()
    outer = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (Path(purelib) / "_outer_site_packages.pth").write_text("\n".join(outer) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["CI"] = "true"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run(
        [python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", wheel],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert script.exists()

    # The venv imports osdpipe (and its conf package) from its own site-packages, not the editable checkout.
    workdir = tmp_path / "work"
    workdir.mkdir()
    probe = run(
        [
            python,
            "-c",
            "import sysconfig, osdpipe, osdpipe.conf; print(sysconfig.get_paths()['purelib']);"
            " print(osdpipe.__file__); print(osdpipe.conf.__file__)",
        ],
        cwd=workdir,
        env=env,
    )
    purelib, package, conf = (Path(line).resolve() for line in probe.stdout.split())
    assert purelib.is_relative_to(venv.resolve())
    assert package == purelib / "osdpipe" / "__init__.py", package
    assert conf == purelib / "osdpipe" / "conf" / "__init__.py", conf

    out = tmp_path / "out"
    cmd = [str(script), "recipe=change_wrapping", f"output.path={out}"]
    result = run_command(cmd, cwd=workdir, env=env, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and report["error"] is None, report
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["target"]["wrap"] == ["Leaf"]  # the recipe came from the wheel's conf/recipe
    assert sorted(manifest["files"]) == ["rank_0.pt", "rank_1.pt"]
