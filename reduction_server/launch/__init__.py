"""Starting jobs: `reduction-server run`'s local launcher (launcher), the placement of its
processes (local_layout), and elastic jobs' rendezvous (rendezvous, elastic)."""
