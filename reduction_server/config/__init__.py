"""Configuration: every RS_* setting, the cluster specs, and where a process stands in its job.
Imports only the top level; its modules: docs/design.md, "Where each concept lives"."""
