"""`pdchat`: serve the model repository, chat with it, run the demo, prepare models and kernels."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pdchat import registry, tensors
from pdchat.core import settings
from pdchat.supervisor import Child, RestartPolicy, Supervisor

DEMO_QUESTION = "In two sentences, why is the sky blue?"
KERNELS = "kernels"  # `pdchat prepare kernels`: the C decode kernels, built for this host


# Commands that start servers or fronts, which read the settings from this environment.
SERVING_COMMANDS = ("serve", "demo", "router", "pd", "openai")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": _serve,
        "chat": _chat,
        "demo": _demo,
        "router": _router,
        "pd": _pd,
        "prepare": _prepare,
        "env": _env,
        "openai": _openai,
    }
    if args.command in SERVING_COMMANDS:
        try:  # what each server's models and fronts would refuse at load, refused before any starts
            settings.check_environment()
        except settings.ModelUnavailable as exc:
            _say(f"{args.command}: {exc}")
            return 2
    return handlers[args.command](args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdchat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run tritonserver on the model repository until interrupted")
    _server_options(serve)
    _served_names_option(serve)
    serve.add_argument("--role", default=registry.MONOLITHIC, choices=registry.ROLES)
    _supervision_options(serve)

    chat = commands.add_parser("chat", help="ask one question and print the answer as it streams")
    chat.add_argument("question")
    chat.add_argument(
        "--url", default="127.0.0.1:8001", help="server address (gRPC port, or HTTP port with --protocol http)"
    )
    _chat_options(chat)

    demo = commands.add_parser("demo", help="start a P/D pair and router on SmolLM2, stream one answer, stop")
    demo.add_argument("question", nargs="?", default=DEMO_QUESTION)
    demo.add_argument("--model", default=registry.DEFAULT_MODEL)
    demo.add_argument("--system", help="system prompt")
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")

    router = commands.add_parser("router", help="run the P/D router with its OpenAI-compatible API")
    router.add_argument("--prefill", action="append", required=True, help="prefill server gRPC address (repeatable)")
    router.add_argument("--decode", action="append", required=True, help="decode server gRPC address (repeatable)")
    router.add_argument(
        "--no-forward-ids",
        action="store_true",
        help="comparison mode for benchmarks: decode renders the request itself (checked against the signed ids)",
    )
    router.add_argument(
        "--policy",
        choices=("prefix", "least-loaded"),
        default="prefix",
        help="how a prefill server is picked: prefix (a conversation's next turn goes where its prefix is cached, "
        "unless that server is busier than the least loaded by more than 2 requests) or least-loaded",
    )
    router.add_argument(
        "--kv-event-source",
        action="append",
        default=[],
        metavar="PREFILL=ENDPOINT",
        help="a prefill server's KV events endpoint (its prefill_kv_events_endpoint, e.g. tcp://host:5557; repeat per "
        "server): the prefix policy then counts a conversation on it only while its blocks are held there",
    )
    router.add_argument(
        "--kv-event-replay-source",
        action="append",
        default=[],
        metavar="PREFILL=ENDPOINT",
        help="that server's replay endpoint (prefill_kv_events_replay_endpoint), for the messages the router missed",
    )
    router.add_argument(
        "--kv-event-block-size",
        type=int,
        help="tokens per KV block on those servers (default: setting kv_block_tokens, 16)",
    )
    _served_names_option(router)
    _http_options(router)

    openai = commands.add_parser(
        "openai", help="one server's chat behind a vLLM-compatible OpenAI API (for vllm-router and the like)"
    )
    openai.add_argument("--server", required=True, help="the server's gRPC address")
    _served_names_option(openai)
    _http_options(openai)

    pd = commands.add_parser("pd", help="start a prefill server, a decode server and the router on loopback")
    pd.add_argument("--model", default=registry.DEFAULT_MODEL)
    pd.add_argument("--connector", choices=registry.KV_CONNECTORS, default=registry.SHM)
    pd.add_argument("--port", type=int, default=8080, help="router port")
    _engine_option(pd)
    _served_names_option(pd)
    _supervision_options(pd)

    commands.add_parser(
        "env", help="print the exports and command that run a stock tritonserver on the model repository"
    )

    prepare = commands.add_parser(
        "prepare", help="build an embedded model, or the C kernels for this host (`kernels`), into the cache"
    )
    prepare.add_argument("name", choices=[*sorted(registry.EMBEDDED_MODELS), KERNELS])

    return parser


def _http_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on all but /health and /metrics "
        f"(default: ${settings.API_KEY.env}; unset: no key)",
    )
    parser.add_argument(
        "--tenant-header",
        help="the header that names each request's tenant (set by an authenticating proxy): each tenant gets "
        f"its own prefix cache and its own share of decode's KV; requests without it get 400 "
        f"(default: ${settings.TENANT_HEADER.env}; unset: one shared cache)",
    )
    parser.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    parser.add_argument("--max-connections", type=int, help="requests over this many connections get 503 (default 256)")
    parser.add_argument(
        "--header-timeout", type=float, help="seconds a client has to send a request's head (default 10)"
    )
    parser.add_argument("--body-timeout", type=float, help="seconds a client has to send a request's body (default 30)")
    parser.add_argument(
        "--keep-alive-timeout", type=float, help="idle kept-alive connections close after this (default 5 s)"
    )


def _engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("pdchat", "vllm"),
        help=f"the engine under prefill and decode (docs/engines.md); sets {settings.ENGINE.env} (default pdchat)",
    )


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    return {settings.ENGINE.env: args.engine} if args.engine else {}


def _served_names_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names a request's `model` may give, the first reported (as vLLM's); "
        f"default ${settings.SERVED_MODEL_NAME.env} (comma-separated), else the model's own name",
    )


def _served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name, else the setting (empty: the server's own name)."""
    if args.served_model_name:
        return settings.SERVED_MODEL_NAME.parse(",".join(args.served_model_name), "--served-model-name")
    return settings.SERVED_MODEL_NAME.get()


