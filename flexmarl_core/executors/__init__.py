"""The executor seam (`api.py`); the in-process thread executor that tests and benches use
stands beside the simulator (`sim/threads.py`)."""
