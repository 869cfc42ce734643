"""Teams as programs: a Python program calls its agents through flexmarl's OpenAI-compatible
endpoint, and every call becomes a MEG Store row (guide: docs/programs.md)."""
