"""What the tests share: real reducer groups and worker runners (cluster), Communicator jobs in
threads (jobs), hand-driven peers of a reducer (peers), a capturing stand-in for a reducer's
socket (capture), hand-driven handshakes (handshake), reference inputs and results (reference,
kernel_reference), cluster specs as platforms hand them out (cluster_specs), scraped metrics
(metrics), failure-test timeouts (timing), free ports (ports), process probes (probes) and the
source tree's modules (source_tree). Imported as `helpers.<module>`: tests/ is on sys.path while
pytest runs, and the scripts in tests/scripts/ put it there themselves."""
