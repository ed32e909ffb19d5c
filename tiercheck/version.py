"""The library's version: its own module, so that no module imports the package it lives in."""

__version__ = "0.1.0"
