"""Printers over the one record type, and the rendered report (markdown + PNG plots)."""
