import sys
from pathlib import Path

# The user-model tests name their model as usermodel:make, as a user would with
# their own package on PYTHONPATH; spawned ranks inherit this path.
sys.path.insert(0, str(Path(__file__).parent))
