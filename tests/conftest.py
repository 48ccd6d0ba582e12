import sys
from collections import defaultdict
from pathlib import Path

import pytest

# Tests are in a folder per layer of the package; what they share (helpers, the
# tests' own models, fault injection) is in support/. The user-model tests name
# their model as usermodel:make, as a user would with their own package on
# PYTHONPATH; spawned ranks inherit this path. The tests folder itself is on it
# for the real frameworks' helpers (``frameworks.launch``).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "support"))

#: Session fixtures that take minutes to build (megatron-core training and saving every source layout): every
#: module that uses one runs on the worker that built it, not on each of them.
BUILT_ONCE = ("megatron_saves",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (pyproject's addopts), each test module is one unit of work for pytest-xdist: its
    module fixtures (a framework's saves, a converted source) are built on one worker, once. Modules that share a
    :data:`BUILT_ONCE` fixture are one unit together. Most tests wait on processes they start (ranks, servers,
    framework jobs), so two workers keep both cores busy where one left half of them idle. A third worker was
    measured slower (44:16 against 40:21 for the whole suite, one run each on the same day): the framework jobs
    keep both cores busy themselves, and beside two other workers took 1.1 to 2.4x as long (median 1.4x, over the 30
    framework tests among both runs' 60 slowest). Under ``-n 0`` the groups mean nothing.

    The units go out in xdist's own order (more tests first). Handing out the framework units first was tried and
    measured slower (58:19 against 50:24 for the whole suite): two of them at once, one on each worker, slow each
    other down more than a framework job beside many short tests does. Handing them out costliest first by a
    recorded run's seconds, one framework unit at a time (a scheduler of xdist's, tried and dropped), would save half
    a minute: replayed on a whole run's per-test times (2026-12-02, 46:08), xdist's order had the two workers done at
    45.9 and 45.0 minutes, that one at 45.4 and 45.4. The suite's time is its work, not its order."""
    modules: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        modules[item.nodeid.split("::")[0]].append(item)
    for module, its in modules.items():
        shared = next((f for f in BUILT_ONCE if any(f in getattr(i, "fixturenames", ()) for i in its)), None)
        for item in its:
            if item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(shared or module))


@pytest.fixture(autouse=True, scope="session")
def settled_vector_math() -> None:
    """Each test process settles oneMKL's vector math before its first test (:mod:`osdpipe.core.vector_math`), as
    osdpipe's own processes do: a test that steps an optimizer here, to compare bit for bit with what a conversion
    made, would otherwise be the process's first vector-math call, and a first call split over two threads can come
    back wrong in one thread's half (pytorch/pytorch#188792). A fixture, not a hook: xdist's controller runs no test
    and need not import torch."""
    from osdpipe.core import vector_math

    vector_math.settle()
