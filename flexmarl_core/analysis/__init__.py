"""Analysis of finished runs from their op logs, and of the machine they ran on: the floors of a
schedule and replays of its measured ops (`bound`), and why a wall-time speedup falls short of
its bound (`shortfall`). The bench scripts are command lines over these. (What a run
needs in memory before it starts is the control plane's: `control/memory.py`.)"""
