"""edgespec: exact speculative decoding (chain, tree, adaptive) on llama.cpp."""

__version__ = "0.1.0"
