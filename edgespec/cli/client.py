"""`edgespec client generate|stream`, `edgespec health`, `edgespec stats`, `edgespec policy`,
`edgespec drain`: a small client for a running daemon."""

from __future__ import annotations

import json
import os
import sys

import typer

from edgespec.cli.common import fail

client_app = typer.Typer(help="Talk to a running edgespec daemon.", no_args_is_help=True)

ADDR = typer.Option("127.0.0.1:50051", "--addr", envvar="EDGESPEC_ADDR",
                    help="host:port of the daemon; several: a,b,c or dns:///name:port (round robin over the healthy ones).")
TOKEN = typer.Option("", "--token", envvar="EDGESPEC_TOKEN", help="Bearer token.")
CA = typer.Option("", "--ca", help="CA certificate (PEM): connect with TLS.")
CERT = typer.Option("", "--cert", help="Client certificate (PEM) for mutual TLS.")
KEY = typer.Option("", "--key", help="Client key (PEM) for mutual TLS.")
SERVER_NAME = typer.Option("", "--server-name", help="TLS server name override.")
TIMEOUT = typer.Option(300.0, "--timeout", help="Deadline in seconds.")


# Exit codes (README, "CLI"): a script can tell a typo from a dead daemon from a refused token.
EXIT_NOT_SERVING = 1  # `health`: the daemon answered, but is not SERVING (loading, draining)
EXIT_USAGE = 2  # bad flags or values, here or as the daemon judged them (INVALID_ARGUMENT)
EXIT_UNREACHABLE = 3  # no daemon answered: refused, dead, unreachable, not listening (UNAVAILABLE)
EXIT_DENIED = 4  # the daemon refused the credentials (UNAUTHENTICATED, PERMISSION_DENIED)
EXIT_FAILED = 5  # the daemon answered with another error (overloaded, deadline, internal, ...)


def _options(addr: str, token: str, ca: str, cert: str, key: str, server_name: str):
    from edgespec.errors import BadRequest
    from edgespec.server.channel import ClientOptions, resolve_target

    try:
        resolve_target(addr)
    except BadRequest as exc:
        fail(str(exc), EXIT_USAGE)
    for flag, path in (("--ca", ca), ("--cert", cert), ("--key", key)):
        if path and not os.path.isfile(path):
            fail(f"{flag}: file not found: {path}", EXIT_USAGE)
    return ClientOptions(addr=addr, token=token, ca=ca, cert=cert, key=key, server_name=server_name)


def exit_code_for(code) -> int:  # a grpc.StatusCode
    import grpc

    s = grpc.StatusCode
    if code == s.UNAVAILABLE:
        return EXIT_UNREACHABLE
    if code in (s.UNAUTHENTICATED, s.PERMISSION_DENIED):
        return EXIT_DENIED
    if code in (s.INVALID_ARGUMENT, s.OUT_OF_RANGE, s.UNIMPLEMENTED):
        return EXIT_USAGE
    return EXIT_FAILED


def _rpc_error(exc: Exception, addr: str = "") -> None:
    import grpc

    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        where = f" ({addr})" if addr and code == grpc.StatusCode.UNAVAILABLE else ""
        fail(f"{code.name}{where}: {exc.details()}", exit_code_for(code))
    raise exc


def _request(prompt: str, chat: bool, system: str, temperature, top_k, top_p, min_p, seed, max_tokens, stop, mode):
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb

    req = pb.GenerateRequest()
    if chat:
        if system:
            req.messages.add(role="system", content=system)
        req.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    s = req.sampling
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                    ("seed", seed), ("max_tokens", max_tokens)):
        if v is not None:
            setattr(s, name, v)
    s.stop.extend(stop or [])
    modes = {"auto": pb.AUTO, "off": pb.OFF, "plain": pb.OFF, "chain": pb.CHAIN, "tree": pb.TREE}
    if mode not in modes:
        fail(f"--mode must be one of {', '.join(modes)}, got {mode!r}")
    req.speculation.mode = modes[mode]
    return req


def _summary(final) -> dict:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(final, preserving_proto_field_name=True)
    d.pop("text", None)
    d.pop("token_ids", None)
    return d


def _unary(stub, req, timeout: float, metadata, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    resp = stub.Generate(req, timeout=timeout, metadata=metadata)
    if as_json:
        typer.echo(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), indent=2))
    else:
        typer.echo(resp.text)
        typer.echo(json.dumps(_summary(resp)), err=True)


def _stream(stub, req, timeout: float, metadata, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    final = None
    for chunk in stub.GenerateStream(req, timeout=timeout, metadata=metadata):
        if as_json:
            typer.echo(json.dumps(MessageToDict(chunk, preserving_proto_field_name=True)))
        else:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final = chunk
    if not as_json:
        sys.stdout.write("\n")
        if final is not None:
            typer.echo(json.dumps(_summary(final)), err=True)


def _gen_command(stream: bool):
    def command(
        prompt: str = typer.Argument(..., help="Prompt text (or the user message with --chat)."),
        chat: bool = typer.Option(False, "--chat", help="Send as a chat message (the model's template applies)."),
        system: str = typer.Option("", "--system", help="System message (with --chat)."),
        temperature: float | None = typer.Option(None, "--temperature"),
        top_k: int | None = typer.Option(None, "--top-k"),
        top_p: float | None = typer.Option(None, "--top-p"),
        min_p: float | None = typer.Option(None, "--min-p"),
        seed: int | None = typer.Option(None, "--seed"),
        max_tokens: int | None = typer.Option(None, "--max-tokens"),
        stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable)."),
        mode: str = typer.Option("auto", "--mode", help="auto|off|chain|tree."),
        as_json: bool = typer.Option(False, "--json", help="Print the full response as JSON."),
        addr: str = ADDR, token: str = TOKEN, ca: str = CA, cert: str = CERT, key: str = KEY,
        server_name: str = SERVER_NAME, timeout: float = TIMEOUT,
    ) -> None:
        import grpc

        from edgespec.proto.edgespec.v1 import inference_pb2_grpc
        from edgespec.server.channel import open_channel

        o = _options(addr, token, ca, cert, key, server_name)
        req = _request(prompt, chat, system, temperature, top_k, top_p, min_p, seed, max_tokens, stop, mode)
        with open_channel(o) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            try:
                (_stream if stream else _unary)(stub, req, timeout, o.metadata, as_json)
            except grpc.RpcError as exc:
                _rpc_error(exc, addr)

    command.__doc__ = ("Stream a generation chunk by chunk." if stream else "Generate (unary) and print the text.")
    return command


