"""GGUF checkpoints (llama.cpp's and Ollama's format), converted once into the Hugging Face layout.

reader.py: the file's config and tensors under Hugging Face names; tokenizer.py: its tokenizer files;
convert.py: the folder on disk and the cache of conversions; cache.py: the cache folder and file digests.
"""
