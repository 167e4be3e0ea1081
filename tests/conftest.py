"""Tests run from the repository root (`make test`); make the top-level scripts importable."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
