"""Operator tools behind the command line: fault injection (chaos), pool sizing (sizing) and the
load of one reducer core (reducer_load)."""
