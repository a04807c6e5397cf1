"""Tools beside the compiler: benchmarks, the fuzzer and the demo (the core never imports them)."""
