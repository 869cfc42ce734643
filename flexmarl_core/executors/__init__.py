"""The executor seam (`api.py`) and the in-process thread executor (`threads.py`)."""
