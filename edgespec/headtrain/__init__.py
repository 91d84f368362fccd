"""The EAGLE-3 head trainer (optional extra [train]): data from the target's own answers and
package text, the head and the target in jax, the training loop and held-out evaluation through
llama.cpp. `edgespec models train-head` runs it; serving reads only the head it writes
(`edgespec.heads`), so the daemon never imports this package or jax."""
