"""LocalAI's `backend.Backend` gRPC service: the subset an LLM backend answers.

`backend.proto` is written from the facts of LocalAI's `backend/backend.proto` (package,
service, method and message names, field numbers and types), so a client generated from
LocalAI's own file talks to rank 0 unchanged. Regenerate the stubs with `make proto`.
"""
