import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors"  # the reference agent's measured behaviour, see its README
PYTHON = sys.executable
