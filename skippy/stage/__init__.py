"""A stage process: TCP server, message handlers, downstream link, prediction return.

The package imports nothing itself: a process that needs only a light part (the Ray actor
that hosts a stage uses `tls` and `lifecycle`) must not load torch with it."""
