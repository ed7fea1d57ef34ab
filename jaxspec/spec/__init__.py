"""Speculation policy: acceptance estimator and its calibration, verify planner, ragged layouts."""
