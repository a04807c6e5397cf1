"""The version of fxpipe: one definition, read by the package, its metadata and every file it writes."""

__version__ = "0.1.0"
