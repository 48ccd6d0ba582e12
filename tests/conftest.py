import sys
from pathlib import Path

# Tests are in a folder per layer of the package; what they share (helpers, the
# tests' own models, fault injection) is in support/. The user-model tests name
# their model as usermodel:make, as a user would with their own package on
# PYTHONPATH; spawned ranks inherit this path. The tests folder itself is on it
# for the real frameworks' helpers (``frameworks.launch``).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "support"))
