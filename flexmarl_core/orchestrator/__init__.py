"""The Joint Orchestrator: the plan, the event loop, its submission policies and hooks."""
