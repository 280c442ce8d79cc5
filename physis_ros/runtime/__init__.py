"""Stage pipelining runtime: wire format, worker processes, engine, placement plans."""
