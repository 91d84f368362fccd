"""EAGLE-3 heads at serving time: their weights (`HeadWeights`), the GGUF that llama.cpp's eagle3
loader reads, and the public HF layout. The trainer lives apart, in `edgespec.headtrain`
(optional extra [train]); the daemon never imports it."""
