"""What workers and reducers both speak: messages, the job token's proofs, encryption,
shared-memory slots and socket send buffers. Imports only the top level and config; its modules:
docs/design.md, "Where each concept lives"."""
