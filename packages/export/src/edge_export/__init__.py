"""edge-infer exporter: ExecuTorch .pte (XNNPACK), Qualcomm QNN and AI Hub, scored by SQNR.

Map: decoder.py (what is exported: static KV cache, finite mask), xnnpack/, qnn/, aihub/
(one folder per backend), sqnr.py (the score), corpus.py (calibration and scoring text),
pipeline.py (one export end to end), records.py (the JSONL record and its markdown table),
cli.py (`edge-infer export`).
"""
