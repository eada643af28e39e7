"""Media in, embeddings out: decoding and preprocessing (torch-light) and the vision encoders."""
