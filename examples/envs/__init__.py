"""User-written environments: a class implementing `flexmarl_core.envs.Environment`, named in a
config as `python:<module>:<Class>` (see guess.py)."""
