"""What runs in a worker process: its context (`worker.py`) and what its parts may use of it
(`view.py`)."""
