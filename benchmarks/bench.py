"""Benchmarks that print tables and write results under bench-results/ (never timed assertions in tests).

    python -m benchmarks reuse        # decode's render cost vs the gate's check
    python -m benchmarks kv           # KV transfer throughput per connector
    python -m benchmarks router       # latency the router adds per request
    python -m benchmarks soak         # N streams at concurrency C through a P/D pair
    python -m benchmarks batching     # throughput and latency by concurrency (batched decode)
    python -m benchmarks batching --kv-events  # decode's step alone, KV events off and on
    python -m benchmarks batching --step-only  # decode's step alone, beside the steps before it
    python -m benchmarks e2e          # TTFT with and without forwarded ids, by prompt length (e2e.py)
    python -m benchmarks vllm-router  # 2 prefill x 2 decode behind vllm-router, one decode killed (scaleout.py)
    python -m benchmarks chaos        # mixed load through a supervised P/D stack, kill -9 and SIGSTOP (chaos.py)
    python -m benchmarks prefix       # TTFT per turn of an 8-turn chat, prefix cache on and off (prefix.py)
    python -m benchmarks peer         # beside vLLM's CPU build: tok/s, TTFT, ITL by concurrency (peer.py)
    python -m benchmarks gpu --model DIR  # P/D on vLLM's engine (engine=vllm) on one GPU (gpu.py)

Ratios are measured side by side in one run: compare those, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import numpy as np

from benchmarks import chaos, e2e, gpu, peer, prefix, scaleout
from benchmarks.report import plot, table, timed, write_results
from pdchat.core.settings import DEVICE, DTYPE, FORWARDED_IDS, MODEL


def bench_reuse(args: argparse.Namespace) -> None:
    """What decode skips: parsing, rendering and tokenizing the conversation, against its
    whole preprocessing on the reuse path (parse, fingerprint, signature, id checks), with
    the ids as the binary tensor and as vLLM's JSON list, at growing prompt lengths."""
    from pdchat import embedded
    from pdchat.core.request.protocol import parse_chat_json
    from pdchat.core.request.rendering import ChatRenderer
    from pdchat.ensemble.gate import Gate, Policy, forwarded_ids
    from pdchat.ensemble.handoff import render_fingerprint, sign

    model_dir = embedded.ensure_model(args.model)
    renderer = ChatRenderer(model_dir, model_dir.name)
    renderer.max_prompt_chars = sys.maxsize  # lengths past this model's context: the cost is what is measured
    key = b"k" * 32
    gate = Gate(Policy.SIGNED, key, vocab_size=len(renderer.tokenizer), context_length=1 << 20)
    rows, xs, series = (
        [],
        [],
        {
            "parse + render + tokenize (naive decode)": [],
            "gate, binary ids (pdchat)": [],
            "gate, ids as JSON list (vLLM wire form)": [],
        },
    )
    for target in args.tokens:
        body = json.dumps(_conversation(renderer.tokenizer, target))
        request = parse_chat_json(body)
        ids = renderer.token_ids(request)
        binary = np.asarray(ids, dtype=np.int32)  # what the prompt_token_ids tensor hands chat
        fingerprint = render_fingerprint(request, model_dir.name)
        # Each admission consumes its handoff (replays are refused): sign one per call, untimed.
        fresh = iter(
            [sign(key, ids, fingerprint, now=time.time() + i).to_params() for i in range(2 * args.repeats + 2)]
        )
        listed = iter([json.dumps({**next(fresh), "prompt_token_ids": ids}) for _ in range(args.repeats + 1)])

        def render(body=body):
            renderer.token_ids(parse_chat_json(body))

        def admit_binary(body=body, binary=binary, fresh=fresh):
            params = next(fresh)
            gate.admit(binary, params, render_fingerprint(parse_chat_json(body), model_dir.name))

        def admit_listed(body=body, listed=listed):
            text = next(listed)
            chat = parse_chat_json(body)
            ids, params = forwarded_ids(None, text)
            gate.admit(ids, params, render_fingerprint(chat, model_dir.name))

        print(f"  {len(ids)} tokens ...", file=sys.stderr, flush=True)
        timings = [statistics.median(timed(fn, args.repeats)) * 1000 for fn in (render, admit_binary, admit_listed)]
        rows.append([len(ids), *timings, timings[0] / timings[1], timings[0] / timings[2]])
        xs.append(len(ids))
        for name, ms in zip(series, timings, strict=True):
            series[name].append(ms)
    headers = [
        "prompt tokens",
        "parse+render+tokenize ms",
        "gate (binary ids) ms",
        "gate (JSON ids) ms",
        "ratio binary",
        "ratio JSON",
    ]
    print(f"\nDecode's preprocessing per request, model {model_dir.name} (median of {args.repeats}):")
    print(table(headers, rows))
    write_results("reuse", {"model": model_dir.name, "repeats": args.repeats, "columns": headers, "rows": rows})
    plot(
        "reuse",
        "Decode: re-render vs checking forwarded ids",
        "prompt tokens",
        "ms (median)",
        {name: (xs, ms) for name, ms in series.items()},
        logx=True,
    )


