"""A user-defined team: word reversal from a JSONL file with a custom reward (see docs/teams.md)."""
