"""Runtime pieces below both the engine and the drafters: a model runner over a paged KV cache, and sequence state."""
