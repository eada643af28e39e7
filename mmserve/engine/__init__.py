"""The engine: core step loop, model runner, sampler, processor, detokenizer, offline `LLM`."""
