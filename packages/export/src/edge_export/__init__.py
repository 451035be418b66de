"""edge-infer exporter."""
