"""The image's bake step, ``python3 /src/download_model.py`` (worker-vllm's path): see
``worker.model.download_model``."""

import sys

from worker.model.download_model import main

if __name__ == "__main__":
    sys.exit(main())
