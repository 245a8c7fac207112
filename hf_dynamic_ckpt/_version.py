"""The library's version (one place: the package, manifests and setup.cfg read it)."""

VERSION = "0.2.0"
