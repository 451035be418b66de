"""4-bit CPU kernels and the dispatch that picks one by what this CPU can run."""
