"""CPU-side scheduling: token budget, KV block allocation, policies. Must never import torch."""
