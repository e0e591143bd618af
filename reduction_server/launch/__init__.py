"""Starting jobs: `reduction-server run`'s local launcher and elastic jobs with their rendezvous.
Its modules: docs/design.md, "Where each concept lives"."""
