"""`mmserve bench`: speed measured side by side in one run, written as JSON."""

# Systems `mmserve bench throughput` compares (torch-free here so the CLI can list them cheaply).
SYSTEMS = ("mmserve", "mmserve-no-chunk", "mmserve-static", "mmserve-structured", "hf-static", "hf-cb")
WORKLOADS = ("random", "random-mm", "prefix", "long-video")