def _conversation(tokenizer, tokens: int) -> dict:
    """A multi-turn chat with a system prompt of about `tokens` tokens."""
    paragraph = "The committee reviewed the quarterly figures, naïve café notes ☕ and all; "
    repeat = max(1, tokens // len(tokenizer.encode(paragraph)) // 4)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": paragraph * repeat} for i in range(4)]
    return {"messages": [{"role": "system", "content": "Be brief."}, *turns]}


def _pull_worker(connection, connector_name: str) -> None:
    from pdchat.core.kv.connector import make_connector

    connector = make_connector(connector_name)
    while True:
        handle = connection.recv()
        if handle is None:
            break
        kv = connector.pull(handle)
        last = float(kv.reshape(-1)[-1])  # touches the last page
        del kv
        connector.done(handle)  # as decode does after its first step
        connection.send(last)
    connector.close()


def bench_kv(args: argparse.Namespace) -> None:
    """Publish in this process, pull in another, per connector and size."""
    from pdchat.core.kv.connector import make_connector

    rows, series = [], {}
    for name in args.connectors:
        try:
            publisher = make_connector(name, budget_bytes=1 << 31)
        except Exception as exc:  # noqa: BLE001 - a missing engine is reported, not fatal
            print(f"{name}: unavailable ({exc})")
            continue
        parent, child = multiprocessing.Pipe()
        worker = multiprocessing.get_context("spawn").Process(target=_pull_worker, args=(child, name), daemon=True)
        worker.start()
        sizes, rates = [], []
        for mib in args.sizes:
            kv = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32)

            def transfer(kv=kv, publisher=publisher, parent=parent):
                parent.send(publisher.publish(kv))
                assert parent.recv() == float(kv[-1])

            transfer()  # warm-up: connection setup, first-touch pages
            samples = timed(transfer, args.repeats)
            median, best = mib / 1024 / statistics.median(samples), mib / 1024 / min(samples)
            rows.append([name, mib, statistics.median(samples) * 1000, median, best])
            sizes.append(mib)
            rates.append(median)
            print(f"  {name} {mib} MiB: {median:.2f} GB/s", file=sys.stderr, flush=True)
        parent.send(None)
        worker.join(30)
        publisher.close()
        series[name] = (sizes, rates)
    print(f"\nKV transfer, publish in one process -> pull in another (median of {args.repeats}):")
    print(table(["connector", "MiB", "ms", "GB/s (median)", "GB/s (best)"], rows))
    plot("kv_transfer", "KV transfer between processes", "KV size (MiB)", "GB/s (median)", series, logx=True)


