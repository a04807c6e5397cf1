"""The version of fxpipe: one definition, read by the package metadata and every file it writes."""

__version__ = "0.1.0"
