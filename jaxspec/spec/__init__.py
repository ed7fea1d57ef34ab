"""Speculation policy: the online acceptance estimator and its calibration, the verify planner, ragged layouts."""
