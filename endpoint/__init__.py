"""The local RunPod endpoint (``python -m endpoint``)."""

import sys
from pathlib import Path

# The endpoint shares the worker's plain modules (no vLLM), such as its error dialects.
_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.append(_SRC)
