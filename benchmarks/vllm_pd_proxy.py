"""vLLM's own P/D proxy protocol, as its NixlConnector docs and toy proxy run it, for `bench
peer`'s `vllm-pd` system: each chat or completion request goes to the prefill `vllm serve`
unstreamed with `max_tokens` 1 and `kv_transfer_params {"do_remote_decode": true}`, then as
the client sent it to the decode `vllm serve` with the `kv_transfer_params` prefill returned
(decode pulls the KV, renders and tokenizes the prompt again), its answer streamed back.

NOTE: vllm-router 0.1.17's vLLM P/D mode forwards a streamed request to prefill streamed, and
vLLM 0.32 returns `kv_transfer_params` only in an unstreamed answer, so behind it every
streamed request is computed whole on decode; hence this proxy.

    python -m benchmarks.vllm_pd_proxy --prefill URL --decode URL --port PORT
"""

from __future__ import annotations

import argparse

from aiohttp import ClientSession, ClientTimeout, web

ROUTES = ("/v1/chat/completions", "/v1/completions")


def prefill_body(body: dict) -> dict:
    """The prefill leg of a client's request: one token, unstreamed, its KV kept for decode."""
    leg = {key: value for key, value in body.items() if key not in ("stream_options", "max_completion_tokens")}
    return {**leg, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


def build_app(prefill: str, decode: str) -> web.Application:
    async def start(app: web.Application) -> None:
        app["session"] = ClientSession(timeout=ClientTimeout(total=None))

    async def close(app: web.Application) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        session: ClientSession = request.app["session"]
        body = await request.json()
        async with session.post(f"{prefill}{request.path}", json=prefill_body(body)) as answer:
            if answer.status != 200:
                return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")
            params = (await answer.json()).get("kv_transfer_params")
        async with session.post(f"{decode}{request.path}", json={**body, "kv_transfer_params": params}) as answer:
            response = web.StreamResponse(status=answer.status, headers={"Content-Type": answer.content_type})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        session: ClientSession = request.app["session"]
        for server in (prefill, decode):
            async with session.get(f"{server}/health") as answer:
                if answer.status != 200:
                    return web.Response(status=503, text=f"{server} answers {answer.status}")
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        async with request.app["session"].get(f"{decode}/v1/models") as answer:
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    for route in ROUTES:
        app.router.add_post(route, relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill vllm serve's base URL")
    parser.add_argument("--decode", required=True, help="the decode vllm serve's base URL")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(build_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
