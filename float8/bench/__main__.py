"""python -m float8.bench: the benchmark suite (float8/bench/suite.py; --help for the options)."""

from float8.bench.suite import main

if __name__ == "__main__":
    main()