def _server_options(parser: argparse.ArgumentParser) -> None:
    from pdchat.launcher import DEFAULT_MODEL_REPOSITORY

    parser.add_argument(
        "--model",
        help=f"embedded model name ({', '.join(registry.EMBEDDED_MODELS)}) or HF model directory; "
        f"sets {settings.MODEL.env}",
    )
    _engine_option(parser)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the three ports listen on (0.0.0.0 in a container)"
    )


def _supervision_options(parser: argparse.ArgumentParser) -> None:
    policy = RestartPolicy()
    parser.add_argument(
        "--exit-on-failure",
        action="store_true",
        help="when a process dies, stop everything and exit 1 (for systemd or Kubernetes to restart the unit) "
        f"instead of restarting it (backoff {policy.first_delay_s:g} s doubling to {policy.max_delay_s:g} s, "
        f"{policy.describe()} per process, then exit 1)",
    )


def _chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--model-name", default="chat", help="Triton model to call (chat or chat_ensemble)")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--no-stream", action="store_true", help="print the answer once complete")


def _serve(args: argparse.Namespace) -> int:
    from pdchat.launcher import TritonServer

    env = {**({settings.MODEL.env: args.model} if args.model else {}), **_engine_env(args)}
    if args.served_model_name:
        env[settings.SERVED_MODEL_NAME.env] = ",".join(_served_names(args))
    server = TritonServer(
        args.model_repository,
        role=args.role,
        env=env,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
    )
    stop = _stop_on_signals()
    _say(f"starting tritonserver ({args.role}) on {args.model_repository}")
    with server:
        _say(
            f"ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}, "
            f"pid {server.process.pid}; Ctrl-C stops"
        )
        status = _supervise([server], stop, args.exit_on_failure)
    return _stopped(status)


