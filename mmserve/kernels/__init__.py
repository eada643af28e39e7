"""Attention and KV-cache kernels: the torch reference (`reference.py`) and fast twins with the same
signatures. `dispatch.py` picks one backend at start-up."""
