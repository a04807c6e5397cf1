"""Test helpers beside the compiler: the transparency check, random models and oracles.

The core never imports them; tests, the fuzzer and users checking their own models do.
"""
