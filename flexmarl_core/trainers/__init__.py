"""The trainer kinds a worker composes (`kinds.py`): the policy (`policy.py`) and the critic
(`critic.py`), and the estimator scopes a policy's train op reads by (`scopes.py`). Typed against
`runtime/view.py` `WorkerView`, never the worker itself."""
