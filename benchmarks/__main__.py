"""python -m benchmarks: the benchmark suite (benchmarks/suite.py; --help for the options)."""

from benchmarks.suite import main

if __name__ == "__main__":
    main()