def health_cmd(
    service: str = typer.Option("", "--service", help="Service name ('' = the whole server)."),
    addr: str = ADDR, token: str = TOKEN, ca: str = CA, cert: str = CERT, key: str = KEY,
    server_name: str = SERVER_NAME, timeout: float = typer.Option(5.0, "--timeout"),
) -> None:
    """Standard gRPC health check; exit 0 when SERVING, 1 otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from edgespec.server.channel import open_channel

    o = _options(addr, token, ca, cert, key, server_name)
    with open_channel(o) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout, metadata=o.metadata)
        except grpc.RpcError as exc:
            _rpc_error(exc, addr)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    typer.echo(name)
    raise typer.Exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else EXIT_NOT_SERVING)


def _admin(call: str, request, addr, token, ca, cert, key, server_name, timeout):
    import grpc
    from google.protobuf.json_format import MessageToDict

    from edgespec.proto.edgespec.v1 import admin_pb2_grpc
    from edgespec.server.channel import open_channel

    o = _options(addr, token, ca, cert, key, server_name)
    with open_channel(o) as ch:
        try:
            resp = getattr(admin_pb2_grpc.AdminStub(ch), call)(request, timeout=timeout, metadata=o.metadata)
        except grpc.RpcError as exc:
            _rpc_error(exc, addr)
    typer.echo(json.dumps(MessageToDict(resp, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True), indent=2))


def stats_cmd(addr: str = ADDR, token: str = TOKEN, ca: str = CA, cert: str = CERT, key: str = KEY,
              server_name: str = SERVER_NAME, timeout: float = typer.Option(10.0, "--timeout")) -> None:
    """Admin.Stats as JSON (needs an admin token when auth is on)."""
    from edgespec.proto.edgespec.v1 import admin_pb2

    _admin("Stats", admin_pb2.StatsRequest(), addr, token, ca, cert, key, server_name, timeout)


def policy_cmd(
    speculation: str | None = typer.Option(None, "--speculation", help="auto|off"),
    max_draft_tokens: int | None = typer.Option(None, "--max-draft-tokens"),
    max_tree_nodes: int | None = typer.Option(None, "--max-tree-nodes"),
    max_tree_depth: int | None = typer.Option(None, "--max-tree-depth"),
    max_tokens: int | None = typer.Option(None, "--max-tokens"),
    reset: bool = typer.Option(False, "--reset", help="Drop earlier overrides first: the config file's values apply again."),
    clear_suffix_cache: bool = typer.Option(False, "--clear-suffix-cache",
                                            help="Empty the cross-request suffix cache (every caller's partition)."),
    model: str = typer.Option("", "--model", help="With --clear-suffix-cache: only this chat model's cache "
                              "(default: every chat model's)."),
    addr: str = ADDR, token: str = TOKEN, ca: str = CA, cert: str = CERT, key: str = KEY,
    server_name: str = SERVER_NAME, timeout: float = typer.Option(10.0, "--timeout"),
) -> None:
    """Admin.SetPolicy: force speculation off/auto and set limits for new requests (overrides of
    the config file that outlive SIGHUP until --reset)."""
    from edgespec.proto.edgespec.v1 import admin_pb2

    req = admin_pb2.SetPolicyRequest(reset=reset, clear_suffix_cache=clear_suffix_cache, model=model)
    if speculation is not None:
        names = {"auto": admin_pb2.SPECULATION_POLICY_AUTO, "off": admin_pb2.SPECULATION_POLICY_OFF}
        if speculation not in names:
            fail(f"--speculation must be auto or off, got {speculation!r}")
        req.speculation = names[speculation]
    for name, v in (("max_draft_tokens", max_draft_tokens), ("max_tree_nodes", max_tree_nodes),
                    ("max_tree_depth", max_tree_depth), ("max_tokens", max_tokens)):
        if v is not None:
            setattr(req, name, v)
    _admin("SetPolicy", req, addr, token, ca, cert, key, server_name, timeout)


def drain_cmd(resume: bool = typer.Option(False, "--resume", help="Leave drain mode."),
              addr: str = ADDR, token: str = TOKEN, ca: str = CA, cert: str = CERT, key: str = KEY,
              server_name: str = SERVER_NAME, timeout: float = typer.Option(10.0, "--timeout")) -> None:
    """Admin.Drain: stop admitting requests (health NOT_SERVING); in-flight ones finish."""
    from edgespec.proto.edgespec.v1 import admin_pb2

    _admin("Drain", admin_pb2.DrainRequest(resume=resume), addr, token, ca, cert, key, server_name, timeout)


def register(app: typer.Typer) -> None:
    app.add_typer(client_app, name="client")
    client_app.command("generate")(_gen_command(stream=False))
    client_app.command("stream")(_gen_command(stream=True))
    app.command("health")(health_cmd)
    app.command("stats")(stats_cmd)
    app.command("policy")(policy_cmd)
    app.command("drain")(drain_cmd)
