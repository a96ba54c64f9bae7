"""`python -m benchmarks <subcommand>`: see benchmarks/bench.py for the subcommands."""

from benchmarks.bench import main

main()
