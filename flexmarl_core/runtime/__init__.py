"""What runs in a worker process: its context, weights, transport, the run's files, the trainer kinds."""
