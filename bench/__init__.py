"""Benchmarks, installed as reduction_server.bench: each suite runs the peer side by side in the
same run and reports ratios (`reduction-server bench SUITE`)."""
