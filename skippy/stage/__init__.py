"""A stage process: its engine (model + data sockets), lanes, control handlers, server, transport.

The package imports nothing itself: a process that needs only a light part (the Ray actor
that hosts a stage uses `certificates` and `lifecycle`) must not load torch with it."""
