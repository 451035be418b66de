"""Qualcomm QNN: guarded import, QnnQuantizer calibration, simulated scores, SDK lowering."""