def bench_router(args: argparse.Namespace) -> None:
    """The same P/D requests driven directly (two gRPC legs) and through the router."""
    import urllib.request

    from pdchat.clients.chat import GrpcChat, chat_inputs, collect
    from pdchat.launcher import PDStack

    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    with PDStack(model=args.model) as stack:
        prefill, decode = GrpcChat(stack.prefill.grpc_url), GrpcChat(stack.decode.grpc_url)

        def direct():
            [handed] = list(prefill.stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
            collect(
                decode.stream(
                    chat_inputs(
                        body, prompt_token_ids=handed.prompt_token_ids, kv_transfer_params=handed.kv_transfer_params
                    )
                )
            )

        def routed():
            request = urllib.request.Request(
                f"{stack.router_url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(request).read()

        for warm in (direct, routed):
            warm()
        pairs = [(timed(direct, 1)[0], timed(routed, 1)[0]) for _ in range(args.repeats)]  # interleaved
        prefill.close()
        decode.close()
    direct_ms = statistics.median(p[0] for p in pairs) * 1000
    routed_ms = statistics.median(p[1] for p in pairs) * 1000
    print(f"\nOne-token P/D request, {args.model}, median of {args.repeats} interleaved pairs:")
    print(
        table(
            ["path", "ms"],
            [
                ["two gRPC legs, no router", direct_ms],
                ["through the router (HTTP)", routed_ms],
                ["router adds", routed_ms - direct_ms],
            ],
        )
    )


def bench_soak(args: argparse.Namespace) -> None:
    """Streamed requests through the router of a P/D pair: rate, TTFT, latency, errors, and
    each server process's memory after warm-up and at the end."""
    from benchmarks import load
    from pdchat import embedded
    from pdchat.launcher import PDStack

    embedded.ensure_model(args.model)

    def body(i: int) -> dict:
        return {
            "messages": [{"role": "user", "content": f"Request {i}: " + "tell me more " * (i % 7)}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 20) == 0 or done == total:
            print(f"  {done}/{total} requests", file=sys.stderr, flush=True)

    with PDStack(model=args.model, connector=args.connector) as stack:
        send = load.RouterStreams(stack.router_url)
        print(f"warm-up: {args.concurrency * 4} requests", file=sys.stderr, flush=True)
        load.run(send, body, args.concurrency * 4, args.concurrency)
        servers = {"prefill": stack.prefill, "decode": stack.decode}
        before = {name: sum(server.memory().values()) for name, server in servers.items()}
        started = time.perf_counter()
        outcomes = load.run(send, body, args.requests, args.concurrency, progress=progress)
        wall = time.perf_counter() - started
        after = {name: sum(server.memory().values()) for name, server in servers.items()}
        alive = all(process.poll() is None for process in stack.processes().values())
    result = {
        "model": args.model,
        "connector": args.connector,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "servers_alive": alive,
        **load.summary(outcomes, wall),
        **{f"{name}_rss_mib_before": before[name] / 2**20 for name in servers},
        **{f"{name}_rss_mib_after": after[name] / 2**20 for name in servers},
    }
    rows = [[k, v] for k, v in result.items()]
    text = table(["", "value"], rows)
    print(f"\nP/D soak through the router ({args.requests} streamed requests, concurrency {args.concurrency}):")
    print(text)
    if errors := load.first_errors(outcomes):
        print("first errors:", *errors, sep="\n  ")
    write_results("soak", result)


def bench_batching(args: argparse.Namespace) -> None:
    """Output tokens/s, TTFT and inter-token latency by concurrency: perf_analyzer on one
    server's `chat`, the router's OpenAI API on a P/D pair; then the other streams'
    inter-token latency while decode prefills a long prompt itself."""
    from transformers import AutoTokenizer

    from benchmarks import load, perf
    from pdchat import embedded
    from pdchat.launcher import PDStack, TritonServer

    model_dir = embedded.ensure_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    placement = {DEVICE.env: args.device, DTYPE.env: args.dtype}  # every server started below
    results_name = args.results or ("batching" if args.device == "cpu" else f"batching-{args.device}-{args.dtype}")
    words = 100
    prompt = perf.input_data(words, args.max_tokens)
    prompt_tokens = len(
        tokenizer.apply_chat_template(
            json.loads(prompt["data"][0]["request"][0])["messages"], add_generation_prompt=True, return_dict=False
        )
    )
    if args.kv_events:
        _kv_events_off_on(model_dir, prompt_tokens, args)
        return
    print(f"decode's forward pass alone, in this process: {args.concurrency} rows", file=sys.stderr, flush=True)
    engine_alone = _forward_alone(model_dir, prompt_tokens, args.concurrency, args.device, args.dtype)
    if args.step_only:
        _print_forward_alone(engine_alone)
        by_threads = {}
        for threads in args.threads:
            print(f"decode's forward pass alone on {threads} torch threads", file=sys.stderr, flush=True)
            by_threads[threads] = _forward_alone(
                model_dir, prompt_tokens, args.concurrency, args.device, args.dtype, threads=threads
            )
            print(f"\non {threads} torch threads:", end="")
            _print_forward_alone(by_threads[threads])
        print(f"prefill's forward pass alone, in this process: {PREFILL_TOKENS} tokens", file=sys.stderr, flush=True)
        prefill_alone = _prefill_alone(model_dir, PREFILL_TOKENS, args.device, args.dtype)
        _print_prefill_alone(prefill_alone)
        write_results(
            f"{results_name}_step-{args.model}",
            {
                "model": args.model,
                "prompt_tokens": prompt_tokens,
                "forward_pass_alone": engine_alone,
                "forward_pass_alone_by_threads": by_threads,
                "prefill_alone": prefill_alone,
            },
        )
        return
    results: dict[str, dict[int, dict[str, float]]] = {}
    env = {MODEL.env: args.model, FORWARDED_IDS.env: "trusted", **placement}
    with TritonServer(env=env, exit_timeout_s=5) as server:
        print(f"monolithic server: perf_analyzer at concurrency {args.concurrency}", file=sys.stderr, flush=True)
        export = perf.profile(server.grpc_url, "chat", args.concurrency, words, args.max_tokens)
        results["monolithic (perf_analyzer)"] = perf.summarize(export)
        results["long local prefill"] = {args.long_prompt: _during_long_prefill(server, tokenizer, args)}
    with PDStack(model=args.model, connector="shm", env=placement) as stack:
        send = load.RouterStreams(stack.router_url)
        body = json.loads(prompt["data"][0]["request"][0])
        pd = {}
        for concurrency in args.concurrency:
            print(f"P/D pair through the router: concurrency {concurrency}", file=sys.stderr, flush=True)
            load.run(send, lambda i: body, concurrency, concurrency)  # warm the connections
            started = time.perf_counter()
            outcomes = load.run(send, lambda i: body, max(8, 2 * concurrency), concurrency)
            pd[concurrency] = load.summary(outcomes, time.perf_counter() - started)
        results["P/D through the router"] = pd
    print(
        f"\nBatched decode, model {args.model} on {args.device} ({args.dtype}), ~{prompt_tokens}-token prompts, "
        f"{args.max_tokens} output tokens, ignore_eos:"
    )
    for name, by_concurrency in results.items():
        if name == "long local prefill":
            continue
        print(f"\n{name}:")
        print(table(["concurrency", "requests", *perf.COLUMNS], perf.rows(by_concurrency, args.concurrency)))
    [long] = results["long local prefill"].values()
    print(f"\nWhile decode prefills a {args.long_prompt}-token prompt itself (chunks of 512), the other streams:")
    print(
        table(
            ["itl p50 ms", "itl p99 ms", "p99 / p50"],
            [[long["itl_p50_ms"], long["itl_p99_ms"], long["itl_p99_ms"] / long["itl_p50_ms"]]],
        )
    )
    _print_forward_alone(engine_alone)
    mono = results["monolithic (perf_analyzer)"]
    if 1 in mono and 16 in mono:
        print(
            "\nmonolithic: tokens/s at 16 / at 1 = "
            f"{mono[16]['output_tokens_per_s'] / mono[1]['output_tokens_per_s']:.1f}x; "
            f"itl p50 at 16 / at 1 = {mono[16]['itl_p50_ms'] / mono[1]['itl_p50_ms']:.1f}x"
        )
    if 1 in engine_alone and 16 in engine_alone:
        print(
            f"forward pass alone: tokens/s at 16 rows / at 1 = "
            f"{engine_alone[16]['output_tokens_per_s'] / engine_alone[1]['output_tokens_per_s']:.1f}x"
        )
    write_results(
        results_name,
        {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "prompt_tokens": prompt_tokens,
            "max_tokens": args.max_tokens,
            "results": results,
            "forward_pass_alone": engine_alone,
        },
    )
    series = {
        name: (list(r), [v["output_tokens_per_s"] for v in r.values()])
        for name, r in results.items()
        if name != "long local prefill"
    }
    series["decode's forward pass alone (x = rows)"] = (
        list(engine_alone),
        [v["output_tokens_per_s"] for v in engine_alone.values()],
    )
    plot(
        results_name,
        f"Batched decode ({args.device}): output tokens/s by concurrency",
        "concurrency",
        "output tokens/s",
        series,
    )


# decode's step alone, side by side: what each part of pdchat's step gives.
STEP_VARIANTS = {
    "ms_per_step": "pdchat's step: its own forward pass, C kernels between the GEMMs, greedy tokens by the GreedyHead",
    "ms_per_step_full_projection": "the same, the vocabulary projected in full (fp32) and a C argmax",
    "ms_per_step_torch_gemms": "pdchat's step with its layers' GEMMs on torch's (plain weights: MKL's)",
    "ms_per_step_torch_ops": "its own forward pass, torch ops between the GEMMs",
    "ms_per_step_transformers": "transformers' forward, torch attention",
    "ms_per_step_nn_linear": "transformers' forward and its nn.Linear vocabulary projection",
}


def _forward_alone(
    model_dir,
    prompt_tokens: int,
    row_counts: list[int],
    device: str,
    dtype: str,
    steps: int = 20,
    rounds: int = 3,
    threads: int | None = None,
) -> dict[int, dict[str, float]]:
    """decode's batched forward pass timed in this process, on `threads` torch threads (else
    those a stage model gets): what a server's steps would cost with nothing else on the CPU
    (the best of `rounds` rounds of `steps` steps, against a noisy neighbour's share). Each
    round times the STEP_VARIANTS one after the other, so they are compared side by side."""
    import torch

    from pdchat.core.generation import llama

    ours = _stage_engine(model_dir, device, dtype, threads=threads)
    theirs = _stage_engine(model_dir, device, dtype, forward="transformers", threads=threads)
    kernels, head, own_forward = ours.decode_kernels, theirs.model.get_output_embeddings(), ours.llama
    stock = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=head.bias is not None)
    stock.weight, stock.bias = head.weight, head.bias
    variants = {
        "ms_per_step": (ours, lambda: _set_step(ours, kernels, own_forward, greedy_head=True)),
        "ms_per_step_full_projection": (ours, lambda: _set_step(ours, kernels, own_forward, greedy_head=False)),
        "ms_per_step_torch_ops": (ours, lambda: _set_step(ours, None, own_forward, greedy_head=False)),
        "ms_per_step_transformers": (theirs, lambda: theirs.model.set_output_embeddings(head)),
        "ms_per_step_nn_linear": (theirs, lambda: theirs.model.set_output_embeddings(stock)),
    }
    if own_forward is not None:  # a model pdchat's own pass takes; its plain GEMMs over transformers' weights
        plain = llama.LlamaForward(theirs.model, blocked_gemms=False)
        variants["ms_per_step_torch_gemms"] = (ours, lambda: _set_step(ours, kernels, plain, greedy_head=True))
    timed = {}
    for rows in row_counts:
        batches = {engine: _decoding(engine, prompt_tokens, rows) for engine in (ours, theirs)}
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(rounds):
            for name, (engine, set_up) in variants.items():
                set_up()
                best[name] = min(best[name], _step_time(batches[engine], rows, steps))
        _set_step(ours, kernels, own_forward, greedy_head=True)
        theirs.model.set_output_embeddings(head)
        for batch in batches.values():
            batch.leave(list(range(rows)))
        timed[rows] = {
            **{name: 1000 * seconds for name, seconds in best.items()},
            "output_tokens_per_s": rows / best["ms_per_step"],
        }
    return timed


def _set_step(engine, kernels, forward, *, greedy_head: bool) -> None:
    engine.decode_kernels, engine.llama = kernels, forward
    engine.use_greedy_head(greedy_head)


def _print_forward_alone(engine_alone: dict[int, dict[str, float]]) -> None:
    print("\nDecode's forward pass alone (in this process, no server: the ceiling of the rows above), ms per step:")
    for name, meaning in STEP_VARIANTS.items():
        print(f"  {name}: {meaning}")
    print(
        table(
            ["rows", *STEP_VARIANTS, "output tokens/s", "transformers / pdchat"],
            [
                [rows, *(r.get(name, float("nan")) for name in STEP_VARIANTS), r["output_tokens_per_s"]]
                + [r["ms_per_step_transformers"] / r["ms_per_step"]]
                for rows, r in engine_alone.items()
            ],
        )
    )


# prefill's pass alone, side by side: what pdchat's GEMMs give a prompt.
PREFILL_TOKENS = [64, 256, 1024]
PREFILL_VARIANTS = {
    "ms_per_prefill_greedy": "pdchat's prefill of a greedy request: its first token by the GreedyHead",
    "ms_per_prefill": "pdchat's prefill: its own pass, GEMMs on oneDNN's blocked weights, norms and SwiGLU in C",
    "ms_per_prefill_torch_gemms": "its own forward pass on torch's GEMMs (plain weights) and torch's ops",
    "ms_per_prefill_transformers": "transformers' forward",
}


def _prefill_alone(
    model_dir, token_counts: list[int], device: str, dtype: str, prompts: int = 3, rounds: int = 3
) -> dict[int, dict[str, float]]:
    """A prompt's whole prefill (one pass, its first token's logits) timed in this process on
    a stage's torch threads, each PREFILL_VARIANTS in turn per round; the best of `rounds`
    rounds of the mean of `prompts` prompts. Every prompt is new (no cached prefix)."""
    from pdchat.core.generation import llama
    from pdchat.core.generation.engine import PromptPrefill

    ours = _stage_engine(model_dir, device, dtype)
    theirs = _stage_engine(model_dir, device, dtype, forward="transformers")
    # name -> (engine, its forward pass, whether the first token is greedy: the logits are then not needed)
    variants = {"ms_per_prefill_transformers": (theirs, theirs.llama, False)}
    if ours.llama is not None:  # a model pdchat's own pass takes
        # On transformers' engine: its layers become views of the stacks, so no weight is held twice.
        plain = llama.LlamaForward(theirs.model, blocked_gemms=False)
        variants = {
            "ms_per_prefill_greedy": (ours, ours.llama, True),
            "ms_per_prefill": (ours, ours.llama, False),
            "ms_per_prefill_torch_gemms": (theirs, plain, False),
            **variants,
        }
    fresh = iter(range(1, 1 << 30))

    def mean_prefill(engine, tokens: int, greedy: bool) -> float:
        started = time.perf_counter()
        for _ in range(prompts):
            first = next(fresh)
            prompt = [(first + 7 * i) % engine.vocab_size for i in range(tokens)]
            prefill = PromptPrefill(engine, prompt, cache_salt=None, chunk=tokens)
            prefill.step(greedy=greedy)
            prefill.release()
        return (time.perf_counter() - started) / prompts

    timed = {}
    for tokens in token_counts:
        best = dict.fromkeys(variants, float("inf"))
        for round_index in range(rounds + 1):
            for name, (engine, forward, greedy) in variants.items():
                engine.llama = forward
                seconds = mean_prefill(engine, tokens, greedy)
                if round_index:  # the first round warms each variant up
                    best[name] = min(best[name], seconds)
        timed[tokens] = {name: 1000 * seconds for name, seconds in best.items()}
    return timed


def _print_prefill_alone(prefill_alone: dict[int, dict[str, float]]) -> None:
    print("\nPrefill's forward pass alone (in this process, no server), ms per prompt:")
    names = [name for name in PREFILL_VARIANTS if name in next(iter(prefill_alone.values()))]
    for name in names:
        print(f"  {name}: {PREFILL_VARIANTS[name]}")
    print(
        table(
            ["prompt tokens", *names], [[tokens, *(r[name] for name in names)] for tokens, r in prefill_alone.items()]
        )
    )


def _stage_engine(model_dir, device: str, dtype: str, forward: str = "auto", threads: int | None = None):
    """The engine a decode stage model runs, on the torch threads (`threads`, else those a
    stage gets by default) and KV pool it gets."""
    from pdchat.core.generation.engine import CausalLM
    from pdchat.core.settings import DECODE_KV_MB, MIB, KVPoolOptions, torch_threads

    pool = KVPoolOptions(bytes=int(DECODE_KV_MB.default) * MIB)
    threads = threads or torch_threads({}, {})
    return CausalLM(model_dir, device, dtype, threads=threads, pool=pool, forward=forward)


def _decoding(engine, prompt_tokens: int, rows: int):
    """A decode batch of `rows` prefilled prompts, stepped once (warm). The prompts differ
    from their first token, so no two rows share a block (each keys its own as it decodes)."""
    from pdchat.core.generation.engine import DecodeBatch

    batch = DecodeBatch(engine)
    for row in range(rows):
        prompt = [(7919 * row + 7 * i) % engine.vocab_size for i in range(prompt_tokens)]
        batch.join(engine.prefill(prompt)[1])
    batch.step([1] * rows)
    return batch


def _step_time(batch, rows: int, steps: int) -> float:
    """Seconds per greedy step (the forward pass and each row's greedy token, as decode's
    scheduler takes them) over `steps` steps of `batch`."""
    started = time.perf_counter()
    for _ in range(steps):
        batch.step_rows([1] * rows, [True] * rows)  # on CUDA the argmax's result waits for the step
    return (time.perf_counter() - started) / steps


def _kv_events_off_on(model_dir, prompt_tokens: int, args: argparse.Namespace, steps: int = 32) -> None:
    """Decode's step alone in this process with KV events off and on, side by side: per row
    count, `args.rounds` rounds of each setting interleaved (off, on, then on, off: neither
    always runs first on a noisy machine), the publisher on a local tcp port with a
    subscriber connected (read after the rounds, so no reader thread shares the process).
    A step of 32 crosses two block boundaries per row: every row keys blocks as it goes."""
    import zmq

    from pdchat.core.kv_events import BlockEvents, KVEventPublisher
    from pdchat.launcher import free_port

    engine = _stage_engine(model_dir, args.device, args.dtype)
    port = free_port()
    sink = BlockEvents()
    publisher = KVEventPublisher(sink, endpoint=f"tcp://*:{port}", block_size=engine.pool.block_tokens)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # subscribed
    timed: dict[int, dict[str, list[float]]] = {}
    for rows in args.concurrency:
        print(f"decode's step alone, {rows} rows: events off and on, {args.rounds} rounds each", file=sys.stderr)
        batch = _decoding(engine, prompt_tokens, rows)
        timed[rows] = {"off": [], "on": []}
        for index in range(args.rounds):
            for setting in ("off", "on") if index % 2 == 0 else ("on", "off"):
                engine.pool.events = sink if setting == "on" else None
                timed[rows][setting].append(1000 * _step_time(batch, rows, steps))
        engine.pool.events = None
    publisher.close()
    received = 0
    while sub.poll(200):
        sub.recv_multipart()
        received += 1
    context.destroy(linger=0)
    stats = publisher.stats()
    results = {
        rows: {
            "off_ms_per_step_median": statistics.median(r["off"]),
            "on_ms_per_step_median": statistics.median(r["on"]),
            "on_over_off_median": statistics.median(r["on"]) / statistics.median(r["off"]),
            "on_over_off_best": min(r["on"]) / min(r["off"]),
            "rounds_ms_per_step": r,
        }
        for rows, r in timed.items()
    }
    print(
        f"\nDecode's step alone, model {args.model} on {args.device} ({args.dtype}), ~{prompt_tokens}-token prompts, "
        f"{steps} steps a round, {args.rounds} rounds per setting interleaved; KV events off and on:"
    )
    print(
        table(
            ["rows", "off ms/step (median)", "on ms/step (median)", "on / off (median)", "on / off (best round)"],
            [
                [
                    rows,
                    r["off_ms_per_step_median"],
                    r["on_ms_per_step_median"],
                    r["on_over_off_median"],
                    r["on_over_off_best"],
                ]
                for rows, r in results.items()
            ],
        )
    )
    print(
        f"published {stats.published} messages, received {received}, "
        f"dropped {stats.dropped_events} events and {stats.dropped_messages} messages"
    )
    write_results(
        "batching_kv_events",
        {
            "model": args.model,
            "device": args.device,
            "dtype": args.dtype,
            "prompt_tokens": prompt_tokens,
            "steps_per_round": steps,
            "rounds": args.rounds,
            "published_messages": stats.published,
            "received_messages": received,
            "dropped_events": stats.dropped_events,
            "dropped_messages": stats.dropped_messages,
            "results": results,
        },
    )


def _during_long_prefill(server, tokenizer, args: argparse.Namespace) -> dict[str, float]:
    """Streams running while one request's ids go to decode without KV (trusted policy):
    decode prefills them itself, in chunks between the others' steps."""
    import threading

    from benchmarks import load
    from pdchat.clients.chat import GrpcChat, chat_inputs

    body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    ids = list(range(100, 100 + args.long_prompt))
    send = load.TritonStreams(server.grpc_url)
    long_client = GrpcChat(server.grpc_url)
    outcomes: list = []
    streams = threading.Thread(target=lambda: outcomes.extend(load.run(send, lambda i: body, 4, 4)))
    streams.start()
    time.sleep(1.0)  # the streams are decoding
    print(f"decode prefills {args.long_prompt} tokens while 4 streams decode", file=sys.stderr, flush=True)
    list(long_client.stream(chat_inputs({**body, "max_tokens": 1}, prompt_token_ids=ids, kv_transfer_params={})))
    streams.join()
    long_client.close()
    send.close()
    return load.summary(outcomes, 1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="bench", required=True)
    reuse = commands.add_parser("reuse")
    reuse.add_argument("--model", default="smollm2")
    reuse.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 16000, 64000])
    reuse.add_argument("--repeats", type=int, default=5)
    kv = commands.add_parser("kv")
    kv.add_argument("--connectors", nargs="+", default=["shm", "nixl"])
    kv.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    kv.add_argument("--repeats", type=int, default=10)
    router = commands.add_parser("router")
    router.add_argument("--model", default="tiny")
    router.add_argument("--repeats", type=int, default=20)
    soak = commands.add_parser("soak")
    soak.add_argument("--model", default="tiny")
    soak.add_argument("--connector", choices=("shm", "nixl"), default="shm")
    soak.add_argument("--requests", type=int, default=2000)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--max-tokens", type=int, default=16)
    batching = commands.add_parser("batching")
    batching.add_argument("--model", default="tiny")
    batching.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    batching.add_argument("--max-tokens", type=int, default=64)
    batching.add_argument("--long-prompt", type=int, default=16000)
    batching.add_argument("--device", default="cpu", help="where the servers run the model: cpu, cuda")
    batching.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16"
    )
    batching.add_argument(
        "--kv-events",
        action="store_true",
        help="only decode's step alone (in this process, no server), KV events off and on side by side",
    )
    batching.add_argument("--rounds", type=int, default=6, help="with --kv-events: rounds of each setting")
    batching.add_argument(
        "--results",
        default=None,
        help="results file name in bench-results/ (default: batching, or batching-DEVICE-DTYPE off the CPU)",
    )
    batching.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=[],
        help="with --step-only: also time the step on each of these torch thread counts (a stage's default first)",
    )
    batching.add_argument(
        "--step-only",
        action="store_true",
        help="only decode's step alone (in this process, no server), beside transformers' forward and nn.Linear head",
    )
    e2e.add_arguments(commands.add_parser("e2e"))
    scaleout.add_arguments(commands.add_parser("vllm-router"))
    chaos.add_arguments(commands.add_parser("chaos"))
    prefix.add_arguments(commands.add_parser("prefix"))
    peer.add_arguments(commands.add_parser("peer"))
    gpu.add_arguments(commands.add_parser("gpu"))
    args = parser.parse_args(argv)
    benches = {
        "reuse": bench_reuse,
        "kv": bench_kv,
        "router": bench_router,
        "soak": bench_soak,
        "batching": bench_batching,
        "e2e": e2e.bench_e2e,
        "vllm-router": scaleout.bench_vllm_router,
        "chaos": chaos.run,
        "prefix": prefix.run,
        "peer": peer.run,
        "gpu": gpu.run,
    }
    benches[args.bench](args)


if __name__ == "__main__":
    main()
