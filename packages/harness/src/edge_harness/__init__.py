"""edge-infer harness."""
