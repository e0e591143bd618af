"""Operator tools behind the command line: fault injection, pool sizing and the load of one
reducer. Its modules: docs/design.md, "Where each concept lives"."""
