"""`edgespec bench`: shipped prompt suites, an interleaved runner over the engine, and reports
(JSON, markdown, PNG) that can be set beside llama.cpp's own binaries (the anchor)."""
