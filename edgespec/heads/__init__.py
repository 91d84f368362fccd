"""EAGLE-3 heads: their weights (`HeadWeights`), the GGUF that llama.cpp's eagle3 loader reads,
and the public HF layout. The trainer lives in `edgespec.heads.train` (optional extra [train])."""
