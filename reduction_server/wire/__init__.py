"""What workers and reducers both speak: the message format (protocol), the job token's proofs
(auth), CurveZMQ keys (encryption), shared-memory slots (shared_memory) and socket send buffers
(send_buffers). Imports only the top-level modules and config."""
