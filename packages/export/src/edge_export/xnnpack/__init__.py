"""XNNPACK: .pte export and runs through executorch.runtime."""
