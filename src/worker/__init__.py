"""The worker's code, in rooms; ``handler.py`` (one level up) puts them together."""
