"""A run's files, the lowest level of flexmarl_core above the store: where they live
(`location.py`), the weights and trainer states published there (`weights.py`), and how new
weights reach a worker's engines (`transport.py`)."""
