"""4-bit weight quantization: primitives, scheme configs, checkpoint writer."""
