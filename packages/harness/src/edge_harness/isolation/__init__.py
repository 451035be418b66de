"""Isolation: physical cores, pinned child processes, one benchmark at a time, a contention guard."""
