"""qtp's version: the one place it is written. setup.cfg reads it (``attr:``), ``qtp --version`` prints it and
``/metrics`` serves it as ``qtp_build_info{version=...}``. This module imports nothing, so the build reads it
without importing qtp."""

__version__ = "0.1.0"
