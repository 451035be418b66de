"""Everything that imports vLLM internals lives here, behind the plugin seam."""
