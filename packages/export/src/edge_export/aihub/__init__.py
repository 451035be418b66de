"""Qualcomm AI Hub: credentials and reachability first, then compile and inference jobs."""
