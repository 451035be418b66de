"""`edge-infer serve` and `edge-infer generate`: vLLM's server and API with a profile applied."""
