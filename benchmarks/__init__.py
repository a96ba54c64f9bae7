"""pdchat's benchmark harnesses: not part of the product, not installed by `pip install .`, not in
the image. Run from the checkout root as `python -m benchmarks <subcommand>` (see benchmarks/bench.py);
each writes its results under bench-results/. They need the `bench` extra (matplotlib) for plots.

    bench     the subcommands and the small in-process benchmarks (reuse, kv, router, soak, batching)
    peer      pdchat beside vLLM's CPU build, interleaved rounds
    e2e       TTFT with and without forwarded ids
    chaos     a supervised P/D stack under load and faults
    prefix    TTFT per turn with the prefix cache on and off, and prefix-aware routing
    scaleout  2 prefill x 2 decode behind vllm-router
    load      concurrent chat streams and their statistics (also used by the soak and fault tests)
    perf      perf_analyzer against a server, summarized like load
    report    tables, plots and results files
"""