def _chat(args: argparse.Namespace, url: str | None = None) -> int:
    from pdchat.clients.chat import ChatError, chat_inputs, connect

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}
    ]
    request = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": not args.no_stream,
    }
    client = connect(url or args.url, args.protocol, args.model_name)
    finish = ""
    try:
        for output in client.stream(chat_inputs(request)):
            print(output.text, end="", flush=True)
            finish = output.finish_reason
    except ChatError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"\n[finish_reason: {finish}]")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The whole system: prefill server, decode server, router; one streamed answer."""
    import json
    import urllib.request

    from pdchat import embedded
    from pdchat.clients.router import stream_completion
    from pdchat.launcher import PDStack

    if args.model in registry.EMBEDDED_MODELS:
        embedded.ensure_model(args.model)  # build before the servers start, with progress shown
    _say("starting a prefill server, a decode server (tritonserver each) and the P/D router")
    started = time.monotonic()
    with PDStack(model=args.model) as stack:
        _say(f"ready in {time.monotonic() - started:.1f} s; asking through {stack.router_url}/v1: {args.question!r}")
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.question}
        ]
        body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature}
        finish = ""
        for chunk in stream_completion(stack.router_url, body):
            print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
            finish = chunk["choices"][0]["finish_reason"] or finish
        print(f"\n[finish_reason: {finish}]")
        metrics = urllib.request.urlopen(stack.decode.metrics_url).read().decode()
        pulled = [
            line
            for line in metrics.splitlines()
            if line.startswith("pdchat_kv_pulls_total") and 'outcome="pulled"' in line
        ]
        stats = json.loads(urllib.request.urlopen(f"{stack.router_url}/health").read())["stats"]
        _say(f"router: {stats}; decode server: {pulled[0] if pulled else 'no KV pulls'}")
        _say("shutting the servers down")
    return 0 if finish else 1


def _router(args: argparse.Namespace) -> int:
    from pdchat.clients.kv_index import parse_sources
    from pdchat.clients.router import PDRouter

    try:
        front = PDRouter(
            args.prefill,
            args.decode,
            forward_ids=not args.no_forward_ids,
            served_model_names=_served_names(args),
            policy=args.policy,
            kv_events=parse_sources(args.kv_event_source, args.kv_event_replay_source),
            kv_event_block_size=args.kv_event_block_size,
            outputs=tensors.FRONT_OUTPUTS,
        )
    except ValueError as exc:
        print(f"pdchat router: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve_http(args, front, f"router (prefill {args.prefill}, decode {args.decode})")
    finally:
        front.close()


def _openai(args: argparse.Namespace) -> int:
    from pdchat.clients.fronts import ServerFront

    front = ServerFront(args.server, served_model_names=_served_names(args), outputs=tensors.FRONT_OUTPUTS)
    return _serve_http(args, front, f"OpenAI front of {args.server}")


def _serve_http(args: argparse.Namespace, front, what: str) -> int:
    import logging

    from pdchat.clients.openai_api import HttpSettings, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = {
        "max_body_bytes": args.max_body_bytes,
        "max_connections": args.max_connections,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
        "keep_alive_s": args.keep_alive_timeout,
    }
    http = HttpSettings(
        api_key=args.api_key or settings.API_KEY.get() or None,
        tenant_header=args.tenant_header or settings.TENANT_HEADER.get() or None,
        **{name: value for name, value in limits.items() if value is not None},
    )
    settings.keep_off_decode_cpus({})  # a decode server on this host steps on those alone
    _say(f"{what} on http://{args.host}:{args.port} (API key {'required' if http.api_key else 'not required'})")
    serve(front, args.host, args.port, http)
    return 0


def _pd(args: argparse.Namespace) -> int:
    from pdchat import embedded
    from pdchat.launcher import PDStack

    if args.model in registry.EMBEDDED_MODELS:
        embedded.ensure_model(args.model)
    stop = _stop_on_signals()
    _say("starting a prefill server, a decode server and the router")
    with PDStack(
        model=args.model,
        connector=args.connector,
        router_port=args.port,
        served_model_names=_served_names(args),
        env=_engine_env(args),
    ) as stack:
        _say(
            f"ready: OpenAI API at {stack.router_url}/v1 "
            f"(prefill gRPC {stack.prefill.grpc_url} pid {stack.prefill.process.pid}, "
            f"decode gRPC {stack.decode.grpc_url} pid {stack.decode.process.pid}, router pid {stack.router.pid}); "
            "Ctrl-C stops"
        )
        status = _supervise(stack.children(), stop, args.exit_on_failure)
        _say("stopping the router, then the servers")
    return _stopped(status)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _supervise(children: Sequence[Child], stop: threading.Event, exit_on_failure: bool) -> int:
    """Keep `children` running (pdchat.supervisor) until `stop` is set: then 0. A process
    that died with `exit_on_failure`, or past its restart budget, gives 1, for systemd or
    Kubernetes to restart the whole unit; the caller stops the rest."""
    return 0 if Supervisor(children, restart=not exit_on_failure, say=_say).run(stop) else 1


def _stopped(status: int) -> int:
    _say("stopped" if status == 0 else "stopped; exiting with status 1")
    return status


def _env(args: argparse.Namespace) -> int:
    from pdchat.launcher import stock_command

    print(stock_command())
    return 0


def _prepare(args: argparse.Namespace) -> int:
    if args.name == KERNELS:
        return _prepare_kernels()
    from pdchat import embedded

    print(embedded.ensure_model(args.name))
    return 0


def _prepare_kernels() -> int:
    """Build the decode kernels for this host into the cache (servers then load them as built);
    status 1, with the reason, where they cannot be built here."""
    from pdchat.core.generation import cpu_kernels

    try:
        print(cpu_kernels.prepare(cpu_kernels.library_dir()))
    except cpu_kernels.KernelsUnavailable as exc:
        _say(f"the decode kernels cannot be built here (servers will take the torch path): {exc}")
        return 1
    return 0


def _say(message: str) -> None:
    print(f"[pdchat] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
