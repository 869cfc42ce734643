"""What runs a run: the run folder and loop, warm start, evaluation, audit, metrics and pictures."""
