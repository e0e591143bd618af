"""Configuration: every RS_* variable declared once (settings), a cluster description parsed
(cluster_spec), and where a process stands in its job (discovery). Imports only the top level."""
