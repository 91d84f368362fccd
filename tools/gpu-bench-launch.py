#!/usr/bin/env python3
"""`edgespec ARGS` (bench, bench-serve, ...) with flash attention set for every model the benches
load, from GPU_FLASH_ATTN (0 or 1; default 0).

A CUDA build without its flash-attention kernels (-DGGML_CUDA_FA=OFF, tools/gpu-check.sh and
tools/gpu-bench.sh: they double the build on a lent GPU box) cannot run the flash-attention op on
the GPU: llama.cpp would hand it to the CPU backend, copying the KV cache across every layer of
every forward. `[target] flash_attn` defaults to true, and neither `edgespec bench` nor the
daemons `bench-serve` starts take it from the command line, so this wraps the two places their
model settings are made: `bench_engine_config` (bench: the engine, and the head's engine of
--head) and `daemon_sections` (bench-serve: each level's daemon config file).

    GPU_FLASH_ATTN=0 python tools/gpu-bench-launch.py bench --suite ... --n-gpu-layers -1
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLASH_ATTN = os.environ.get("GPU_FLASH_ATTN", "0") == "1"


def _patch() -> None:
    import edgespec.bench.serve_systems as serve_systems
    import edgespec.cli.bench as cli_bench

    engine_config = cli_bench.bench_engine_config
    daemon_sections = serve_systems.daemon_sections

    def bench_engine_config(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        cfg = engine_config(*args, **kwargs)
        target = dataclasses.replace(cfg.target, flash_attn=FLASH_ATTN)
        draft = None if cfg.draft is None else dataclasses.replace(cfg.draft, flash_attn=FLASH_ATTN)
        cfg = dataclasses.replace(cfg, target=target, draft=draft)
        cfg.validate()
        return cfg

    def sections(**kwargs):  # noqa: ANN003, ANN202
        s = daemon_sections(**kwargs)
        s["target"]["flash_attn"] = FLASH_ATTN
        s["draft"]["flash_attn"] = FLASH_ATTN
        return s

    cli_bench.bench_engine_config = bench_engine_config
    serve_systems.daemon_sections = sections


def main() -> None:
    _patch()
    from edgespec.cli.main import app

    print(f"gpu-bench-launch: flash_attn = {str(FLASH_ATTN).lower()} for every model", file=sys.stderr)
    sys.argv = ["edgespec", *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
