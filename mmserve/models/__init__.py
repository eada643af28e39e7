"""Decoder language models with paged attention, and their weight loader."""
