"""`python -m edgespec.bench ...` = `edgespec bench ...` without the other command groups (whose
imports, grpc and the generated protobuf modules, a bare GPU machine may lack)."""

import typer

from edgespec.cli.bench import bench

if __name__ == "__main__":
    typer.run(bench)
